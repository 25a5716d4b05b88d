// Llama-family model runner on libtorch: the reference forward pass the capture tool records
// from and the evaluator measures with (CPU or CUDA, fp32 or bf16 weights and activations).
//
// It follows transformers' LlamaForCausalLM operation by operation (RMSNorm in fp32 then cast
// back, RoPE cos/sin in fp32 cast to the activation dtype, SwiGLU, untied or tied lm_head),
// with one deliberate difference: attention scores, softmax and the probability-weighted sum
// of V are computed in fp32 for every dtype (as flash/SDPA kernels do), because the captured
// attention maps must not carry bf16 rounding of the logits.
//
// The model is immutable after load(); per-sequence state lives in a KvCache, so one model
// serves several sequences. Observers see the pre-RoPE q/k and v of every layer and, for
// single-token steps, full attention rows, without the runner knowing how they are stored.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "capture/hf_config.h"

namespace kvs {

// Callbacks from inside a forward pass. Default implementations do nothing.
struct LlamaObserver {
  virtual ~LlamaObserver() = default;

  // Once per layer per forward call, for the tokens at positions [start, start + T):
  // q_pre [T, Hq, d], k_pre [T, Hkv, d] (before RoPE) and v [T, Hkv, d], in the model's dtype
  // and on its device. They are fresh tensors (not views of the cache): keeping them is safe.
  virtual void on_qkv(int layer, int64_t start, const torch::Tensor& q_pre,
                      const torch::Tensor& k_pre, const torch::Tensor& v) {}

  // Whether on_attention should be called for `layer` (asked once per layer per decode step).
  virtual bool wants_attention(int layer) const { return false; }

  // Single-token forward calls only (decode steps): the post-softmax attention of the token
  // at `pos` over all pos + 1 cached tokens, probs [Hq, pos + 1] fp32 on the model's device.
  // Query head h reads KV head h / (Hq / Hkv), as in transformers' repeat_kv.
  virtual void on_attention(int layer, int64_t pos, const torch::Tensor& probs) {}
};

// Attention of single-token calls (decode steps) done elsewhere: the runtime's engines plug
// into the runner here (capture/engine_attention.h). The runner still computes q, k, v and
// RoPE and appends K/V to its own KvCache; for every layer it then asks attend() for the
// attention output instead of attending itself.
struct DecodeAttention {
  virtual ~DecodeAttention() = default;

  // The token at position `pos` of `layer`: q [Hq, d] after RoPE, q_pre [Hq, d] before it,
  // k [Hkv, d] after RoPE and v [Hkv, d], in the model's dtype and device. Returns the
  // attention output [Hq, d] (any float dtype, the model's device).
  virtual torch::Tensor attend(int layer, int64_t pos, const torch::Tensor& q,
                               const torch::Tensor& q_pre, const torch::Tensor& k,
                               const torch::Tensor& v) = 0;
};

// Which logits a forward call returns.
enum class LogitsMode {
  All,   ///< [T, vocab]
  Last,  ///< [1, vocab]: what a prefill needs before decoding; avoids T x vocab memory
  None,  ///< undefined tensor: only fill the cache (and feed observers)
};

// Per-layer K (post-RoPE) and V of one sequence, [capacity, Hkv, d] per layer in the model's
// dtype and device. Grows geometrically when a forward call needs more room.
class KvCache {
 public:
  KvCache() = default;

  int64_t size() const { return size_; }  ///< tokens cached (= next position)
  int64_t capacity() const { return capacity_; }
  int num_layers() const { return int(k_.size()); }
  void clear() { size_ = 0; }  ///< keeps the memory
  // Forgets the tokens from position `tokens` on (keeps the memory), so that several decode
  // runs can start from one prefilled prompt. Throws when tokens > size().
  void truncate(int64_t tokens);

  torch::Tensor keys(int layer) const;    ///< [size, Hkv, d] view, post-RoPE
  torch::Tensor values(int layer) const;  ///< [size, Hkv, d] view

