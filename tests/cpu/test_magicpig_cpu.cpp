// MagicPIG on the CPU: the hash against its closed form, the tables and the >= 2 rule, the
// production CPU path (every ISA this CPU has) against the fp64 reference, the estimator's
// bias over hyperplane seeds, the exact merge and the edge cases through the engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "artifacts/bundle.h"
#include "artifacts/h5.h"
#include "h5_test_support.h"
#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/magicpig/magicpig.h"
#include "kernels/magicpig/magicpig_math.h"
#include "runtime/engine.h"
#include "runtime/magicpig_engine.h"

namespace kvs {
namespace {

namespace mp = kernels::magicpig;

// Contiguous host KV of `batch` sequences (one page each, page_size = capacity).
struct HostKV {
  int batch, cap, hkv, d;
  std::vector<bf16> k, v;
  std::vector<int32_t> table, lens;
  HostKV(int batch_, int cap_, int hkv_, int d_)
      : batch(batch_),
        cap(cap_),
        hkv(hkv_),
        d(d_),
        k(size_t(batch_) * cap_ * hkv_ * d_),
        v(k.size()),
        table(size_t(batch_)),
        lens(size_t(batch_), cap_) {
    std::iota(table.begin(), table.end(), 0);
  }
  PagedKV view() const {
    PagedKV kv;
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.seq_lens = lens.data();
    kv.batch = batch;
    kv.num_pages = batch;
    kv.page_size = cap;
    kv.num_kv_heads = hkv;
    kv.head_dim = d;
    kv.max_pages_per_seq = 1;
    return kv;
  }
  bf16* key(int b, int t, int h) { return k.data() + view().offset(b, t, h); }
  bf16* value(int b, int t, int h) { return v.data() + view().offset(b, t, h); }
};

// Keys with the geometry of spec 2.6: a common offset (the mean the centring removes), a
// sink key opposite to it, a few "topic" directions; values random.
void fill_structured(HostKV& kv, std::mt19937_64& rng) {
  std::normal_distribution<float> n01(0.f, 1.f);
  const int d = kv.d;
  for (int h = 0; h < kv.hkv; ++h) {
    std::vector<float> mean(static_cast<size_t>(d)), topics(static_cast<size_t>(4 * d));
    for (float& x : mean) x = 2.f * n01(rng);
    for (float& x : topics) x = 1.5f * n01(rng);
    for (int b = 0; b < kv.batch; ++b)
      for (int t = 0; t < kv.cap; ++t) {
        const int topic = int(rng() % 4);
        for (int i = 0; i < d; ++i) {
          float x = t == 0 ? -3.f * mean[size_t(i)]
                           : mean[size_t(i)] + topics[size_t(topic * d + i)] + 0.7f * n01(rng);
          kv.key(b, t, h)[i] = float_to_bf16(x);
          kv.value(b, t, h)[i] = float_to_bf16(n01(rng));
        }
      }
  }
}

std::vector<float> bf16_row(const bf16* x, int d) {
  std::vector<float> f(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) f[size_t(i)] = bf16_to_float(x[i]);
  return f;
}

// ---- hashing and the closed form --------------------------------------------------------

// Two unit vectors at angle theta in R^d.
void pair_at(double theta, int d, std::mt19937_64& rng, std::vector<float>* x,
             std::vector<float>* y) {
  std::normal_distribution<double> n01;
  std::vector<double> a(static_cast<size_t>(d)), b(static_cast<size_t>(d));
  for (double& v : a) v = n01(rng);
  for (double& v : b) v = n01(rng);
  const double na = std::sqrt(std::inner_product(a.begin(), a.end(), a.begin(), 0.0));
  for (double& v : a) v /= na;
  const double ab = std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
  for (int i = 0; i < d; ++i) b[size_t(i)] -= ab * a[size_t(i)];
  const double nb = std::sqrt(std::inner_product(b.begin(), b.end(), b.begin(), 0.0));
  x->resize(size_t(d));
  y->resize(size_t(d));
  for (int i = 0; i < d; ++i) {
    (*x)[size_t(i)] = float(a[size_t(i)]);
    (*y)[size_t(i)] = float(std::cos(theta) * a[size_t(i)] + std::sin(theta) * b[size_t(i)] / nb);
  }
}

TEST(MagicPigHash, CollisionRatesMatchTheClosedForm) {
  // Fixed pairs, fresh hyperplanes per trial. Bounds are 5 binomial standard deviations.
  const int d = 32, K = 3, L = 8, trials = 20000;
  std::mt19937_64 rng(20240607);
  for (double theta : {0.3, 0.9, 1.5708, 2.4}) {
    std::vector<float> x, y;
    pair_at(theta, d, rng, &x, &y);
    const double cosv = std::cos(theta);
    int64_t bits_same = 0, table_same = 0, two_tables = 0;
    std::vector<uint16_t> cx(L), cy(L);
    for (int t = 0; t < trials; ++t) {
      const mp::Projection p = mp::make_projection(d, K, L, 1000003ull * t + 17);
      mp::hash_query_cpu(x.data(), p, cx.data());
      mp::hash_query_cpu(y.data(), p, cy.data());
      int hits = 0;
      for (int l = 0; l < L; ++l) {
        bits_same += K - __builtin_popcount(unsigned(cx[size_t(l)] ^ cy[size_t(l)]));
        hits += cx[size_t(l)] == cy[size_t(l)];
      }
      table_same += cx[0] == cy[0];
      two_tables += hits >= 2;
    }
    auto check = [&](const char* what, double rate, double expect, double samples) {
      const double sigma = std::sqrt(std::max(expect * (1 - expect), 1e-12) / samples);
      EXPECT_NEAR(rate, expect, 5 * sigma) << what << " at theta " << theta;
    };
    const double p = mp::bit_agreement(cosv);
    EXPECT_NEAR(p, 1 - theta / M_PI, 1e-12);
    check("bit agreement", double(bits_same) / (double(trials) * K * L), p, double(trials) * K * L);
    check("table collision", double(table_same) / trials, std::pow(p, K), trials);
    check(">= 2 of L", double(two_tables) / trials, mp::sampling_probability(cosv, K, L), trials);
  }
}

TEST(MagicPigHash, SamplingProbabilityIsTheBinomialTail) {
  for (int K : {1, 4, 10})
    for (int L : {2, 10, 150, 300})
      for (double c : {-0.99, -0.5, 0.0, 0.3, 0.8, 0.999}) {
        const double P = std::pow(1 - std::acos(c) / M_PI, K);
        double tail = 0.0;  // sum_{j >= 2} C(L, j) P^j (1 - P)^(L - j), in logs
        for (int j = 2; j <= L; ++j)
          tail += std::exp(std::lgamma(L + 1.0) - std::lgamma(j + 1.0) - std::lgamma(L - j + 1.0) +
                           j * std::log(P) + (L - j) * std::log1p(-P));
        const double u = mp::sampling_probability(c, K, L);
        EXPECT_NEAR(u, tail, 1e-12 + 1e-9 * tail) << "K " << K << " L " << L << " cos " << c;
        EXPECT_NEAR(mp::sampling_probability(float(c), K, L), tail, 1e-5 + 1e-4 * tail);
      }
  // Far from q the tail is C(L, 2) P^2, which the naive 1 - (1-P)^L - ... loses to rounding.
  const double P = std::pow(0.2, 10);
  EXPECT_NEAR(mp::sampling_probability(std::cos(0.8 * M_PI), 10, 150) / (150 * 149 / 2 * P * P),
              1.0, 1e-3);
  EXPECT_EQ(mp::sampling_probability(1.0000001, 10, 150), 1.0);  // clamped, not NaN
}

TEST(MagicPigHash, ProjectionIsReproducibleAndGaussian) {
  const mp::Projection a = mp::make_projection(128, 10, 150, 7),
                       b = mp::make_projection(128, 10, 150, 7);
  const mp::Projection c = mp::make_projection(128, 10, 150, 8);
  EXPECT_EQ(a.w, b.w);
  EXPECT_NE(a.w, c.w);
  double s = 0, s2 = 0;
  for (float x : a.w) {
    s += x;
    s2 += double(x) * x;
  }
  const double n = double(a.w.size());
  EXPECT_NEAR(s / n, 0.0, 5 / std::sqrt(n));
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
  EXPECT_THROW(mp::check_projection(a, 64, 10, 150), std::invalid_argument);
  EXPECT_THROW(mp::make_projection(128, 17, 150, 1), std::invalid_argument);
}

TEST(MagicPigHash, ProjectionRoundTripsThroughHdf5) {
  testing_h5::TempDir dir;
  const mp::Projection p = mp::make_projection(64, 9, 120, 0xFEEDFACECAFEBEEFull);
  {
    h5::AtomicWriter w(dir.path("bundle.h5"));
    save_magicpig_projection(w.root().create_group("magicpig"), p);
    w.commit();
  }
  const h5::File f = h5::File::open_read(dir.path("bundle.h5"));
  const mp::Projection q = load_magicpig_projection(f.root().open_group("magicpig"));
  EXPECT_EQ(q.head_dim, 64);
  EXPECT_EQ(q.bits, 9);
  EXPECT_EQ(q.tables, 120);
  EXPECT_EQ(q.seed, p.seed);
  EXPECT_EQ(q.w, p.w);
}

// ---- tables and retrieval -----------------------------------------------------------------

TEST(MagicPigTables, CountingSortGroupsIdsByCode) {
  const int bits = 5, n = 1000;
  std::mt19937_64 rng(3);
  std::vector<uint16_t> codes(n);
  for (auto& c : codes) c = uint16_t(rng() % 32);
  std::vector<int32_t> off(33), ids(n);
  mp::build_table_cpu(codes.data(), n, bits, off.data(), ids.data());
  EXPECT_EQ(off[0], 0);
  EXPECT_EQ(off[32], n);
  for (int x = 0; x < 32; ++x) {
    std::vector<int32_t> want;
    for (int i = 0; i < n; ++i)
      if (codes[size_t(i)] == x) want.push_back(i);
    EXPECT_EQ(std::vector<int32_t>(ids.begin() + off[size_t(x)], ids.begin() + off[size_t(x) + 1]),
              want);
  }
  codes[5] = 32;
  EXPECT_THROW(mp::build_table_cpu(codes.data(), n, bits, off.data(), ids.data()),
               std::invalid_argument);
}

TEST(MagicPigTables, RetrievesExactlyTheKeysHitInAtLeastTwoTables) {
  // Key i collides with the query in exactly hits[i] tables; L = 300 also checks that a key
  // hit in every table (more than 255 times) is reported once.
  for (int L : {6, 300}) {
    const int bits = 3, n = 7;
    const std::vector<int> hits = {0, 1, 2, 3, L - 1, L, 1};
    mp::Params p;
    p.bits = bits;
    p.tables = L;
    std::vector<uint16_t> q_codes(static_cast<size_t>(L));
    std::vector<uint16_t> codes(size_t(L) * n);
    for (int l = 0; l < L; ++l) {
      q_codes[size_t(l)] = uint16_t(l % 8);
      for (int i = 0; i < n; ++i)
        codes[size_t(l) * n + i] = uint16_t(l < hits[size_t(i)] ? l % 8 : (l + 1) % 8);
    }
    std::vector<int32_t> off(size_t(L) * 9), ids(size_t(L) * n);
    for (int l = 0; l < L; ++l)
      mp::build_table_cpu(codes.data() + l * n, n, bits, off.data() + l * 9, ids.data() + l * n);
    mp::HeadTables t;
    t.offsets = off.data();
    t.ids = ids.data();
    t.table_stride = n;
    t.n = n;
    std::vector<uint8_t> counters(n, 0);
    std::vector<int32_t> out(n);
    int64_t scanned = 0;
    const int c = mp::retrieve_cpu(q_codes.data(), t, p, counters.data(), out.data(), &scanned);
    std::vector<int32_t> got(out.begin(), out.begin() + c);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<int32_t>{2, 3, 4, 5})) << "L " << L;
    EXPECT_EQ(scanned, std::accumulate(hits.begin(), hits.end(), int64_t(0)));
    EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](uint8_t x) { return x == 0; }));
  }
}

