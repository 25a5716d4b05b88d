// MagicPIG on the CPU: projection, centring, hashing, tables, the production sampled
// attention (vectorised loops in magicpig_isa_*.cpp) and the fp64 reference.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/dense/dense_decode.h"
#include "kernels/magicpig/magicpig.h"
#include "kernels/magicpig/magicpig_isa.h"
#include "kernels/magicpig/magicpig_math.h"

namespace kvs::kernels::magicpig {
namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1): 53 random bits, never 0 (Box-Muller takes its log).
double uniform_open(uint64_t& s) { return (double(splitmix64(s) >> 11) + 0.5) * 0x1.0p-53; }

void check_params(const Params& p, const char* who) {
  if (p.bits < 1 || p.bits > kMaxBits || p.tables < 2)
    throw std::invalid_argument(std::string(who) + ": K (bits) must be in [1, " +
                                std::to_string(kMaxBits) + "] and L (tables) >= 2, got K " +
                                std::to_string(p.bits) + ", L " + std::to_string(p.tables));
  if (!(p.epsilon > 0.0))
    throw std::invalid_argument(std::string(who) + ": epsilon must be > 0, got " +
                                std::to_string(p.epsilon));
}

const isa::Kernels& kernels_for(CpuIsa isa) {
#if defined(__x86_64__)
  if (isa == CpuIsa::Avx512) return isa::kAvx512;
  if (isa == CpuIsa::Avx2) return isa::kAvx2;
#endif
  return isa::kPortable;
}

}  // namespace

Projection make_projection(int head_dim, int bits, int tables, uint64_t seed) {
  if (head_dim < 1 || bits < 1 || bits > kMaxBits || tables < 1)
    throw std::invalid_argument("make_projection: head_dim " + std::to_string(head_dim) + ", K " +
                                std::to_string(bits) + ", L " + std::to_string(tables) +
                                " (need head_dim >= 1, 1 <= K <= " + std::to_string(kMaxBits) +
                                ", L >= 1)");
  Projection p;
  p.head_dim = head_dim;
  p.bits = bits;
  p.tables = tables;
  p.seed = seed;
  p.w.resize(size_t(head_dim) * p.columns());
  uint64_t s = seed;
  for (size_t i = 0; i < p.w.size(); i += 2) {
    const double r = std::sqrt(-2.0 * std::log(uniform_open(s)));
    const double t = 2.0 * 3.14159265358979323846 * uniform_open(s);
    p.w[i] = float(r * std::cos(t));
    if (i + 1 < p.w.size()) p.w[i + 1] = float(r * std::sin(t));
  }
  return p;
}

void check_projection(const Projection& p, int head_dim, int bits, int tables) {
  if (p.head_dim != head_dim || p.bits != bits || p.tables != tables ||
      p.w.size() != size_t(head_dim) * size_t(bits) * size_t(tables))
    throw std::invalid_argument(
        "MagicPIG projection is for head_dim " + std::to_string(p.head_dim) + ", K " +
        std::to_string(p.bits) + ", L " + std::to_string(p.tables) + " with " +
        std::to_string(p.w.size()) + " values; expected head_dim " + std::to_string(head_dim) +
        ", K " + std::to_string(bits) + ", L " + std::to_string(tables) + " (" +
        std::to_string(size_t(head_dim) * bits * tables) + " values)");
}

void centre_cpu(const PagedKV& kv, int b, int h, int start, int n, float* centre) {
  const int d = kv.head_dim;
  std::vector<double> total(static_cast<size_t>(d), 0.0), chunk(static_cast<size_t>(d), 0.0);
  for (int c0 = 0; c0 < n; c0 += kCentreChunk) {
    std::fill(chunk.begin(), chunk.end(), 0.0);
    for (int t = c0; t < std::min(n, c0 + kCentreChunk); ++t) {
      const bf16* k = kv.k + kv.offset(b, start + t, h);
      for (int i = 0; i < d; ++i) chunk[size_t(i)] += double(bf16_to_float(k[i]));
    }
    for (int i = 0; i < d; ++i) total[size_t(i)] += chunk[size_t(i)];
  }
  for (int i = 0; i < d; ++i) centre[i] = n > 0 ? float(total[size_t(i)] / n) : 0.f;
}

float centred_norm_cpu(const bf16* row, const float* centre, int d) {
  double s = 0.0;
  for (int i = 0; i < d; ++i) {
    const float x = bf16_to_float(row[i]) - centre[i];
    s += double(x) * double(x);
  }
  return float(std::sqrt(s));
}

