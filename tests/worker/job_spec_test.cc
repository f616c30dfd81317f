#include "common/job/job_spec.h"

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/job/job_paths.h"
#include "common/protocol/messages.h"
#include "worker_test_util.h"

using namespace lorastream;

namespace {

bool Mentions(const std::vector<std::string>& problems, const std::string& text) {
  for (const auto& p : problems)
    if (p.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("the example job file parses with its documented defaults", "[worker]") {
  JobSpec s = ParseJobSpec(
      testing::ReadFile(std::string(LORASTREAM_SOURCE_DIR) + "/configs/jobs/tiny_llama.toml"),
      "tiny_llama.toml");
  CHECK(s.lora.rank == 8);
  CHECK(s.lora.targets.size() == 7);
  CHECK(s.optim.schedule == "cosine");
  CHECK(s.stream.ring_size == 2);
  JobSpec d = ParseJobSpec("[train]\nsteps = 1\n", "min.toml");
  CHECK(d.lora.rank == 16);
  CHECK(d.lora.alpha == 32.0);
  CHECK(d.optim.lr == 2e-4);
  CHECK(d.optim.grad_clip == 1.0);
  CHECK(d.train.dtype == "auto");
  CHECK(d.data.packing);
}

TEST_CASE("job specs: unknown keys and wrong types are errors naming the key", "[worker]") {
  try {
    ParseJobSpec("[lora]\nranke = 8\n", "j.toml");
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("ranke") != std::string::npos);
  }
  CHECK_THROWS_AS(ParseJobSpec("[lora]\nrank = \"8\"\n", "j.toml"), Error);
  JobSpec s = ParseJobSpec("[stream]\ngpu_memory_budget = \"8GiB\"\n", "j.toml");
  CHECK(s.stream.gpu_memory_budget == 8ull << 30);
  CHECK(ParseJobSpec("[stream]\ngpu_memory_budget = 1000\n", "j.toml").stream.gpu_memory_budget ==
        1000);
  CHECK_THROWS_AS(ParseJobSpec("[stream]\ngpu_memory_budget = \"8 parsecs\"\n", "j.toml"), Error);
  CHECK(ParseByteSize("500MB", "x") == 500000000ull);
  CHECK(ParseByteSize("1.5 KiB", "x") == 1536ull);
}

TEST_CASE("job specs: a [stream] section naming no plan plans within the GPU's free memory",
          "[worker]") {
  // No plan named: "auto" (the worker resolves it on its device; on the CPU it means none).
  CHECK(ParseJobSpec("", "j.toml").stream.budget_auto);
  CHECK(ParseJobSpec("[stream]\n", "j.toml").stream.budget_auto);
  CHECK(ParseJobSpec("[stream]\ngpu_memory_budget = \"auto\"\n", "j.toml").stream.budget_auto);
  // Any plan of the job's own, or a budget in bytes (0 included), is kept as it is.
  for (const char* own : {"blocks_to_swap = 0", "blocks_to_swap = 3", "ring_size = 1",
                          "forward_slots = -1", "backward_slots = 2", "taped_blocks = -1",
                          "gpu_memory_budget = 0", "gpu_memory_budget = \"8GiB\""}) {
    CAPTURE(own);
    const JobSpec s = ParseJobSpec(std::string("[stream]\n") + own + "\n", "j.toml");
    CHECK_FALSE(s.stream.budget_auto);
  }
  // A word that is not "auto" names the key and both forms.
  try {
    ParseJobSpec("[stream]\ngpu_memory_budget = \"automatic\"\n", "j.toml");
    FAIL("accepted");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("gpu_memory_budget") != std::string::npos);
    CHECK(what.find("\"auto\"") != std::string::npos);
    CHECK(what.find("automatic") != std::string::npos);
  }
  // Specs built in code keep their plan.
  CHECK_FALSE(JobSpec{}.stream.budget_auto);
}

TEST_CASE("ValidateJobSpec returns every problem, each naming its field", "[worker]") {
  testing::TempDir dir("spec");
  testing::MakeCheckpoint(dir / "model", "tiny");
  JobSpec s = testing::TinyJob(dir / "model", dir / "missing.jsonl", dir / "out");
  s.lora.rank = 0;
  s.lora.targets = {"q_proj", "qkv_proj"};
  s.data.seq_len = 4096;  // tiny: max_position_embeddings = 256
  s.optim.schedule = "exponential";
  s.optim.type = "adam8";
  s.stream.ring_size = 0;
  auto problems = ValidateJobSpec(s);
  CHECK(problems.size() == 7);
  CHECK(Mentions(problems, "`optim.type` must be \"adamw\" or \"adamw8bit\" (found \"adam8\")"));
  CHECK(Mentions(problems, "`lora.rank` must be > 0"));
  CHECK(Mentions(problems, "unknown module `qkv_proj`"));
  CHECK(Mentions(problems, "`data.path` names a file that does not exist"));
  CHECK(Mentions(problems, "`data.seq_len` is 4096, longer than the model allows"));
  CHECK(Mentions(problems, "`optim.schedule`"));
  CHECK(Mentions(problems, "`stream.ring_size`"));
  try {
    RequireValidJobSpec(s);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
  }

  testing::WriteJsonl(dir / "d.jsonl", 4, 8, 16, 512);
  JobSpec ok = testing::TinyJob(dir / "model", dir / "d.jsonl", dir / "out");
  CHECK(ValidateJobSpec(ok).empty());
  ok.model.store = "also-a-store";
  CHECK(Mentions(ValidateJobSpec(ok), "exactly one of"));
  ok.model.store.clear();
  ok.model.checkpoint = dir / "nowhere";
  CHECK(Mentions(ValidateJobSpec(ok), "`model.checkpoint` names a folder that does not exist"));
}

TEST_CASE("stream.forward_slots and backward_slots: parsed, checked against the ring", "[worker]") {
  const JobSpec s =
      ParseJobSpec("[stream]\nring_size = 2\nforward_slots = 6\nbackward_slots = -1\n", "j.toml");
  CHECK(s.stream.forward_slots == 6);
  CHECK(s.stream.backward_slots == -1);
  const JobSpec d = ParseJobSpec("[stream]\nring_size = 1\n", "j.toml");
  CHECK(d.stream.forward_slots == 0);
  CHECK(d.stream.backward_slots == 0);
  testing::TempDir dir("spec-slots");
  testing::MakeCheckpoint(dir / "model", "tiny");
  JobSpec bad = testing::TinyJob(dir / "model", dir / "missing.jsonl", dir / "out");
  bad.stream.ring_size = 3;
  bad.stream.forward_slots = 2;    // below the ring
  bad.stream.backward_slots = -2;  // not a choice
  auto problems = ValidateJobSpec(bad);
  CHECK(Mentions(problems, "`stream.forward_slots` must be 0 (= ring_size), -1"));
  CHECK(Mentions(problems, "`stream.backward_slots` must be 0 (= ring_size), -1"));
}

TEST_CASE("stream.taped_blocks: parsed, checked against the model's depth", "[worker]") {
  CHECK(ParseJobSpec("[stream]\ntaped_blocks = -1\n", "j.toml").stream.taped_blocks == -1);
  CHECK(ParseJobSpec("[stream]\ntaped_blocks = 3\n", "j.toml").stream.taped_blocks == 3);
  CHECK(ParseJobSpec("[stream]\n", "j.toml").stream.taped_blocks == 0);
  testing::TempDir dir("spec-taped");
  testing::MakeCheckpoint(dir / "model", "tiny");
  JobSpec bad = testing::TinyJob(dir / "model", dir / "missing.jsonl", dir / "out");
  ModelConfig config;
  config.num_hidden_layers = 4;
  for (int64_t taped : {-2, 5}) {
    CAPTURE(taped);
    bad.stream.taped_blocks = taped;
    CHECK(Mentions(ValidateJobSpec(bad, &config),
                   "`stream.taped_blocks` must be 0 (none, or the budget planner's choice), -1"));
  }
  bad.stream.taped_blocks = 4;
  CHECK_FALSE(Mentions(ValidateJobSpec(bad, &config), "taped_blocks"));
}

TEST_CASE("FLUX job files: the [flux] section is the job, checked naming file and key",
          "[worker][flux]") {
  const std::string configs = std::string(LORASTREAM_SOURCE_DIR) + "/configs";
  const std::string text =
      "name = \"flux-demo\"\npriority = 3\n[flux]\nstore = \"flux-tiny\"\n"
      "cache_dir = \"" +
      configs +
      "/data/flux-tiny\"\noutput_dir = \"out\"\nsteps = 12\n"
      "save_every = 4\n";
  JobSpec s = ParseJobSpec(text, "/jobs/flux.toml");
  ResolveJobSpecIn(s, "/jobs");
  REQUIRE(s.is_flux);
  CHECK(s.name == "flux-demo");
  CHECK(s.priority == 3);
  CHECK(s.flux.cache_dir == configs + "/data/flux-tiny");
  // Mirrored where the scheduler, the listings and the checkpoint reports read every job's.
  CHECK(s.model.store == "flux-tiny");
  CHECK(s.model.checkpoint.empty());
  CHECK(s.train.output_dir == "/jobs/out");
  CHECK(s.train.steps == 12);
  CHECK(s.train.checkpoint_every == 4);
  CHECK(ValidateJobSpec(s).empty());
  const JobSpec back = ParseJobSpec(JobSpecToToml(s), s.source);
  CHECK(JobSpecToToml(back) == JobSpecToToml(s));

  // The example job validates; every bad value is a problem naming the file and the key.
  CHECK(ValidateJobSpec(LoadJobSpec(configs + "/jobs/flux_tiny.toml")).empty());
  s.flux.rank = 0;
  s.flux.timestep_sampling = "logit_normal";
  s.flux.ring_size = 0;
  s.flux.cache_dir = "/no/such/cache";
  s.flux.store.clear();
  s.flux.checkpoint = configs + "/jobs/flux_tiny.toml";
  const auto problems = ValidateJobSpec(s);
  CHECK(problems.size() == 5);
  CHECK(Mentions(problems, "key `flux.cache_dir`: names a folder that does not exist"));
  CHECK(Mentions(problems, "key `flux.checkpoint`: " + configs +
                               "/jobs/flux_tiny.toml: not a .safetensors file"));
  CHECK(Mentions(problems, "/jobs/flux.toml: key `flux.rank`: must be at least 1"));
  CHECK(Mentions(problems, "key `flux.timestep_sampling`"));
  CHECK(Mentions(problems, "key `flux.ring_size`"));

  // An LLM section beside [flux], both or neither of checkpoint and store, a store with
  // singles_per_unit: refused by name.
  CHECK_THROWS_WITH(ParseJobSpec(text + "[lora]\nrank = 4\n", "f.toml"), Catch::Contains("lora"));
  CHECK_THROWS_WITH(ParseJobSpec(text + "checkpoint = \"m\"\n", "f.toml"),
                    Catch::Contains("f.toml: key `flux.checkpoint`") &&
                        Catch::Contains("exactly one of flux.checkpoint"));
  CHECK_THROWS_WITH(
      ParseJobSpec(text + "singles_per_unit = 1\n", "f.toml"),
      Catch::Contains("key `flux.singles_per_unit`") && Catch::Contains("a store fixes its units"));
}

TEST_CASE(
    "FLUX job files in every family's sections: the same job as the [flux]-only form; moved "
    "keys, LLM sections and unknown keys refused by name",
    "[worker][flux]") {
  const std::string configs = std::string(LORASTREAM_SOURCE_DIR) + "/configs";
  const std::string cache = configs + "/data/flux-tiny";
  const std::string single =
      "name = \"f\"\n[flux]\ncheckpoint = \"m.safetensors\"\ncache_dir = \"" + cache +
      "\"\noutput_dir = \"out\"\nsteps = 12\nbatch_size = 2\nseed = 7\nlearning_rate = 3e-4\n"
      "lr_schedule = \"cosine\"\nwarmup_steps = 2\nweight_decay = 0.05\nmax_grad_norm = 0.5\n"
      "optimizer = \"adamw8bit\"\nrank = 8\nalpha = 4\ntargets = [\"attention\"]\nguidance = 3.5\n"
      "timestep_sampling = \"shift\"\nsigmoid_scale = 2.0\ndiscrete_flow_shift = 1.5\n"
      "save_every = 4\nkeep_checkpoints = 3\ndtype = \"bf16\"\nblocks_to_swap = 5\n"
      "ring_size = 3\ntaped_blocks = 2\nsingles_per_unit = 4\n";
  const std::string shared =
      "name = \"f\"\n[model]\ncheckpoint = \"m.safetensors\"\n"
      "[lora]\nrank = 8\nalpha = 4\ntargets = [\"attention\"]\n"
      "[optim]\nlr = 3e-4\nschedule = \"cosine\"\nwarmup_steps = 2\nweight_decay = 0.05\n"
      "grad_clip = 0.5\ntype = \"adamw8bit\"\n"
      "[train]\nsteps = 12\nbatch_size = 2\nseed = 7\noutput_dir = \"out\"\n"
      "checkpoint_every = 4\nkeep_checkpoints = 3\ndtype = \"bf16\"\n"
      "[stream]\nblocks_to_swap = 5\nring_size = 3\ntaped_blocks = 2\n"
      "[flux]\ncache_dir = \"" +
      cache +
      "\"\nguidance = 3.5\ntimestep_sampling = \"shift\"\nsigmoid_scale = 2.0\n"
      "discrete_flow_shift = 1.5\nsingles_per_unit = 4\n";
  JobSpec a = ParseJobSpec(single, "/jobs/a.toml");
  JobSpec b = ParseJobSpec(shared, "/jobs/b.toml");
  CHECK_THAT(a.flux_form_note, Catch::Contains("learning_rate -> optim.lr") &&
                                   Catch::Contains("save_every -> train.checkpoint_every"));
  CHECK(b.flux_form_note.empty());
  REQUIRE(b.is_flux);
  ResolveJobSpecIn(a, "/jobs");
  ResolveJobSpecIn(b, "/jobs");
  // The same job: each written out (every key) in its own form, and equal written in one.
  CHECK(a.flux.shared_form == false);
  CHECK(b.flux.shared_form == true);
  FluxJob a_shared = a.flux;
  a_shared.shared_form = true;
  CHECK(FluxJobToToml(b.flux) == FluxJobToToml(a_shared));
  CHECK(FluxJobToToml(b.flux) != FluxJobToToml(a.flux));
  // Read back, each is itself in its own form, written out the same again.
  for (const JobSpec* s : {&a, &b}) {
    const std::string text = JobSpecToToml(*s);
    INFO(text);
    CHECK((text.find("[optim]") != std::string::npos) == s->flux.shared_form);
    const JobSpec back = ParseJobSpec(text, s->source);
    CHECK(back.flux.shared_form == s->flux.shared_form);
    CHECK(SerializePayload(back) == SerializePayload(*s));
    CHECK(JobSpecToToml(back) == text);
  }
  CHECK(b.optim.lr == 3e-4);
  CHECK(b.optim.grad_clip == 0.5);
  CHECK(b.optim.type == "adamw8bit");  // flux.optimizer in the [flux]-only form
  CHECK(a.optim.type == "adamw8bit");
  CHECK(b.lora.rank == 8);
  CHECK(b.flux.taped_blocks == 2);
  CHECK(b.train.seed == 7);
  CHECK(b.train.keep_checkpoints == 3);
  CHECK(b.train.output_dir == "/jobs/out");
  // Absent keys take FLUX.1's defaults, not an LLM job's.
  const JobSpec d = ParseJobSpec(
      "[model]\nstore = \"s\"\n[train]\noutput_dir = \"o\"\n[flux]\ncache_dir = \"c\"\n", "d.toml");
  CHECK(d.flux.learning_rate == FluxJob{}.learning_rate);
  CHECK(d.flux.alpha == FluxJob{}.alpha);
  CHECK(d.flux.targets == FluxJob{}.targets);
  CHECK(d.flux.dtype == FluxJob{}.dtype);
  CHECK(d.optim.type == "adamw");
  CHECK_THROWS_WITH(ParseJobSpec(shared + "optimizer = \"adamw8bit\"\n", "f.toml"),
                    Catch::Contains("key `flux.optimizer`") && Catch::Contains("`optim.type`"));

  // A moved key left in [flux], an LLM-only section or key, an unknown key: refused by name.
  CHECK_THROWS_WITH(
      ParseJobSpec(shared + "learning_rate = 1e-4\n", "f.toml"),
      Catch::Contains("f.toml: key `flux.learning_rate`") && Catch::Contains("`optim.lr`"));
  CHECK_THROWS_WITH(ParseJobSpec(shared + "[data]\npath = \"d.jsonl\"\n", "f.toml"),
                    Catch::Contains("[data] is an LLM job's section"));
  CHECK_THROWS_WITH(
      ParseJobSpec("[lora]\nrank = 4\ndropout = 0.1\n[model]\nstore = \"s\"\n[train]\n"
                   "output_dir = \"o\"\n[flux]\ncache_dir = \"c\"\n",
                   "f.toml"),
      Catch::Contains("key `lora.dropout`") && Catch::Contains("rank, alpha, targets"));
  CHECK_THROWS_WITH(ParseJobSpec(shared + "tokens = 3\n", "f.toml"),
                    Catch::Contains("key `flux.tokens`"));
  // Neither base: the shared form's keys are named.
  CHECK_THROWS_WITH(
      ParseJobSpec("[train]\noutput_dir = \"o\"\n[flux]\ncache_dir = \"c\"\n", "f.toml"),
      Catch::Contains("exactly one of model.checkpoint") && Catch::Contains("model.store"));
}

TEST_CASE(
    "the example FLUX job, in every family's sections, is the same job as its [flux]-only form",
    "[worker][flux]") {
  const std::string jobs = std::string(LORASTREAM_SOURCE_DIR) + "/configs/jobs";
  // configs/jobs/flux_tiny.toml as it was written before the shared sections, as one [flux]
  // section: still a valid job file, trained as it was.
  const std::string single = R"(name = "flux-tiny-demo"

[flux]
store = "flux-tiny"                 # or: checkpoint = "../../runs/models/flux-tiny/flux1.safetensors"
cache_dir = "../data/flux-tiny"     # relative to this file's folder
output_dir = "../../runs/jobs/flux-tiny-demo"
steps = 20
batch_size = 1
seed = 0
rank = 4
alpha = 4.0
learning_rate = 1e-3
timestep_sampling = "sigmoid"
save_every = 10                     # checkpoint-10, checkpoint-20 (a requeued job resumes)
dtype = "f32"                       # the store's dtype (flux-tiny is f32; bf16 for FLUX.1-dev)
blocks_to_swap = 2                  # units streamed from the store through the ring
ring_size = 2
)";
  JobSpec legacy = ParseJobSpec(single, jobs + "/flux_tiny_single.toml");
  ResolveJobSpecIn(legacy, jobs);
  REQUIRE(legacy.is_flux);
  CHECK_THAT(legacy.flux_form_note, Catch::Contains("save_every -> train.checkpoint_every"));
  CHECK(ValidateJobSpec(legacy).empty());

