// Tactic on the CPU: the budget math, k-means, and the engine against exact attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/dense/dense_decode.h"
#include "kernels/tactic/tactic.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "runtime/tactic_engine.h"
#include "tests/common/test_util.h"

namespace kvs {
namespace {

namespace tk = kernels::tactic;

// ---- budget math ------------------------------------------------------------------------

TEST(TacticFit, HarmonicSeriesMatchesTheSumAcrossTheSwitch) {
  double h = 0.0;
  for (int m = 1; m <= 5000; ++m) {
    h += 1.0 / m;
    ASSERT_NEAR(tk::harmonic(m), h, 1e-12) << "m=" << m;
  }
  EXPECT_EQ(tk::harmonic(0), 0.0);
}

TEST(TacticFit, PlanSamplesExactPrefixAndTwoDisjointWindows) {
  const tk::FitParams f;
  const tk::FitPlan p = tk::make_fit_plan(100000, f);
  ASSERT_TRUE(p.fitted);
  EXPECT_EQ(p.num_exact, 1500);  // 1.5 %
  EXPECT_EQ(p.w, 500);           // 0.5 %
  EXPECT_NEAR(p.x1(), 10000, 5.0);
  EXPECT_NEAR(p.x2(), 60000, 5.0);
  double inv = 0.0;  // harmonic mean of the window's positions
  for (int x = p.lo1; x < p.lo1 + p.w; ++x) inv += 1.0 / x;
  EXPECT_NEAR(p.x1(), p.w / inv, 1e-6);
  EXPECT_EQ(p.position(0), 1);
  EXPECT_EQ(p.position(1499), 1500);
  EXPECT_EQ(p.position(1500), p.lo1);
  EXPECT_EQ(p.position(2000), p.lo2);
  // Short lists: the minimum window (32) pushes the first window past the exact prefix.
  const tk::FitPlan s = tk::make_fit_plan(300, f);
  ASSERT_TRUE(s.fitted);
  EXPECT_EQ(s.w, 32);
  EXPECT_GE(s.lo1, s.num_exact + 1);
  EXPECT_GE(s.lo2, s.lo1 + s.w);
  EXPECT_LE(s.lo2 + s.w - 1, 300);
  // Tiny lists are computed exactly: sampling would cost as much.
  const tk::FitPlan t = tk::make_fit_plan(60, f);
  EXPECT_FALSE(t.fitted);
  EXPECT_EQ(t.num_samples(), 60);
  EXPECT_EQ(t.position(59), 60);
}

// Window means taken from y = a/x + b itself, as Algorithm 1 does.
tk::TailModel fit_curve(double a, double b, const tk::FitPlan& p) {
  double m1 = 0.0, m2 = 0.0;
  for (int i = 0; i < p.w; ++i) {
    m1 += a / (p.lo1 + i) + b;
    m2 += a / (p.lo2 + i) + b;
  }
  return tk::fit_tail(m1 / p.w, m2 / p.w, p.x1(), p.x2(), p.n);
}

TEST(TacticFit, RecoversAAndBOfSyntheticCurves) {
  const tk::FitParams f;
  for (int n : {2000, 32768, 131072})
    for (double a : {0.5, 20.0, 3000.0})
      for (double b : {0.0, 1e-4, 0.02}) {
        const tk::FitPlan p = tk::make_fit_plan(n, f);
        const tk::TailModel t = fit_curve(a, b, p);
        EXPECT_NEAR(t.a, a, 1e-9 * a) << "n=" << n << " a=" << a << " b=" << b;
        EXPECT_NEAR(t.b, b, 1e-12 * a + 1e-15) << "n=" << n << " a=" << a << " b=" << b;
        EXPECT_EQ(t.end, n);
      }
}

TEST(TacticFit, DegenerateFitsAreGuarded) {
  // Flat or rising tails (a <= 0) fall back to a flat model at the windows' mean.
  const tk::TailModel flat = tk::fit_tail(0.3, 0.5, 100.0, 600.0, 1000);
  EXPECT_EQ(flat.a, 0.0);
  EXPECT_DOUBLE_EQ(flat.b, 0.4);
  // b < 0: the model is cut where a/x + b reaches 0, never negative.
  const tk::TailModel neg = tk::fit_tail(1.0, 0.01, 100.0, 600.0, 1000);
  ASSERT_LT(neg.b, 0.0);
  EXPECT_LT(neg.end, 1000);
  EXPECT_GE(neg.a / neg.end + neg.b, 0.0);
  EXPECT_NEAR(tk::tail_sum(neg, 10, 1000), tk::tail_sum(neg, 10, neg.end), 0.0);
}

// Budget from samples of a power-law curve y = x^-alpha (+ a floor) against the exact count.
int exact_count(const std::vector<double>& y, double P) {
  const double total = std::accumulate(y.begin() + 1, y.end(), 0.0);
  double c = 0.0;
  for (size_t x = 1; x < y.size(); ++x)
    if ((c += y[x]) >= P * total) return int(x);
  return int(y.size()) - 1;
}

int modelled_count(const std::vector<double>& y, double P) {
  tk::FitParams f;
  f.target = P;
  const int n = int(y.size()) - 1;
  const tk::FitPlan p = tk::make_fit_plan(n, f);
  std::vector<double> pre(size_t(p.num_exact) + 1, 0.0);
  for (int i = 1; i <= p.num_exact; ++i) pre[size_t(i)] = pre[size_t(i) - 1] + y[size_t(i)];
  double m1 = 0.0, m2 = 0.0;
  for (int i = 0; i < p.w; ++i) {
    m1 += y[size_t(p.lo1 + i)];
    m2 += y[size_t(p.lo2 + i)];
  }
  const tk::TailModel t = tk::fit_tail(m1 / p.w, m2 / p.w, p.x1(), p.x2(), n);
  return tk::budget_tokens(p, t, P, [&](int k) { return pre[size_t(k)]; });
}

TEST(TacticFit, BudgetOnPowerLawCurvesIsCloseToTheExactCount) {
  for (int n : {5000, 40000, 131072})
    for (double alpha : {0.9, 1.0, 1.1})
      for (double P : {0.75, 0.9}) {
        std::vector<double> y(size_t(n) + 1, 0.0);
        for (int x = 1; x <= n; ++x) y[size_t(x)] = std::pow(x, -alpha) + 1e-5;
        const int exact = exact_count(y, P), model = modelled_count(y, P);
        // alpha = 1 is the model itself; other exponents are within a few percent.
        const double tol = alpha == 1.0 ? 0.002 : 0.05;
        EXPECT_NEAR(double(model) / exact, 1.0, tol)
            << "n=" << n << " alpha=" << alpha << " P=" << P << " exact " << exact << " modelled "
            << model;
      }
}

TEST(TacticFit, BudgetWithinTheExactPrefixAndAtPOne) {
  // A spike carrying > 90 % of the mass in the first tokens: K comes from the exact prefix.
  std::vector<double> y(20001, 1e-6);
  y[1] = 1000.0;
  y[2] = 500.0;
  EXPECT_EQ(modelled_count(y, 0.5), 1);
  EXPECT_EQ(modelled_count(y, 0.9), 2);
  EXPECT_EQ(modelled_count(y, 1.0), 20000);
}

// ---- k-means ----------------------------------------------------------------------------

// Keys from `centres` Gaussian clusters (spread sigma) at random positions: bf16 values.
std::vector<float> mixture_keys(int n, int d, int centres, double sigma, std::mt19937& gen,
                                std::vector<int>* truth = nullptr) {
  std::normal_distribution<float> N01(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, centres - 1);
  std::vector<float> mu(size_t(centres) * d);
  for (auto& x : mu) x = 3.f * N01(gen);
  std::vector<float> keys(size_t(n) * d);
  if (truth) truth->resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int c = pick(gen);
    if (truth) (*truth)[size_t(i)] = c;
    for (int j = 0; j < d; ++j)
      keys[size_t(i) * d + j] =
          bf16_to_float(float_to_bf16(mu[size_t(c) * d + j] + float(sigma) * N01(gen)));
  }
  return keys;
}

void expect_valid_csr(const std::vector<int32_t>& off, const std::vector<int32_t>& mem, int n,
                      int C) {
  ASSERT_EQ(off[0], 0);
  ASSERT_EQ(off[size_t(C)], n);
  std::vector<int> seen(size_t(n), 0);
  for (int c = 0; c < C; ++c) {
    ASSERT_LE(off[size_t(c)], off[size_t(c) + 1]);
    for (int m = off[size_t(c)]; m < off[size_t(c) + 1]; ++m) {
      ++seen[size_t(mem[size_t(m)])];
      if (m > off[size_t(c)]) {
        ASSERT_LT(mem[size_t(m) - 1], mem[size_t(m)]) << "not ascending";
      }
    }
  }
  for (int i = 0; i < n; ++i) ASSERT_EQ(seen[size_t(i)], 1) << "token " << i;
}

TEST(TacticKMeans, BeatsConsecutiveGroupingAndIsAValidPartition) {
  std::mt19937 gen(5);
  const int n = 1600, d = 32, C = tk::kmeans_num_clusters(n, 16);
  const auto keys = mixture_keys(n, d, 60, 0.5, gen);
  std::vector<bf16> cent(size_t(C) * d);
  std::vector<int32_t> off(size_t(C) + 1), mem(static_cast<size_t>(n));
  tk::kmeans_cpu(keys.data(), n, d, C, 10, 42, cent.data(), off.data(), mem.data());
  expect_valid_csr(off, mem, n, C);
  const double wcss =
      tk::kmeans_wcss_cpu(keys.data(), n, d, C, cent.data(), off.data(), mem.data());
  // Consecutive pages of 16 with their means (Table 1's baseline).
  double pages = 0.0;
  for (int c = 0; c < C; ++c) {
    const int lo = c * 16, hi = std::min(n, lo + 16);
    for (int j = 0; j < d; ++j) {
      double m = 0.0;
      for (int i = lo; i < hi; ++i) m += keys[size_t(i) * d + j];
      m /= hi - lo;
      for (int i = lo; i < hi; ++i)
        pages += (keys[size_t(i) * d + j] - m) * (keys[size_t(i) * d + j] - m);
    }
  }
  EXPECT_LT(wcss, 0.5 * pages);
  // Centroids are the bf16-rounded means of their members.
  for (int c = 0; c < C; ++c) {
    if (off[size_t(c)] == off[size_t(c) + 1]) continue;
    for (int j = 0; j < d; ++j) {
      double m = 0.0;
      for (int x = off[size_t(c)]; x < off[size_t(c) + 1]; ++x)
        m += keys[size_t(mem[size_t(x)]) * d + j];
      m /= off[size_t(c) + 1] - off[size_t(c)];
      ASSERT_EQ(cent[size_t(c) * d + j].bits, float_to_bf16(float(m)).bits);
    }
  }
}

TEST(TacticKMeans, SeparatedClustersAreRecoveredAndInitIsStratified) {
  std::mt19937 gen(6);
  const int n = 400, d = 16, C = 4;
  std::vector<int> truth;
  const auto keys = mixture_keys(n, d, C, 0.05, gen, &truth);
  std::vector<bf16> cent(size_t(C) * d);
  std::vector<int32_t> off(size_t(C) + 1), mem(static_cast<size_t>(n));
  // A few seeds: with 4 centres, some inits put two seeds in one true cluster; the
  // partition must then still be a refinement-free relabelling for most seeds.
  int recovered = 0;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    tk::kmeans_cpu(keys.data(), n, d, C, 10, seed, cent.data(), off.data(), mem.data());
    bool pure = true;
    for (int c = 0; c < C && pure; ++c)
      for (int m = off[size_t(c)] + 1; m < off[size_t(c) + 1]; ++m)
        pure &= truth[size_t(mem[size_t(m)])] == truth[size_t(mem[size_t(off[size_t(c)])])];
    recovered += pure;
  }
  EXPECT_GE(recovered, 3);
  for (int c = 0; c < 50; ++c) {
    const int i = tk::kmeans_init_index(77, c, 1000, 50);
    EXPECT_GE(i, c * 20);
    EXPECT_LT(i, (c + 1) * 20);
  }
  EXPECT_THROW(tk::kmeans_cpu(keys.data(), n, d, n + 1, 10, 1, cent.data(), off.data(), mem.data()),
               std::invalid_argument);
}

