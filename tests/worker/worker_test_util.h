// Helpers of the worker tests: tiny checkpoints (lorastream-synth's generator), data files
// and job specs in a fresh temporary folder.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/job/job_spec.h"
#include "store/server.h"
#include "store/synth.h"
#include "tests/support/test_support.h"

namespace lorastream::testing {

// Writes a bf16 checkpoint of the model `preset_toml` describes (a preset's TOML text, kept in
// dir/p.toml) into dir/m and returns dir/m: shapes no preset has (odd widths for the kernels).
inline std::string MakeCheckpointOfShape(const std::string& dir, const std::string& preset_toml,
                                         uint64_t seed) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/p.toml") << preset_toml;
  store::SynthOptions o;
  o.preset = dir + "/p.toml";
  o.out_dir = dir + "/m";
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.seed = seed;
  o.dtype = "bf16";
  o.threads = 2;
  store::RunSynth(o);
  return o.out_dir;
}

// Writes a checkpoint of configs/models/<preset>.toml (f32) into `dir`.
inline std::string MakeCheckpoint(const std::string& dir, const std::string& preset,
                                  uint64_t seed = 1) {
  store::SynthOptions o;
  o.preset = preset;
  o.out_dir = dir;
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.seed = seed;
  o.dtype = "f32";
  o.threads = 1;
  o.force = true;  // tests write into their own temporary folders, some more than once
  store::RunSynth(o);
  return dir;
}

// `model_dir` published as a store in this process (compressed as `quantize` says, unlocked),
// under a name no other test or run uses; unpublished when the result is destroyed.
inline std::unique_ptr<store::PublishedStore> ServeForTest(const std::string& model_dir,
                                                           QuantMethod quantize,
                                                           const std::string& tag,
                                                           bool quantize_head = false,
                                                           bool quantize_embedding = false) {
  static std::atomic<int> counter{0};
  store::ServeOptions o;
  o.model_dir = model_dir;
  o.name = "test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  o.threads = 2;
  o.lock = false;
  o.quantize = quantize;
  o.quantize_head = quantize_head;
  o.quantize_embedding = quantize_embedding;
  return store::PublishedStore::Build(o);
}

// `docs` documents of random lengths in [min_len, max_len] with ids in [0, vocab).
inline std::string WriteJsonl(const std::string& path, int docs, int min_len, int max_len,
                              int64_t vocab, uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::ofstream out(path);
  for (int d = 0; d < docs; ++d) {
    int len = min_len + static_cast<int>(rng() % static_cast<uint64_t>(max_len - min_len + 1));
    out << "{\"input_ids\": [";
    for (int k = 0; k < len; ++k) out << (k ? ", " : "") << (rng() % static_cast<uint64_t>(vocab));
    out << "]}\n";
  }
  return path;
}

inline JobSpec TinyJob(const std::string& checkpoint, const std::string& data,
                       const std::string& out_dir) {
  JobSpec s;
  s.name = "test";
  s.source = "test.toml";
  s.model.checkpoint = checkpoint;
  s.data.path = data;
  s.data.format = "jsonl";
  s.data.seq_len = 32;
  s.lora.rank = 4;
  s.lora.alpha = 8;
  s.optim.lr = 1e-2;
  s.train.steps = 4;
  s.train.batch_size = 2;
  s.train.seed = 3;
  s.train.output_dir = out_dir;
  return s;
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// `lorastream-worker plan` on the CPU for a one-step job of store `store` over dir/d.jsonl (the
// job written to dir/plan.toml): its exit status and its output.
inline std::pair<int, std::string> RunPlanOnStore(const std::string& dir,
                                                  const std::string& store) {
  const std::string job = dir + "/plan.toml";
  std::ofstream(job) << "name = \"plan\"\n[model]\nstore = \"" << store
                     << "\"\n[data]\npath = \"d.jsonl\"\nseq_len = 32\n[train]\nsteps = 1\n"
                        "output_dir = \"out\"\n";
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker plan " + job +
                          " --device cpu > " + dir + "/plan.log 2>&1";
  const int status = std::system(cmd.c_str());
  return {status, ReadFile(dir + "/plan.log")};
}

}  // namespace lorastream::testing
