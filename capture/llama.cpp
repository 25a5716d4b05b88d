#include "capture/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "capture/safetensors.h"

namespace kvs {

namespace F = torch::nn::functional;

namespace {

torch::ScalarType torch_dtype_of(StDtype dtype) {
  switch (dtype) {
    case StDtype::BF16:
      return torch::kBFloat16;
    case StDtype::F16:
      return torch::kHalf;
    case StDtype::F32:
      return torch::kFloat32;
    default:
      break;
  }
  throw std::logic_error("torch_dtype_of: not a float dtype");
}

// Copies (never aliases) the mapped bytes: safetensors gives no alignment guarantee and the
// mapping would otherwise have to outlive every tensor made from it.
torch::Tensor load_weight(const SafetensorsModel& st, const std::string& name,
                          const std::vector<int64_t>& shape, torch::Device device,
                          torch::ScalarType dtype) {
  const StTensorInfo& info = st.require(name, shape);
  if (!is_float_dtype(info.dtype))
    throw std::runtime_error("safetensors '" + st.file_of(name).path() + "': tensor '" + name +
                             "' has dtype " + to_string(info.dtype) +
                             "; only BF16, F16 and F32 weights are supported");
  torch::Tensor t = torch::empty(shape, torch::dtype(torch_dtype_of(info.dtype)));
  std::memcpy(t.data_ptr(), st.file_of(name).data(info), size_t(info.nbytes()));
  return t.to(device, dtype);
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

torch::Tensor KvCache::keys(int layer) const {
  if (layer < 0 || layer >= num_layers())
    throw std::out_of_range("KvCache::keys: layer " + std::to_string(layer) + " of " +
                            std::to_string(num_layers()));
  return k_[size_t(layer)].narrow(0, 0, size_);
}

torch::Tensor KvCache::values(int layer) const {
  if (layer < 0 || layer >= num_layers())
    throw std::out_of_range("KvCache::values: layer " + std::to_string(layer) + " of " +
                            std::to_string(num_layers()));
  return v_[size_t(layer)].narrow(0, 0, size_);
}

void KvCache::truncate(int64_t tokens) {
  if (tokens < 0 || tokens > size_)
    throw std::out_of_range("KvCache::truncate: " + std::to_string(tokens) +
                            " tokens, the cache holds " + std::to_string(size_));
  size_ = tokens;
}

void KvCache::reserve(int64_t tokens) {
  if (tokens <= capacity_) return;
  // Doubling keeps appends amortized O(1) per token; a prefill that knows its length can
  // reserve exactly through new_cache().
  const int64_t cap = std::max(tokens, capacity_ * 2);
  for (size_t l = 0; l < k_.size(); ++l) {
    for (torch::Tensor* t : {&k_[l], &v_[l]}) {
      torch::Tensor grown = torch::empty({cap, num_kv_heads_, head_dim_}, options_);
      if (size_ > 0) grown.narrow(0, 0, size_).copy_(t->narrow(0, 0, size_));
      *t = grown;
    }
  }
  capacity_ = cap;
}

// ---------------------------------------------------------------------------------------------

LlamaModel LlamaModel::load(const std::string& folder, torch::Device device,
                            torch::ScalarType dtype) {
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16)
    throw std::invalid_argument(std::string("LlamaModel::load: dtype ") + c10::toString(dtype) +
                                " is not supported (float32 or bfloat16)");
  torch::NoGradGuard no_grad;
  LlamaModel m;
  m.cfg_ = load_hf_config(folder);
  m.device_ = device;
  m.dtype_ = dtype;
  const SafetensorsModel st(folder);
  m.cfg_.shape.weights_hash = st.weights_hash();

  const HfConfig& c = m.cfg_;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, vocab = c.vocab_size;
  const int64_t d = c.shape.head_dim, hq = c.shape.num_q_heads, hkv = c.shape.num_kv_heads;
  auto w = [&](const std::string& name, std::vector<int64_t> shape) {
    return load_weight(st, name, shape, device, dtype);
  };
  m.embed_ = w("model.embed_tokens.weight", {vocab, hidden});
  m.final_norm_ = w("model.norm.weight", {hidden});
  if (st.contains("lm_head.weight"))
    m.lm_head_ = w("lm_head.weight", {vocab, hidden});
  else if (c.tie_word_embeddings)
    m.lm_head_ = m.embed_;
  else
    throw std::runtime_error("model '" + folder +
                             "': missing tensor 'lm_head.weight' and tie_word_embeddings is false");
  for (int l = 0; l < c.shape.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer L;
    L.input_norm = w(p + "input_layernorm.weight", {hidden});
    L.q = w(p + "self_attn.q_proj.weight", {hq * d, hidden});
    L.k = w(p + "self_attn.k_proj.weight", {hkv * d, hidden});
    L.v = w(p + "self_attn.v_proj.weight", {hkv * d, hidden});
    L.o = w(p + "self_attn.o_proj.weight", {hidden, hq * d});
    L.post_norm = w(p + "post_attention_layernorm.weight", {hidden});
    L.gate = w(p + "mlp.gate_proj.weight", {inter, hidden});
    L.up = w(p + "mlp.up_proj.weight", {inter, hidden});
    L.down = w(p + "mlp.down_proj.weight", {hidden, inter});
    m.layers_.push_back(std::move(L));
  }
  const std::vector<float> inv = rope_inv_freq(c.shape.rope, c.shape.head_dim);
  m.inv_freq_ =
      torch::from_blob(const_cast<float*>(inv.data()), {int64_t(inv.size())}, torch::kFloat32)
          .to(device, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
  return m;
}

KvCache LlamaModel::new_cache(int64_t reserve_tokens) const {
  KvCache cache;
  cache.num_kv_heads_ = cfg_.shape.num_kv_heads;
  cache.head_dim_ = cfg_.shape.head_dim;
  cache.options_ = torch::TensorOptions().dtype(dtype_).device(device_);
  cache.k_.assign(size_t(cfg_.shape.num_layers), torch::Tensor());
  cache.v_.assign(size_t(cfg_.shape.num_layers), torch::Tensor());
  for (size_t l = 0; l < cache.k_.size(); ++l) {
    cache.k_[l] = torch::empty({0, cache.num_kv_heads_, cache.head_dim_}, cache.options_);
    cache.v_[l] = torch::empty({0, cache.num_kv_heads_, cache.head_dim_}, cache.options_);
  }
  if (reserve_tokens < 0)
    throw std::invalid_argument("new_cache: reserve_tokens must be >= 0, got " +
                                std::to_string(reserve_tokens));
  cache.reserve(reserve_tokens);
  return cache;
}

torch::Tensor LlamaModel::rms_norm(const torch::Tensor& x, const torch::Tensor& weight) const {
  // As transformers' LlamaRMSNorm: statistics in fp32, cast back, then the weight.
  const torch::Tensor xf = x.to(torch::kFloat32);
  const torch::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (xf * torch::rsqrt(var + cfg_.rms_norm_eps)).to(x.scalar_type());
}

torch::Tensor LlamaModel::attention(int layer, const torch::Tensor& h, int64_t start,
                                    KvCache& cache, LlamaObserver* observer,
                                    DecodeAttention* decode_attention,
                                    const torch::Tensor& cos, const torch::Tensor& sin) const {
  const Layer& L = layers_[size_t(layer)];
  const int64_t T = h.size(0), S = start + T;
  const int64_t hq = cfg_.shape.num_q_heads, hkv = cfg_.shape.num_kv_heads;
  const int64_t d = cfg_.shape.head_dim, g = hq / hkv;

  const torch::Tensor q = F::linear(h, L.q).view({T, hq, d});
  const torch::Tensor k = F::linear(h, L.k).view({T, hkv, d});
  const torch::Tensor v = F::linear(h, L.v).view({T, hkv, d});
  if (observer) observer->on_qkv(layer, start, q, k, v);

  // RoPE in the activation dtype with cos/sin already cast to it, as transformers does.
  const torch::Tensor qr = q * cos + rotate_half(q) * sin;
  const torch::Tensor kr = k * cos + rotate_half(k) * sin;
  cache.k_[size_t(layer)].narrow(0, start, T).copy_(kr);
  cache.v_[size_t(layer)].narrow(0, start, T).copy_(v);
  if (decode_attention && T == 1) {
    const torch::Tensor o = decode_attention->attend(layer, start, qr[0], q[0], kr[0], v[0]);
    if (!o.defined() || o.dim() != 2 || o.size(0) != hq || o.size(1) != d)
      throw std::runtime_error("LlamaModel: DecodeAttention::attend of layer " +
                               std::to_string(layer) + " did not return [" + std::to_string(hq) +
                               ", " + std::to_string(d) + "]");
    return F::linear(o.to(device_, dtype_).reshape({1, hq * d}), L.o);
  }
  const torch::Tensor keys = cache.k_[size_t(layer)].narrow(0, 0, S);
  const torch::Tensor values = cache.v_[size_t(layer)].narrow(0, 0, S);

  // Grouped layout [Hkv, g, T, d] against [Hkv, 1, S, d]: query head kv * g + j uses KV head
  // kv without materializing repeated K/V.
  const torch::Tensor qg = qr.to(torch::kFloat32).view({T, hkv, g, d}).permute({1, 2, 0, 3});
  const torch::Tensor kg = keys.to(torch::kFloat32).permute({1, 0, 2}).unsqueeze(1);
  const torch::Tensor vg = values.to(torch::kFloat32).permute({1, 0, 2}).unsqueeze(1);
  torch::Tensor scores = torch::matmul(qg, kg.transpose(-1, -2));  // [Hkv, g, T, S]
  scores.mul_(cfg_.shape.scale());
  if (T > 1) {
    // Query i sits at position start + i and sees keys 0 .. start + i.
    const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device_);
    const torch::Tensor qpos = torch::arange(start, S, opts).unsqueeze(1);
    const torch::Tensor kpos = torch::arange(0, S, opts).unsqueeze(0);
    scores.masked_fill_(kpos > qpos, -std::numeric_limits<float>::infinity());
  }
  const torch::Tensor probs = torch::softmax(scores, -1);
  if (observer && T == 1 && observer->wants_attention(layer))
    observer->on_attention(layer, start, probs.reshape({hq, S}));
  const torch::Tensor out = torch::matmul(probs, vg)  // [Hkv, g, T, d]
                                .permute({2, 0, 1, 3})
                                .reshape({T, hq * d})
                                .to(dtype_);
  return F::linear(out, L.o);
}

torch::Tensor LlamaModel::forward(const int32_t* ids, int64_t count, KvCache& cache,
                                  LlamaObserver* observer, LogitsMode logits,
                                  DecodeAttention* decode_attention) const {
  if (count <= 0) throw std::invalid_argument("LlamaModel::forward: no tokens");
  if (cache.num_layers() != cfg_.shape.num_layers ||
      cache.num_kv_heads_ != cfg_.shape.num_kv_heads || cache.head_dim_ != cfg_.shape.head_dim ||
      cache.options_.dtype() != dtype_ || cache.options_.device() != device_)
    throw std::invalid_argument(
        "LlamaModel::forward: the KV cache was not made by this model "
        "(use new_cache())");
  const int64_t start = cache.size();
  if (start + count > cfg_.shape.max_position)
    throw std::invalid_argument(
        "LlamaModel::forward: positions up to " + std::to_string(start + count - 1) +
        " exceed max_position_embeddings " + std::to_string(cfg_.shape.max_position));
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= cfg_.vocab_size)
      throw std::invalid_argument("LlamaModel::forward: token " + std::to_string(i) + " id " +
                                  std::to_string(ids[i]) + " is outside the vocabulary [0, " +
                                  std::to_string(cfg_.vocab_size) + ")");
  torch::NoGradGuard no_grad;
  cache.reserve(start + count);

