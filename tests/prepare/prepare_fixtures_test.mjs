// tools/prepare/prepare.mjs against Python transformers' ids (tests/fixtures/tokenizers/, made
// by tools/fixtures/make_tokenizer_fixtures.py): every tokenizer kind, every format, the
// assistant masks, bad records, the validation split and the written files.
// Run: node --test tests/prepare/ (CTest: prepare_fixtures).
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { encode, loadModelTokenizer, recordDocument, validationIndices } from "../../tools/prepare/prepare.mjs";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const fixtures = path.join(root, "tests/fixtures/tokenizers");
const script = path.join(root, "tools/prepare/prepare.mjs");
const kinds = ["llama3", "qwen", "mistral", "llama2"];

for (const kind of kinds) {
  const dir = path.join(fixtures, kind);
  const expected = JSON.parse(fs.readFileSync(path.join(dir, "expected.json"), "utf8"));
  const model = loadModelTokenizer(dir);

  test(`${kind}: encode with and without special tokens equals transformers`, () => {
    assert.equal(model.vocabSize, expected.vocab_size);
    for (const e of expected.encode) {
      assert.deepEqual(encode(model, e.text, true), e.ids, JSON.stringify(e.text));
      assert.deepEqual(encode(model, e.text, false), e.ids_plain, JSON.stringify(e.text));
    }
  });

  for (const [format, c] of Object.entries(expected.formats)) {
    test(`${kind}: --format ${format} ids and labels equal transformers`, () => {
      c.records.forEach((rec, i) => {
        const doc = recordDocument(model, rec, format, false, `record ${i}`);
        assert.deepEqual(doc.ids, c.expected[i].input_ids, `record ${i} ids`);
        assert.deepEqual(doc.labels, c.expected[i].labels, `record ${i} labels`);
        if (format !== "text") assert.ok(doc.labels.some((l) => l === -100) && doc.labels.some((l) => l !== -100));
        const all = recordDocument(model, rec, format, true, `record ${i}`);
        assert.deepEqual(all.labels, all.ids, "--train-on-all trains every token");
      });
    });
  }

  test(`${kind}: malformed records are refused naming the field`, () => {
    for (const [format, recs] of Object.entries(expected.errors)) {
      for (const rec of recs) {
        assert.throws(() => recordDocument(model, rec, format, false, "in.jsonl:7"),
                      (e) => e.code === 4 && /in\.jsonl:7/.test(e.message), `${format} ${JSON.stringify(rec)}`);
      }
    }
  });
}

test("validation split: disjoint, covers all, seeded", () => {
  const v = validationIndices(100, 0.02, 5);
  assert.equal(v.length, 2);
  assert.deepEqual(validationIndices(100, 0.02, 5), v);
  assert.notDeepEqual(validationIndices(100, 0.1, 6), validationIndices(100, 0.1, 7));
  assert.equal(validationIndices(3, 0.01, 0).length, 1, "at least one");
  assert.equal(validationIndices(1, 0.5, 0).length, 0, "never all");
});

function run(args) {
  return spawnSync("node", [script, ...args], { encoding: "utf8" });
}

test("the command writes train + validation jsonl with the tokenizer record", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-"));
  const expected = JSON.parse(fs.readFileSync(path.join(fixtures, "llama3/expected.json"), "utf8"));
  const input = path.join(tmp, "chats.jsonl");
  const recs = expected.formats.messages.records;
  fs.writeFileSync(input, recs.map((r) => JSON.stringify(r)).join("\n") + "\n");
  const out = path.join(tmp, "train.jsonl");
  const r = run(["--model", path.join(fixtures, "llama3"), "--in", input, "--format", "messages",
                 "--out", out, "--val-split", "0.34", "--fingerprint", "tok-test", "--seed", "1"]);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /3 documents/);
  assert.match(r.stdout, /\[masked\]<\|begin_of_text\|>/);
  const lines = (f) => fs.readFileSync(f, "utf8").trim().split("\n").map((l) => JSON.parse(l));
  const train = lines(out), val = lines(path.join(tmp, "train.val.jsonl"));
  assert.deepEqual(train[0].lorastream_tokenizer, { name: "llama3", fingerprint: "tok-test", vocab_size: 700 });
  assert.deepEqual(val[0], train[0]);
  assert.equal(train.length - 1 + val.length - 1, 3);
  const got = [...train.slice(1), ...val.slice(1)].map((d) => d.input_ids).sort();
  assert.deepEqual(got, expected.formats.messages.expected.map((e) => e.input_ids).sort());
  fs.rmSync(tmp, { recursive: true });
});

test("a model folder without tokenizer.json, a bad format, a bad line are refused clearly", () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "prepare-"));
  const input = path.join(tmp, "in.jsonl");
  fs.writeFileSync(input, '{"text": "fine"}\n{"text": \n');
  let r = run(["--model", tmp, "--in", input, "--format", "text", "--out", path.join(tmp, "o.tok")]);
  assert.equal(r.status, 3);
  assert.match(r.stderr, /has no tokenizer\.json/);
  r = run(["--model", path.join(fixtures, "qwen"), "--in", input, "--format", "csv", "--out", path.join(tmp, "o.tok")]);
  assert.equal(r.status, 2);
  r = run(["--model", path.join(fixtures, "qwen"), "--in", input, "--format", "text", "--out", path.join(tmp, "o.tok")]);
  assert.equal(r.status, 4);
  assert.match(r.stderr, /in\.jsonl:2: not JSON/);
  fs.rmSync(tmp, { recursive: true });
});
