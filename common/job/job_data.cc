#include "common/job/job_data.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "common/base/error.h"

namespace lorastream {

void SplitDocuments(std::vector<Document> docs, double fraction, uint64_t seed,
                    std::vector<Document>* train, std::vector<Document>* eval) {
  const int64_t n = static_cast<int64_t>(docs.size());
  const int64_t k =
      std::max<int64_t>(1, static_cast<int64_t>(std::llround(fraction * static_cast<double>(n))));
  if (n < 2 || k >= n)
    throw Error(ErrorCode::kRefused,
                "eval.split = " + std::to_string(fraction) + " of " + std::to_string(n) +
                    " documents leaves no training data: give more documents or an eval.path");
  // The first k documents of a seeded permutation (the sampler's, over documents, with a
  // salted seed so that the split does not mirror the training order) are held out.
  Sampler permutation(n, seed ^ 0xe7a15b1172ull);
  std::vector<char> held(n, 0);
  for (int64_t i = 0; i < k; ++i) held[permutation.Index(i)] = 1;
  train->clear();
  eval->clear();
  for (int64_t i = 0; i < n; ++i) (held[i] ? eval : train)->push_back(std::move(docs[i]));
}

namespace {

// A sequence's first label is never a target (the loss predicts token s + 1 from s): data
// without any other unmasked label would train to "done" at loss 0 having learnt nothing.
void RequireTargets(const SequenceSet& set, const std::string& path) {
  for (size_t i = 0; i < set.labels.size(); ++i)
    if (set.labels[i] != kIgnoreIndex && static_cast<int64_t>(i) % set.seq_len != 0) return;
  throw Error(ErrorCode::kRefused, "data.path " + path +
                                       ": no token to train on: every label of its " +
                                       std::to_string(set.count) + " sequences is masked (-100)");
}

}  // namespace

JobData LoadJobData(const JobSpec& spec, int64_t vocab_size) {
  JobData out;
  const int32_t pad = static_cast<int32_t>(spec.data.pad_id);
  std::vector<Document> docs = LoadDocuments(spec.data.path, spec.data.format, vocab_size);
  std::vector<Document> eval_docs;
  if (spec.eval.split > 0) {
    std::vector<Document> train_docs;
    SplitDocuments(std::move(docs), spec.eval.split, spec.train.seed, &train_docs, &eval_docs);
    docs = std::move(train_docs);
  } else if (!spec.eval.path.empty()) {
    eval_docs = LoadDocuments(spec.eval.path, spec.eval.format, vocab_size);
  }
  out.train_documents = static_cast<int64_t>(docs.size());
  out.eval_documents = static_cast<int64_t>(eval_docs.size());
  out.train = BuildSequences(docs, spec.data.seq_len, spec.data.packing, pad);
  docs.clear();
  RequireTargets(out.train, spec.data.path);
  if (!eval_docs.empty())
    out.eval = BuildSequences(eval_docs, spec.data.seq_len, spec.data.packing, pad);
  else
    out.eval.seq_len = spec.data.seq_len;

  const int64_t per_step = spec.train.batch_size * spec.train.grad_accum;
  out.steps_per_epoch = (out.train.count + per_step - 1) / per_step;
  out.steps = spec.train.epochs > 0 ? StepsForEpochs(spec.train.epochs, out.train.count,
                                                     spec.train.batch_size, spec.train.grad_accum)
                                    : spec.train.steps;
  if (spec.optim.warmup_steps > out.steps)
    throw Error(ErrorCode::kRefused,
                (spec.source.empty() ? std::string("job") : spec.source) +
                    ": key `optim.warmup_steps` is " + std::to_string(spec.optim.warmup_steps) +
                    ", more than the job's " + std::to_string(out.steps) + " steps");
  return out;
}

std::string DescribeJobData(const JobSpec& spec, const JobData& d) {
  std::string text = std::to_string(d.train.count) + " training sequences of " +
                     std::to_string(d.train.seq_len) + " tokens from " +
                     std::to_string(d.train_documents) + " documents";
  if (d.eval.count > 0)
    text += ", " + std::to_string(d.eval.count) + " eval sequences from " +
            std::to_string(d.eval_documents) +
            (spec.eval.split > 0 ? " held-out documents" : " documents of eval.path");
  const int64_t per_step = spec.train.batch_size * spec.train.grad_accum;
  if (spec.train.epochs > 0) {
    char epochs[32];
    std::snprintf(epochs, sizeof epochs, "%g", spec.train.epochs);
    text += "; " + std::string(epochs) + " epochs = " + std::to_string(d.steps) + " steps of " +
            std::to_string(per_step) + " sequences (" + std::to_string(d.steps_per_epoch) +
            " per epoch; ceil(epochs x sequences / " + std::to_string(per_step) + "))";
  } else {
    char epochs[32];
    std::snprintf(epochs, sizeof epochs, "%.2f",
                  static_cast<double>(d.steps * per_step) /
                      static_cast<double>(std::max<int64_t>(1, d.train.count)));
    text += "; " + std::to_string(d.steps) + " steps of " + std::to_string(per_step) +
            " sequences (" + epochs + " epochs)";
  }
  return text;
}

}  // namespace lorastream