  const torch::Tensor tok = torch::from_blob(const_cast<int32_t*>(ids), {count}, torch::kInt32)
                                .to(device_, torch::kInt64, /*non_blocking=*/false, /*copy=*/true);
  torch::Tensor x = embed_.index_select(0, tok);  // [T, hidden]

  // Angles float(pos) * inv_freq in fp32, duplicated for the rotate_half layout.
  const torch::Tensor pos =
      torch::arange(start, start + count,
                    torch::TensorOptions().dtype(torch::kInt64).device(device_))
          .to(torch::kFloat32);
  const torch::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);
  const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  const torch::Tensor cos = emb.cos().to(dtype_).unsqueeze(1);  // [T, 1, d]
  const torch::Tensor sin = emb.sin().to(dtype_).unsqueeze(1);

  for (int l = 0; l < cfg_.shape.num_layers; ++l) {
    const Layer& L = layers_[size_t(l)];
    x = x + attention(l, rms_norm(x, L.input_norm), start, cache, observer, decode_attention,
                      cos, sin);
    const torch::Tensor h = rms_norm(x, L.post_norm);
    x = x + F::linear(torch::silu(F::linear(h, L.gate)) * F::linear(h, L.up), L.down);
  }
  cache.size_ = start + count;

  if (logits == LogitsMode::None) return torch::Tensor();
  if (logits == LogitsMode::Last) x = x.narrow(0, count - 1, 1);
  return F::linear(rms_norm(x, final_norm_), lm_head_).to(torch::kFloat32);
}