// ---- the CPU path against the reference ---------------------------------------------------

struct Prepared {
  HostKV kv;
  mp::Params p;
  mp::Projection proj;
  int start, n;
  std::vector<float> centre, norms;
  std::vector<uint16_t> codes;
  std::vector<int32_t> off, ids;
  std::vector<bf16> k, v;  // hashed rows, [n, d]
  Prepared(int cap, int d, int K, int L, uint64_t seed, int start_, int n_)
      : kv(1, cap, 1, d), proj(mp::make_projection(d, K, L, seed)), start(start_), n(n_) {
    p.bits = K;
    p.tables = L;
    std::mt19937_64 rng(seed ^ 0x55);
    fill_structured(kv, rng);
    build();
  }
  void build() {
    const int d = kv.d, L = p.tables;
    const PagedKV view = kv.view();
    centre.assign(size_t(d), 0.f);
    norms.assign(size_t(n), 0.f);
    codes.assign(size_t(L) * n, 0);
    mp::centre_cpu(view, 0, 0, start, n, centre.data());
    mp::hash_keys_cpu(view, 0, 0, start, n, centre.data(), proj, codes.data(), n, norms.data());
    off.assign(size_t(L) * p.offsets_per_table(), 0);
    ids.assign(size_t(L) * n, 0);
    for (int l = 0; l < L; ++l)
      mp::build_table_cpu(codes.data() + l * n, n, p.bits, off.data() + l * p.offsets_per_table(),
                          ids.data() + l * n);
    k.resize(size_t(n) * d);
    v.resize(size_t(n) * d);
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i) {
        k[size_t(t) * d + i] = kv.k[view.offset(0, start + t, 0) + i];
        v[size_t(t) * d + i] = kv.v[view.offset(0, start + t, 0) + i];
      }
  }
  mp::HeadTables tables() const {
    mp::HeadTables t;
    t.k = k.data();
    t.v = v.data();
    t.norms = norms.data();
    t.centre = centre.data();
    t.offsets = off.data();
    t.ids = ids.data();
    t.table_stride = n;
    t.n = n;
    t.head_dim = kv.d;
    return t;
  }
};

