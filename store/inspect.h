// `lorastream-store inspect PATH`: validate a .safetensors file or a checkpoint folder and
// list its tensors, or say exactly what is wrong (an Error naming the file and tensor).
#pragma once

#include <ostream>
#include <string>

namespace lorastream::store {

// Prints the listing to `out`; throws Error for anything malformed or missing. A folder is
// also checked against its config.json (the checks `serve` makes before loading).
void RunInspect(const std::string& path, std::ostream& out);

}  // namespace lorastream::store
