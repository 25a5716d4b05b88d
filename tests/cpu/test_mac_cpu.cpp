// MAC-Attention on the CPU: the reference engine against fp64 dense attention and against
// hits computed independently from the spec's formulas (designed query copies), ring
// wrap-around, ragged batches, GQA groups 1 / 4 / 8, the threshold rules and prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/mac/mac.h"
#include "runtime/dense_engine.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "runtime/mac_engine.h"
#include "tests/cpu/mac_scene.h"

namespace kvs {
namespace {

namespace mk = kernels::mac;
using test::MacScene;
using test::MacSceneConfig;

EngineConfig mac_config(int max_batch, int window, int band, int min_context,
                        MacThreshold rule = MacThreshold::Paper) {
  EngineConfig c;
  c.backend = Backend::Cpu;
  c.max_batch = max_batch;
  c.mac.window = window;
  c.mac.band = band;
  c.mac.min_context = min_context;
  c.mac.threshold = rule;
  c.mac.min_queries = 4;
  return c;
}

// fp64 attention of query row q (bf16) of sequence b over tokens [begin, end) of kv head h.
void attend(const bf16* q, const PagedKV& kv, int b, int h, int begin, int end, double scale,
            std::vector<double>& o, double* lse) {
  std::vector<float> qf(static_cast<size_t>(kv.head_dim));
  for (int i = 0; i < kv.head_dim; ++i) qf[size_t(i)] = bf16_to_float(q[i]);
  std::vector<int32_t> tokens(static_cast<size_t>(std::max(end - begin, 0)));
  std::iota(tokens.begin(), tokens.end(), begin);
  o.assign(size_t(kv.head_dim), 0.0);
  if (tokens.empty()) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  kernels::attend_cpu(qf.data(), kv, b, h, tokens.data(), int(tokens.size()), scale, o.data(), lse);
}

// What a hit on `src` (a position whose own step was a miss, so entry(src) is exact) must
// give at step t, straight from the spec: merge(A_src([0, E(src))), A_t([E(src), t])). The
// entry is rounded to bf16 as the ring stores it. src < 0: dense attention.
std::vector<double> expected_output(const MacScene& sc, const PagedKV& kv, int b, int h, int t,
                                    int src, int band) {
  const int d = sc.c.d, kvh = h / (sc.c.hq / sc.c.hkv);
  const double scale = sc.shape.scale();
  const bf16* qt = sc.q[size_t(b)].data() + (size_t(t) * sc.c.hq + h) * d;
  std::vector<double> o, tail;
  double lse, lse_tail;
  if (src < 0) {
    attend(qt, kv, b, kvh, 0, t + 1, scale, o, &lse);
    return o;
  }
  const bf16* qs = sc.q[size_t(b)].data() + (size_t(src) * sc.c.hq + h) * d;
  attend(qs, kv, b, kvh, 0, mk::cache_end(src, band), scale, o, &lse);
  for (double& x : o) x = bf16_to_float(float_to_bf16(float(x)));
  attend(qt, kv, b, kvh, mk::cache_end(src, band), t + 1, scale, tail, &lse_tail);
  kernels::merge_state_cpu(o.data(), &lse, tail.data(), lse_tail, d);
  return o;
}

// |a - e| within bf16 rounding of the output plus what a bf16 entry can move it.
void expect_close(const bf16* got, const std::vector<double>& want, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(bf16_to_float(got[i]), want[i], 8e-3 * std::max(1.0, std::fabs(want[i])))
        << what << " dim " << i;
}

struct Stepper {
  MacScene& sc;
  KVCache cache;
  explicit Stepper(MacScene& s) : sc(s), cache(s.cache_config(Device::Cpu)) { sc.fill_cache(cache); }

