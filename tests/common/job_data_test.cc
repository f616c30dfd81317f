// The job keys of evaluation and epochs, the held-out split, the step count from epochs and
// the statistics' eval fields in JSON.
#include "common/job/job_data.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <set>

#include "common/base/error.h"
#include "common/job/step_stats_json.h"

using namespace lorastream;
namespace fs = std::filesystem;

namespace {

bool Mentions(const std::vector<std::string>& problems, const std::string& text) {
  for (const auto& p : problems)
    if (p.find(text) != std::string::npos) return true;
  return false;
}

struct Dir {
  fs::path path = fs::temp_directory_path() / ("lorastream-jobdata-" + std::to_string(getpid()));
  Dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
};

// n documents; document d holds the ids d*100 + 0 .. d*100 + len-1.
std::string WriteDocs(const fs::path& file, int n, int len) {
  std::ofstream out(file);
  for (int d = 0; d < n; ++d) {
    out << "{\"input_ids\": [";
    for (int i = 0; i < len; ++i) out << (i ? "," : "") << d * 100 + i;
    out << "]}\n";
  }
  return file.string();
}

JobSpec Spec(const std::string& toml, const fs::path& dir) {
  JobSpec s = ParseJobSpec(
      "[model]\nstore = \"m\"\n[data]\npath = \"" + (dir / "d.jsonl").string() +
          "\"\nseq_len = 8\n[train]\noutput_dir = \"" + (dir / "out").string() + "\"\n" + toml,
      "job.toml");
  ResolveJobSpec(s);
  return s;
}

}  // namespace

TEST_CASE("train.epochs or train.steps, exactly one; [eval] keys checked", "[common]") {
  Dir dir;
  WriteDocs(dir.path / "d.jsonl", 4, 10);
  CHECK(ValidateJobSpec(Spec("steps = 3\n", dir.path)).empty());
  JobSpec by_epochs = Spec("epochs = 2.5\n", dir.path);
  CHECK(by_epochs.train.epochs == 2.5);
  CHECK(ValidateJobSpec(by_epochs).empty());
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\nepochs = 1\n", dir.path)),
                 "key `train.epochs` and `train.steps` are both given"));
  CHECK(Mentions(ValidateJobSpec(Spec("epochs = -1\n", dir.path)), "key `train.epochs` must be"));
  CHECK(Mentions(ValidateJobSpec(Spec("", dir.path)), "or give `train.epochs` instead"));

  CHECK(ValidateJobSpec(Spec("steps = 3\n[eval]\nsplit = 0.25\nevery = 2\nbatches = 1\n", dir.path))
            .empty());
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\n[eval]\nsplit = 0.9\n", dir.path)),
                 "key `eval.split` must be in (0, 0.5]"));
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\n[eval]\npath = \"nope.jsonl\"\n", dir.path)),
                 "key `eval.path` names a file that does not exist"));
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\n[eval]\npath = \"" +
                                          (dir.path / "d.jsonl").string() + "\"\nsplit = 0.1\n",
                                      dir.path)),
                 "both given"));
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\n[eval]\nevery = 5\n", dir.path)),
                 "needs an evaluation set"));
  CHECK(Mentions(ValidateJobSpec(Spec("steps = 3\n[eval]\nsplit = 0.1\nevery = -1\n", dir.path)),
                 "key `eval.every` must be >= 0"));
  CHECK_THROWS_WITH(Spec("steps = 3\n[eval]\nspilt = 0.1\n", dir.path), Catch::Contains("spilt"));
  // eval.path's format comes from its extension, like data.path's.
  JobSpec with_path = Spec("steps = 1\n[eval]\npath = \"v.tok\"\n", dir.path);
  CHECK(with_path.eval.format == "tokens");
  CHECK(fs::path(with_path.eval.path).is_absolute());
}

TEST_CASE("steps from epochs: ceil(epochs x sequences / (batch x accum)), at least 1", "[common]") {
  CHECK(StepsForEpochs(1, 10, 2, 1) == 5);
  CHECK(StepsForEpochs(1, 11, 2, 1) == 6);    // the last step wraps into the next epoch
  CHECK(StepsForEpochs(2.5, 10, 2, 2) == 7);  // 25 sequences / 4 per step
  CHECK(StepsForEpochs(0.01, 10, 2, 1) == 1);
  CHECK_THROWS_AS(StepsForEpochs(1e6, int64_t{1} << 50, 1, 1), Error);
}