void hash_keys_cpu(const PagedKV& kv, int b, int h, int start, int n, const float* centre,
                   const Projection& proj, uint16_t* codes, int64_t stride, float* norms) {
  const int d = kv.head_dim;
  check_projection(proj, d, proj.bits, proj.tables);
  std::vector<float> x(static_cast<size_t>(d));
  for (int t = 0; t < n; ++t) {
    const bf16* k = kv.k + kv.offset(b, start + t, h);
    for (int i = 0; i < d; ++i) x[size_t(i)] = bf16_to_float(k[i]) - centre[i];
    for (int l = 0; l < proj.tables; ++l)
      codes[l * stride + t] =
          uint16_t(simhash_code(x.data(), proj.w.data(), d, proj.bits, proj.tables, l));
    if (norms) norms[t] = centred_norm_cpu(k, centre, d);
  }
}

void hash_query_cpu(const float* q, const Projection& proj, uint16_t* codes) {
  for (int l = 0; l < proj.tables; ++l)
    codes[l] = uint16_t(simhash_code(q, proj.w.data(), proj.head_dim, proj.bits, proj.tables, l));
}

void build_table_cpu(const uint16_t* codes, int n, int bits, int32_t* offsets, int32_t* ids) {
  const int buckets = 1 << bits;
  std::fill(offsets, offsets + buckets + 1, 0);
  for (int i = 0; i < n; ++i) {
    if (codes[i] >= buckets)
      throw std::invalid_argument("build_table_cpu: code " + std::to_string(codes[i]) + " of key " +
                                  std::to_string(i) + " has more than K = " + std::to_string(bits) +
                                  " bits");
    ++offsets[codes[i] + 1];
  }
  for (int x = 0; x < buckets; ++x) offsets[x + 1] += offsets[x];
  // offsets[x] is the write cursor of bucket x; afterwards it is bucket x + 1's start,
  // so one shift restores the starts.
  for (int i = 0; i < n; ++i) ids[offsets[codes[i]]++] = i;
  for (int x = buckets; x > 0; --x) offsets[x] = offsets[x - 1];
  offsets[0] = 0;
}

const char* to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Auto:
      return "auto";
    case CpuIsa::Portable:
      return "portable";
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
  }
  return "?";
}

bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Auto:
    case CpuIsa::Portable:
      return true;
#if defined(__x86_64__)
    case CpuIsa::Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::Avx512:
      return __builtin_cpu_supports("avx512f");
#else
    default:
      return false;
#endif
  }
  return false;
}

CpuIsa resolve_isa(CpuIsa wanted, int head_dim) {
  if (wanted == CpuIsa::Auto) {
    for (CpuIsa c : {CpuIsa::Avx512, CpuIsa::Avx2})
      if (cpu_supports(c) && head_dim % kernels_for(c).lanes == 0) return c;
    return CpuIsa::Portable;
  }
  if (!cpu_supports(wanted))
    throw std::invalid_argument(std::string("MagicPIG CPU path: this CPU lacks ") +
                                to_string(wanted) + " (use auto or portable)");
  if (head_dim % kernels_for(wanted).lanes != 0)
    throw std::invalid_argument(
        std::string("MagicPIG CPU path: ") + to_string(wanted) + " needs head_dim a multiple of " +
        std::to_string(kernels_for(wanted).lanes) + ", got " + std::to_string(head_dim));
  return wanted;
}

void HeadScratch::reserve(int n) {
  if (int(counters_.size()) < n) counters_.resize(size_t(n), 0);  // new counters are zero
  if (int(scores_.size()) < n) scores_.resize(size_t(n));
}

int retrieve_cpu(const uint16_t* q_codes, const HeadTables& t, const Params& p, uint8_t* counters,
                 int32_t* out, int64_t* scanned) {
  const int64_t per_table = p.offsets_per_table();
  int count = 0;
  int64_t read = 0;
  for (int l = 0; l < p.tables; ++l) {
    const int32_t* off = t.offsets + l * per_table;
    const int32_t* ids = t.ids + l * t.table_stride;
    const int32_t e = off[q_codes[l] + 1];
    read += e - off[q_codes[l]];
    for (int32_t j = off[q_codes[l]]; j < e; ++j) {
      const int32_t id = ids[j];
      const uint8_t c = counters[id];
      // Saturates at 2: a uint8 that kept counting would wrap at 256 hits (L can exceed
      // 255) and emit the key again at 258.
      if (c < 2) {
        counters[id] = uint8_t(c + 1);
        if (c == 1) out[count++] = id;
      }
    }
  }
  // Walking the same buckets again to clear is cheaper than clearing all n counters:
  // the buckets hold ~L n / 2^K entries.
  for (int l = 0; l < p.tables; ++l) {
    const int32_t* off = t.offsets + l * per_table;
    const int32_t* ids = t.ids + l * t.table_stride;
    for (int32_t j = off[q_codes[l]]; j < off[q_codes[l] + 1]; ++j) counters[ids[j]] = 0;
  }
  if (scanned) *scanned = read;
  return count;
}

