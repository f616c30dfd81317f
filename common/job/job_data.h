// A job's data as the trainer uses it: the training sequences, the evaluation sequences (from
// eval.path or held out of the training documents by eval.split) and the number of optimizer
// steps (train.steps, or computed from train.epochs). Torch-free: the worker trains on it and
// `lorastream submit` shows the step count of an epochs job with the same code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/data.h"
#include "common/job/job_spec.h"

namespace lorastream {

struct JobData {
  SequenceSet train;
  SequenceSet eval;  // count == 0 without an eval set
  int64_t train_documents = 0;
  int64_t eval_documents = 0;
  int64_t steps = 0;            // train.steps, or from train.epochs over train.count
  int64_t steps_per_epoch = 0;  // ceil(train.count / (batch_size * grad_accum))
};

// Held-out split: k = max(1, round(fraction * n)) of the n documents, chosen by a permutation
// drawn from `seed` (the same on every platform), go to `eval`, the rest to `train`; both keep
// file order. Error(kRefused) naming eval.split when either side would be empty.
void SplitDocuments(std::vector<Document> docs, double fraction, uint64_t seed,
                    std::vector<Document>* train, std::vector<Document>* eval);

// Loads, splits and builds the sequences of `spec` (resolved: formats filled in) against
// `vocab_size`, and resolves the step count. Refusals as LoadDocuments, plus eval.split and
// warmup_steps against the computed steps.
JobData LoadJobData(const JobSpec& spec, int64_t vocab_size);

// "120 sequences of 64 tokens (3 documents held out for eval); 2.5 epochs = 38 steps of 8
// sequences (15 per epoch, the last one rounded up)" — the line the worker logs first and
// `submit` prints for an epochs job.
std::string DescribeJobData(const JobSpec& spec, const JobData& data);

}  // namespace lorastream