 private:
  friend class LlamaModel;
  void reserve(int64_t tokens);

  std::vector<torch::Tensor> k_, v_;
  int64_t size_ = 0;
  int64_t capacity_ = 0;
  int num_kv_heads_ = 0;
  int head_dim_ = 0;
  torch::TensorOptions options_;
};

struct PrefillOptions {
  int64_t chunk =
      512;  ///< tokens per forward call; attention memory ~ 12 * chunk * context * Hq bytes
  LogitsMode logits = LogitsMode::All;
};

class LlamaModel {
 public:
  // Loads config.json and the safetensors weights (single file or sharded) of `folder`,
  // converted to `dtype` (torch::kFloat32 or torch::kBFloat16) on `device`. Throws naming
  // the file and tensor when a weight is missing or has the wrong shape.
  static LlamaModel load(const std::string& folder, torch::Device device, torch::ScalarType dtype);

  const HfConfig& config() const { return cfg_; }
  const ModelShape& shape() const { return cfg_.shape; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }

  // An empty cache for this model, with room for `reserve_tokens` before it has to grow.
  KvCache new_cache(int64_t reserve_tokens = 0) const;

  // Runs `count` tokens at positions cache.size() .. cache.size() + count - 1: attention to
  // everything cached plus causal within the call; appends their K/V to the cache. Returns
  // fp32 logits on the model's device (see LogitsMode). Throws for an id outside the
  // vocabulary, a position past max_position_embeddings, or a cache from another model.
  // With `attention` set, single-token calls take their attention from it (DecodeAttention).
  torch::Tensor forward(const int32_t* ids, int64_t count, KvCache& cache,
                        LlamaObserver* observer = nullptr, LogitsMode logits = LogitsMode::All,
                        DecodeAttention* attention = nullptr) const;

  // forward() over `ids` in chunks of options.chunk tokens. With LogitsMode::All the result
  // is [ids.size(), vocab], the same as one unchunked call up to fp rounding.
  torch::Tensor prefill(const std::vector<int32_t>& ids, KvCache& cache,
                        const PrefillOptions& options = {},
                        LlamaObserver* observer = nullptr) const;

  // One token: logits [vocab] fp32; observers may ask for attention rows; `attention`
  // (when set) replaces the runner's own attention in every layer.
  torch::Tensor decode(int32_t id, KvCache& cache, LlamaObserver* observer = nullptr,
                       DecodeAttention* attention = nullptr) const;

 private:
  struct Layer {
    torch::Tensor input_norm, q, k, v, o, post_norm, gate, up, down;
  };

  torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight) const;
  torch::Tensor attention(int layer, const torch::Tensor& h, int64_t start, KvCache& cache,
                          LlamaObserver* observer, DecodeAttention* decode_attention,
                          const torch::Tensor& cos, const torch::Tensor& sin) const;

  HfConfig cfg_;
  torch::Device device_ = torch::kCPU;
  torch::ScalarType dtype_ = torch::kFloat32;
  torch::Tensor embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  torch::Tensor inv_freq_;  ///< [d/2] fp32 on device, from rope_inv_freq
};

// Where and in what precision the runner runs, from command-line words: device "cpu",
// "cuda" or "auto" (cuda when libtorch sees one); dtype "bf16", "fp32" or "auto" (bf16 on
// cuda, fp32 on cpu). Throws naming the option and the value.
struct RunnerPlacement {
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
};
RunnerPlacement parse_placement(const std::string& device, const std::string& dtype);

// -log p(ids[t + 1] | ids[0..t]) in nats for t = 0 .. T-2, from logits [T, vocab] of `ids`
// (fp64 on the CPU). Bits per byte of a byte-level model = mean / ln 2.
torch::Tensor next_token_nll(const torch::Tensor& logits, const std::vector<int32_t>& ids);

}  // namespace kvs