  // Decodes step `step` of layer 0; returns out [batch, Hq, d].
  std::vector<bf16> decode(Engine& e, int step, std::vector<float>* lse = nullptr) {
    cache.set_lengths(sc.lengths(step));
    const std::vector<bf16> q = sc.step_queries(step, false), qp = sc.step_queries(step, true);
    std::vector<bf16> out(q.size());
    if (lse) lse->resize(size_t(sc.batch()) * sc.c.hq);
    e.decode(0, q.data(), qp.data(), cache.view(0), out.data(), lse ? lse->data() : nullptr,
             nullptr);
    return out;
  }
  void prefill(Engine& e) {
    std::vector<int> prompt = sc.c.prompt;
    cache.set_lengths(prompt);
    e.prefill(0, cache.view(0), nullptr);
  }
};

int start_of(const std::vector<std::vector<int32_t>>& read, int h) {
  return read[size_t(h)].empty() ? -1 : read[size_t(h)].front();
}

TEST(MacCpu, CacheEndExcludesTheLastBandKeys) {
  EXPECT_EQ(mk::cache_end(0, 4), 0);
  EXPECT_EQ(mk::cache_end(2, 4), 0);
  EXPECT_EQ(mk::cache_end(3, 4), 0);
  EXPECT_EQ(mk::cache_end(4, 4), 1);
  EXPECT_EQ(mk::cache_end(1000, 256), 745);  // [745, 1000] are the last 256 keys
}

TEST(MacCpu, ThresholdRules) {
  mk::MatchParams p;
  p.tau = 0.45f;
  p.rule = mk::ThresholdRule::Paper;
  EXPECT_NEAR(mk::match_threshold(p, 0, 128, 0.f, 0), 77.44f, 1e-3);  // spec 2.3
  p.rule = mk::ThresholdRule::Relative;
  p.min_queries = 10;
  EXPECT_EQ(mk::match_threshold(p, 0, 128, 128.f, 9), -INFINITY);
  EXPECT_NEAR(mk::match_threshold(p, 0, 128, 128.f, 10), 77.44f, 1e-3);  // = Paper at v = d
  const float per_head[2] = {3.f, 5.f};
  p.rule = mk::ThresholdRule::PerHead;
  p.head_threshold = per_head;
  EXPECT_EQ(mk::match_threshold(p, 1, 128, 0.f, 0), 5.f);
}

TEST(MacCpu, BadKnobsAreRefusedByName) {
  MacSceneConfig c;
  MacScene sc(c);
  auto refuse = [&](EngineConfig e, const std::string& knob) {
    try {
      MacEngine engine(sc.shape, e);
      FAIL() << knob << " accepted";
    } catch (const std::invalid_argument& ex) {
      EXPECT_NE(std::string(ex.what()).find(knob), std::string::npos) << ex.what();
    }
  };
  EngineConfig e = mac_config(1, 8, 4, 0);
  e.mac.tau = 1.5;
  refuse(e, "tau");
  e = mac_config(1, 0, 4, 0);
  refuse(e, "window");
  e = mac_config(1, 8, 0, 0);
  refuse(e, "band");
  e = mac_config(1, 8, 4, 0, MacThreshold::PerHead);
  refuse(e, "per_head_threshold");
  EXPECT_THROW(mac_threshold_from_string("cosine"), std::invalid_argument);
  EXPECT_EQ(mac_threshold_from_string(to_string(MacThreshold::Relative)), MacThreshold::Relative);
  EXPECT_EQ(method_from_string("mac"), Method::Mac);
  EXPECT_EQ(make_engine(Method::Mac, sc.shape, mac_config(1, 8, 4, 0))->method(), Method::Mac);
}

// tau = 1 accepts nothing: every step is a miss, equal to the dense engine.
TEST(MacCpu, WithoutHitsTheOutputIsDenseAttention) {
  MacSceneConfig c;
  c.hq = 8;
  c.hkv = 2;
  c.prompt = {150, 90};
  c.steps = 12;
  c.repeat = 0.7;
  MacScene sc(c);
  EngineConfig e = mac_config(2, 16, 8, 0);
  e.mac.tau = 1.0;
  MacEngine mac(sc.shape, e);
  DenseEngine dense(sc.shape, e);
  Stepper st(sc);
  st.prefill(mac);
  for (int s = 0; s < c.steps; ++s) {
    std::vector<float> lse_m, lse_d;
    const std::vector<bf16> om = st.decode(mac, s, &lse_m), od = st.decode(dense, s, &lse_d);
    for (size_t i = 0; i < om.size(); ++i)
      ASSERT_NEAR(bf16_to_float(om[i]), bf16_to_float(od[i]),
                  8e-3 * std::max(1.f, std::fabs(bf16_to_float(od[i]))))
          << "step " << s << " element " << i;
    for (size_t i = 0; i < lse_m.size(); ++i) ASSERT_NEAR(lse_m[i], lse_d[i], 1e-4) << i;
    for (int b = 0; b < 2; ++b) {
      const auto read = mac.last_read(0, b);
      for (int h = 0; h < c.hq; ++h) ASSERT_EQ(int(read[size_t(h)].size()), sc.len(b, s));
    }
  }
  EXPECT_EQ(mac.mac_stats().head_hits, 0u);
  EXPECT_EQ(mac.mac_stats().head_steps, uint64_t(2 * c.steps * c.hq));
  EXPECT_DOUBLE_EQ(mac.stats().kv_read_fraction(), 1.0);
}

// Designed copies: position dst asks exactly what src asked. Hit iff src is in the window
// [dst - W, dst) and in the ring; the output must be the spec's formula; fresh queries
// (far from every ring query) miss and are exact. W = 8 wraps the ring many times; the copy
// at lag W reuses the slot that the same step overwrites.
void run_designed_copies(int hq, int hkv, int d, std::vector<int> prompt, bool mixed_heads) {
  MacSceneConfig c;
  c.hq = hq;
  c.hkv = hkv;
  c.d = d;
  c.prompt = prompt;
  c.steps = 60;
  c.repeat = 0.0;
  MacScene sc(c);
  const int W = 8, B = 4;
  struct Copy {
    int step, lag;
  };
  const std::vector<Copy> copies = {{20, 7}, {30, 8}, {40, 9}, {50, 5}, {52, 1}};
  for (int b = 0; b < sc.batch(); ++b)
    for (const Copy& cp : copies) {
      const int dst = sc.len(b, cp.step) - 1;
      if (mixed_heads) {
        for (int h = 0; h < hq; h += 2) sc.copy_query(b, dst, dst - cp.lag, h);
      } else {
        sc.copy_query(b, dst, dst - cp.lag);
      }
    }
  MacEngine mac(sc.shape, mac_config(sc.batch(), W, B, 0, MacThreshold::Relative));
  Stepper st(sc);
  st.prefill(mac);
  uint64_t hits = 0;
  for (int s = 0; s < c.steps; ++s) {
    const std::vector<bf16> out = st.decode(mac, s);
    for (int b = 0; b < sc.batch(); ++b) {
      const int t = sc.len(b, s) - 1;
      const auto read = mac.last_read(0, b);
      // After the step, the ring holds exactly positions (t - W, t].
      const mk::RingState& ring = mac.ring_state(0);
      for (int slot = 0; slot < W; ++slot) {
        const int p = ring.pos[b * W + slot];
        if (s >= W - 1) {
          ASSERT_EQ(p % W, slot);
          ASSERT_GT(p, t - W);
          ASSERT_LE(p, t);
        }
      }
      for (int h = 0; h < hq; ++h) {
        const int lag = sc.lag[size_t(b)][size_t(t) * hq + h];
        const int src = t - lag;
        // src must be a decode position (the ring starts empty) whose step was a miss.
        const bool want_hit = lag > 0 && lag <= W && src >= sc.c.prompt[size_t(b)] &&
                              sc.lag[size_t(b)][size_t(src) * hq + h] == 0;
        const std::string what = "seq " + std::to_string(b) + " step " + std::to_string(s) +
                                 " head " + std::to_string(h) + " lag " + std::to_string(lag);
        ASSERT_EQ(start_of(read, h), want_hit ? mk::cache_end(src, B) : 0) << what;
        ASSERT_EQ(read[size_t(h)].back(), t) << what;
        hits += want_hit;
        expect_close(out.data() + (size_t(b) * hq + h) * d,
                     expected_output(sc, st.cache.view(0), b, h, t, want_hit ? src : -1, B), what);
      }
    }
  }
  EXPECT_GT(hits, 0u);
  const MacStats ms = mac.mac_stats();
  EXPECT_EQ(ms.head_hits, hits);
  if (mixed_heads) {
    EXPECT_EQ(ms.kv_rows_read, ms.kv_rows_context);  // a miss head makes its group read all
  } else {
    EXPECT_LT(ms.kv_rows_read, ms.kv_rows_context);
  }
}

TEST(MacCpu, HitsFollowTheSpecAndTheRingWrapsGroup1) { run_designed_copies(4, 4, 64, {120}, false); }
TEST(MacCpu, HitsFollowTheSpecAndTheRingWrapsGroup4) { run_designed_copies(8, 2, 64, {120}, false); }
TEST(MacCpu, MixedGroupsGroup8) { run_designed_copies(8, 1, 32, {100}, true); }
TEST(MacCpu, RaggedBatchMixedGroupsGroup4) {
  run_designed_copies(8, 2, 64, {97, 140, 61}, true);
}

// The identical pre-RoPE query at another position (so a different post-RoPE query): a hit
// whose error against fp64 dense attention is bounded by the mass outside the recomputed
// band + tail. With a = the prefix output, f = the band + tail output, out = al a + (1 - al) f:
// ||out_reuse - out_exact|| <= (alpha_exact + alpha_reused) * diam(V), alpha the weight of
// the prefix [0, E(j)) in each merge and diam(V) <= 2 sqrt(d) for values in [-1, 1]. The
// prefix keys are weak and the band + tail keys point along q_t, so the bound is far below
// ||o||: a band off by one, a double-counted key or a wrong merge weight breaks it.
TEST(MacCpu, IdenticalQueryReusesWithErrorBoundedByMassOutsideTheBand) {
  MacSceneConfig c;
  c.hq = 4;
  c.hkv = 4;
  c.d = 64;
  c.prompt = {100};
  c.steps = 45;
  c.repeat = 0.0;
  const int B = 16, lag = 6, step = 40;
  const int t = c.prompt[0] + step, j = t - lag, ej = mk::cache_end(j, B);
  c.old_keys_until = ej;
  c.old_key_scale = 0.1f;
  MacScene sc(c);
  sc.copy_query(0, t, j);
  for (int h = 0; h < c.hq; ++h) {
    const bf16* qt = sc.q[0].data() + (size_t(t) * c.hq + h) * c.d;
    double n2 = 0.0;
    for (int i = 0; i < c.d; ++i) n2 += double(bf16_to_float(qt[i])) * bf16_to_float(qt[i]);
    for (int p = ej; p <= t; ++p)
      for (int i = 0; i < c.d; ++i)
        sc.k[0][(size_t(p) * c.hkv + h) * c.d + i] =
            float_to_bf16(float(7.0 * std::sqrt(double(c.d) / n2) * bf16_to_float(qt[i])));
  }
  MacEngine mac(sc.shape, mac_config(1, 32, B, 0, MacThreshold::Relative));
  Stepper st(sc);
  st.prefill(mac);
  for (int s = 0; s < step; ++s) st.decode(mac, s);
  const mk::RingState& ring = mac.ring_state(0);
  std::vector<float> entry_lse(static_cast<size_t>(c.hq));
  for (int h = 0; h < c.hq; ++h) entry_lse[size_t(h)] = ring.lse[ring.row(0, j % 32, h)];
  std::vector<float> lse;
  const std::vector<bf16> out = st.decode(mac, step, &lse);
  const auto read = mac.last_read(0, 0);
  const PagedKV kv = st.cache.view(0);
  for (int h = 0; h < c.hq; ++h) {
    ASSERT_EQ(start_of(read, h), ej) << "head " << h;
    ASSERT_EQ(int(read[size_t(h)].size()), B + lag);  // band + tail: B + (t - j) keys
    std::vector<double> exact, prefix;
    double lse_exact, lse_prefix;
    const bf16* qt = sc.q[0].data() + (size_t(t) * c.hq + h) * c.d;
    attend(qt, kv, 0, h, 0, t + 1, sc.shape.scale(), exact, &lse_exact);
    attend(qt, kv, 0, h, 0, ej, sc.shape.scale(), prefix, &lse_prefix);
    const double alpha_exact = std::exp(lse_prefix - lse_exact);
    const double alpha_reused = std::exp(double(entry_lse[size_t(h)]) - double(lse[size_t(h)]));
    double err = 0.0, norm = 0.0;
    for (int i = 0; i < c.d; ++i) {
      const double e = bf16_to_float(out[size_t(h) * c.d + i]) - exact[size_t(i)];
      err += e * e;
      norm += exact[size_t(i)] * exact[size_t(i)];
    }
    err = std::sqrt(err);
    norm = std::sqrt(norm);
    const double bound = (alpha_exact + alpha_reused) * 2.0 * std::sqrt(double(c.d)) +
                         8e-3 * norm;  // bf16 output and entry rounding
    EXPECT_LE(err, bound) << "head " << h << " alpha " << alpha_exact << " / " << alpha_reused;
    EXPECT_LT(bound, 0.5 * norm) << "head " << h << ": the scene should make the bound tight";
  }
}

// Paper's absolute threshold on small queries accepts unrelated ones; the relative rule only
// accepts the repeats.
TEST(MacCpu, PaperThresholdAcceptsSmallUnrelatedQueriesRelativeDoesNot) {
  MacSceneConfig c;
  c.hq = 4;
  c.hkv = 2;
  c.d = 64;
  c.prompt = {200};
  c.steps = 40;
  c.repeat = 0.0;
  c.q_scale = 0.05f;
  c.q_mean = 2.f;
  MacScene sc(c);
  for (int s = 20; s < 40; s += 4) sc.copy_query(0, sc.len(0, s) - 1, sc.len(0, s) - 4);
  MacEngine paper(sc.shape, mac_config(1, 16, 8, 0, MacThreshold::Paper));
  MacEngine relative(sc.shape, mac_config(1, 16, 8, 0, MacThreshold::Relative));
  Stepper st(sc);
  st.prefill(paper);
  st.prefill(relative);
  for (int s = 0; s < c.steps; ++s) {
    st.decode(paper, s);
    st.decode(relative, s);
    const auto rp = paper.last_read(0, 0), rr = relative.last_read(0, 0);
    const int t = sc.len(0, s) - 1;
    for (int h = 0; h < c.hq; ++h) {
      if (s >= 1) {
        EXPECT_GT(start_of(rp, h), 0) << "paper rule, step " << s;
      }
      const bool copy = sc.lag[0][size_t(t) * c.hq + h] > 0;
      if (s >= 8) {
        EXPECT_EQ(start_of(rr, h) > 0, copy) << "relative rule, step " << s;
      }
    }
  }
  EXPECT_GT(paper.mac_stats().hit_rate(), 0.9);
  EXPECT_LT(relative.mac_stats().hit_rate(), 0.2);
  EXPECT_GT(relative.mac_stats().head_hits, 0u);
}

TEST(MacCpu, PerHeadThresholds) {
  MacSceneConfig c;
  c.hq = 4;
  c.hkv = 2;
  c.prompt = {100};
  c.steps = 10;
  MacScene sc(c);
  EngineConfig e = mac_config(1, 16, 8, 0, MacThreshold::PerHead);
  e.mac.per_head_threshold.assign(size_t(sc.shape.num_layers) * c.hq, 0.f);
  e.mac.per_head_threshold[1] = 1e30f;  // layer 0, head 1 reuses whatever is nearest
  MacEngine mac(sc.shape, e);
  Stepper st(sc);
  st.prefill(mac);
  for (int s = 0; s < c.steps; ++s) {
    st.decode(mac, s);
    const auto read = mac.last_read(0, 0);
    for (int h = 0; h < c.hq; ++h)
      EXPECT_EQ(start_of(read, h) > 0, h == 1 && s >= 1) << "step " << s << " head " << h;
  }
}

// prefill_queries: entries of the last n prompt tokens are exact, and the first decode step
// can reuse a prompt position.
TEST(MacCpu, PrefillQueriesFillTheRingFromThePrompt) {
  MacSceneConfig c;
  c.hq = 8;
  c.hkv = 2;
  c.prompt = {180, 75};
  c.steps = 3;
  c.repeat = 0.0;
  MacScene sc(c);
  const int W = 32, B = 8;
  sc.copy_query(0, sc.len(0, 0) - 1, c.prompt[0] - 5);
  sc.copy_query(1, sc.len(1, 0) - 1, c.prompt[1] - 30, 3);
  MacEngine mac(sc.shape, mac_config(2, W, B, 0, MacThreshold::Relative));
  Stepper st(sc);
  st.prefill(mac);
  for (int b = 0; b < 2; ++b) {
    const std::vector<bf16> q = sc.prompt_queries(b, W, false), qp = sc.prompt_queries(b, W, true);
    mac.prefill_queries(0, b, q.data(), qp.data(), W, st.cache.view(0), nullptr);
  }
  EXPECT_THROW(mac.prefill_queries(0, 0, sc.q[0].data(), sc.q_pre[0].data(), W + 1,
                                   st.cache.view(0), nullptr),
               std::out_of_range);
  const mk::RingState& ring = mac.ring_state(0);
  const PagedKV kv = st.cache.view(0);
  for (int b = 0; b < 2; ++b) {
    const int p = c.prompt[size_t(b)] - 7;
    ASSERT_EQ(ring.pos[b * W + p % W], p);
    for (int h = 0; h < c.hq; ++h) {
      std::vector<double> o;
      double l;
      attend(sc.q[size_t(b)].data() + (size_t(p) * c.hq + h) * c.d, kv, b, h / 4, 0,
             mk::cache_end(p, B), sc.shape.scale(), o, &l);
      ASSERT_NEAR(ring.lse[ring.row(b, p % W, h)], l, 1e-4);
      expect_close(ring.o + ring.row(b, p % W, h) * c.d, o, "prompt entry");
    }
  }
  const std::vector<bf16> out = st.decode(mac, 0);
  for (int b = 0; b < 2; ++b) {
    const int t = sc.len(b, 0) - 1;
    const auto read = mac.last_read(0, b);
    for (int h = 0; h < c.hq; ++h) {
      const int lag = sc.lag[size_t(b)][size_t(t) * c.hq + h];
      ASSERT_EQ(start_of(read, h), lag ? mk::cache_end(t - lag, B) : 0) << b << " " << h;
      expect_close(out.data() + (size_t(b) * c.hq + h) * c.d,
                   expected_output(sc, kv, b, h, t, lag ? t - lag : -1, B), "first step");
    }
  }
}

// Below min_context nothing is reused, even an exact repeat.
TEST(MacCpu, MinimumContextGatesReuse) {
  MacSceneConfig c;
  c.prompt = {100};
  c.steps = 8;
  c.repeat = 1.0;
  c.max_lag = 2;
  MacScene sc(c);
  MacEngine mac(sc.shape, mac_config(1, 16, 8, 104, MacThreshold::Relative));
  Stepper st(sc);
  st.prefill(mac);
  for (int s = 0; s < c.steps; ++s) {
    st.decode(mac, s);
    const auto read = mac.last_read(0, 0);
    if (sc.len(0, s) - 1 < 104) {
      for (int h = 0; h < c.hq; ++h) EXPECT_EQ(start_of(read, h), 0) << "step " << s;
    }
  }
  EXPECT_EQ(mac.mac_stats().head_steps, uint64_t(c.steps * c.hq));
}

}  // namespace
}  // namespace kvs
