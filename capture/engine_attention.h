// A runtime engine inside the model runner's decode loop: the bridge between the libtorch
// runner (capture/llama.h) and the torch-free runtime (runtime/engine.h), used the way a user
// embeds kvsparse in their own decode loop.
//
// The runner prefills the prompt with its own dense attention. start() then copies the
// prompt's post-RoPE K and V from the runner's KvCache into the runtime's paged bf16
// KVCache, prefills the engine for every layer, and hands engines that reuse past queries
// (MAC) the prompt's last queries. From then on every single-token forward call of the
// runner asks attend() per layer: the new token's K/V are appended to the runtime cache and
// the engine's decode() computes the attention output on raw pointers (host memory for the
// CPU reference backend, device memory for CUDA). The engine sees every layer; its own dense
// layers (each method's dense_layers knob) stay dense inside it.
//
// One sequence (batch 1), as the runner decodes one sequence at a time.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "capture/llama.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"

namespace kvs {

// Records the pre-RoPE queries of the last `keep` positions of every layer during a prefill
// (for engines whose prompt_queries_wanted() > 0).
class PromptQueryRecorder : public LlamaObserver {
 public:
  PromptQueryRecorder(int num_layers, int64_t prompt_tokens, int keep);
  void on_qkv(int layer, int64_t start, const torch::Tensor& q_pre, const torch::Tensor& k_pre,
              const torch::Tensor& v) override;
  // [n, Hq, d] bf16 on the CPU: the recorded queries of positions prompt_tokens - n .. end.
  torch::Tensor queries(int layer) const;
  int64_t first_position() const { return first_; }

 private:
  int64_t prompt_tokens_, first_;
  std::vector<std::vector<torch::Tensor>> parts_;
};

class EngineAttention : public DecodeAttention {
 public:
  // An engine for `model` from a method spec ("name" or "name:knob=value,...", runtime/knobs.h)
  // on the backend that matches the model's device, for sequences of up to max_tokens.
  // `bundle` may be null for methods without stored parts.
  EngineAttention(const LlamaModel& model, const std::string& method_spec,
                  const EngineConfig& base, const Bundle* bundle, int max_tokens);
  ~EngineAttention() override;

  // After model.prefill() of the prompt into `cache`: fills the runtime cache and prefills
  // the engine (see the file comment). `queries` may be null when the engine wants none;
  // it must have recorded at least the engine's prompt_queries_wanted() last positions of
  // the prompt otherwise.
  void start(const KvCache& cache, const PromptQueryRecorder* queries);

  torch::Tensor attend(int layer, int64_t pos, const torch::Tensor& q, const torch::Tensor& q_pre,
                       const torch::Tensor& k, const torch::Tensor& v) override;

  Engine& engine() { return *engine_; }
  int prompt_queries_wanted() const { return engine_->prompt_queries_wanted(); }
  // The engine's counters since start() (kv_read_fraction: KV rows read over a dense read).
  EngineStats stats() const { return engine_->stats(); }

 private:
  torch::Tensor to_backend_bf16(const torch::Tensor& x) const;

  ModelShape shape_;
  Backend backend_;
  torch::Device device_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KVCache> kv_;
  torch::Tensor workspace_;
  int max_tokens_;
  int64_t step_pos_ = -1;  ///< position of the decode step in progress
  bool started_ = false;
};

}  // namespace kvs
