// lorastream prepare, the tokenizing half: a user's text or conversations -> training data,
// with the model folder's own tokenizer (tokenizer.json + tokenizer_config.json) and chat
// template, through Hugging Face's JavaScript tokenizers and Jinja (vendored in vendor/, so
// no network is needed). `lorastream prepare` (C++) checks the arguments, fingerprints the
// tokenizer and runs this script with Debian's node; run alone it takes the same options.
//
// Ids equal Python transformers' (tests/fixtures/tokenizers/ holds its ids for each tokenizer
// kind): text is tokenizer(text) with special tokens (BOS as the post-processor adds it) plus
// EOS unless it already ends the ids; a conversation is apply_chat_template(messages)
// tokenized without special tokens (the template writes them). The trained tokens of
// assistant message i run from len(tok(text[:start])) to len(tok(text[:end])) where start is
// the length of the rendering of messages[:i] with the generation prompt and end that of
// messages[:i+1]; a template whose rendering of a prefix is not a prefix of the whole (one
// that rewrites earlier turns) is refused unless --train-on-all.
//
// Exit status as lorastream's: 2 bad argument, 3 not found, 4 corrupt input, 5 refused.
import fs from "node:fs";
import path from "node:path";
import vm from "node:vm";

import { Environment, Template } from "./vendor/jinja.mjs";
import { Tokenizer } from "./vendor/tokenizers.mjs";

const kFailed = 1, kBadArgument = 2, kNotFound = 3, kCorrupt = 4, kRefused = 5;
const kIgnore = -100;

class PrepareError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

const USAGE = `usage: prepare.mjs --model DIR --in FILE... --format text|alpaca|sharegpt|messages
  --out DATA(.jsonl|.tok|.bin) [--val-split F] [--seq-len N] [--train-on-all] [--seed S]
  [--fingerprint FP] [--tokenizer-name NAME] [--force]`;

// A chat template is a program: each rendering is bounded so that a template that loops for
// ever or builds a huge value ends with a message naming it instead of hanging or ending node
// (Jinja's range(1e9) builds the whole list, which V8 aborts on with a fatal error).
export const kTemplateLimits = { seconds: 10, rangeItems: 1_000_000, renderedChars: 16 << 20 };

// Jinja's range() as the vendored package defines it, refusing lists over the limit before
// building them (the package installs its globals through Environment.set).
const jinjaSet = Environment.prototype.set;
Environment.prototype.set = function (name, value) {
  if (name === "range" && typeof value === "function") {
    const build = value;
    value = (start, stop, step = 1) => {
      const [from, to] = stop === undefined ? [0, start] : [start, stop];
      const items = step === 0 ? 0 : Math.ceil((to - from) / step);
      if (items > kTemplateLimits.rangeItems)
        throw new Error(`range() of ${items} items is over the limit of ${kTemplateLimits.rangeItems}`);
      return build(start, stop, step);
    };
  }
  return jinjaSet.call(this, name, value);
};