  const JobSpec example = LoadJobSpec(jobs + "/flux_tiny.toml");
  REQUIRE(example.is_flux);
  CHECK(example.flux_form_note.empty());  // written in the shared form
  CHECK(ValidateJobSpec(example).empty());
  FluxJob legacy_shared = legacy.flux;
  legacy_shared.shared_form = true;
  CHECK(FluxJobToToml(example.flux) == FluxJobToToml(legacy_shared));
  CHECK(example.flux.store == "flux-tiny");
  CHECK(example.flux.steps == 20);
  CHECK(example.flux.save_every == 10);
  CHECK(example.flux.learning_rate == 1e-3);
  CHECK(example.flux.blocks_to_swap == 2);
}

TEST_CASE("a pre-quantised checkpoint named as model.checkpoint: a store serves it, says why",
          "[worker]") {
  testing::TempDir dir("spec-fp8");
  store::SynthOptions o;
  o.preset = "tiny";
  o.out_dir = dir / "fp8";
  o.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
  o.dtype = "bf16";
  o.threads = 1;
  o.prequantized = "fp8";
  store::RunSynth(o);
  testing::WriteJsonl(dir / "d.jsonl", 4, 8, 16, 512);
  JobSpec s = testing::TinyJob(dir / "fp8", dir / "d.jsonl", dir / "out");
  const std::vector<std::string> problems = ValidateJobSpec(s);
  INFO(problems.size());
  CHECK(Mentions(problems, "`model.checkpoint` " + dir / "fp8" + " is a pre-quantised (fp8)"));
  CHECK(Mentions(problems, "lorastream-store serve " + dir / "fp8" + " --name NAME"));
}