TEST_CASE("eval.split holds out whole documents, the same ones for a seed, never trained on",
          "[common]") {
  std::vector<Document> docs(20);
  for (int d = 0; d < 20; ++d) docs[d].ids = docs[d].labels = {d, d, d};
  std::vector<Document> train, eval, train2, eval2;
  SplitDocuments(docs, 0.2, 7, &train, &eval);
  REQUIRE(eval.size() == 4);
  REQUIRE(train.size() == 16);
  std::set<int> held, trained;
  for (const auto& d : eval) held.insert(d.ids[0]);
  for (const auto& d : train) trained.insert(d.ids[0]);
  CHECK(held.size() == 4);
  for (int h : held) CHECK(trained.count(h) == 0);
  CHECK(held.size() + trained.size() == 20);
  CHECK(std::is_sorted(train.begin(), train.end(),
                       [](const Document& a, const Document& b) { return a.ids[0] < b.ids[0]; }));
  SplitDocuments(docs, 0.2, 7, &train2, &eval2);
  for (size_t i = 0; i < eval.size(); ++i) CHECK(eval2[i].ids == eval[i].ids);
  SplitDocuments(docs, 0.2, 8, &train2, &eval2);
  std::set<int> other;
  for (const auto& d : eval2) other.insert(d.ids[0]);
  CHECK(other != held);  // another seed, another split
  CHECK_THROWS_WITH(SplitDocuments({docs[0]}, 0.5, 1, &train, &eval),
                    Catch::Contains("leaves no training data"));
}

TEST_CASE("LoadJobData: split, separate eval file, steps by epochs and the description",
          "[common]") {
  Dir dir;
  WriteDocs(dir.path / "d.jsonl", 10, 16);  // 160 tokens = 20 sequences of 8 when packed
  JobSpec s = Spec("epochs = 1.5\nbatch_size = 2\ngrad_accum = 2\n[eval]\nsplit = 0.2\n", dir.path);
  JobData d = LoadJobData(s, 1 << 20);
  CHECK(d.train_documents == 8);
  CHECK(d.eval_documents == 2);
  CHECK(d.train.count == 16);
  CHECK(d.eval.count == 4);
  CHECK(d.steps_per_epoch == 4);
  CHECK(d.steps == 6);  // ceil(1.5 * 16 / 4)
  // Held-out tokens are nowhere in the training sequences.
  std::set<int32_t> eval_ids(d.eval.ids.begin(), d.eval.ids.end());
  for (int32_t id : d.train.ids) CHECK(eval_ids.count(id) == 0);
  CHECK(DescribeJobData(s, d) ==
        "16 training sequences of 8 tokens from 8 documents, 4 eval sequences from 2 held-out "
        "documents; 1.5 epochs = 6 steps of 4 sequences (4 per epoch; ceil(epochs x sequences "
        "/ 4))");

  WriteDocs(dir.path / "v.jsonl", 3, 8);
  JobSpec f =
      Spec("steps = 5\n[eval]\npath = \"" + (dir.path / "v.jsonl").string() + "\"\n", dir.path);
  JobData g = LoadJobData(f, 1 << 20);
  CHECK(g.train.count == 20);
  CHECK(g.eval.count == 3);
  CHECK(g.steps == 5);
  CHECK_THAT(DescribeJobData(f, g), Catch::EndsWith("; 5 steps of 1 sequences (0.25 epochs)"));

  // Warmup longer than the steps the epochs give is refused once they are known.
  JobSpec w = Spec("epochs = 0.1\n[optim]\nwarmup_steps = 10\n", dir.path);
  CHECK(ValidateJobSpec(w).empty());
  CHECK_THROWS_WITH(LoadJobData(w, 1 << 20), Catch::Contains("optim.warmup_steps"));
}

TEST_CASE("statistics carry eval_loss only on the steps that evaluated", "[common]") {
  StepStats s;
  s.step = 4;
  CHECK_FALSE(s.has_eval());
  CHECK_FALSE(StepStatsToJson(s).contains("eval_loss"));
  s.eval_loss = 1.5;
  s.eval_tokens = 30;
  nlohmann::json j = StepStatsToJson(s);
  CHECK(j["eval_loss"] == 1.5);
  CHECK(j["eval_tokens"] == 30);
}
