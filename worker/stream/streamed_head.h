// The LM head as a HeadProvider (worker/model/lm_head.h) copied Host->Device for each use,
// through the streaming engine's backend for the device (CUDA: the range registered
// read-only, else pinned staging; CPU: a copy thread), with the engine's debug options
// (poison, delay): what a plan that streams the head (ResidencyPlan::head_streamed) uses.
#pragma once

#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/stream/stream_engine_options.h"

namespace lorastream::worker {

// `host_weight` [vocab, hidden] lies in host RAM (a store's read-only shared memory, a
// checkpoint's mapping; for a tied model the embedding table); the view keeps its owner
// alive. When its dtype is not `dtype` it is converted once into page-aligned host memory this
// provider owns (HostBytes, read-only once filled).
std::unique_ptr<HeadProvider> MakeStreamedHead(const at::Tensor& host_weight, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options);

// The head of `rest`: rest.lm_head as above, or a compressed rest.packed_head whose
// compressed bytes are copied for each use and expanded per vocabulary slice
// (options.head_slice_rows rows; 0: HeadSliceRows's).
std::unique_ptr<HeadProvider> MakeStreamedHead(const RestWeights& rest, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options);

}  // namespace lorastream::worker