TEST(MagicPigCpuPath, EveryIsaMatchesTheReference) {
  const int d = 128;
  Prepared s(3000, d, 6, 40, 11, 4, 3000 - 4 - 64);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n01;
  mp::HeadScratch scratch;
  int tested = 0;
  for (mp::CpuIsa isa : {mp::CpuIsa::Portable, mp::CpuIsa::Avx2, mp::CpuIsa::Avx512}) {
    if (!mp::cpu_supports(isa)) continue;
    ++tested;
    for (int rep = 0; rep < 6; ++rep) {
      // Queries near a stored key (a retrieval-heavy head) and random ones.
      std::vector<float> q(static_cast<size_t>(d));
      const std::vector<float> near = bf16_row(s.kv.key(0, 100 + 300 * rep, 0), d);
      for (int i = 0; i < d; ++i)
        q[size_t(i)] = bf16_to_float(
            float_to_bf16((rep % 2 ? 0.3f * near[size_t(i)] : 0.f) + 0.4f * n01(rng)));
      std::vector<uint16_t> qc(size_t(s.p.tables));
      mp::hash_query_cpu(q.data(), s.proj, qc.data());
      const float scale = 1.f / std::sqrt(float(d));
      std::vector<double> ro(static_cast<size_t>(d));
      double rl = 0;
      const std::vector<int32_t> ref = mp::sampled_attention_reference(
          q.data(), qc.data(), s.kv.view(), 0, 0, s.start, s.n, s.codes.data(), s.n, s.norms.data(),
          s.centre.data(), s.p, scale, ro.data(), &rl);
      std::vector<int32_t> cand(size_t(s.n));
      std::vector<float> o(static_cast<size_t>(d));
      float lse = 0;
      const mp::HeadResult r = mp::sampled_attention_cpu(
          q.data(), qc.data(), s.tables(), s.p, scale, isa, scratch, cand.data(), o.data(), &lse);
      std::vector<int32_t> got(cand.begin(), cand.begin() + r.candidates);
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, ref) << mp::to_string(isa) << " rep " << rep;
      ASSERT_GT(ref.size(), 0u);
      EXPECT_NEAR(lse, rl, 2e-4 * std::max(1.0, std::abs(rl))) << mp::to_string(isa);
      for (int i = 0; i < d; ++i)
        EXPECT_NEAR(o[size_t(i)], ro[size_t(i)], 2e-4) << mp::to_string(isa) << " dim " << i;
    }
  }
  EXPECT_GE(tested, 1);
  EXPECT_NE(mp::resolve_isa(mp::CpuIsa::Auto, d), mp::CpuIsa::Auto);
  EXPECT_EQ(mp::resolve_isa(mp::CpuIsa::Auto, 12), mp::CpuIsa::Portable);  // lanes do not divide
}

