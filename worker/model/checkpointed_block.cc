// Per-block gradient checkpointing as a custom autograd function: one node per block. The
// forward keeps only the block's input; the backward re-acquires the block's weights from the
// provider (in the step's order L-1..0, which is what the streaming engine plans for),
// recomputes the block onto a tape, runs the hand-written BlockBackward (worker/model/block.h) and
// releases the block. A group of jobs (model.h: CheckpointedGroupBlockForward) is one node:
// the block is acquired once per pass and its base GEMMs run over every job's rows
// (block.h's group functions). A taped block (the plan's last ones) keeps the forward's tape in its
// node instead, and its backward skips the recompute; the weights are still acquired (the
// backward reads them) and no base weight is in the tape.
#include <memory>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "worker/model/block.h"
#include "worker/model/model.h"

namespace lorastream::worker {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One job's part of a checkpointed group block.
struct CheckpointJob {
  BlockCompute compute;
  LoraSettings settings;  // which of the block's pairs are parameters (LoraSlots)
  LoraBlockCast lora;     // the adapter in the compute dtype, cast once for the three passes
};

// What the backward needs besides the saved tensors. Lives on the heap, owned by the node
// (through saved_data) so that it is freed with the graph.
struct CheckpointArgs {
  int block = 0;
  BlockProvider* provider = nullptr;
  std::vector<CheckpointJob> jobs;

  std::vector<BlockJob> BlockJobs() const {
    std::vector<BlockJob> out;
    for (const CheckpointJob& j : jobs) out.push_back(BlockJob{&j.lora, &j.compute});
    return out;
  }
};

class ArgsHolder : public torch::CustomClassHolder {
 public:
  explicit ArgsHolder(CheckpointArgs a) : args(std::move(a)) {}
  CheckpointArgs args;
  std::unique_ptr<BlockTape> tape;  // a taped block's activations, until its backward
};

// One node for the whole group: the block is acquired once per pass for every job.
struct CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
  // inputs: each job's x, then the jobs' LoRA tensors (A, B per targeted projection, job by
  // job).
  static variable_list forward(AutogradContext* ctx, at::TensorList xs, at::TensorList params,
                               const CheckpointArgs* args, bool keep_tape) {
    auto holder = c10::make_intrusive<ArgsHolder>(*args);
    if (keep_tape) holder->tape = std::make_unique<BlockTape>();
    const BlockWeights& w = args->provider->Acquire(args->block);
    const std::vector<at::Tensor> inputs(xs.begin(), xs.end());
    std::vector<at::Tensor> ys =
        GroupBlockForwardTaped(inputs, w, holder->args.BlockJobs(), holder->tape.get());
    args->provider->Release(args->block);
    variable_list saved(xs.begin(), xs.end());
    for (auto& p : params) saved.push_back(p);
    ctx->save_for_backward(saved);
    ctx->saved_data["args"] = c10::IValue::make_capsule(std::move(holder));
    return ys;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto capsule = ctx->saved_data["args"].toCapsule();
    ArgsHolder* holder = static_cast<ArgsHolder*>(capsule.get());
    const CheckpointArgs& args = holder->args;
    const size_t k = args.jobs.size();
    variable_list saved = ctx->get_saved_variables();
    const std::vector<at::Tensor> xs(saved.begin(), saved.begin() + static_cast<int64_t>(k));
    bool need_x = false;
    for (size_t j = 0; j < k; ++j) need_x = need_x || ctx->needs_input_grad(j);
    const std::vector<BlockJob> jobs = args.BlockJobs();
    const BlockWeights& w = args.provider->Acquire(args.block);
    std::vector<LoraBlockGrads> grads;
    std::vector<at::Tensor> dxs;
    {
      // The kept tape (freed here, with its activations), else a recompute onto a new one.
      std::unique_ptr<BlockTape> tape = std::move(holder->tape);
      if (!tape) {
        tape = std::make_unique<BlockTape>();
        GroupBlockForwardTaped(xs, w, jobs, tape.get());
      }
      dxs = GroupBlockBackward(*tape, w, jobs, grad_out, need_x, grads);
    }
    args.provider->Release(args.block);
    variable_list result(dxs.begin(), dxs.end());
    for (size_t j = 0; j < k; ++j)  // in the order of the adapter's BlockParams
      for (const LoraSlot& slot :
           LoraSlots(*args.jobs[j].compute.config, args.jobs[j].settings, grads[j])) {
        result.push_back(*slot.a);
        result.push_back(*slot.b);
      }
    result.push_back(at::Tensor());  // the CheckpointArgs pointer
    result.push_back(at::Tensor());  // keep_tape
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> CheckpointedGroupBlockForward(const std::vector<GroupBlockInput>& inputs,
                                                      int block, BlockProvider& provider,
                                                      bool keep_tape) {
  LS_CHECK(!inputs.empty(), "a checkpointed block needs at least one job");
  CheckpointArgs args;
  args.block = block;
  args.provider = &provider;
  std::vector<at::Tensor> xs, params;
  for (const GroupBlockInput& in : inputs) {
    CheckpointJob job;
    job.compute = in.compute;
    job.settings = in.adapter->settings();
    job.lora = CastLoraBlock(in.adapter->block(block), in.x.scalar_type());
    const std::vector<at::Tensor> p = in.adapter->BlockParams(block);
    params.insert(params.end(), p.begin(), p.end());
    xs.push_back(in.x);
    args.jobs.push_back(std::move(job));
  }
  // As TensorLists: custom functions track tensors inside an ArrayRef, not a std::vector.
  return CheckpointedBlock::apply(at::TensorList(xs), at::TensorList(params), &args, keep_tape);
}

at::Tensor CheckpointedBlockForward(const at::Tensor& x, int block, const LoraAdapter& adapter,
                                    BlockProvider& provider, const BlockCompute& c,
                                    bool keep_tape) {
  return CheckpointedGroupBlockForward({GroupBlockInput{x, &adapter, c}}, block, provider,
                                       keep_tape)[0];
}

}  // namespace lorastream::worker