function parseArgs(argv) {
  const o = { inputs: [], valSplit: 0, seqLen: 0, trainOnAll: false, seed: 0,
              fingerprint: "", tokenizerName: "" };
  const value = (i) => {
    if (i + 1 >= argv.length) throw new PrepareError(kBadArgument, `${argv[i]} needs a value\n${USAGE}`);
    return argv[i + 1];
  };
  const number = (i, min, max) => {
    const v = Number(value(i));
    if (!Number.isFinite(v) || v < min || v > max)
      throw new PrepareError(kBadArgument, `${argv[i]} must be a number in [${min}, ${max}] (found ${argv[i + 1]})`);
    return v;
  };
  for (let i = 0; i < argv.length; i++) {
    switch (argv[i]) {
      case "--model": o.model = value(i++); break;
      case "--in": o.inputs.push(value(i++)); break;
      case "--format": o.format = value(i++); break;
      case "--out": o.out = value(i++); break;
      case "--val-split": o.valSplit = number(i++, 0, 0.9); break;
      case "--seq-len": o.seqLen = Math.floor(number(i++, 0, 2 ** 31)); break;
      case "--seed": o.seed = Math.floor(number(i++, 0, 2 ** 32 - 1)); break;
      case "--train-on-all": o.trainOnAll = true; break;
      case "--fingerprint": o.fingerprint = value(i++); break;
      case "--tokenizer-name": o.tokenizerName = value(i++); break;
      case "--force": o.force = true; break;
      default: throw new PrepareError(kBadArgument, `unknown argument ${argv[i]}\n${USAGE}`);
    }
  }
  if (!o.model || !o.inputs.length || !o.format || !o.out)
    throw new PrepareError(kBadArgument, `--model, --in, --format and --out are required\n${USAGE}`);
  if (!["text", "alpaca", "sharegpt", "messages"].includes(o.format))
    throw new PrepareError(kBadArgument, `--format must be text, alpaca, sharegpt or messages (found ${o.format})`);
  if (!/\.(jsonl|tok|bin)$/.test(o.out))
    throw new PrepareError(kBadArgument, `--out must end in .jsonl, .tok or .bin (found ${o.out})`);
  return o;
}

function readJson(file) {
  let text;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    throw new PrepareError(kNotFound, `cannot read ${file}: ${e.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new PrepareError(kCorrupt, `${file} is not JSON: ${e.message}`);
  }
}

// A special token as tokenizer_config.json writes it: a string, or {content: ...} in older files.
function tokenString(v) {
  if (v && typeof v === "object") v = v.content;
  return typeof v === "string" ? v : null;
}

export function loadModelTokenizer(dir) {
  const tokPath = path.join(dir, "tokenizer.json");
  if (!fs.existsSync(tokPath))
    throw new PrepareError(kNotFound, `${dir} has no tokenizer.json: prepare needs the model folder's ` +
                           "Hugging Face tokenizer (tokenizer.json and tokenizer_config.json)");
  const json = readJson(tokPath);
  const cfgPath = path.join(dir, "tokenizer_config.json");
  const config = fs.existsSync(cfgPath) ? readJson(cfgPath) : {};
  let template = config.chat_template ?? null;
  if (Array.isArray(template)) {  // named templates: transformers uses "default"
    template = (template.find((t) => t.name === "default") ?? {}).template ?? null;
  }
  let templateName = `the chat template of ${cfgPath}`;
  const jinjaPath = path.join(dir, "chat_template.jinja");
  if (template === null && fs.existsSync(jinjaPath)) {
    template = fs.readFileSync(jinjaPath, "utf8");
    templateName = `the chat template ${jinjaPath}`;
  }
  let tokenizer;
  try {
    tokenizer = new Tokenizer(json, config);
  } catch (e) {
    throw new PrepareError(kCorrupt, `${tokPath}: cannot build the tokenizer: ${e.message}`);
  }
  const specials = {};
  for (const name of ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"]) {
    const s = tokenString(config[name]);
    if (s !== null) specials[name] = s;
  }
  let vocabSize = 0;
  for (const id of tokenizer.get_vocab(true).values()) vocabSize = Math.max(vocabSize, id + 1);
  let compiled = null;
  if (template !== null) {
    try {
      compiled = new Template(template);
    } catch (e) {
      throw new PrepareError(kCorrupt, `${templateName} does not parse: ${e.message}`);
    }
  }
  const eosId = specials.eos_token !== undefined ? tokenizer.token_to_id(specials.eos_token) ?? null : null;
  return { dir, tokenizer, template: compiled, templateName, specials, eosId, vocabSize };
}

export function encode(model, text, addSpecial) {
  return model.tokenizer.encode(text, { add_special_tokens: addSpecial }).ids;
}