TEST(MagicPigCpuPath, NoCandidateGivesAnEmptyState) {
  Prepared s(200, 64, 16, 2, 3, 0, 200);
  std::vector<float> q(64, 0.f);
  q[0] = 1.f;
  // A code no key has: flip every bit of the first key's code in both tables.
  std::vector<uint16_t> qc = {uint16_t(~s.codes[0]), uint16_t(~s.codes[size_t(s.n)])};
  std::set<uint16_t> used0(s.codes.begin(), s.codes.begin() + s.n);
  if (used0.count(qc[0]))
    GTEST_SKIP() << "the flipped code exists (cannot happen with 200 of 65536)";
  mp::HeadScratch scratch;
  std::vector<int32_t> cand(size_t(s.n));
  std::vector<float> o(64, 1.f);
  float lse = 0;
  const mp::HeadResult r =
      mp::sampled_attention_cpu(q.data(), qc.data(), s.tables(), s.p, 0.125f, mp::CpuIsa::Portable,
                                scratch, cand.data(), o.data(), &lse);
  EXPECT_EQ(r.candidates, 0);
  EXPECT_EQ(lse, -INFINITY);
  EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.f; }));
}

// ---- estimator bias -----------------------------------------------------------------------

TEST(MagicPigEstimator, BiasAndErrorShrinkAsTheBudgetGrows) {
  // Over many hyperplane seeds, the mean output approaches exact attention as L grows at
  // fixed K (a larger budget); sink tokens [0, 4) are the dense part.
  const int d = 16, cap = 260, sink = 4, n = cap - sink, K = 6, seeds = 120;
  HostKV kv(1, cap, 1, d);
  std::mt19937_64 rng(99);
  fill_structured(kv, rng);
  std::vector<float> q(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i)  // leans towards two keys: a peaked but long-tailed head
    q[size_t(i)] =
        0.35f * (bf16_to_float(kv.key(0, 50, 0)[i]) + bf16_to_float(kv.key(0, 180, 0)[i]));
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> exact(static_cast<size_t>(d));
  double exact_lse;
  kernels::attend_cpu(q.data(), kv.view(), 0, 0, nullptr, 0, scale, exact.data(), &exact_lse);
  std::vector<int32_t> sink_tokens = {0, 1, 2, 3};
  std::vector<double> dense_o(static_cast<size_t>(d));
  double dense_lse;
  kernels::attend_cpu(q.data(), kv.view(), 0, 0, sink_tokens.data(), sink, scale, dense_o.data(),
                      &dense_lse);
  const double norm = std::sqrt(std::inner_product(exact.begin(), exact.end(), exact.begin(), 0.0));
  std::vector<double> bias, error, budget;
  for (int L : {4, 16, 64}) {
    std::vector<double> mean(static_cast<size_t>(d), 0.0);
    double err = 0.0, cand = 0.0;
    for (int s = 0; s < seeds; ++s) {
      const mp::Projection proj = mp::make_projection(d, K, L, 7919ull * s + L);
      mp::Params p;
      p.bits = K;
      p.tables = L;
      std::vector<float> centre(static_cast<size_t>(d)), norms(static_cast<size_t>(n));
      std::vector<uint16_t> codes(static_cast<size_t>(L) * n), qc(static_cast<size_t>(L));
      mp::centre_cpu(kv.view(), 0, 0, sink, n, centre.data());
      mp::hash_keys_cpu(kv.view(), 0, 0, sink, n, centre.data(), proj, codes.data(), n,
                        norms.data());
      mp::hash_query_cpu(q.data(), proj, qc.data());
      std::vector<double> o = dense_o, so(static_cast<size_t>(d));
      double lse = dense_lse, slse;
      cand += double(mp::sampled_attention_reference(q.data(), qc.data(), kv.view(), 0, 0, sink, n,
                                                     codes.data(), n, norms.data(), centre.data(),
                                                     p, scale, so.data(), &slse)
                         .size());
      kernels::merge_state_cpu<double>(o.data(), &lse, so.data(), slse, d);
      double e2 = 0.0;
      for (int i = 0; i < d; ++i) {
        mean[size_t(i)] += o[size_t(i)] / seeds;
        e2 += (o[size_t(i)] - exact[size_t(i)]) * (o[size_t(i)] - exact[size_t(i)]);
      }
      err += std::sqrt(e2) / norm / seeds;
    }
    double b2 = 0.0;
    for (int i = 0; i < d; ++i)
      b2 += (mean[size_t(i)] - exact[size_t(i)]) * (mean[size_t(i)] - exact[size_t(i)]);
    bias.push_back(std::sqrt(b2) / norm);
    error.push_back(err);
    budget.push_back(cand / seeds / n);
    std::printf("K %d L %3d: budget %.3f  bias %.4f  mean error %.4f\n", K, L, budget.back(),
                bias.back(), error.back());
  }
  EXPECT_LT(budget[0], budget[1]);
  EXPECT_LT(budget[1], budget[2]);
  EXPECT_LT(bias[2], bias[0]);
  EXPECT_LT(error[1], error[0]);
  EXPECT_LT(error[2], error[1]);
  EXPECT_LT(bias[2], 0.05);
}