torch::Tensor LlamaModel::prefill(const std::vector<int32_t>& ids, KvCache& cache,
                                  const PrefillOptions& options, LlamaObserver* observer) const {
  if (options.chunk <= 0)
    throw std::invalid_argument("PrefillOptions.chunk must be > 0, got " +
                                std::to_string(options.chunk));
  if (ids.empty()) throw std::invalid_argument("LlamaModel::prefill: no tokens");
  const int64_t n = int64_t(ids.size());
  cache.reserve(cache.size() + n);
  std::vector<torch::Tensor> parts;
  torch::Tensor last;
  for (int64_t begin = 0; begin < n; begin += options.chunk) {
    const int64_t count = std::min(options.chunk, n - begin);
    const bool final_chunk = begin + count == n;
    const LogitsMode mode = options.logits == LogitsMode::All                   ? LogitsMode::All
                            : options.logits == LogitsMode::Last && final_chunk ? LogitsMode::Last
                                                                                : LogitsMode::None;
    torch::Tensor out = forward(ids.data() + begin, count, cache, observer, mode);
    if (mode == LogitsMode::All) parts.push_back(out);
    if (mode == LogitsMode::Last) last = out;
  }
  if (options.logits == LogitsMode::All) return parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
  return last;
}

torch::Tensor LlamaModel::decode(int32_t id, KvCache& cache, LlamaObserver* observer,
                                 DecodeAttention* attention) const {
  return forward(&id, 1, cache, observer, LogitsMode::All, attention).squeeze(0);
}