// ---- engine -------------------------------------------------------------------------------

ModelShape shape(int hq, int hkv, int d, int max_pos) {
  ModelShape s;
  s.num_layers = 2;
  s.num_q_heads = hq;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.max_position = max_pos;
  return s;
}

// A cache of clustered keys and queries with a skewed score spread. Mixture: keys from 40
// Gaussian centres per kv head, each query head leaning on two of them (a step-like score
// curve). PowerLaw: the curve the method models: groups of ~16 keys whose logit against the
// group's query direction u is -log(rank of the group) (so the cluster-sorted exponentials
// fall like 1/x), plus components orthogonal to u that make clustering non-trivial.
enum class Keys { Mixture, PowerLaw };

struct Scene {
  ModelShape s;
  std::vector<int> lens;
  KVCache cache;
  std::vector<bf16> q;

  Scene(const ModelShape& shape_, const std::vector<int>& lens_, int capacity, uint32_t seed,
        Keys kind = Keys::Mixture)
      : s(shape_), lens(lens_), cache(config(shape_, int(lens_.size()), capacity)) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> N01(0.f, 1.f);
    const int d = s.head_dim, B = int(lens.size()), row = s.num_kv_heads * d;
    const int ncent = 40;
    std::vector<std::vector<float>> centres(size_t(s.num_kv_heads),
                                            std::vector<float>(size_t(ncent) * d));
    for (auto& c : centres)
      for (auto& x : c) x = N01(gen);
    std::vector<std::vector<float>> dir(size_t(s.num_kv_heads), std::vector<float>(size_t(d)));
    for (auto& u : dir) {
      double n2 = 0.0;
      for (auto& x : u) {
        x = N01(gen);
        n2 += double(x) * x;
      }
      for (auto& x : u) x = float(x / std::sqrt(n2));
    }
    auto orthogonal = [&](int h, float sigma, float* out) {  // sigma * N(0, I) with u projected out
      double dot = 0.0;
      for (int j = 0; j < d; ++j) dot += (out[j] = sigma * N01(gen)) * dir[size_t(h)][size_t(j)];
      for (int j = 0; j < d; ++j) out[j] -= float(dot) * dir[size_t(h)][size_t(j)];
    };
    std::uniform_int_distribution<int> pick(0, ncent - 1);
    for (int b = 0; b < B; ++b) cache.reserve(b, capacity);
    std::vector<float> tmp(static_cast<size_t>(d));
    for (int b = 0; b < B; ++b) {
      const int n = lens[size_t(b)];
      const int groups = std::max(1, n / 16);
      std::vector<bf16> k(size_t(n) * row), v(k.size());
      for (int h = 0; h < s.num_kv_heads; ++h) {
        std::vector<int> rank(static_cast<size_t>(groups));
        std::iota(rank.begin(), rank.end(), 1);
        std::shuffle(rank.begin(), rank.end(), gen);
        std::vector<float> gc(size_t(groups) * d);
        for (int c = 0; c < groups; ++c) orthogonal(h, 1.0f, gc.data() + size_t(c) * d);
        std::uniform_int_distribution<int> group(0, groups - 1);
        for (int t = 0; t < n; ++t) {
          bf16* kt = k.data() + size_t(t) * row + h * d;
          if (kind == Keys::Mixture) {
            const int c = pick(gen);
            for (int j = 0; j < d; ++j)
              kt[j] = float_to_bf16(2.f * centres[size_t(h)][size_t(c) * d + j] + 0.4f * N01(gen));
          } else {
            const int c = group(gen);
            const float logit = -std::log(float(rank[size_t(c)]));
            orthogonal(h, 0.1f, tmp.data());
            for (int j = 0; j < d; ++j)
              kt[j] = float_to_bf16(logit * dir[size_t(h)][size_t(j)] + gc[size_t(c) * d + j] +
                                    tmp[size_t(j)]);
          }
          for (int j = 0; j < d; ++j) v[size_t(t) * row + h * d + j] = float_to_bf16(N01(gen));
        }
      }
      for (int l = 0; l < s.num_layers; ++l) cache.write(l, b, 0, n, k.data(), v.data());
    }
    cache.set_lengths(lens);
    q.resize(size_t(B) * s.num_q_heads * d);
    for (int b = 0; b < B; ++b)
      for (int hq = 0; hq < s.num_q_heads; ++hq) {
        const int h = hq / s.group_size();
        bf16* qh = q.data() + (size_t(b) * s.num_q_heads + hq) * d;
        if (kind == Keys::Mixture) {
          // Each query head leans on two cluster centres of its kv head, differently per head.
          const int c1 = pick(gen), c2 = pick(gen);
          for (int j = 0; j < d; ++j)
            qh[j] = float_to_bf16(0.6f * (centres[size_t(h)][size_t(c1) * d + j] +
                                          centres[size_t(h)][size_t(c2) * d + j]) +
                                  0.3f * N01(gen));
        } else {
          // |q| = sqrt(d) along u: the logit q.k / sqrt(d) is the key's u component.
          orthogonal(h, 0.05f, tmp.data());
          for (int j = 0; j < d; ++j)
            qh[j] =
                float_to_bf16(std::sqrt(float(d)) * (dir[size_t(h)][size_t(j)] + tmp[size_t(j)]));
        }
      }
  }

  static KVCacheConfig config(const ModelShape& s, int batch, int capacity) {
    return test::cache_config(s, 16, batch, capacity, Device::Cpu);
  }

  // Appends one random token to every sequence in every layer.
  void step(std::mt19937& gen) {
    std::normal_distribution<float> N01(0.f, 1.f);
    const size_t n = lens.size() * s.num_kv_heads * s.head_dim;
    std::vector<bf16> k(n), v(n);
    for (auto& x : k) x = float_to_bf16(N01(gen));
    for (auto& x : v) x = float_to_bf16(N01(gen));
    cache.begin_step(nullptr);
    for (int l = 0; l < s.num_layers; ++l) cache.append(l, k.data(), v.data(), nullptr);
    for (auto& x : lens) ++x;
  }
};