// ---- the engine (CPU reference backend) -----------------------------------------------------

ModelShape small_shape(int layers, int hq, int hkv, int d) {
  ModelShape s;
  s.name = "magicpig-test";
  s.num_layers = layers;
  s.num_q_heads = hq;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.max_position = 4096;
  return s;
}

EngineConfig cpu_config(int K, int L) {
  EngineConfig c;
  c.backend = Backend::Cpu;
  c.max_batch = 2;
  c.magicpig.bits = K;
  c.magicpig.tables = L;
  c.magicpig.dense_layers = std::vector<int>{};
  c.magicpig.threads = 2;
  return c;
}

std::vector<bf16> random_q(int rows, int d, std::mt19937_64& rng, float sd = 0.5f) {
  std::normal_distribution<float> n01(0.f, sd);
  std::vector<bf16> q(size_t(rows) * d);
  for (auto& x : q) x = float_to_bf16(n01(rng));
  return q;
}

// Exact dense attention of every head, fp32 from the fp64 oracle.
std::vector<float> dense_out(const std::vector<bf16>& q, int hq, const PagedKV& kv, double scale,
                             std::vector<float>* lse) {
  std::vector<float> o(q.size());
  lse->resize(size_t(kv.batch) * hq);
  kernels::dense_decode_cpu(q.data(), hq, kv, float(scale), o.data(), lse->data());
  return o;
}

