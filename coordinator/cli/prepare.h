// `lorastream prepare`: a user's text or conversations -> training data (common/formats/data.h
// formats) with the model folder's own tokenizer and chat template. The tokenizing runs in
// tools/prepare/prepare.mjs (Hugging Face's JavaScript tokenizers and Jinja, vendored) under
// Node.js; this side checks the model folder, fingerprints its tokenizer
// (common/formats/tokenizer_id.h) so that the data records it, and finds the script and node.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream::cli {

struct PrepareOptions {
  std::string model_dir;            // has tokenizer.json (+ tokenizer_config.json)
  std::vector<std::string> inputs;  // .jsonl, .json (an array) or .txt (text only)
  std::string format;               // text | alpaca | sharegpt | messages
  std::string out;                  // .jsonl or .tok/.bin
  double val_split = 0;             // fraction held out into OUT with ".val" before the extension
  int64_t seq_len = 0;              // truncate longer documents (0 = keep whole)
  bool train_on_all = false;        // train on every token, not only assistant turns
  uint64_t seed = 0;                // the validation split's draw
  bool force = false;               // replace an OUT that exists or is an input (else refused)
};

// Runs the script and returns its exit status (lorastream's: 0 ok, 1 failed write, 2 bad
// argument or an OUT it would not replace, 3 not found, 4 corrupt input, 5 refused). Throws
// Error(kNotFound) for a model folder without tokenizer.json, Error(kUnsupported) when Node.js
// or the script cannot be found, Error(kInternal) when node ends otherwise (killed, or its own
// fatal error), saying so.
int RunPrepare(const PrepareOptions& options);

// Where prepare.mjs is: $LORASTREAM_PREPARE_SCRIPT, else ../share/lorastream/prepare/ beside
// the running executable (an installed tree), else the source tree this build came from.
std::string FindPrepareScript();

}  // namespace lorastream::cli
