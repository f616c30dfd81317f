#!/usr/bin/env python3
"""Turns text into lorastream's training data (formats: common/formats/data.h).

  tokenize.py --tokenizer DIR_OR_NAME --in corpus.jsonl --field text --out train.jsonl
  tokenize.py --tokenizer DIR --in corpus.txt --out train.tok       # binary token file
  tokenize.py --random 64 --vocab 512 --out demo.jsonl              # random ids (demos/tests)

Input: a .jsonl file (one object per line; --field names the text, --prompt-field an
optional prompt that is not trained on) or a plain .txt file (one document per line).
Output by extension: .jsonl (input_ids [+ loss_mask]) or .tok/.bin (the binary token file,
u16 ids when they fit, else u32; a loss mask when any token is masked). An EOS token is
appended to each document unless --no-eos. Needs the `tokenizers` (or `transformers`)
package for real text; --random needs nothing.
"""
import argparse
import json
import random
import struct
import sys

MAGIC = b"LSTOKEN\0"


def load_tokenizer(name):
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(name)
        return (lambda s: tok.encode(s, add_special_tokens=False)), tok.eos_token_id
    except ImportError:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(name if name.endswith(".json") else name + "/tokenizer.json")
        return (lambda s: tok.encode(s, add_special_tokens=False).ids), None


def read_documents(path, field, prompt_field):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                obj = json.loads(line)
                if field not in obj:
                    sys.exit(f"{path}:{line_no}: no field `{field}`")
                yield obj.get(prompt_field, "") if prompt_field else "", obj[field]
            else:
                yield "", line.rstrip("\n")


def write_jsonl(path, docs):
    with open(path, "w") as f:
        for ids, mask in docs:
            obj = {"input_ids": ids}
            if mask is not None and not all(mask):
                obj["loss_mask"] = mask
            f.write(json.dumps(obj) + "\n")


def write_tokens(path, docs):
    max_id = max((max(ids) for ids, _ in docs if ids), default=0)
    width = 2 if max_id < 65536 else 4
    has_mask = any(m is not None and not all(m) for _, m in docs)
    num_tokens = sum(len(ids) for ids, _ in docs)
    with open(path + ".tmp", "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<IIQQII", 1, width, len(docs), num_tokens, 1 if has_mask else 0, 0))
        offset = 0
        f.write(struct.pack("<Q", 0))
        for ids, _ in docs:
            offset += len(ids)
            f.write(struct.pack("<Q", offset))
        fmt = "<%d" + ("H" if width == 2 else "I")
        for ids, _ in docs:
            f.write(struct.pack(fmt % len(ids), *ids))
        if has_mask:
            for ids, m in docs:
                f.write(bytes(m if m is not None else [1] * len(ids)))
    import os
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help=".jsonl or .tok/.bin")
    ap.add_argument("--in", dest="inp", help=".jsonl or .txt input")
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer folder or name")
    ap.add_argument("--field", default="text")
    ap.add_argument("--prompt-field", default="")
    ap.add_argument("--no-eos", action="store_true")
    ap.add_argument("--random", type=int, default=0, help="N random documents instead")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    docs = []
    if args.random:
        rng = random.Random(args.seed)
        for _ in range(args.random):
            n = rng.randint(args.min_len, args.max_len)
            docs.append(([rng.randrange(args.vocab) for _ in range(n)], None))
    else:
        if not args.inp or not args.tokenizer:
            sys.exit("give --in and --tokenizer (or --random N)")
        encode, eos = load_tokenizer(args.tokenizer)
        for prompt, text in read_documents(args.inp, args.field, args.prompt_field):
            p = encode(prompt) if prompt else []
            t = encode(text)
            if eos is not None and not args.no_eos:
                t = t + [eos]
            docs.append((p + t, [0] * len(p) + [1] * len(t)))
    import os
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.out.endswith(".jsonl"):
        write_jsonl(args.out, docs)
    elif args.out.endswith((".tok", ".bin", ".tokens")):
        write_tokens(args.out, docs)
    else:
        sys.exit("--out must end in .jsonl, .tok or .bin")
    print(f"{args.out}: {len(docs)} documents, {sum(len(d) for d, _ in docs)} tokens")


if __name__ == "__main__":
    main()
