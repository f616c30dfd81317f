// The names of a mixture of experts' per-expert weights inside a block (torch-free), as
// transformers names them: qwen3_moe "mlp.experts.E.{gate,up,down}_proj.weight", mixtral
// "block_sparse_moe.experts.E.{w1,w3,w2}.weight".
#pragma once

#include <cstdint>
#include <string>

namespace lorastream {

// The projection of block-relative `name` if it is an expert's weight: 0 gate (w1), 1 up (w3),
// 2 down (w2), with *expert set to E (a decimal without leading zeros, below 10^6); else -1.
int ExpertProjectionOf(const std::string& name, int64_t* expert);

}  // namespace lorastream