TEST(MagicPigEngineCpu, AllKeysSampledWithUEqualOneIsExactAttention) {
  // K = 1, L = 64: every key collides in >= 2 tables with u = 1 - O(1e-12), and epsilon
  // 1e-12: the sampled part is exact attention over the hashed range, and the merge with
  // the dense part must give exact attention (the lse to fp32 precision).
  const ModelShape shape = small_shape(2, 4, 2, 64);
  EngineConfig c = cpu_config(1, 64);
  c.magicpig.epsilon = 1e-12;
  HostKV kv(2, 300, 2, 64);
  kv.lens = {300, 231};
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n01;
  for (auto& x : kv.k) x = float_to_bf16(n01(rng));
  for (auto& x : kv.v) x = float_to_bf16(n01(rng));
  auto e = make_engine(Method::MagicPig, shape, c);
  e->prefill(1, kv.view(), nullptr);
  const std::vector<bf16> q = random_q(2 * 4, 64, rng);
  std::vector<bf16> out(q.size());
  std::vector<float> lse(8), ref_lse;
  e->decode(1, q.data(), nullptr, kv.view(), out.data(), lse.data(), nullptr);
  const std::vector<float> ref = dense_out(q, 4, kv.view(), shape.scale(), &ref_lse);
  for (size_t i = 0; i < out.size(); ++i)
    EXPECT_NEAR(bf16_to_float(out[i]), ref[i], 4e-3 * std::max(1.f, std::abs(ref[i])));
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], ref_lse[i], 1e-5);
  for (int b = 0; b < 2; ++b) {
    const auto read = e->last_read(1, b);
    ASSERT_EQ(read.size(), 4u);
    for (const auto& t : read) EXPECT_EQ(int(t.size()), kv.lens[size_t(b)]);
  }
  const auto* m = dynamic_cast<const MagicPigEngine*>(e.get());
  ASSERT_NE(m, nullptr);
  EXPECT_DOUBLE_EQ(m->magicpig_stats().retrieval_rate(), 1.0);
}

