// Records what kvs-capture stores: runs the model over a token sequence (prefill, then
// teacher-forced or greedy decode steps) and writes pre-RoPE q/k, v and the decode steps'
// block-pooled attention rows through CaptureWriter (artifacts/capture_file.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "capture/llama.h"

namespace kvs {

struct RecordOptions {
  int decode_steps = 64;   ///< last steps of the sequence run one token at a time, recorded
  bool greedy = false;     ///< false: teacher-forced over the text; true: the model's argmax
  int64_t chunk = 512;     ///< prefill chunk (tokens per forward call)
};

// Called after every forward call with (tokens done, tokens total).
using Progress = std::function<void(int64_t, int64_t)>;

// Runs `tokens` (T = tokens.size() positions) through the model and records sequence data
// for meta.layers into `writer` (which must have been made with the same model's shape).
// The first T - decode_steps tokens are prefilled; the rest are decode steps. With greedy,
// the tokens after the prefill are replaced by the model's own argmax continuations; the
// tokens actually run are written. Returns them.
std::vector<int32_t> record_sequence(const LlamaModel& model, std::vector<int32_t> tokens,
                                     const RecordOptions& options, const std::string& source,
                                     CaptureWriter& writer, const Progress& progress = {});

// Reads a text file, transparently gunzipping a .gz (the corpus ships compressed).
std::string read_text_file(const std::string& path);

}  // namespace kvs
