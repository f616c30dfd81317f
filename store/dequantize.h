// `lorastream-store dequantize`: a compressed base written back as a plain Hugging Face
// checkpoint holding exactly the weights the worker computes with (the parity harness runs
// transformers on it; the quality report compares it with the bf16 original).
//
// The checkpoint is packed as `serve` packs it (with `--quantize`, or as a pre-quantised
// folder holds it) into a private store that lives only during the call, and every compressed
// projection weight is expanded with store/quantize.h's arithmetic to BF16, the dtype the
// expansion defines; every other tensor keeps the store's bytes. config.json is the source's
// without `quantization_config`; the folder's other files (tokenizer, generation config) are
// copied. A FLUX.1 checkpoint (BFL's file or a diffusers folder) is written as BFL's single
// file, OUT_DIR/flux1.safetensors, its linears in BF16 and every other tensor as the store
// holds it. The model passes through memory once: meant for test and report models.
#pragma once

#include <cstdint>
#include <string>

#include "common/formats/manifest.h"
#include "common/formats/quant_format.h"

namespace lorastream::store {

struct DequantizeOptions {
  std::string model_dir;
  std::string out_dir;  // created; refused when it already holds files
  // The format to quantise to; kNone: `model_dir` must be a pre-quantised checkpoint.
  QuantMethod quantize = QuantMethod::kNone;
  bool quantize_head = false;       // with `quantize`: the LM head too (serve's --quantize-head)
  bool quantize_embedding = false;  // and the untied embedding table
  int threads = 0;                  // quantising threads; 0: one per hardware thread
};

struct DequantizeResult {
  QuantInfo format;          // what the weights were compressed as
  int expanded_tensors = 0;  // projection weights written dequantised
};

// Errors: kInvalidArgument for an out_dir that holds files or a plain checkpoint without
// `quantize`; the loader's own (kCorrupt, kUnsupported) for a checkpoint it refuses.
DequantizeResult WriteDequantized(const DequantizeOptions& options);

// The bf16 bits of elements [begin, end) (row-major) of compressed weight `w` of a segment
// whose bytes start at `segment` (its scales found through `layout`): what the dequantised
// checkpoint holds, and the worker's host expansion of a compressed embedding's rows.
void ExpandElements(const uint8_t* segment, const SegmentInfo& layout, const TensorSlice& w,
                    int64_t begin, int64_t end, uint16_t* out);

}  // namespace lorastream::store