RunnerPlacement parse_placement(const std::string& device, const std::string& dtype) {
  if (device != "cpu" && device != "cuda" && device != "auto")
    throw std::invalid_argument("--device must be cpu, cuda or auto, got '" + device + "'");
  if (device == "cuda" && !torch::cuda::is_available())
    throw std::invalid_argument("--device cuda: libtorch sees no CUDA device");
  const bool cuda = device == "cuda" || (device == "auto" && torch::cuda::is_available());
  RunnerPlacement p;
  p.device = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  if (dtype == "bf16" || (dtype == "auto" && cuda)) {
    p.dtype = torch::kBFloat16;
  } else if (dtype == "fp32" || dtype == "auto") {
    p.dtype = torch::kFloat32;
  } else {
    throw std::invalid_argument("--dtype must be bf16, fp32 or auto, got '" + dtype + "'");
  }
  return p;
}

torch::Tensor next_token_nll(const torch::Tensor& logits, const std::vector<int32_t>& ids) {
  const int64_t T = int64_t(ids.size());
  if (logits.dim() != 2 || logits.size(0) != T)
    throw std::invalid_argument("next_token_nll: logits must be [" + std::to_string(T) +
                                ", vocab] for " + std::to_string(T) + " ids");
  if (T < 2) return torch::empty({0}, torch::kFloat64);
  const torch::Tensor lp =
      torch::log_softmax(logits.narrow(0, 0, T - 1).to(torch::kCPU, torch::kFloat64), -1);
  const torch::Tensor next =
      torch::from_blob(const_cast<int32_t*>(ids.data()) + 1, {T - 1}, torch::kInt32)
          .to(torch::kInt64);
  if (next.min().item<int64_t>() < 0 || next.max().item<int64_t>() >= logits.size(1))
    throw std::invalid_argument("next_token_nll: an id is outside the vocabulary of the logits");
  return -lp.gather(1, next.unsqueeze(1)).squeeze(1);
}

}  // namespace kvs
