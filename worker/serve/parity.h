// `lorastream-worker parity`: our side of the parity harness (tools/parity/). Loads a
// Hugging Face checkpoint (or attaches a published store: a compressed one computes with its
// expansion) and a peft adapter, runs one checkpointed training forward and
// backward on a token batch, and writes OUT/parity.safetensors:
//   "logits" [B, S, vocab] f32, "loss" [1] f32 (mean over target tokens, as transformers),
//   "grad.<peft key>" f32 for every LoRA A and B,
// plus OUT/adapter/ (the adapter re-saved by our writer, for PeftModel.from_pretrained).
// With --repeat N (speed) it also times N full training steps as training runs them (the
// chunked LM head and loss, forward, backward, AdamW)
// after one warm-up and writes OUT/speed.json. Torch-free header.
#pragma once

#include <cstdint>
#include <string>

namespace lorastream::worker {

struct ParityOptions {
  std::string model_dir;
  std::string store_name;   // instead of model_dir: a published store
  std::string tokens_path;  // safetensors: "input_ids" I64 [B, S], optional "labels" I64 [B, S]
  std::string adapter_dir;  // a peft adapter folder; "" = a fresh one of `rank` on all 7
  std::string out_dir;
  std::string dtype = "f32";   // f32 | bf16
  std::string device = "cpu";  // cpu | cuda:N
  int64_t rank = 16;           // for a fresh adapter (alpha = 2 * rank)
  int timing_repeats = 0;
  // Blocks that keep their forward's activations into their backward in the timed steps
  // (BlockProvider::taped_blocks): 0 none (every block recomputed), -1 all, N the last N.
  int taped_blocks = 0;
};

void RunParity(const ParityOptions& options);

}  // namespace lorastream::worker
