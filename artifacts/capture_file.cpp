#include "artifacts/capture_file.h"

#include <algorithm>
#include <stdexcept>

#include "artifacts/model_io.h"

namespace kvs {
namespace {

const char* kKind = "kvsparse-capture";

std::string seq_name(int i) { return "seq" + std::to_string(i); }
std::string layer_name(int l) { return "layer" + std::to_string(l); }
int num_blocks(int tokens) { return (tokens + kAttnBlockSize - 1) / kAttnBlockSize; }

}  // namespace

ModelShape CaptureMeta::captured_shape() const {
  ModelShape s = shape;
  if (!all_heads()) {
    s.num_kv_heads = int(kv_heads.size());
    s.num_q_heads = int(kv_heads.size()) * shape.group_size();
  }
  return s;
}

void pool_attention_row(const float* probs, int len, int width_tokens, float* pooled) {
  const int nb = num_blocks(width_tokens);
  std::fill(pooled, pooled + nb, 0.0f);
  for (int t = 0; t < len; ++t) {
    float& m = pooled[t / kAttnBlockSize];
    m = std::max(m, probs[t]);
  }
}

struct CaptureWriter::Impl {
  CaptureMeta meta;
  h5::AtomicWriter writer;
  int seq = -1;
  int num_tokens = 0, decode_start = 0;
  h5::Group group;
  // Per captured layer (index into meta.layers): the growing datasets and row counts.
  std::vector<h5::Dataset> q, k, v, attn;
  std::vector<int64_t> qkv_rows, attn_rows;

  Impl(const std::string& path, const CaptureMeta& m) : meta(m), writer(path) {}

  int slot(int layer) const {
    const auto it = std::find(meta.layers.begin(), meta.layers.end(), layer);
    if (it == meta.layers.end())
      throw std::invalid_argument("capture " + writer.final_path() + ": layer " +
                                  std::to_string(layer) + " is not among the captured layers");
    return int(it - meta.layers.begin());
  }

  void check_complete() const {
    if (seq < 0) return;
    for (size_t i = 0; i < meta.layers.size(); ++i) {
      const std::string where = writer.final_path() + ": " + seq_name(seq) + "/" +
                                layer_name(meta.layers[i]);
      if (qkv_rows[i] != num_tokens)
        throw std::logic_error(where + " has " + std::to_string(qkv_rows[i]) +
                               " q/k/v rows, expected " + std::to_string(num_tokens));
      if (attn_rows[i] != num_tokens - decode_start)
        throw std::logic_error(where + " has " + std::to_string(attn_rows[i]) +
                               " attention rows, expected " +
                               std::to_string(num_tokens - decode_start));
    }
  }
};

CaptureWriter::CaptureWriter(const std::string& path, const CaptureMeta& meta)
    : impl_(std::make_unique<Impl>(path, meta)) {
  meta.shape.validate();
  if (meta.layers.empty()) throw std::invalid_argument("capture " + path + ": no layers to capture");
  for (int l : meta.layers)
    if (l < 0 || l >= meta.shape.num_layers)
      throw std::invalid_argument("capture " + path + ": layer " + std::to_string(l) +
                                  " outside [0, " + std::to_string(meta.shape.num_layers) + ")");
  std::sort(impl_->meta.layers.begin(), impl_->meta.layers.end());
  std::vector<int>& heads = impl_->meta.kv_heads;
  if (heads.empty())
    for (int h = 0; h < meta.shape.num_kv_heads; ++h) heads.push_back(h);
  std::sort(heads.begin(), heads.end());
  for (size_t i = 0; i < heads.size(); ++i)
    if (heads[i] < 0 || heads[i] >= meta.shape.num_kv_heads || (i > 0 && heads[i] == heads[i - 1]))
      throw std::invalid_argument("capture " + path + ": kv head " + std::to_string(heads[i]) +
                                  " is out of [0, " + std::to_string(meta.shape.num_kv_heads) +
                                  ") or repeated");
  const h5::Group root = impl_->writer.root();
  root.set_attr_int("format_version", kCaptureFormatVersion);
  root.set_attr_string("kind", kKind);
  write_model_shape(root, meta.shape);
  root.set_attr_string("dtype", meta.dtype);
  root.set_attr_string("tokenizer", meta.tokenizer);
  root.set_attr_int("vocab_size", meta.vocab_size);
  root.set_attr_ints("layers", std::vector<int64_t>(impl_->meta.layers.begin(), impl_->meta.layers.end()));
  root.set_attr_ints("kv_heads", std::vector<int64_t>(heads.begin(), heads.end()));
}

CaptureWriter::~CaptureWriter() = default;

const CaptureMeta& CaptureWriter::meta() const { return impl_->meta; }

void CaptureWriter::begin_sequence(const std::vector<int32_t>& tokens, int decode_start,
                                   const std::string& source) {
  Impl& m = *impl_;
  m.check_complete();
  const int T = int(tokens.size());
  if (T == 0 || decode_start < 1 || decode_start > T)
    throw std::invalid_argument("capture: decode_start " + std::to_string(decode_start) +
                                " outside [1, " + std::to_string(T) + "] for " +
                                std::to_string(T) + " tokens");
  m.seq += 1;
  m.num_tokens = T;
  m.decode_start = decode_start;
  m.group = m.writer.root().create_group(seq_name(m.seq));
  h5::write_dataset(m.group, "tokens", tokens, {T});
  m.group.set_attr_int("decode_start", decode_start);
  m.group.set_attr_string("source", source);
  const ModelShape s = m.meta.captured_shape();
  const size_t n = m.meta.layers.size();
  m.q.assign(n, {});
  m.k.assign(n, {});
  m.v.assign(n, {});
  m.attn.assign(n, {});
  m.qkv_rows.assign(n, 0);
  m.attn_rows.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const h5::Group g = m.group.create_group(layer_name(m.meta.layers[i]));
    m.q[i] = h5::create_appendable<bf16>(g, "q_pre", {s.num_q_heads, s.head_dim});
    m.k[i] = h5::create_appendable<bf16>(g, "k_pre", {s.num_kv_heads, s.head_dim});
    m.v[i] = h5::create_appendable<bf16>(g, "v", {s.num_kv_heads, s.head_dim});
    m.attn[i] = h5::create_appendable<float>(g, "attn_blocks", {s.num_q_heads, num_blocks(T)});
  }
}