TEST(MagicPigEngineCpu, ShortContextsAndDenseLayersAreExact) {
  const ModelShape shape = small_shape(4, 4, 2, 64);
  EngineConfig c = cpu_config(10, 150);
  c.magicpig.dense_layers.reset();  // default: {0, 2}
  HostKV kv(2, 80, 2, 64);
  kv.lens = {60, 68};  // < sink + local = 68 hashes nothing; 68 hashes nothing either
  std::mt19937_64 rng(2);
  fill_structured(kv, rng);
  auto e = make_engine(Method::MagicPig, shape, c);
  const auto* m = dynamic_cast<const MagicPigEngine*>(e.get());
  EXPECT_TRUE(m->is_dense_layer(0));
  EXPECT_TRUE(m->is_dense_layer(2));
  EXPECT_FALSE(m->is_dense_layer(1));
  for (int layer : {0, 1}) {
    e->prefill(layer, kv.view(), nullptr);
    const std::vector<bf16> q = random_q(8, 64, rng);
    std::vector<bf16> out(q.size());
    std::vector<float> lse(8), ref_lse;
    e->decode(layer, q.data(), nullptr, kv.view(), out.data(), lse.data(), nullptr);
    const std::vector<float> ref = dense_out(q, 4, kv.view(), shape.scale(), &ref_lse);
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i].bits, float_to_bf16(ref[i]).bits) << "layer " << layer << " i " << i;
    }
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], ref_lse[i], 1e-6);
  }
  EXPECT_EQ(m->hashed_range(1, 0), (std::pair<int, int>{4, 0}));
  EXPECT_EQ(m->hashed_range(1, 1), (std::pair<int, int>{4, 0}));
  EXPECT_TRUE(e->last_read(0, 0).empty());  // dense layer: everything
}

TEST(MagicPigEngineCpu, NoCandidateMeansTheDensePartAlone) {
  // K = 16, L = 2: a key collides with the query in both tables with probability ~1e-10.
  const ModelShape shape = small_shape(2, 4, 2, 64);
  EngineConfig c = cpu_config(16, 2);
  HostKV kv(1, 600, 2, 64);
  std::mt19937_64 rng(4);
  fill_structured(kv, rng);
  kv.lens = {590};
  auto e = make_engine(Method::MagicPig, shape, c);
  e->prefill(1, kv.view(), nullptr);
  kv.lens = {600};  // ten new tokens, attended densely
  const std::vector<bf16> q = random_q(4, 64, rng);
  std::vector<bf16> out(q.size());
  std::vector<float> lse(4);
  e->decode(1, q.data(), nullptr, kv.view(), out.data(), lse.data(), nullptr);
  std::vector<int32_t> dense;
  for (int t = 0; t < 4; ++t) dense.push_back(t);
  for (int t = 590 - 64; t < 600; ++t) dense.push_back(t);
  const auto read = e->last_read(1, 0);
  for (int h = 0; h < 4; ++h) {
    ASSERT_EQ(read[size_t(h)], dense) << "head " << h;
    const std::vector<float> qf = bf16_row(q.data() + h * 64, 64);
    std::vector<double> o(64);
    double l;
    kernels::attend_cpu(qf.data(), kv.view(), 0, h / 2, dense.data(), int(dense.size()),
                        shape.scale(), o.data(), &l);
    for (int i = 0; i < 64; ++i)
      EXPECT_EQ(out[size_t(h) * 64 + i].bits, float_to_bf16(float(o[size_t(i)])).bits);
    EXPECT_NEAR(lse[size_t(h)], l, 1e-6);
  }
  const EngineStats s = e->stats();
  EXPECT_EQ(s.kv_rows_read, uint64_t(dense.size()) * 2);
  EXPECT_EQ(s.kv_rows_context, 600u * 2);
}

TEST(MagicPigEngineCpu, LastReadListsSinkCandidatesLocalAndNewTokens) {
  const ModelShape shape = small_shape(2, 4, 2, 64);
  EngineConfig c = cpu_config(6, 30);
  HostKV kv(1, 1200, 2, 64);
  std::mt19937_64 rng(6);
  fill_structured(kv, rng);
  kv.lens = {1100};
  auto e = make_engine(Method::MagicPig, shape, c);
  e->prefill(1, kv.view(), nullptr);
  kv.lens = {1103};
  const std::vector<bf16> q = random_q(4, 64, rng, 1.0f);
  std::vector<bf16> out(q.size());
  e->decode(1, q.data(), nullptr, kv.view(), out.data(), nullptr, nullptr);
  const auto read = e->last_read(1, 0);
  const auto* m = dynamic_cast<const MagicPigEngine*>(e.get());
  uint64_t sampled = 0;
  for (const auto& t : read) {
    ASSERT_TRUE(std::is_sorted(t.begin(), t.end()));
    ASSERT_TRUE(std::adjacent_find(t.begin(), t.end()) == t.end());
    for (int i = 0; i < 4; ++i) EXPECT_EQ(t[size_t(i)], i);
    for (int i = 0; i < 67; ++i) EXPECT_EQ(t[t.size() - 67 + i], 1036 + i);
    sampled += t.size() - 4 - 67;
  }
  const MagicPigStats s = m->magicpig_stats();
  EXPECT_EQ(s.candidates, sampled);
  EXPECT_EQ(s.hashed_keys, 4u * (1100 - 68));
  EXPECT_GT(s.retrieval_rate(), 0.0);
  EXPECT_LT(s.retrieval_rate(), 1.0);
  EXPECT_EQ(e->stats().kv_rows_read, sampled + 2u * (4 + 67));
}

