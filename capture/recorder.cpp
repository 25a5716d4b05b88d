#include "capture/recorder.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace kvs {
namespace {

// Copies a tensor to a contiguous CPU bf16 buffer laid out as its row-major shape.
std::vector<bf16> to_bf16(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kCPU, torch::kBFloat16).contiguous();
  std::vector<bf16> out(size_t(c.numel()));
  std::memcpy(out.data(), c.data_ptr(), out.size() * sizeof(bf16));
  return out;
}

class Recorder : public LlamaObserver {
 public:
  Recorder(CaptureWriter& writer, const std::vector<int>& layers, int width)
      : writer_(writer), layers_(layers), width_(width) {
    const CaptureMeta& m = writer.meta();
    if (!m.all_heads()) {
      // Captured KV heads and the query heads of their groups, as index tensors.
      std::vector<int64_t> kv(m.kv_heads.begin(), m.kv_heads.end()), q;
      for (int h : m.kv_heads)
        for (int j = 0; j < m.shape.group_size(); ++j) q.push_back(int64_t(h) * m.shape.group_size() + j);
      kv_index_ = torch::tensor(kv, torch::kInt64);
      q_index_ = torch::tensor(q, torch::kInt64);
    }
  }

  void on_qkv(int layer, int64_t start, const torch::Tensor& q_pre, const torch::Tensor& k_pre,
              const torch::Tensor& v) override {
    if (!wants(layer)) return;
    const auto q = to_bf16(heads(q_pre, q_index_, 1)), k = to_bf16(heads(k_pre, kv_index_, 1)),
               vv = to_bf16(heads(v, kv_index_, 1));
    writer_.append_qkv(layer, int(q_pre.size(0)), q.data(), k.data(), vv.data());
  }

  bool wants_attention(int layer) const override { return recording_ && wants(layer); }

  void on_attention(int layer, int64_t pos, const torch::Tensor& probs) override {
    const torch::Tensor p = heads(probs, q_index_, 0).to(torch::kCPU, torch::kFloat32).contiguous();
    const int heads = int(p.size(0)), len = int(p.size(1));
    const int nb = (width_ + kAttnBlockSize - 1) / kAttnBlockSize;
    std::vector<float> pooled(size_t(heads) * nb);
    const float* src = p.data_ptr<float>();
    for (int h = 0; h < heads; ++h)
      pool_attention_row(src + int64_t(h) * len, len, width_, pooled.data() + int64_t(h) * nb);
    writer_.append_attn_row(layer, pooled.data());
  }

  void set_recording(bool on) { recording_ = on; }

 private:
  // The captured heads along `dim` (all of them when no subset was asked for).
  static torch::Tensor heads(const torch::Tensor& t, const torch::Tensor& index, int64_t dim) {
    return index.defined() ? t.index_select(dim, index.to(t.device())) : t;
  }
  torch::Tensor kv_index_, q_index_;  // undefined: every head
  bool wants(int layer) const {
    for (int l : layers_)
      if (l == layer) return true;
    return false;
  }
  CaptureWriter& writer_;
  std::vector<int> layers_;
  int width_;
  bool recording_ = false;
};

}  // namespace

std::vector<int32_t> record_sequence(const LlamaModel& model, std::vector<int32_t> tokens,
                                     const RecordOptions& options, const std::string& source,
                                     CaptureWriter& writer, const Progress& progress) {
  const int64_t T = int64_t(tokens.size());
  if (options.decode_steps < 1 || options.decode_steps >= T)
    throw std::invalid_argument("record_sequence: decode_steps " +
                                std::to_string(options.decode_steps) + " must be in [1, " +
                                std::to_string(T - 1) + "] for a sequence of " +
                                std::to_string(T) + " tokens from " + source);
  if (T > model.shape().max_position)
    throw std::invalid_argument("record_sequence: " + std::to_string(T) + " tokens from " +
                                source + " exceed the model's max_position_embeddings " +
                                std::to_string(model.shape().max_position));
  const int64_t prefill = T - options.decode_steps;
  // Greedy tokens are only known as they are generated; the writer needs the final tokens
  // up front, so greedy runs the sequence twice: once to generate, once to record.
  if (options.greedy) {
    KvCache cache = model.new_cache(T);
    std::vector<int32_t> head(tokens.begin(), tokens.begin() + prefill);
    PrefillOptions po;
    po.chunk = options.chunk;
    po.logits = LogitsMode::Last;
    torch::Tensor logits = model.prefill(head, cache, po);
    for (int64_t p = prefill; p < T; ++p) {
      tokens[size_t(p)] = int32_t(logits.reshape({-1}).argmax().item<int64_t>());
      if (p + 1 < T) logits = model.decode(tokens[size_t(p)], cache);
    }
  }
  const std::vector<int> layers = writer.meta().layers;
  writer.begin_sequence(tokens, int(prefill), source);
  Recorder recorder(writer, layers, int(T));
  KvCache cache = model.new_cache(T);
  PrefillOptions po;
  po.chunk = options.chunk;
  po.logits = LogitsMode::None;
  for (int64_t s = 0; s < prefill; s += options.chunk) {
    const int64_t n = std::min<int64_t>(options.chunk, prefill - s);
    model.forward(tokens.data() + s, n, cache, &recorder, LogitsMode::None);
    if (progress) progress(s + n, T);
  }
  recorder.set_recording(true);
  for (int64_t p = prefill; p < T; ++p) {
    model.forward(tokens.data() + p, 1, cache, &recorder, LogitsMode::None);
    if (progress && ((p - prefill) % 16 == 15 || p + 1 == T)) progress(p + 1, T);
  }
  return tokens;
}

std::string read_text_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files as they are, too
  if (!f) throw std::runtime_error("cannot open text file " + path);
  std::string text;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) text.append(buf, size_t(n));
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string why = (n < 0 && msg) ? msg : "";
  gzclose(f);
  if (n < 0) throw std::runtime_error("reading " + path + " failed: " + why);
  return text;
}

}  // namespace kvs