EngineConfig cpu_config(int max_batch, double P) {
  EngineConfig c;
  c.backend = Backend::Cpu;
  c.max_batch = max_batch;
  c.tactic.target = P;
  return c;
}

std::vector<float> qrow(const Scene& sc, int b, int hq) {
  const int d = sc.s.head_dim;
  std::vector<float> f(static_cast<size_t>(d));
  for (int j = 0; j < d; ++j)
    f[size_t(j)] = bf16_to_float(sc.q[(size_t(b) * sc.s.num_q_heads + hq) * d + j]);
  return f;
}

// Exact attention mass of `tokens` for query head hq of sequence b.
double mass(const Scene& sc, int layer, int b, int hq, const std::vector<int32_t>& tokens) {
  const PagedKV kv = sc.cache.view(layer);
  const int d = sc.s.head_dim, h = hq / sc.s.group_size();
  const auto qf = qrow(sc, b, hq);
  std::vector<double> o(static_cast<size_t>(d));
  double all, part;
  kernels::attend_cpu(qf.data(), kv, b, h, nullptr, 0, sc.s.scale(), o.data(), &all);
  kernels::attend_cpu(qf.data(), kv, b, h, tokens.data(), int(tokens.size()), sc.s.scale(),
                      o.data(), &part);
  return std::exp(part - all);
}