// One rendering, stopped after kTemplateLimits.seconds (vm's timeout interrupts whatever
// JavaScript runs, the package's interpreter included).
function render(model, messages, generationPrompt, where) {
  if (!messages.length) return "";
  const items = { messages, add_generation_prompt: generationPrompt, ...model.specials };
  const context = vm.createContext({ run: () => model.template.render(items) });
  let text;
  try {
    text = vm.runInContext("run()", context, { timeout: kTemplateLimits.seconds * 1000 });
  } catch (e) {
    if (e.code === "ERR_SCRIPT_EXECUTION_TIMEOUT")
      throw new PrepareError(kRefused, `${where}: ${model.templateName} did not finish rendering ` +
                             `the conversation within ${kTemplateLimits.seconds} s (a loop too long for a chat template)`);
    throw new PrepareError(kCorrupt, `${where}: ${model.templateName} refused the conversation: ${e.message}`);
  }
  if (text.length > kTemplateLimits.renderedChars)
    throw new PrepareError(kRefused, `${where}: ${model.templateName} rendered ${text.length} characters, ` +
                           `over the limit of ${kTemplateLimits.renderedChars}`);
  return text;
}

// One conversation -> {ids, labels} (see the top of the file for what is trained).
export function conversationDocument(model, messages, trainOnAll, where) {
  if (!model.template)
    throw new PrepareError(kRefused, `${model.dir} has no chat template (tokenizer_config.json ` +
                           "chat_template or chat_template.jinja): use --format text, or a model folder with one");
  const text = render(model, messages, false, where);
  const ids = encode(model, text, false);
  const labels = trainOnAll ? ids.slice() : ids.map(() => kIgnore);
  if (trainOnAll) return { ids, labels };
  for (let i = 0; i < messages.length; i++) {
    if (messages[i].role !== "assistant") continue;
    const before = render(model, messages.slice(0, i), true, where);
    const upto = render(model, messages.slice(0, i + 1), false, where);
    if (!upto.startsWith(before) || !text.startsWith(upto))
      throw new PrepareError(kRefused, `${where}: ${model.templateName} renders message ${i} ` +
                             "differently once later messages follow, so its assistant tokens cannot be " +
                             "told apart; use --train-on-all");
    const a = encode(model, text.slice(0, before.length), false).length;
    const b = encode(model, text.slice(0, upto.length), false).length;
    for (let j = a; j < b; j++) labels[j] = ids[j];
  }
  return { ids, labels };
}

// Why text documents will have no EOS with this tokenizer ("" when they will).
export function eosProblem(model, format) {
  if (format !== "text" || model.eosId !== null) return "";
  return `${model.dir}: the tokenizer names no eos_token (or it is not in its vocabulary), so ` +
         "text documents get no end-of-sequence token: set eos_token in tokenizer_config.json, " +
         "or add the end marker to the text yourself";
}

export function textDocument(model, text) {
  const ids = encode(model, text, true);
  if (model.eosId !== null && ids[ids.length - 1] !== model.eosId) ids.push(model.eosId);
  return { ids, labels: ids.slice() };
}

// The classic Alpaca prompt, for a model without a chat template: the prompt is not trained.
function alpacaPromptDocument(model, rec, trainOnAll) {
  const prompt = (rec.input
    ? "Below is an instruction that describes a task, paired with an input that provides further " +
      "context. Write a response that appropriately completes the request.\n\n" +
      `### Instruction:\n${rec.instruction}\n\n### Input:\n${rec.input}\n\n### Response:\n`
    : "Below is an instruction that describes a task. Write a response that appropriately " +
      `completes the request.\n\n### Instruction:\n${rec.instruction}\n\n### Response:\n`);
  const doc = textDocument(model, prompt + rec.output);
  if (trainOnAll) return doc;
  const withSpecial = encode(model, "x", true), plain = encode(model, "x", false);
  const lead = Math.max(0, withSpecial.indexOf(plain[0]));
  const n = lead + encode(model, prompt, false).length;
  for (let j = 0; j < Math.min(n, doc.labels.length); j++) doc.labels[j] = kIgnore;
  return doc;
}

const kShareGptRoles = { human: "user", user: "user", gpt: "assistant", assistant: "assistant",
                         model: "assistant", system: "system" };
const kRoles = ["system", "user", "assistant"];

