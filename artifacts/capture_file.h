// The capture file (DESIGN.md, "Files"): what kvs-capture records from a real model and what
// kvs-eval and the trainers read.
//
//   /                      attrs: format_version, kind = "kvsparse-capture", the ModelShape
//                          (artifacts/model_io.h), dtype, tokenizer, vocab_size, layers,
//                          kv_heads (captured KV heads; Hq, Hkv below count captured heads)
//   /seq<i>/tokens         int32 [T]
//          attrs           decode_start (first teacher-forced/greedy decode position), source
//   /seq<i>/layer<l>/q_pre bf16 [T, Hq, d]   queries before RoPE
//                   /k_pre bf16 [T, Hkv, d]  keys before RoPE
//                   /v     bf16 [T, Hkv, d]
//                   /attn_blocks float32 [S, Hq, ceil(T/16)]: for decode step s (position
//                          decode_start + s), the post-softmax attention row of each query
//                          head, max-pooled over blocks of 16 keys (0 past the position)
// Arrays grow by appends (chunked prefill writes chunk by chunk), compressed; the file is
// written under a temporary name and renamed when complete.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "artifacts/h5.h"
#include "artifacts/model_shape.h"

namespace kvs {

constexpr int kCaptureFormatVersion = 1;
constexpr int kAttnBlockSize = 16;  ///< keys per block of attn_blocks

struct CaptureMeta {
  ModelShape shape;
  std::string dtype = "bfloat16";  ///< compute dtype of the run that captured
  std::string tokenizer = "bytes"; ///< "bytes" (token = byte) or "ids" (pre-tokenized)
  int vocab_size = 0;
  std::vector<int> layers;         ///< captured layers, ascending
  std::vector<int> kv_heads;       ///< captured KV heads, ascending, with all the query heads
                                   ///< of their groups; empty when writing = every head

  bool all_heads() const { return int(kv_heads.size()) == shape.num_kv_heads; }
  // The shape of the captured arrays: the model's, with the head counts of the captured
  // heads (equal to `shape` when every head was captured).
  ModelShape captured_shape() const;
};

// Writes a capture file; nothing appears at `path` until commit().
class CaptureWriter {
 public:
  CaptureWriter(const std::string& path, const CaptureMeta& meta);
  ~CaptureWriter();
  const CaptureMeta& meta() const;  ///< layers sorted ascending

  // Starts sequence `index` (0, 1, ... in order) with its tokens; decode_start in [1, T].
  void begin_sequence(const std::vector<int32_t>& tokens, int decode_start,
                      const std::string& source);
  // Appends n tokens' rows of one captured layer of the current sequence.
  void append_qkv(int layer, int n, const bf16* q_pre, const bf16* k_pre, const bf16* v);
  // Appends one decode step's pooled attention row [Hq, ceil(T/16)] of one layer.
  void append_attn_row(int layer, const float* pooled);
  // Checks the current sequence is complete (T rows everywhere, T - decode_start attention
  // rows) and commits the file.
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Max-pools one post-softmax row of `len` probabilities into ceil(width/16) blocks (zeros
// past len): the one place the attn_blocks pooling is defined.
void pool_attention_row(const float* probs, int len, int width_tokens, float* pooled);

struct CaptureSequence {
  std::string name;   ///< "seq0"
  int num_tokens = 0; ///< T
  int decode_start = 0;
  int num_steps() const { return num_tokens - decode_start; }
};

// Reads and validates a capture file: version, model attributes, and per layer the shapes
// of q_pre/k_pre/v/attn_blocks against the model and the sequence length, with errors that
// name the file and dataset.
class CaptureFile {
 public:
  static CaptureFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const CaptureMeta& meta() const { return meta_; }
  const std::vector<CaptureSequence>& sequences() const { return sequences_; }
  bool has_layer(int layer) const;

  std::vector<int32_t> tokens(int seq) const;
  // [T, H, d] bf16
  std::vector<bf16> q_pre(int seq, int layer) const;
  std::vector<bf16> k_pre(int seq, int layer) const;
  std::vector<bf16> v(int seq, int layer) const;
  // [S, Hq, ceil(T/16)]
  std::vector<float> attn_blocks(int seq, int layer) const;

 private:
  h5::Dataset dataset(int seq, int layer, const char* name, h5::DType dtype,
                      const h5::Shape& shape) const;
  std::string path_;
  h5::File file_;
  CaptureMeta meta_;
  std::vector<CaptureSequence> sequences_;
};

}  // namespace kvs