// Fewest tokens reaching mass P for query head hq, taking tokens by exact score.
int optimal_count(const Scene& sc, int layer, int b, int hq, double P) {
  const PagedKV kv = sc.cache.view(layer);
  const int d = sc.s.head_dim, h = hq / sc.s.group_size(), n = kv.seq_lens[b];
  const auto qf = qrow(sc, b, hq);
  std::vector<double> e(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) {
    double dot = 0.0;
    for (int j = 0; j < d; ++j)
      dot += double(qf[size_t(j)]) * bf16_to_float(kv.k[kv.offset(b, t, h) + j]);
    e[size_t(t)] = dot * sc.s.scale();
  }
  const double m = *std::max_element(e.begin(), e.end());
  for (auto& x : e) x = std::exp(x - m);
  std::sort(e.begin(), e.end(), std::greater<double>());
  const double total = std::accumulate(e.begin(), e.end(), 0.0);
  double c = 0.0;
  for (int k = 0; k < n; ++k)
    if ((c += e[size_t(k)]) >= P * total) return k + 1;
  return n;
}

TEST(TacticEngineCpu, TargetOneIsExactDenseAttention) {
  Scene sc(shape(8, 2, 64, 4096), {700, 213}, 800, 1);
  auto engine = make_engine(Method::Tactic, sc.s, cpu_config(2, 1.0));
  engine->prefill(1, sc.cache.view(1), nullptr);
  std::vector<bf16> out(sc.q.size());
  std::vector<float> lse(2 * 8), ref(sc.q.size()), ref_lse(lse.size());
  engine->decode(1, sc.q.data(), nullptr, sc.cache.view(1), out.data(), lse.data(), nullptr);
  kernels::dense_decode_cpu(sc.q.data(), 8, sc.cache.view(1), float(sc.s.scale()), ref.data(),
                            ref_lse.data());
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_NEAR(bf16_to_float(out[i]), ref[i], 1e-2 * std::abs(ref[i]) + 1e-6) << i;
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 1e-5);
  const EngineStats st = engine->stats();
  EXPECT_EQ(st.kv_rows_read, uint64_t(913 * 2));
  EXPECT_DOUBLE_EQ(st.kv_read_fraction(), 1.0);
  EXPECT_GT(st.selection_bytes_read, 0u);
}