function requireString(rec, key, where) {
  if (typeof rec[key] !== "string")
    throw new PrepareError(kCorrupt, `${where}: "${key}" must be a string (found ${JSON.stringify(rec[key]) ?? "nothing"})`);
  return rec[key];
}

// A record of the given format -> its messages (null for text).
export function recordMessages(rec, format, where) {
  if (rec === null || typeof rec !== "object" || Array.isArray(rec))
    throw new PrepareError(kCorrupt, `${where}: a record must be a JSON object`);
  if (format === "messages" || format === "sharegpt") {
    const key = format === "messages" ? "messages" : "conversations";
    const list = rec[key];
    if (!Array.isArray(list) || !list.length)
      throw new PrepareError(kCorrupt, `${where}: "${key}" must be a non-empty array`);
    return list.map((m, k) => {
      const at = `${where}: ${key}[${k}]`;
      if (m === null || typeof m !== "object") throw new PrepareError(kCorrupt, `${at} must be an object`);
      if (format === "messages") {
        if (!kRoles.includes(m.role))
          throw new PrepareError(kCorrupt, `${at}: "role" must be one of ${kRoles.join(", ")} (found ${JSON.stringify(m.role) ?? "nothing"})`);
        return { role: m.role, content: requireString(m, "content", at) };
      }
      const role = kShareGptRoles[m.from];
      if (!role)
        throw new PrepareError(kCorrupt, `${at}: "from" must be one of ${Object.keys(kShareGptRoles).join(", ")} (found ${JSON.stringify(m.from) ?? "nothing"})`);
      return { role, content: requireString(m, "value", at) };
    });
  }
  if (format === "alpaca") {
    const instruction = requireString(rec, "instruction", where);
    const output = requireString(rec, "output", where);
    if (rec.input !== undefined && rec.input !== null) requireString(rec, "input", where);
    if (rec.system !== undefined && rec.system !== null) requireString(rec, "system", where);
    const msgs = rec.system ? [{ role: "system", content: rec.system }] : [];
    return msgs.concat([{ role: "user", content: instruction + (rec.input ? "\n\n" + rec.input : "") },
                        { role: "assistant", content: output }]);
  }
  requireString(rec, "text", where);
  return null;
}

export function recordDocument(model, rec, format, trainOnAll, where) {
  const messages = recordMessages(rec, format, where);
  if (messages === null) return textDocument(model, rec.text);
  if (format === "alpaca" && !model.template) return alpacaPromptDocument(model, rec, trainOnAll);
  return conversationDocument(model, messages, trainOnAll, where);
}

// .jsonl: one object per line; .json: an array of objects; .txt (text only): one document per line.
function* readRecords(file, format) {
  let text;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    throw new PrepareError(kNotFound, `cannot read ${file}: ${e.message}`);
  }
  if (file.endsWith(".json")) {
    let list;
    try {
      list = JSON.parse(text);
    } catch (e) {
      throw new PrepareError(kCorrupt, `${file} is not JSON: ${e.message}`);
    }
    if (!Array.isArray(list)) throw new PrepareError(kCorrupt, `${file}: a .json input must hold an array of records`);
    for (let i = 0; i < list.length; i++) yield [list[i], `${file}: record ${i}`];
    return;
  }
  const lines = text.split("\n");
  for (let i = 0; i < lines.length; i++) {
    if (!lines[i].trim()) continue;
    const where = `${file}:${i + 1}`;
    if (file.endsWith(".txt")) {
      if (format !== "text") throw new PrepareError(kBadArgument, `${file}: a .txt input needs --format text`);
      yield [{ text: lines[i] }, where];
      continue;
    }
    let rec;
    try {
      rec = JSON.parse(lines[i]);
    } catch (e) {
      throw new PrepareError(kCorrupt, `${where}: not JSON: ${e.message}`);
    }
    yield [rec, where];
  }
}

