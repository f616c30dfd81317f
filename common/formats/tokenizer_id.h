// Which tokenizer made a model's vocabulary or a data file's token ids. `lorastream prepare`
// records it in the data it writes, the store in its manifest; `submit` and `worker train`
// refuse data made for another tokenizer. Torch-free.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace lorastream {

struct TokenizerId {
  std::string name;         // the model folder's name, for messages
  std::string fingerprint;  // "tok-" + 16 hex digits; empty = unknown
  int64_t vocab_size = 0;   // the largest token id + 1 (vocabulary and added tokens)
};

// The tokenizer of a Hugging Face model folder: nullopt when it has no tokenizer.json; a
// tokenizer.json that is not JSON is Error(kCorrupt) naming it. The fingerprint hashes the
// parts that decide the ids (model, normalizer, pre_tokenizer, post_processor, added_tokens),
// with keys sorted, so that re-saving the same tokenizer keeps it.
std::optional<TokenizerId> ModelTokenizerId(const std::string& model_dir);

// The record `lorastream prepare` wrote into a data file (format "jsonl" or "tokens", as
// data.format): nullopt when the file has none (ids made by hand or by other tools). A
// malformed record is Error(kCorrupt) naming the file.
std::optional<TokenizerId> DataTokenizerId(const std::string& data_path, const std::string& format);

// Empty when `data` may train `model`; else the refusal, naming both tokenizers and the fix.
// Data without a record is left to the vocabulary check of the loader; a model without a
// tokenizer (a synthetic one) is checked by vocabulary size only. `model_what` names the model
// (checkpoint folder or store) and `model_vocab_size` is its config.json's vocab_size.
std::string TokenizerMismatch(const std::optional<TokenizerId>& model,
                              const std::string& model_what, int64_t model_vocab_size,
                              const std::optional<TokenizerId>& data, const std::string& data_path);

// The same for a job: reads `data_path`'s record (format "jsonl"/"tokens") and, only when it
// has one, asks `model_tokenizer` for the model's (nullopt: the model has none). Errors reading
// either become the returned problem. Used by submit, the coordinator and `worker train`.
std::string DataTokenizerProblem(const std::string& data_path, const std::string& format,
                                 const std::function<std::optional<TokenizerId>()>& model_tokenizer,
                                 const std::string& model_what, int64_t model_vocab_size);

}  // namespace lorastream
