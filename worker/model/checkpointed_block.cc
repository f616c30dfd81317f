// Per-block gradient checkpointing as a custom autograd function: one node per block. The
// forward keeps only the block's input; the backward re-acquires the block's weights from the
// provider (in the step's order L-1..0, which is what the streaming engine plans for),
// recomputes the block onto a tape, runs the hand-written BlockBackward (worker/model/block.h) and
// releases the block. A taped block (the plan's last ones) keeps the forward's tape in its
// node instead, and its backward skips the recompute; the weights are still acquired (the
// backward reads them) and no base weight is in the tape.
#include <memory>

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/model/block.h"
#include "worker/model/model.h"

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
  std::unique_ptr<BlockTape> tape;  // a taped block's activations, until its backward
};

struct CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
  // inputs: x, then the block's LoRA tensors (A, B per targeted projection).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                               const CheckpointArgs* args, bool keep_tape) {
    auto holder = c10::make_intrusive<ArgsHolder>(*args);
    if (keep_tape) holder->tape = std::make_unique<BlockTape>();
    const BlockWeights& w = args->provider->Acquire(args->block);
    at::Tensor y = BlockForwardTaped(x, w, args->lora, args->compute, holder->tape.get());
    args->provider->Release(args->block);
    variable_list saved{x};
    for (auto& p : params) saved.push_back(p);
    ctx->save_for_backward(saved);
    ctx->saved_data["args"] = c10::IValue::make_capsule(std::move(holder));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto capsule = ctx->saved_data["args"].toCapsule();
    ArgsHolder* holder = static_cast<ArgsHolder*>(capsule.get());
    const CheckpointArgs& args = holder->args;
    variable_list saved = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0);
    const BlockWeights& w = args.provider->Acquire(args.block);
    LoraBlockGrads grads;
    at::Tensor dx;
    {
      // The kept tape (freed here, with its activations), else a recompute onto a new one.
      std::unique_ptr<BlockTape> tape = std::move(holder->tape);
      if (!tape) {
        tape = std::make_unique<BlockTape>();
        BlockForwardTaped(saved[0], w, args.lora, args.compute, tape.get());
      }
      dx = BlockBackward(*tape, w, args.lora, args.compute, grad_out[0], need_x, grads);
    }
    args.provider->Release(args.block);
    variable_list result{dx};
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (!args.targets[t]) continue;
      result.push_back(grads.a[t]);
      result.push_back(grads.b[t]);
    }
    result.push_back(at::Tensor());  // the CheckpointArgs pointer
    result.push_back(at::Tensor());  // keep_tape
    return result;
  }
};

}  // namespace

at::Tensor CheckpointedBlockForward(const at::Tensor& x, int block, const LoraAdapter& adapter,
                                    BlockProvider& provider, const BlockCompute& c,
                                    bool keep_tape) {
  CheckpointArgs args;
  args.block = block;
  args.provider = &provider;
  args.compute = c;
  args.targets = adapter.settings().targets;
  args.lora = CastLoraBlock(adapter.block(block), x.scalar_type());
  // As a TensorList: custom functions track tensors inside an ArrayRef, not a std::vector.
  const std::vector<at::Tensor> params = adapter.BlockParams(block);
  return CheckpointedBlock::apply(x, at::TensorList(params), &args, keep_tape)[0];
}

}  // namespace lorastream::worker
