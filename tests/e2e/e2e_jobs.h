// What the end-to-end tests share: data and job files for the tiny model, a standalone run of
// a job (the reference a cluster's adapter must equal), the comparison of two adapters, a free
// loopback port, a file's text, and a wait on a condition that fails the test naming what it
// waited for.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace lorastream::cli {
class LocalCluster;
}

namespace lorastream::testing {

// `documents` random documents of token ids below the tiny model's vocabulary (512), written to
// DIR/data-SEED.jsonl; returns the path.
std::string WriteData(const std::string& dir, int documents, uint32_t seed);

// DIR/NAME.toml: a job on `store`; output_dir is left out when empty (a LocalCluster chooses
// one). Returns the path.
std::string WriteJob(const std::string& dir, const std::string& name, const std::string& store,
                     const std::string& data, int steps, int checkpoint_every, int seed,
                     const std::string& output_dir = "");

// Trains the job standalone (`lorastream-worker train --device cpu`), its output in `log`.
void TrainStandalone(const std::string& job, const std::string& log);

// Every tensor of the two folders' adapter_model.safetensors is bit-identical.
void RequireSameAdapter(const std::string& a_dir, const std::string& b_dir);

// A TCP port free on 127.0.0.1 when asked (bound, read, released).
int FreeLoopbackPort();

// A file's whole text ("" when it cannot be read).
std::string ReadAll(const std::string& path);

// The index of the cluster's worker that runs job `id` and nothing else; fails the test when
// none does.
size_t WorkerRunningOnly(const cli::LocalCluster& cluster, int64_t id);

// Waits until every job of `ids` is past its first step (each worker has read every block),
// then checks that the cluster holds its base once: each worker's resident share of the
// store's mappings is at least 80% of the base (it reads the shared copy), and the proportional
// set sizes of the store's and the workers' mappings sum to the base (within 5% + `slack_kb`).
void CheckBaseHeldOnce(const cli::LocalCluster& cluster, const std::vector<int64_t>& ids,
                       double slack_kb);

// WaitFor(done, timeout_s), failing the test with "waiting for WHAT" when it times out.
void WaitUntil(const std::function<bool()>& done, double timeout_s, const std::string& what);

}  // namespace lorastream::testing
