#include "artifacts/model_shape.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace kvs {

const char* to_string(RopeType type) {
  switch (type) {
    case RopeType::Default: return "default";
    case RopeType::Linear: return "linear";
    case RopeType::Llama3: return "llama3";
  }
  return "?";
}

RopeType rope_type_from_string(const std::string& name) {
  if (name == "default" || name.empty()) return RopeType::Default;
  if (name == "linear") return RopeType::Linear;
  if (name == "llama3") return RopeType::Llama3;
  throw std::invalid_argument("unsupported RoPE type '" + name +
                              "' (supported: default, linear, llama3)");
}

double ModelShape::scale() const {
  return softmax_scale > 0.0 ? softmax_scale : 1.0 / std::sqrt(double(head_dim));
}

void ModelShape::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("model shape: " + what); };
  if (num_layers <= 0) fail("num_layers must be > 0, got " + std::to_string(num_layers));
  if (num_q_heads <= 0) fail("num_q_heads must be > 0, got " + std::to_string(num_q_heads));
  if (num_kv_heads <= 0) fail("num_kv_heads must be > 0, got " + std::to_string(num_kv_heads));
  if (num_q_heads % num_kv_heads != 0)
    fail("num_q_heads (" + std::to_string(num_q_heads) + ") must be a multiple of num_kv_heads (" +
         std::to_string(num_kv_heads) + ")");
  if (head_dim <= 0 || head_dim % 2 != 0)
    fail("head_dim must be even and > 0, got " + std::to_string(head_dim));
  if (max_position <= 0) fail("max_position must be > 0, got " + std::to_string(max_position));
  if (!(rope.theta > 0.0)) fail("rope theta must be > 0");
  if (rope.type != RopeType::Default && !(rope.factor > 0.0)) fail("rope scaling factor must be > 0");
  if (rope.type == RopeType::Llama3) {
    if (!(rope.high_freq_factor > rope.low_freq_factor))
      fail("llama3 rope: high_freq_factor must exceed low_freq_factor");
    if (rope.original_max_position <= 0) fail("llama3 rope: original_max_position must be > 0");
  }
  if (softmax_scale < 0.0 || !std::isfinite(softmax_scale)) fail("softmax_scale must be >= 0");
}

static std::string num(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

std::string ModelShape::canonical() const {
  std::ostringstream s;
  s << "layers=" << num_layers << ";q_heads=" << num_q_heads << ";kv_heads=" << num_kv_heads
    << ";head_dim=" << head_dim << ";max_position=" << max_position
    << ";rope=" << to_string(rope.type) << ";theta=" << num(rope.theta);
  if (rope.type != RopeType::Default) s << ";factor=" << num(rope.factor);
  if (rope.type == RopeType::Llama3)
    s << ";low_freq_factor=" << num(rope.low_freq_factor)
      << ";high_freq_factor=" << num(rope.high_freq_factor)
      << ";original_max_position=" << rope.original_max_position;
  s << ";scale=" << num(scale()) << ";weights=" << weights_hash;
  return s.str();
}

uint64_t hash64(const void* data, size_t bytes, uint64_t h) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::string hash_hex(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string ModelShape::fingerprint() const {
  const std::string c = canonical();
  return hash_hex(hash64(c.data(), c.size()));
}

std::string ModelShape::diff(const ModelShape& o) const {
  // Compare field by field through the canonical text, so the two can never disagree.
  auto split = [](const std::string& s) {
    std::vector<std::string> parts;
    std::stringstream ss(s);
    for (std::string p; std::getline(ss, p, ';');) parts.push_back(p);
    return parts;
  };
  const auto a = split(canonical()), b = split(o.canonical());
  std::string out;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "", y = i < b.size() ? b[i] : "";
    if (x != y) out += "  " + (x.empty() ? "(none)" : x) + " vs " + (y.empty() ? "(none)" : y) + "\n";
  }
  return out;
}

std::vector<float> rope_inv_freq(const RopeParams& rope, int head_dim) {
  // fp32 throughout, in the order transformers computes it, so that angles match its RoPE.
  const int half = head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    const float e = float(2 * i) / float(head_dim);
    inv[i] = 1.0f / std::pow(float(rope.theta), e);
  }
  if (rope.type == RopeType::Linear) {
    for (float& f : inv) f = f / float(rope.factor);
  } else if (rope.type == RopeType::Llama3) {
    const float pi = 3.14159265358979323846f;
    const float factor = float(rope.factor);
    const float lo = float(rope.low_freq_factor), hi = float(rope.high_freq_factor);
    const float old_len = float(rope.original_max_position);
    const float low_freq_wavelen = old_len / lo, high_freq_wavelen = old_len / hi;
    for (float& f : inv) {
      const float wavelen = 2.0f * pi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / factor;  // long wavelengths: fully interpolated
      } else if (wavelen >= high_freq_wavelen) {
        const float smooth = (old_len / wavelen - lo) / (hi - lo);  // blend in between
        f = (1.0f - smooth) * f / factor + smooth * f;
      }  // short wavelengths: unchanged
    }
  }
  return inv;
}

}  // namespace kvs