TEST(TacticEngineCpu, SelectionReachesTheTargetAndObeysTheErrorBound) {
  Scene sc(shape(8, 2, 64, 4096), {3000}, 3000, 2, Keys::PowerLaw);
  const int layer = 0;
  auto engine = make_engine(Method::Tactic, sc.s, cpu_config(1, 0.9));
  engine->prefill(layer, sc.cache.view(layer), nullptr);
  auto* te = dynamic_cast<TacticEngine*>(engine.get());
  ASSERT_NE(te, nullptr);
  const tk::ClusterState& st = te->cluster_state(layer);
  const PagedKV kv = sc.cache.view(layer);
  const tk::FitParams fit;  // P = 0.9, the engine's defaults
  double achieved = 0.0;
  int selected_total = 0, optimal_total = 0;
  for (int hq = 0; hq < 8; ++hq) {
    const int h = hq / 4;
    std::vector<uint8_t> flags(size_t(st.num_clusters[st.slot(0, h)]), 0);
    const auto qf = qrow(sc, 0, hq);
    int K = 0;
    const int sel =
        tk::select_clusters_cpu(qf.data(), kv, 0, h, sc.s.scale(), fit, st, flags.data(), &K);
    const auto tokens = tk::selected_tokens_cpu(kv, 0, h, st, flags.data());
    ASSERT_EQ(int(tokens.size()), sel);
    EXPECT_GE(sel, K);
    EXPECT_LT(sel, 3000);  // really sparse on this data
    const double p = mass(sc, layer, 0, hq, tokens);
    achieved += p;
    selected_total += sel;
    optimal_total += optimal_count(sc, layer, 0, hq, 0.9);
    // ||o - o_sel|| <= 2 (1 - p) max ||v||
    std::vector<double> o(64), os(64);
    double l;
    kernels::attend_cpu(qf.data(), kv, 0, h, nullptr, 0, sc.s.scale(), o.data(), &l);
    kernels::attend_cpu(qf.data(), kv, 0, h, tokens.data(), int(tokens.size()), sc.s.scale(),
                        os.data(), &l);
    double err = 0.0, vmax = 0.0;
    for (int j = 0; j < 64; ++j)
      err += (o[size_t(j)] - os[size_t(j)]) * (o[size_t(j)] - os[size_t(j)]);
    for (int t = 0; t < 3000; ++t) {
      double n2 = 0.0;
      for (int j = 0; j < 64; ++j) {
        const double v = bf16_to_float(kv.v[kv.offset(0, t, h) + j]);
        n2 += v * v;
      }
      vmax = std::max(vmax, std::sqrt(n2));
    }
    EXPECT_LE(std::sqrt(err), 2.0 * (1.0 - p) * vmax + 1e-12) << "head " << hq;
  }
  // The fit is an estimate: on average the target is met within a few points, with a token
  // count within a small factor of the optimum (global top tokens by exact score; the paper
  // reports 2.0-2.3x for whole clusters, Table 3).
  std::printf("achieved mass %.3f, selected %d, optimal %d tokens per head\n", achieved / 8,
              selected_total / 8, optimal_total / 8);
  EXPECT_GT(achieved / 8, 0.87);
  EXPECT_LT(selected_total, 2.5 * optimal_total);
}