TEST(MagicPigEngineCpu, ProjectionFromABundleGivesTheSameResult) {
  const ModelShape shape = small_shape(2, 4, 2, 64);
  EngineConfig a = cpu_config(6, 30);
  EngineConfig b = a;
  b.magicpig.projection = mp::make_projection(64, 6, 30, a.magicpig.seed).w;
  b.magicpig.seed = 0;  // not used when the matrix is given
  HostKV kv(1, 700, 2, 64);
  std::mt19937_64 rng(8);
  fill_structured(kv, rng);
  auto ea = make_engine(Method::MagicPig, shape, a), eb = make_engine(Method::MagicPig, shape, b);
  ea->prefill(1, kv.view(), nullptr);
  eb->prefill(1, kv.view(), nullptr);
  const std::vector<bf16> q = random_q(4, 64, rng);
  std::vector<bf16> oa(q.size()), ob(q.size());
  ea->decode(1, q.data(), nullptr, kv.view(), oa.data(), nullptr, nullptr);
  eb->decode(1, q.data(), nullptr, kv.view(), ob.data(), nullptr, nullptr);
  for (size_t i = 0; i < oa.size(); ++i) EXPECT_EQ(oa[i].bits, ob[i].bits);
  b.magicpig.projection.pop_back();
  EXPECT_THROW(make_engine(Method::MagicPig, shape, b), std::invalid_argument);
}

TEST(MagicPigEngineCpu, MakeEngineTakesTheProjectionFromABundle) {
  testing_h5::TempDir dir;
  const ModelShape shape = small_shape(2, 4, 2, 64);
  const mp::Projection stored = mp::make_projection(64, 6, 30, 4242);
  {
    BundleWriter w(dir.path("bundle.h5"), shape);
    save_magicpig_projection(w.method_group("magicpig"), stored);
    w.commit();
  }
  const Bundle bundle = Bundle::open(dir.path("bundle.h5"));
  validate_stored_parts(Method::MagicPig, bundle.method_group("magicpig"), shape);
  EXPECT_THROW(validate_stored_parts(Method::MagicPig, bundle.method_group("magicpig"),
                                     small_shape(2, 4, 2, 128)),
               std::invalid_argument);
  EngineConfig c = cpu_config(6, 30);
  auto e = make_engine(Method::MagicPig, shape, c, &bundle);
  EXPECT_EQ(dynamic_cast<const MagicPigEngine&>(*e).projection().w, stored.w);
  c.magicpig.tables = 31;  // the bundle's (K, L) must match the knobs
  EXPECT_THROW(make_engine(Method::MagicPig, shape, c, &bundle), std::invalid_argument);
}

TEST(MagicPigEngineCpu, RejectsBadKnobsAndUnpreparedLayers) {
  const ModelShape shape = small_shape(2, 4, 2, 64);
  auto bad = [&](auto edit) {
    EngineConfig c = cpu_config(10, 150);
    edit(c);
    EXPECT_THROW(make_engine(Method::MagicPig, shape, c), std::invalid_argument);
  };
  bad([](EngineConfig& c) { c.magicpig.bits = 17; });
  bad([](EngineConfig& c) { c.magicpig.tables = 1; });
  bad([](EngineConfig& c) { c.magicpig.epsilon = 0; });
  bad([](EngineConfig& c) { c.magicpig.dense_layers = std::vector<int>{2}; });
  bad([](EngineConfig& c) { c.magicpig.cpu_isa = "sse9"; });
  auto e = make_engine(Method::MagicPig, shape, cpu_config(10, 150));
  HostKV kv(1, 100, 2, 64);
  std::vector<bf16> q(4 * 64), out(q.size());
  EXPECT_THROW(e->decode(1, q.data(), nullptr, kv.view(), out.data(), nullptr, nullptr),
               std::logic_error);
  EXPECT_EQ(method_from_string("magicpig"), Method::MagicPig);
  EXPECT_EQ(magicpig_mode_from_string("gpu"), MagicPigMode::Gpu);
  EXPECT_THROW(magicpig_mode_from_string("tpu"), std::invalid_argument);
}

}  // namespace
}  // namespace kvs