TEST_CASE(
    "Qwen-Image job files: every family's sections and [qwen_image]; written back equal; what it "
    "does not read refused by name",
    "[worker][qwen_image]") {
  const std::string configs = std::string(LORASTREAM_SOURCE_DIR) + "/configs";
  const std::string model =
      std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/qwen_image/qi_l2_model.safetensors";
  const std::string text = "name = \"qi\"\n[model]\ncheckpoint = \"" + model +
                           "\"\n[train]\nsteps = 3\noutput_dir = \"out\"\n[qwen_image]\n"
                           "cache_dir = \"cache\"\n";
  JobSpec s = ParseJobSpec(text, "/jobs/qi.toml");
  ResolveJobSpecIn(s, "/jobs");
  REQUIRE(s.is_qwen_image);
  CHECK(!s.is_flux);
  CHECK(s.qwen_image.cache_dir == "/jobs/cache");
  CHECK(s.qwen_image.timestep_sampling == "shift");
  CHECK(s.qwen_image.discrete_flow_shift == 2.2);
  CHECK(s.lora.targets == std::vector<std::string>{"default"});
  CHECK(s.train.output_dir == "/jobs/out");
  // As every job: planned within the GPU's free memory unless [stream] names a plan; a
  // budget given is read.
  CHECK(s.stream.budget_auto);
  CHECK(ValidateJobSpec(s).empty());
  for (const char* budget : {"\"24GiB\"", "\"auto\""}) {
    const JobSpec b =
        ParseJobSpec(text + "[stream]\ngpu_memory_budget = " + budget + "\n", "q.toml");
    CHECK(ValidateJobSpec(b).empty());
    CHECK((b.stream.budget_auto || b.stream.gpu_memory_budget == (uint64_t{24} << 30)));
  }
  CHECK(!ParseJobSpec(text + "[stream]\nblocks_to_swap = 1\n", "q.toml").stream.budget_auto);
  const JobSpec back = ParseJobSpec(JobSpecToToml(s), s.source);
  CHECK(back.is_qwen_image);
  CHECK(JobSpecToToml(back) == JobSpecToToml(s));
  CHECK(JobSpecToToml(s).find("[data]") == std::string::npos);

  // The example job file parses and names its cache folder.
  const JobSpec example = ParseJobSpec(testing::ReadFile(configs + "/jobs/qwen_image_tiny.toml"),
                                       configs + "/jobs/x.toml");
  CHECK(example.is_qwen_image);
  CHECK(example.qwen_image.cache_dir == "cache");

  // What a Qwen-Image job does not read: refused, each naming the key.
  JobSpec bad = s;
  bad.model.checkpoint = configs + "/jobs/flux_tiny.toml";
  bad.lora.targets = {"attn.to_q", "nope"};
  bad.lora.dropout = 0.1;
  bad.train.grad_accum = 2;
  bad.stream.taped_blocks = -2;  // a count of taped blocks, or -1, is read (as the LLMs')
  bad.qwen_image.timestep_sampling = "flux_shift";
  bad.qwen_image.cache_dir.clear();
  const auto problems = ValidateJobSpec(bad);
  CHECK(problems.size() == 7);
  CHECK(Mentions(problems, "key `model.checkpoint` " + configs +
                               "/jobs/flux_tiny.toml: not a .safetensors file"));
  CHECK(Mentions(problems, "`nope`"));
  CHECK(Mentions(problems, "key `lora.dropout` must be 0 for a Qwen-Image job"));
  CHECK(Mentions(problems, "key `train.grad_accum` must be 1"));
  CHECK(Mentions(problems, "key `stream.taped_blocks` must be 0"));
  CHECK(Mentions(problems, "key `qwen_image.timestep_sampling` must be uniform, sigmoid, shift"));
  CHECK(Mentions(problems, "key `qwen_image.cache_dir` is required"));
  // A store instead of the checkpoint is read (the store's family is checked where it is
  // attached); both, or neither, are refused.
  bad = s;
  bad.model.checkpoint.clear();
  bad.model.store = "qi";
  CHECK(ValidateJobSpec(bad).empty());
  bad.model.checkpoint = s.model.checkpoint;
  CHECK(Mentions(ValidateJobSpec(bad), "must name exactly one of `model.store`"));
  bad.model.checkpoint.clear();
  bad.model.store.clear();
  CHECK(Mentions(ValidateJobSpec(bad), "key `model.checkpoint` is required"));
  // The LLM family's sections, and an unknown key of its own section.
  CHECK_THROWS_WITH(ParseJobSpec(text + "[data]\npath = \"d.jsonl\"\n", "q.toml"),
                    Catch::Contains("data"));
  CHECK_THROWS_WITH(ParseJobSpec(text + "guidance = 1.0\n", "q.toml"), Catch::Contains("guidance"));
}

