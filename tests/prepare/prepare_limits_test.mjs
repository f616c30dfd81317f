// `lorastream prepare`'s script with careless input: chat templates that loop for ever or build
// huge values end with a message naming the template (not a hang or node's fatal error), and
// an --out that is an input or exists is refused unless --force.
// Run: node --test tests/prepare/ (CTest: prepare).
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { kTemplateLimits } from "../../tools/prepare/prepare.mjs";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const qwen = path.join(root, "tests/fixtures/tokenizers/qwen");
const script = path.join(root, "tools/prepare/prepare.mjs");

function run(args) {
  return spawnSync("node", [script, ...args], { encoding: "utf8", timeout: 120_000 });
}

// A model folder with qwen's tokenizer and `template` as its chat_template.jinja.
function modelWithTemplate(tmp, template) {
  const dir = path.join(tmp, "model");
  fs.mkdirSync(dir);
  fs.copyFileSync(path.join(qwen, "tokenizer.json"), path.join(dir, "tokenizer.json"));
  const config = JSON.parse(fs.readFileSync(path.join(qwen, "tokenizer_config.json"), "utf8"));
  delete config.chat_template;
  fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(config));
  fs.writeFileSync(path.join(dir, "chat_template.jinja"), template);
  return dir;
}

function chats(tmp) {
  const input = path.join(tmp, "chats.jsonl");
  fs.writeFileSync(input, JSON.stringify({ messages: [{ role: "user", content: "hi" },
                                                      { role: "assistant", content: "hello" }] }) + "\n");
  return input;
}

test("a template calling range(10**9) is refused naming the template and the limit", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-range-"));
  for (const n of ["10**9", "1000000000"]) {
    const model = modelWithTemplate(tmp, `{% for i in range(${n}) %}x{% endfor %}{{ messages[0].content }}`);
    const r = run(["--model", model, "--in", chats(tmp), "--format", "messages", "--out", path.join(tmp, "o.jsonl")]);
    assert.equal(r.status, 4, r.stderr);
    assert.match(r.stderr, /chats\.jsonl:1: the chat template .*chat_template\.jinja refused the conversation: range\(\) of 1000000000 items is over the limit of 1000000/);
    assert.ok(!fs.existsSync(path.join(tmp, "o.jsonl")));
    fs.rmSync(model, { recursive: true });
  }
  fs.rmSync(tmp, { recursive: true });
});

test("a template whose nested loops run too long is stopped, naming the template", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-loops-"));
  const model = modelWithTemplate(tmp, "{% for i in range(1000000) %}{% for j in range(1000000) %}" +
                                        "{% endfor %}{% endfor %}{{ messages[0].content }}");
  const start = Date.now();
  const r = run(["--model", model, "--in", chats(tmp), "--format", "messages", "--out", path.join(tmp, "o.jsonl")]);
  assert.equal(r.status, 5, r.stderr);
  assert.match(r.stderr, new RegExp(`chats\\.jsonl:1: the chat template .*chat_template\\.jinja did not finish ` +
                                    `rendering the conversation within ${kTemplateLimits.seconds} s`));
  assert.ok(Date.now() - start < (kTemplateLimits.seconds + 60) * 1000);
  fs.rmSync(tmp, { recursive: true });
});

test("a template rendering more than the size limit is refused", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-size-"));
  // 2^25 characters by doubling a string 25 times.
  const model = modelWithTemplate(tmp, "{% set s = namespace(v='x') %}{% for i in range(25) %}" +
                                        "{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}");
  const r = run(["--model", model, "--in", chats(tmp), "--format", "messages", "--out", path.join(tmp, "o.jsonl")]);
  assert.equal(r.status, 5, r.stderr);
  assert.match(r.stderr, /chat_template\.jinja rendered 33554432 characters, over the limit of 16777216/);
  fs.rmSync(tmp, { recursive: true });
});

test("an --out that is an input or exists is refused unless --force", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-out-"));
  const input = path.join(tmp, "in.jsonl");
  const text = '{"text": "keep me"}\n';
  fs.writeFileSync(input, text);
  let r = run(["--model", qwen, "--in", input, "--format", "text", "--out", input]);
  assert.equal(r.status, 2, r.stderr);
  assert.match(r.stderr, /in\.jsonl is also an input \(--in .*in\.jsonl\): writing it would replace that file/);
  assert.equal(fs.readFileSync(input, "utf8"), text);
  // The same file by another name.
  r = run(["--model", qwen, "--in", input, "--format", "text", "--out", path.join(tmp, ".", "in.jsonl")]);
  assert.equal(r.status, 2, r.stderr);
  assert.equal(fs.readFileSync(input, "utf8"), text);

  const out = path.join(tmp, "data.jsonl");
  fs.writeFileSync(out, "older data\n");
  r = run(["--model", qwen, "--in", input, "--format", "text", "--out", out]);
  assert.equal(r.status, 2, r.stderr);
  assert.match(r.stderr, /data\.jsonl exists; choose another --out or pass --force/);
  assert.equal(fs.readFileSync(out, "utf8"), "older data\n");
  // The validation file is an output too.
  fs.writeFileSync(path.join(tmp, "fresh.val.jsonl"), "older validation\n");
  r = run(["--model", qwen, "--in", input, "--in", input, "--format", "text", "--out",
           path.join(tmp, "fresh.jsonl"), "--val-split", "0.5"]);
  assert.equal(r.status, 2, r.stderr);
  assert.match(r.stderr, /fresh\.val\.jsonl exists/);

  r = run(["--model", qwen, "--in", input, "--format", "text", "--out", out, "--force"]);
  assert.equal(r.status, 0, r.stderr);
  assert.match(fs.readFileSync(out, "utf8"), /lorastream_tokenizer/);
  assert.deepEqual(fs.readdirSync(tmp).filter((f) => f.includes(".tmp")), [], "no temporary left");
  fs.rmSync(tmp, { recursive: true });
});

test("text data with a tokenizer that names no EOS trains with a warning, not silently", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-eos-"));
  try {
    const dir = path.join(tmp, "model");
    fs.mkdirSync(dir);
    fs.copyFileSync(path.join(qwen, "tokenizer.json"), path.join(dir, "tokenizer.json"));
    const config = JSON.parse(fs.readFileSync(path.join(qwen, "tokenizer_config.json"), "utf8"));
    delete config.eos_token;
    fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(config));
    const input = path.join(tmp, "text.jsonl");
    fs.writeFileSync(input, JSON.stringify({ text: "hello world" }) + "\n");
    const r = run(["--model", dir, "--in", input, "--format", "text", "--out",
                   path.join(tmp, "out.jsonl")]);
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stderr, /warning: .*names no eos_token.*text documents get no end-of-sequence/);
    // With the EOS named, no warning.
    const ok = run(["--model", qwen, "--in", input, "--format", "text", "--out",
                    path.join(tmp, "ok.jsonl")]);
    assert.equal(ok.status, 0, ok.stderr);
    assert.doesNotMatch(ok.stderr, /warning/);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});