// mulberry32: a small seeded generator, so that a split is the same on every machine.
function random(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Indices of the validation documents (sorted): round(n * fraction), at least 1 and at most n - 1.
export function validationIndices(n, fraction, seed) {
  if (fraction <= 0 || n < 2) return [];
  const k = Math.min(n - 1, Math.max(1, Math.round(n * fraction)));
  const order = Array.from({ length: n }, (_, i) => i);
  const next = random(seed);
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(next() * (i + 1));
    [order[i], order[j]] = [order[j], order[i]];
  }
  return order.slice(0, k).sort((x, y) => x - y);
}

// A temporary name beside the file, renamed over it once complete: an interrupted run leaves
// the old file or the new one, never a part.
function writeAtomically(file, data) {
  fs.mkdirSync(path.dirname(path.resolve(file)), { recursive: true });
  const temp = `${file}.tmp-${process.pid}`;
  try {
    fs.writeFileSync(temp, data);
    fs.renameSync(temp, file);
  } catch (e) {
    fs.rmSync(temp, { force: true });
    throw new PrepareError(kFailed, `cannot write ${file}: ${e.message}`);
  }
}

// The formats of common/formats/data.h. The tokenizer record: JSONL's first line
// {"lorastream_tokenizer": {...}}; in a token file flags bit 1 and, after the mask, a u32
// byte count and the same object as JSON.
export function writeData(file, docs, record) {
  const hasMask = docs.some((d) => d.labels.some((l) => l === kIgnore));
  if (file.endsWith(".jsonl")) {
    const lines = [JSON.stringify({ lorastream_tokenizer: record })];
    for (const d of docs)
      lines.push(JSON.stringify(d.labels.some((l) => l === kIgnore) ? { input_ids: d.ids, labels: d.labels } : { input_ids: d.ids }));
    writeAtomically(file, lines.join("\n") + "\n");
    return;
  }
  const width = record.vocab_size <= 65536 ? 2 : 4;
  const numTokens = docs.reduce((s, d) => s + d.ids.length, 0);
  const json = Buffer.from(JSON.stringify(record), "utf8");
  const size = 40 + 8 * (docs.length + 1) + numTokens * width + (hasMask ? numTokens : 0) + 4 + json.length;
  const buf = Buffer.alloc(size);
  buf.write("LSTOKEN\0", 0, "latin1");
  buf.writeUInt32LE(1, 8);
  buf.writeUInt32LE(width, 12);
  buf.writeBigUInt64LE(BigInt(docs.length), 16);
  buf.writeBigUInt64LE(BigInt(numTokens), 24);
  buf.writeUInt32LE((hasMask ? 1 : 0) | 2, 32);
  let at = 40, offset = 0;
  buf.writeBigUInt64LE(0n, at);
  at += 8;
  for (const d of docs) {
    offset += d.ids.length;
    buf.writeBigUInt64LE(BigInt(offset), at);
    at += 8;
  }
  for (const d of docs)
    for (const id of d.ids) {
      if (width === 2) buf.writeUInt16LE(id, at);
      else buf.writeUInt32LE(id, at);
      at += width;
    }
  if (hasMask)
    for (const d of docs) for (const l of d.labels) buf[at++] = l === kIgnore ? 0 : 1;
  buf.writeUInt32LE(json.length, at);
  json.copy(buf, at + 4);
  writeAtomically(file, buf);
}

export function validationPath(out) {
  return out.replace(/\.(jsonl|tok|bin)$/, ".val.$1");
}

// The example with its masked spans marked: [masked]...[/masked] is not trained on.
function markedExample(model, doc) {
  let out = "", start = 0;
  for (let j = 1; j <= doc.ids.length; j++) {
    const masked = doc.labels[start] === kIgnore;
    if (j < doc.ids.length && (doc.labels[j] === kIgnore) === masked) continue;
    const piece = model.tokenizer.decode(doc.ids.slice(start, j), { skip_special_tokens: false });
    out += masked ? `[masked]${piece}[/masked]` : piece;
    start = j;
  }
  return out;
}

