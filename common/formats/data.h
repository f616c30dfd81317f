// Training data: pre-tokenized documents, packed or padded into fixed-length sequences,
// visited in a seeded order. Torch-free.
//
// Two input formats (`lorastream prepare` writes both from text and conversations):
//
// JSONL (.jsonl): one JSON object per line (blank lines skipped):
//   {"input_ids": [1, 15043, 29892, ...],      required, token ids in [0, vocab_size)
//    "labels":    [-100, -100, 29892, ...],    optional, same length: the token to predict
//                                              at each position (HF convention: labels are
//                                              aligned with input_ids, the shift by one
//                                              happens in the loss); -100 = not trained
//    "loss_mask": [0, 0, 1, ...]}              optional (instead of labels): 1 = train on
//                                              this token as a target, 0 = do not
//   Without labels/loss_mask every token is a target. The first line may instead be
//   {"lorastream_tokenizer": {"name", "fingerprint", "vocab_size"}}: the tokenizer that
//   made the ids (common/formats/tokenizer_id.h), written by `lorastream prepare`.
//
// Token file (.tok / .bin), little-endian, sizes exact (anything else is refused):
//   offset 0   char[8]  magic "LSTOKEN\0"
//          8   u32      version = 1
//          12  u32      token_bytes: 2 (u16 ids) or 4 (u32 ids)
//          16  u64      num_docs
//          24  u64      num_tokens
//          32  u32      flags: bit 0 = a loss mask follows the tokens; bit 1 = the file
//                       ends with a tokenizer record: u32 byte count + that many bytes of
//                       JSON {"name", "fingerprint", "vocab_size"} (common/formats/tokenizer_id.h)
//          36  u32      reserved, 0
//          40  u64[num_docs + 1] offsets: document d is tokens [offsets[d], offsets[d+1]);
//                       offsets[0] = 0, non-decreasing, offsets[num_docs] = num_tokens
//          ..  tokens[num_tokens], token_bytes each
//          ..  u8 mask[num_tokens] when flags bit 0: 1 = target, 0 = not trained
//
// Sequences: with packing, all documents are concatenated (in file order; put an EOS token
// at the end of each document yourself) and cut into seq_len chunks, the last one padded;
// without, each document is one sequence, truncated to seq_len or padded. Padding uses
// data.pad_id and is never a target; attention is causal, so right padding never reaches a
// real token. Order: sequence positions are visited epoch by epoch, each epoch a permutation
// drawn from (seed, epoch): the position after N samples determines everything (resume).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorastream {

constexpr int32_t kIgnoreIndex = -100;

struct Document {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;  // aligned with ids; kIgnoreIndex = not a target
};

// Loads every document; format "jsonl" or "tokens". Ids (and labels) outside
// [0, vocab_size) are refused (Error kRefused) naming the file and the line (JSONL) or the
// document (token file); malformed files are Error kCorrupt with the same detail.
std::vector<Document> LoadDocuments(const std::string& path, const std::string& format,
                                    int64_t vocab_size);

// Refuses (Error kCorrupt naming `where` and the column) a JSONL line holding a NUL byte: the
// JSON parser stops at NUL, so whatever follows it would be dropped without a word.
void RequireNoNul(std::string_view line, const std::string& where);

// Writes a token file (token_bytes 2 or 4; with_mask writes labels != -100 as the mask;
// labels must then equal ids or -100).
void WriteTokenFile(const std::string& path, const std::vector<Document>& docs, int token_bytes,
                    bool with_mask);

struct SequenceSet {
  int64_t seq_len = 0;
  int64_t count = 0;
  std::vector<int32_t> ids;     // count * seq_len
  std::vector<int32_t> labels;  // count * seq_len, aligned with ids
};
SequenceSet BuildSequences(const std::vector<Document>& docs, int64_t seq_len, bool packing,
                           int32_t pad_id);

// Visit order: sample `position` (0, 1, 2, ... across epochs) -> sequence index.
class Sampler {
 public:
  Sampler(int64_t count, uint64_t seed);
  int64_t Index(int64_t position);

 private:
  int64_t count_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

// A micro-batch: `rows` sequences starting at sample `position`. targets are the labels
// shifted by one (targets[s] = labels[s + 1], the last position kIgnoreIndex), as the loss
// of transformers computes them; n_targets counts those != kIgnoreIndex.
struct Batch {
  int64_t rows = 0, seq_len = 0;
  std::vector<int64_t> ids, targets;
  int64_t n_targets = 0;
};
Batch MakeBatch(const SequenceSet& set, Sampler& sampler, int64_t position, int64_t rows);
// The same from explicit sequence indices (evaluation visits its set in order).
Batch MakeBatchOf(const SequenceSet& set, const std::vector<int64_t>& indices);

}  // namespace lorastream