void CaptureWriter::append_qkv(int layer, int n, const bf16* q_pre, const bf16* k_pre,
                               const bf16* v) {
  Impl& m = *impl_;
  if (m.seq < 0) throw std::logic_error("CaptureWriter: append_qkv before begin_sequence");
  const int i = m.slot(layer);
  if (m.qkv_rows[i] + n > m.num_tokens)
    throw std::logic_error("CaptureWriter: layer " + std::to_string(layer) + " would get " +
                           std::to_string(m.qkv_rows[i] + n) + " rows for " +
                           std::to_string(m.num_tokens) + " tokens");
  m.q[i].append(q_pre, n);
  m.k[i].append(k_pre, n);
  m.v[i].append(v, n);
  m.qkv_rows[i] += n;
}

void CaptureWriter::append_attn_row(int layer, const float* pooled) {
  Impl& m = *impl_;
  if (m.seq < 0) throw std::logic_error("CaptureWriter: append_attn_row before begin_sequence");
  const int i = m.slot(layer);
  if (m.attn_rows[i] + 1 > m.num_tokens - m.decode_start)
    throw std::logic_error("CaptureWriter: more attention rows than decode steps for layer " +
                           std::to_string(layer));
  m.attn[i].append(pooled, 1);
  m.attn_rows[i] += 1;
}

void CaptureWriter::commit() {
  Impl& m = *impl_;
  if (m.seq < 0) throw std::logic_error("CaptureWriter: no sequence written");
  m.check_complete();
  m.writer.root().set_attr_int("num_sequences", m.seq + 1);
  m.group = h5::Group();
  m.q.clear();
  m.k.clear();
  m.v.clear();
  m.attn.clear();
  m.writer.commit();
}