// The files prepare would write: refused when one is an input (it would replace the user's
// text with token ids) or already exists, unless --force. Checked before any tokenizing.
export function checkOutputs(o) {
  const outputs = [o.out];
  if (o.valSplit > 0) outputs.push(validationPath(o.out));
  const same = (a, b) => {
    try {
      const x = fs.statSync(a), y = fs.statSync(b);
      return x.dev === y.dev && x.ino === y.ino;
    } catch {
      return path.resolve(a) === path.resolve(b);
    }
  };
  for (const out of outputs) {
    const input = o.inputs.find((i) => same(i, out));
    if (input !== undefined && !o.force)
      throw new PrepareError(kBadArgument, `${out} is also an input (--in ${input}): writing it would ` +
                             "replace that file with token ids; choose another --out (or pass --force)");
    if (fs.existsSync(out) && !o.force)
      throw new PrepareError(kBadArgument, `${out} exists; choose another --out or pass --force to replace it`);
  }
}

function main(argv) {
  const o = parseArgs(argv);
  checkOutputs(o);
  const model = loadModelTokenizer(o.model);
  const docs = [];
  // Text documents end with the tokenizer's EOS, so that the model learns where one stops;
  // a tokenizer without one leaves them open: say so rather than train that silently.
  const eosWarning = eosProblem(model, o.format);
  if (eosWarning) process.stderr.write(`lorastream prepare: warning: ${eosWarning}\n`);
  let records = 0, truncated = 0, untrained = 0;
  for (const file of o.inputs) {
    for (const [rec, where] of readRecords(file, o.format)) {
      records++;
      const doc = recordDocument(model, rec, o.format, o.trainOnAll, where);
      if (o.seqLen && doc.ids.length > o.seqLen) {
        doc.ids.length = o.seqLen;
        doc.labels.length = o.seqLen;
        truncated++;
      }
      if (!doc.labels.some((l) => l !== kIgnore)) {
        untrained++;
        continue;
      }
      docs.push(doc);
    }
  }
  if (!docs.length)
    throw new PrepareError(kRefused, `${o.inputs.join(", ")}: no document with a token to train on (${records} records)`);
  const record = { name: o.tokenizerName || path.basename(path.resolve(o.model)),
                   fingerprint: o.fingerprint, vocab_size: model.vocabSize };
  const val = new Set(validationIndices(docs.length, o.valSplit, o.seed));
  const train = docs.filter((_, i) => !val.has(i)), held = docs.filter((_, i) => val.has(i));
  writeData(o.out, train, record);
  if (held.length) writeData(validationPath(o.out), held, record);

  const count = (list) => list.reduce((s, d) => s + d.ids.length, 0);
  const trained = (list) => list.reduce((s, d) => s + d.labels.filter((l) => l !== kIgnore).length, 0);
  const n = (x) => x.toLocaleString("en-US");
  const docsOf = (k) => `${k} document${k === 1 ? "" : "s"}`;
  console.log(`prepare: ${records} records from ${o.inputs.length} file(s) -> ${docsOf(docs.length)}, ` +
              `${n(count(docs))} tokens (${n(trained(docs))} trained), ${truncated} truncated` +
              (o.seqLen ? ` to ${o.seqLen} tokens` : "") +
              (untrained ? `, ${untrained} skipped (no token to train on)` : ""));
  console.log(`  train:      ${o.out} (${docsOf(train.length)}, ${n(count(train))} tokens)`);
  if (held.length)
    console.log(`  validation: ${validationPath(o.out)} (${docsOf(held.length)}, ${n(count(held))} tokens)`);
  console.log(`  tokenizer:  ${record.name}, vocabulary ${record.vocab_size}` +
              (record.fingerprint ? `, fingerprint ${record.fingerprint}` : ""));
  console.log(`example (document 1 of the training data; [masked]...[/masked] is not trained on):`);
  console.log(markedExample(model, train[0]));
}

if (import.meta.url === `file://${process.argv[1]}` || process.argv[1]?.endsWith("prepare.mjs")) {
  try {
    main(process.argv.slice(2));
  } catch (e) {
    if (!(e instanceof PrepareError)) throw e;
    process.stderr.write(`lorastream prepare: ${e.message}\n`);
    process.exit(e.code);
  }
}