TEST(TacticEngineCpu, GqaUnionGivesEveryHeadAtLeastItsOwnMass) {
  Scene sc(shape(8, 2, 64, 4096), {1500}, 1500, 3);
  auto engine = make_engine(Method::Tactic, sc.s, cpu_config(1, 0.8));
  engine->prefill(0, sc.cache.view(0), nullptr);
  const tk::ClusterState& st = dynamic_cast<TacticEngine&>(*engine).cluster_state(0);
  const PagedKV kv = sc.cache.view(0);
  tk::FitParams fit;
  fit.target = 0.8;
  for (int h = 0; h < 2; ++h) {
    const size_t C = size_t(st.num_clusters[st.slot(0, h)]);
    std::vector<uint8_t> uni(C, 0);
    std::vector<std::vector<uint8_t>> own(4, std::vector<uint8_t>(C, 0));
    for (int j = 0; j < 4; ++j) {
      const auto qf = qrow(sc, 0, h * 4 + j);
      tk::select_clusters_cpu(qf.data(), kv, 0, h, sc.s.scale(), fit, st, own[size_t(j)].data(),
                              nullptr);
      tk::select_clusters_cpu(qf.data(), kv, 0, h, sc.s.scale(), fit, st, uni.data(), nullptr);
    }
    const auto all = tk::selected_tokens_cpu(kv, 0, h, st, uni.data());
    for (int j = 0; j < 4; ++j) {
      const auto mine = tk::selected_tokens_cpu(kv, 0, h, st, own[size_t(j)].data());
      EXPECT_LE(mine.size(), all.size());
      EXPECT_GE(mass(sc, 0, 0, h * 4 + j, all), mass(sc, 0, 0, h * 4 + j, mine) - 1e-12);
    }
  }
}