CaptureFile CaptureFile::open(const std::string& path) {
  CaptureFile c;
  c.path_ = path;
  c.file_ = h5::File::open_read(path);
  const h5::Group root = c.file_.root();
  if (!root.has_attr("kind") || root.attr_string("kind") != kKind)
    throw h5::Error(path + ": not a kvsparse capture file (root attribute kind != '" +
                    std::string(kKind) + "')");
  const int64_t version = root.attr_int("format_version");
  if (version != kCaptureFormatVersion)
    throw h5::Error(path + ": capture format_version " + std::to_string(version) +
                    ", this build reads version " + std::to_string(kCaptureFormatVersion));
  c.meta_.shape = read_model_shape(root);
  c.meta_.dtype = root.attr_string("dtype");
  c.meta_.tokenizer = root.attr_string("tokenizer");
  c.meta_.vocab_size = int(root.attr_int("vocab_size"));
  for (int64_t l : root.attr_ints("layers")) c.meta_.layers.push_back(int(l));
  // Captures written before head subsets existed hold every head.
  if (root.has_attr("kv_heads")) {
    for (int64_t h : root.attr_ints("kv_heads")) c.meta_.kv_heads.push_back(int(h));
  } else {
    for (int h = 0; h < c.meta_.shape.num_kv_heads; ++h) c.meta_.kv_heads.push_back(h);
  }
  for (size_t i = 0; i < c.meta_.kv_heads.size(); ++i)
    if (c.meta_.kv_heads[i] < 0 || c.meta_.kv_heads[i] >= c.meta_.shape.num_kv_heads ||
        (i > 0 && c.meta_.kv_heads[i] <= c.meta_.kv_heads[i - 1]))
      throw h5::Error(path + ": kv_heads attribute is not an ascending list of heads in [0, " +
                      std::to_string(c.meta_.shape.num_kv_heads) + ")");
  if (c.meta_.kv_heads.empty()) throw h5::Error(path + ": kv_heads attribute is empty");
  const int64_t n = root.attr_int("num_sequences");
  for (int64_t i = 0; i < n; ++i) {
    CaptureSequence s;
    s.name = seq_name(int(i));
    const h5::Group g = root.open_group(s.name);
    s.num_tokens = int(h5::open_dataset(g, "tokens", h5::DType::I32, {-1}).shape()[0]);
    s.decode_start = int(g.attr_int("decode_start"));
    if (s.decode_start < 1 || s.decode_start > s.num_tokens)
      throw h5::Error(g.describe() + ": decode_start " + std::to_string(s.decode_start) +
                      " outside [1, " + std::to_string(s.num_tokens) + "]");
    c.sequences_.push_back(s);
  }
  // Validate every array's shape up front, so a damaged file fails at open, not mid-run.
  for (int i = 0; i < int(n); ++i)
    for (int l : c.meta_.layers) {
      const ModelShape m = c.meta_.captured_shape();
      const int T = c.sequences_[i].num_tokens, S = c.sequences_[i].num_steps();
      c.dataset(i, l, "q_pre", h5::DType::BF16, {T, m.num_q_heads, m.head_dim});
      c.dataset(i, l, "k_pre", h5::DType::BF16, {T, m.num_kv_heads, m.head_dim});
      c.dataset(i, l, "v", h5::DType::BF16, {T, m.num_kv_heads, m.head_dim});
      c.dataset(i, l, "attn_blocks", h5::DType::F32, {S, m.num_q_heads, num_blocks(T)});
    }
  return c;
}

bool CaptureFile::has_layer(int layer) const {
  return std::find(meta_.layers.begin(), meta_.layers.end(), layer) != meta_.layers.end();
}

h5::Dataset CaptureFile::dataset(int seq, int layer, const char* name, h5::DType dtype,
                                 const h5::Shape& shape) const {
  if (seq < 0 || seq >= int(sequences_.size()))
    throw std::out_of_range(path_ + ": sequence " + std::to_string(seq) + " outside [0, " +
                            std::to_string(sequences_.size()) + ")");
  if (!has_layer(layer))
    throw std::out_of_range(path_ + ": layer " + std::to_string(layer) + " was not captured");
  const h5::Group g = file_.root().open_group(seq_name(seq) + "/" + layer_name(layer));
  return h5::open_dataset(g, name, dtype, shape);
}

std::vector<int32_t> CaptureFile::tokens(int seq) const {
  return h5::open_dataset(file_.root(), seq_name(seq) + "/tokens", h5::DType::I32, {-1})
      .read<int32_t>();
}

std::vector<bf16> CaptureFile::q_pre(int seq, int layer) const {
  return dataset(seq, layer, "q_pre", h5::DType::BF16, {-1, -1, -1}).read<bf16>();
}
std::vector<bf16> CaptureFile::k_pre(int seq, int layer) const {
  return dataset(seq, layer, "k_pre", h5::DType::BF16, {-1, -1, -1}).read<bf16>();
}
std::vector<bf16> CaptureFile::v(int seq, int layer) const {
  return dataset(seq, layer, "v", h5::DType::BF16, {-1, -1, -1}).read<bf16>();
}
std::vector<float> CaptureFile::attn_blocks(int seq, int layer) const {
  return dataset(seq, layer, "attn_blocks", h5::DType::F32, {-1, -1, -1}).read<float>();
}

}  // namespace kvs
