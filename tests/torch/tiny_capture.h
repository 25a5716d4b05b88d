// A capture of the embedded kvs-tiny-a for the trainer tests: two 1024-byte prompts of the
// held-out text (training batches come from one prompt each), the given layers, the last
// decode_steps tokens of each recorded one at a time (CPU, fp32).
#pragma once

#include <string>
#include <vector>

#include "capture/recorder.h"
#include "capture/tokens.h"
#include "tests/torch/test_util.h"

namespace kvs::testing {

inline void record_tiny_capture(const std::string& path, const std::vector<int>& layers,
                                int decode_steps) {
  const LlamaModel model = LlamaModel::load(tiny_model_dir(), torch::kCPU, torch::kFloat32);
  CaptureMeta meta;
  meta.shape = model.shape();
  meta.layers = layers;
  meta.vocab_size = 256;
  CaptureWriter w(path, meta);
  RecordOptions ro;
  ro.decode_steps = decode_steps;
  const std::string text = validation_text(2048);
  for (int i = 0; i < 2; ++i)
    record_sequence(model, byte_tokens(model.config(), text.substr(size_t(i) * 1024, 1024)), ro,
                    "val" + std::to_string(i), w);
  w.commit();
}

}  // namespace kvs::testing