HeadResult sampled_attention_cpu(const float* q, const uint16_t* q_codes, const HeadTables& t,
                                 const Params& p, float scale, CpuIsa isa, HeadScratch& scratch,
                                 int32_t* candidates, float* o, float* lse) {
  const int d = t.head_dim;
  const isa::Kernels& kern = kernels_for(isa);
  scratch.reserve(t.n);
  HeadResult r;
  r.candidates = retrieve_cpu(q_codes, t, p, scratch.counters(), candidates, &r.scanned);
  std::fill(o, o + d, 0.f);
  const int n = r.candidates;
  if (n == 0) {
    *lse = -std::numeric_limits<float>::infinity();
    return r;
  }
  float qn2 = 0.f, qc = 0.f;
  for (int i = 0; i < d; ++i) {
    qn2 += q[i] * q[i];
    qc += q[i] * t.centre[i];
  }
  const float qn = std::sqrt(qn2);
  float* s = scratch.scores();
  const auto* k_words = reinterpret_cast<const uint16_t*>(t.k);
  const auto* v_words = reinterpret_cast<const uint16_t*>(t.v);
  kern.gather_dot(q, k_words, candidates, n, d, s);
  // The logits use the raw keys (what the dense part and the exact softmax see); the
  // angle for u uses the centred key that was hashed: q.(k - c) = q.k - q.c.
  // Softmax weights exp(s scale - log(u + eps) - m) are taken as exp(s scale - m) / (u + eps)
  // with m the largest unshifted logit: one exponential and no logarithm per candidate
  // (the transcendental functions of u are most of this loop's time). The weights stay
  // below 1 / eps, which the config keeps finite.
  const float eps = float(p.epsilon);
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, s[i] * scale);
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    const float denom = qn * t.norms[candidates[i]];
    const float cosv = denom > 0.f ? (s[i] - qc) / denom : 0.f;
    const float u = sampling_probability(cosv, p.bits, p.tables);
    s[i] = std::exp(s[i] * scale - m) / (u + eps);
    sum += s[i];
  }
  kern.gather_axpy(v_words, candidates, s, n, d, o);
  const float inv = 1.f / sum;
  for (int i = 0; i < d; ++i) o[i] *= inv;
  *lse = m + std::log(sum);
  return r;
}

std::vector<int32_t> sampled_attention_reference(const float* q, const uint16_t* q_codes,
                                                 const PagedKV& kv, int b, int h, int start, int n,
                                                 const uint16_t* codes, int64_t code_stride,
                                                 const float* norms, const float* centre,
                                                 const Params& p, double scale, double* o,
                                                 double* lse) {
  check_params(p, "sampled_attention_reference");
  const int d = kv.head_dim;
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    int hits = 0;
    for (int l = 0; l < p.tables; ++l) hits += codes[l * code_stride + i] == q_codes[l];
    if (hits >= 2) ids.push_back(i);
  }
  double qn2 = 0.0, qc = 0.0;
  for (int i = 0; i < d; ++i) {
    qn2 += double(q[i]) * q[i];
    qc += double(q[i]) * centre[i];
  }
  std::vector<int32_t> tokens(ids.size());
  std::vector<double> shift(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    tokens[j] = start + ids[j];
    const bf16* k = kv.k + kv.offset(b, tokens[j], h);
    double dot = 0.0;
    for (int i = 0; i < d; ++i) dot += double(q[i]) * double(bf16_to_float(k[i]));
    const double denom = std::sqrt(qn2) * double(norms[ids[j]]);
    const double u = sampling_probability(denom > 0.0 ? (dot - qc) / denom : 0.0, p.bits, p.tables);
    shift[j] = -std::log(u + p.epsilon);
  }
  if (tokens.empty()) {  // a null token list would mean "every token" to attend_cpu
    std::fill(o, o + d, 0.0);
    *lse = -std::numeric_limits<double>::infinity();
    return ids;
  }
  attend_cpu_shifted(q, kv, b, h, tokens.data(), int(tokens.size()), scale, shift.data(), o, lse);
  return ids;
}

}  // namespace kvs::kernels::magicpig
