// A job group: up to K jobs trained at once against one base on one device. Torch-free header.
//
// Per group step every job takes its own optimizer step. Its micro-batches run together with
// the other jobs' (micro-batch m of the group holds every job whose step has more than m
// micro-batches: a job with fewer sits out the group's later ones): each block is acquired
// once per pass for every job in it, and its base projections run once over the rows of all
// of them on CUDA, per job on the CPU (worker/model/model.h: CausalLm::TrainGroupMicroBatch).
// Everything else is the job's own, as RunTraining (worker/train/trainer.h) describes it for one
// job: data and its order, seq_len, batch_size, grad_accum, adapter (rank, alpha, targets, dropout
// and its masks), AdamW, schedule, clipping by its own gradient norm, steps, evaluation,
// checkpoints, statistics and output folder. A job trained in a group computes what it computes
// alone (bit for bit on the CPU, whatever the BLAS: its base GEMMs run on its own rows there; to
// bf16 rounding on CUDA), and its checkpoints resume alone or in another group.
//
// Jobs join (Add) and leave at step boundaries: a job leaves when it has finished, when its
// should_stop says so (after a checkpoint), or when it fails (bad data, a non-finite loss, an
// output folder it may not write): its failure is its own, and the others train on. When the
// forward and backward of several jobs fail together (an allocation failure, say), the group
// splits: from then on each job's step runs alone (its own pass over the blocks), the step
// that failed included, and only a job that fails alone leaves, with its own error. A failure
// outside the forward and backward (the updates, the device) ends every job in it.
//
// The jobs of a group share the base (model.store or model.checkpoint), the compute dtype and
// the plan ([stream]); a job that differs in any of them is refused naming the field.
// A group of one job is RunTraining's path: the same calls, CUDA graphs included.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/job/job_group.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "worker/train/trainer.h"

namespace lorastream {
class ActingAs;  // common/posix/acting_as.h
}  // namespace lorastream

namespace lorastream::worker {

// A job and its callbacks (as RunTraining takes them).
struct GroupJob {
  JobSpec spec;
  std::function<void(const StepStats&)> on_step;
  std::function<bool()> should_stop;
  // What its output folder's lock names as the holder (a serving worker's job attempt);
  // "": the group's TrainOptions::lock_holder.
  std::string lock_holder;
};

// What became of a job that left the group: its result, or the error that ended it.
struct GroupJobOutcome {
  std::string name;  // the job's spec.name
  size_t index = 0;  // the order in which it was added (0 = the first); RunGroupTraining:
                     // its place in the jobs given
  TrainResult result;
  std::exception_ptr error;  // set when it failed
};

// Whether two jobs may share a group: common/job/job_group.h (the coordinator applies it too).
using ::lorastream::GroupRefusal;

template <class Job>
class GroupMembers;  // worker/train/group_members.h

class FamilyGroup;

// The one group trainer of every family (worker/train/family.h): the family of `first`
// (worker/families.cc) builds the base and the model; every job of the group is of that family.
class GroupTrainer final {
 public:
  // The group's base, provider and model come from `first`'s spec (resolved), on
  // options.device; options.resume, lock_holder apply to every job.
  GroupTrainer(const JobSpec& first, const TrainOptions& options);
  ~GroupTrainer();
  GroupTrainer(const GroupTrainer&) = delete;
  GroupTrainer& operator=(const GroupTrainer&) = delete;

  // Adds a job at a step boundary: it resumes from its output folder's latest checkpoint (with
  // options.resume) and takes its first step in the next Step(). A job that cannot join
  // (GroupRefusal) or cannot start (an invalid spec, missing or bad data, a locked output
  // folder) leaves at once with its error (TakeLeft); the group goes on. Returns its index.
  size_t Add(GroupJob job);
  // Why `spec` cannot join now: the memory the group's plan was made for (the first job's and
  // those given with it) cannot also hold it beside the jobs training now
  // (FamilyGroup::JoinRefusal); "" when it can, or when no estimate can be made (the job then
  // fails alone when it starts). Callers ask before Add; a refused job waits for a group of its
  // own.
  std::string JoinRefusal(const JobSpec& spec) const;
  // One group step: every job's next optimizer step. Returns false when no job is left.
  bool Step();
  // Runs Step() until every job has left.
  void Run();
  // The jobs that left since the last call, in the order they left.
  std::vector<GroupJobOutcome> TakeLeft();
  size_t size() const;  // jobs training now

 private:
  class Job;
  // Every job's forward and backward as one (RunStep), their losses added to each.
  void RunTogether(const std::vector<Job*>& jobs);

  TrainOptions options_;
  JobSpec first_;  // resolved
  std::unique_ptr<FamilyGroup> family_;
  // From after the model is built: every file a job opens or creates is opened as the
  // submitter (TrainOptions::files_as; a store is the worker's own to attach).
  std::unique_ptr<ActingAs> as_submitter_;
  std::unique_ptr<GroupMembers<Job>> members_;
  bool split_ = false;  // a shared step failed: each job's step runs alone
};

// Trains `jobs` until each has finished, stopped or failed; their outcomes in the order they
// were given. One group when its plan can hold them all (options.plan_group, unless the caller
// set it): the plan leaves room for every job. When it cannot (refused: a job beyond the
// budget or the device's memory), the group is planned for its first job alone and each other
// job joins while the plan's memory holds it (GroupTrainer::JoinRefusal); the others train
// after, in a group of their own, planned the same way. A job refused alone fails alone, naming
// it; the others train as they would alone.
std::vector<GroupJobOutcome> RunGroupTraining(std::vector<GroupJob> jobs,
                                              const TrainOptions& options);

// `lorastream-worker train A.toml B.toml ...`: the jobs as one group, a progress line per job
// and step (prefixed by the job's name), and a line per job at its end. Exit status: 0 when
// every job finished, 128 + the signal when stopped, 1 when any job failed. Jobs of different
// families are refused before anything is trained, naming the file.
int RunGroupTrainCommand(const std::vector<std::string>& job_paths, const TrainOptions& options,
                         const std::atomic<int>* stop_signal = nullptr);

}  // namespace lorastream::worker