TEST(TacticEngineCpu, RaggedBatchEqualsSequencesRunAlone) {
  const ModelShape s = shape(16, 2, 64, 4096);  // GQA 8
  Scene sc(s, {900, 37, 400}, 1000, 4);
  auto batch = make_engine(Method::Tactic, s, cpu_config(3, 0.9));
  batch->prefill(0, sc.cache.view(0), nullptr);
  std::vector<bf16> out(sc.q.size());
  std::vector<float> lse(3 * 16);
  batch->decode(0, sc.q.data(), nullptr, sc.cache.view(0), out.data(), lse.data(), nullptr);
  for (int b = 0; b < 3; ++b) {
    // The same sequence alone in slot 0 of its own cache.
    KVCache one(Scene::config(s, 1, 1000));
    one.reserve(0, 1000);
    const PagedKV src = sc.cache.view(0);
    const int row = 2 * 64, n = sc.lens[size_t(b)];
    std::vector<bf16> k(size_t(n) * row), v(k.size());
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 64; ++j) {
          k[size_t(t) * row + h * 64 + j] = src.k[src.offset(b, t, h) + j];
          v[size_t(t) * row + h * 64 + j] = src.v[src.offset(b, t, h) + j];
        }
    one.write(0, 0, 0, n, k.data(), v.data());
    one.set_lengths({n});
    auto alone = make_engine(Method::Tactic, s, cpu_config(1, 0.9));
    alone->prefill(0, one.view(0), nullptr);
    std::vector<bf16> o1(size_t(16) * 64);
    std::vector<float> l1(16);
    alone->decode(0, sc.q.data() + size_t(b) * 16 * 64, nullptr, one.view(0), o1.data(), l1.data(),
                  nullptr);
    for (size_t i = 0; i < o1.size(); ++i) ASSERT_EQ(o1[i].bits, out[size_t(b) * 16 * 64 + i].bits);
    for (int i = 0; i < 16; ++i) ASSERT_EQ(l1[size_t(i)], lse[size_t(b) * 16 + i]);
  }
}

TEST(TacticEngineCpu, TokensAddedAfterPrefillAreAlwaysAttended) {
  Scene sc(shape(8, 2, 64, 4096), {600}, 700, 5);
  EngineConfig cfg = cpu_config(1, 0.5);
  cfg.tactic.recluster_interval = 0;  // never re-cluster: every new token stays recent
  auto engine = make_engine(Method::Tactic, sc.s, cfg);
  engine->prefill(0, sc.cache.view(0), nullptr);
  std::mt19937 gen(9);
  for (int i = 0; i < 5; ++i) sc.step(gen);
  // A new token whose key is the query scaled up dominates head 0: the output must be its v.
  const PagedKV kv = sc.cache.view(0);
  bf16* k = const_cast<bf16*>(kv.k) + kv.offset(0, 602, 0);
  const bf16* v = kv.v + kv.offset(0, 602, 0);
  for (int j = 0; j < 64; ++j) k[j] = float_to_bf16(4.f * bf16_to_float(sc.q[size_t(j)]));
  std::vector<bf16> out(sc.q.size());
  engine->decode(0, sc.q.data(), nullptr, kv, out.data(), nullptr, nullptr);
  for (int j = 0; j < 64; ++j)
    EXPECT_NEAR(bf16_to_float(out[size_t(j)]), bf16_to_float(v[j]), 2e-2);
  const tk::ClusterState& st = dynamic_cast<TacticEngine&>(*engine).cluster_state(0);
  EXPECT_EQ(st.clustered_len[0], 600);
  std::vector<uint8_t> none(size_t(st.num_clusters[0]), 0);
  const auto tokens = tk::selected_tokens_cpu(kv, 0, 0, st, none.data());
  EXPECT_EQ(tokens, (std::vector<int32_t>{600, 601, 602, 603, 604}));
  EXPECT_GE(engine->stats().kv_rows_read, uint64_t(2 * 5));
}

