// Per-block gradient checkpointing as a custom autograd function: one node per block. The
// forward keeps only the block's input; the backward re-acquires the block's weights from the
// provider (in the step's order L-1..0, which is what the streaming engine plans for),
// recomputes the block onto a tape, runs the hand-written BlockBackward (worker/block.h) and
// releases the block.
#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/block.h"
#include "worker/model.h"

namespace lorastream::worker {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs besides the saved tensors. Lives on the heap, owned by the node
// (through saved_data) so that it is freed with the graph.
struct CheckpointArgs {
  int block = 0;
  BlockProvider* provider = nullptr;
  BlockCompute compute;
  std::array<bool, kNumLoraTargets> targets{};
  LoraBlockCast lora;  // the adapter in the compute dtype, cast once for the three passes
};

class ArgsHolder : public torch::CustomClassHolder {
 public:
  explicit ArgsHolder(const CheckpointArgs& a) : args(a) {}
  CheckpointArgs args;
};

struct CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
  // inputs: x, then the block's LoRA tensors (A, B per targeted projection).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                               const CheckpointArgs* args) {
    const BlockWeights& w = args->provider->Acquire(args->block);
    at::Tensor y = BlockForwardTaped(x, w, args->lora, args->compute, /*tape=*/nullptr);
    args->provider->Release(args->block);
    variable_list saved{x};
    for (auto& p : params) saved.push_back(p);
    ctx->save_for_backward(saved);
    ctx->saved_data["args"] = c10::IValue::make_capsule(c10::make_intrusive<ArgsHolder>(*args));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto holder = ctx->saved_data["args"].toCapsule();
    const CheckpointArgs& args = static_cast<ArgsHolder*>(holder.get())->args;
    variable_list saved = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    const BlockWeights& w = args.provider->Acquire(args.block);
    LoraBlockGrads grads;
    at::Tensor dx;
    {
      BlockTape tape;
      BlockForwardTaped(saved[0], w, args.lora, args.compute, &tape);
      dx = BlockBackward(tape, w, args.lora, args.compute, grad_out[0], need_x, grads);
    }
    args.provider->Release(args.block);
    variable_list result{dx};
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (!args.targets[t]) continue;
      result.push_back(grads.a[t]);
      result.push_back(grads.b[t]);
    }
    result.push_back(at::Tensor());  // the CheckpointArgs pointer
    return result;
  }
};

}  // namespace

at::Tensor CheckpointedBlockForward(const at::Tensor& x, int block, const LoraAdapter& adapter,
                                    BlockProvider& provider, const BlockCompute& c) {
  CheckpointArgs args;
  args.block = block;
  args.provider = &provider;
  args.compute = c;
  args.targets = adapter.settings().targets;
  args.lora = CastLoraBlock(adapter.block(block), x.scalar_type());
  // As a TensorList: custom functions track tensors inside an ArrayRef, not a std::vector.
  const std::vector<at::Tensor> params = adapter.BlockParams(block);
  return CheckpointedBlock::apply(x, at::TensorList(params), &args)[0];
}

}  // namespace lorastream::worker