TEST_CASE("a FLUX job's problems name its keys as its file writes them, in either form",
          "[worker][flux]") {
  const std::string shared =
      "[model]\ncheckpoint = \"\"\n[lora]\nrank = 0\n[optim]\nlr = -1.0\nwarmup_steps = 9\n"
      "[train]\noutput_dir = \"o\"\nsteps = 3\ncheckpoint_every = -1\n"
      "[stream]\nring_size = 0\n[flux]\ncache_dir = \"no-such-cache\"\n";
  const JobSpec s = ParseJobSpec(shared, "s.toml");
  REQUIRE(s.is_flux);
  CHECK(s.flux.shared_form);
  const std::vector<std::string> p = ValidateJobSpec(s);
  CHECK(Mentions(p,
                 "s.toml: key `model.checkpoint`: name exactly one of model.checkpoint and "
                 "model.store"));
  CHECK(Mentions(p, "key `lora.rank`: must be at least 1"));
  CHECK(Mentions(p, "key `optim.lr`: must be 0 or more"));
  CHECK(Mentions(p, "key `optim.warmup_steps`: must be in [0, train.steps = 3]"));
  CHECK(Mentions(p, "key `train.checkpoint_every`: must be 0 or more"));
  CHECK(Mentions(p, "key `stream.ring_size`"));
  CHECK(Mentions(p, "key `flux.cache_dir`"));  // FLUX.1's own key, in [flux] in either form
  CHECK_FALSE(Mentions(p, "flux.rank"));
  CHECK(FluxKeyName(s.flux, "store") == "model.store");
  CHECK(FluxKeyName(s.flux, "save_every") == "train.checkpoint_every");
  CHECK(FluxKeyName(s.flux, "learning_rate") == "optim.lr");
  CHECK(FluxKeyName(s.flux, "gpu_memory_budget") == "stream.gpu_memory_budget");
  CHECK(FluxKeyName(s.flux, "guidance") == "flux.guidance");

  // The [flux]-only form: every key under flux., as before.
  const JobSpec l = ParseJobSpec(
      "[flux]\ncheckpoint = \"\"\nrank = 0\nlearning_rate = -1.0\nwarmup_steps = 9\n"
      "output_dir = \"o\"\nsteps = 3\nsave_every = -1\nring_size = 0\n"
      "cache_dir = \"no-such-cache\"\n",
      "l.toml");
  CHECK_FALSE(l.flux.shared_form);
  const std::vector<std::string> q = ValidateJobSpec(l);
  CHECK(Mentions(q,
                 "l.toml: key `flux.checkpoint`: name exactly one of flux.checkpoint and "
                 "flux.store"));
  CHECK(Mentions(q, "key `flux.rank`: must be at least 1"));
  CHECK(Mentions(q, "key `flux.learning_rate`: must be 0 or more"));
  CHECK(Mentions(q, "key `flux.warmup_steps`: must be in [0, flux.steps = 3]"));
  CHECK(Mentions(q, "key `flux.save_every`: must be 0 or more"));
  CHECK_FALSE(Mentions(q, "lora.rank"));
  CHECK(FluxKeyName(l.flux, "store") == "flux.store");

  // The form travels with the job (not in its journal form, written alike: restored from the
  // job file's text).
  CHECK(IsSharedFormFluxJobText(shared));
  CHECK_FALSE(IsSharedFormFluxJobText("[flux]\nstore = \"s\"\n"));
  CHECK_FALSE(IsSharedFormFluxJobText("[model]\nstore = \"s\"\n"));  // an LLM job
  CHECK_FALSE(IsSharedFormFluxJobText("not toml ["));
}