TEST(TacticEngineCpu, RecentBlockIsClusteredOnItsOwnAtTheInterval) {
  Scene sc(shape(8, 2, 64, 4096), {200}, 400, 6);
  EngineConfig cfg = cpu_config(1, 0.9);
  cfg.tactic.recluster_interval = 64;
  auto engine = make_engine(Method::Tactic, sc.s, cfg);
  engine->prefill(0, sc.cache.view(0), nullptr);
  const tk::ClusterState& st = dynamic_cast<TacticEngine&>(*engine).cluster_state(0);
  ASSERT_EQ(st.num_clusters[1], 13);  // ceil(200 / 16)
  const std::vector<int32_t> before(st.members_of(0, 1), st.members_of(0, 1) + 200);
  std::vector<bf16> out(sc.q.size());
  std::mt19937 gen(10);
  for (int i = 0; i < 63; ++i) {
    sc.step(gen);
    engine->decode(0, sc.q.data(), nullptr, sc.cache.view(0), out.data(), nullptr, nullptr);
  }
  EXPECT_EQ(st.clustered_len[1], 200);  // 63 recent tokens: not due yet
  sc.step(gen);
  engine->decode(0, sc.q.data(), nullptr, sc.cache.view(0), out.data(), nullptr, nullptr);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(st.clustered_len[h], 264);
    EXPECT_EQ(st.num_clusters[h], 13 + 4);
  }
  // The prefill clusters are untouched; the block is exactly k-means of its own keys.
  EXPECT_EQ(std::vector<int32_t>(st.members_of(0, 1), st.members_of(0, 1) + 200), before);
  const PagedKV kv = sc.cache.view(0);
  std::vector<float> keys(size_t(64) * 64);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j)
      keys[size_t(i) * 64 + j] = bf16_to_float(kv.k[kv.offset(0, 200 + i, 1) + j]);
  std::vector<bf16> cent(size_t(4) * 64);
  std::vector<int32_t> off(5), mem(64);
  tk::kmeans_cpu(keys.data(), 64, 64, 4, 10, tk::kmeans_stream(cfg.tactic.seed, 0, 1, 200),
                 cent.data(), off.data(), mem.data());
  for (int c = 0; c <= 4; ++c) EXPECT_EQ(st.offsets_of(0, 1)[13 + c], 200 + off[size_t(c)]);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(st.members_of(0, 1)[200 + i], 200 + mem[size_t(i)]);
  for (int e = 0; e < 4 * 64; ++e) EXPECT_EQ(st.centroid(0, 1, 13)[e].bits, cent[size_t(e)].bits);
  // One more step: 1 recent token, no new block.
  sc.step(gen);
  engine->decode(0, sc.q.data(), nullptr, sc.cache.view(0), out.data(), nullptr, nullptr);
  EXPECT_EQ(st.num_clusters[0], 17);
}

TEST(TacticEngineCpu, DenseLayersAndConfigErrors) {
  Scene sc(shape(8, 2, 64, 4096), {300}, 300, 7);
  EngineConfig cfg = cpu_config(1, 0.5);
  cfg.tactic.dense_layers = {1};
  auto engine = make_engine(Method::Tactic, sc.s, cfg);
  engine->prefill(1, sc.cache.view(1), nullptr);
  std::vector<bf16> out(sc.q.size());
  std::vector<float> ref(sc.q.size());
  engine->decode(1, sc.q.data(), nullptr, sc.cache.view(1), out.data(), nullptr, nullptr);
  kernels::dense_decode_cpu(sc.q.data(), 8, sc.cache.view(1), float(sc.s.scale()), ref.data(),
                            nullptr);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i].bits, float_to_bf16(ref[i]).bits);
  // Layer 0 was never prefilled.
  EXPECT_THROW(
      engine->decode(0, sc.q.data(), nullptr, sc.cache.view(0), out.data(), nullptr, nullptr),
      std::logic_error);
  EXPECT_EQ(method_from_string("tactic"), Method::Tactic);
  EXPECT_STREQ(to_string(Method::Tactic), "tactic");
  auto bad = [&](auto edit) {
    EngineConfig c = cpu_config(1, 0.9);
    edit(c.tactic);
    return make_engine(Method::Tactic, sc.s, c);
  };
  EXPECT_THROW(bad([](TacticConfig& t) { t.target = 0.0; }), std::invalid_argument);
  EXPECT_THROW(bad([](TacticConfig& t) { t.recluster_interval = 100; }), std::invalid_argument);
  EXPECT_THROW(bad([](TacticConfig& t) { t.window_centre2 = 0.05; }), std::invalid_argument);
  EXPECT_THROW(bad([](TacticConfig& t) { t.dense_layers = {2}; }), std::invalid_argument);
  try {
    bad([](TacticConfig& t) { t.kmeans_iterations = 0; });
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kmeans_iterations"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvs
