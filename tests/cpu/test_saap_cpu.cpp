// SAAP on the CPU: the stored parts (bundle round trip, bad bundles), batch-norm folding, the
// engine's selection rule against an independent recomputation, decode-time indexing, the
// nearest-centroid router, the CUDA attention's split of its parts (attend_member_parts), and
// kvs-eval's replay with --methods saap --bundle.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "artifacts/bundle.h"
#include "artifacts/capture_file.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/saap/saap.h"
#include "runtime/eval/replay.h"
#include "runtime/knobs.h"
#include "runtime/saap_engine.h"
#include "tests/cpu/h5_test_support.h"
#include "tests/cpu/saap_scene.h"

namespace kvs {
namespace {

using testing_h5::TempDir;
namespace sk = kernels::saap;

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

void write_bundle(const std::string& path, const ModelShape& shape, const SaapParts& p) {
  BundleWriter w(path, shape);
  write_saap_parts(w.method_group("saap"), p);
  w.commit();
}

TEST(SaapParts, BundleRoundTripAndEngineFromBundle) {
  TempDir tmp;
  const ModelShape shape = saap_test::scene_shape();
  const SaapParts p = saap_test::random_parts(shape, 16, 32, 1);
  write_bundle(tmp.path("b.h5"), shape, p);
  const Bundle b = Bundle::open(tmp.path("b.h5"));
  const SaapParts r = read_saap_parts(b.method_group("saap"), shape);
  EXPECT_EQ(r.num_clusters, 16);
  EXPECT_EQ(r.hidden_dim, 32);
  EXPECT_EQ(r.layers, p.layers);
  EXPECT_EQ(r.dense_layers, p.dense_layers);
  EXPECT_EQ(r.recent_tokens, p.recent_tokens);
  ASSERT_EQ(r.per_layer.size(), p.per_layer.size());
  for (size_t i = 0; i < p.per_layer.size(); ++i) {
    EXPECT_EQ(r.per_layer[i].centroids, p.per_layer[i].centroids);
    EXPECT_EQ(r.per_layer[i].w1, p.per_layer[i].w1);
    EXPECT_EQ(r.per_layer[i].bn_var, p.per_layer[i].bn_var);
    EXPECT_EQ(r.per_layer[i].w2, p.per_layer[i].w2);
    EXPECT_EQ(r.per_layer[i].b2, p.per_layer[i].b2);
  }
  validate_stored_parts(Method::Saap, b.method_group("saap"), shape);
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.saap.probes = 4;  // l <= C = 16
  auto e = make_engine(Method::Saap, shape, cfg, &b);
  EXPECT_EQ(e->method(), Method::Saap);
  EXPECT_NE(
      message_of([&] { make_engine(Method::Saap, shape, cfg, nullptr); }).find("kvs-indexbuild"),
      std::string::npos);
}

TEST(SaapParts, BadBundlesAreRejectedNamingWhatIsWrong) {
  TempDir tmp;
  const ModelShape shape = saap_test::scene_shape();
  const SaapParts p = saap_test::random_parts(shape, 16, 32, 2);
  {  // wrong C: the attribute says 32, the arrays hold 16 clusters
    const std::string path = tmp.path("c.h5");
    BundleWriter w(path, shape);
    h5::Group g = w.method_group("saap");
    write_saap_parts(g, p);
    g.set_attr_int("num_clusters", 32);
    w.commit();
    const Bundle b = Bundle::open(path);
    const std::string m = message_of([&] { read_saap_parts(b.method_group("saap"), shape); });
    EXPECT_NE(m.find("centroids"), std::string::npos) << m;
    EXPECT_NE(m.find("expected"), std::string::npos) << m;
    EXPECT_NE(message_of([&] {
                validate_stored_parts(Method::Saap, b.method_group("saap"), shape);
              }).find("centroids"),
              std::string::npos);
  }
  {  // wrong head count: parts for 4 query heads, the model has 8
    const std::string path = tmp.path("h.h5");
    ModelShape other = shape;
    other.num_q_heads = 4;
    const SaapParts q = saap_test::random_parts(other, 16, 32, 3);
    BundleWriter w(path, shape);
    write_saap_parts(w.method_group("saap"), q);
    w.commit();
    const Bundle b = Bundle::open(path);
    const std::string m = message_of([&] { read_saap_parts(b.method_group("saap"), shape); });
    EXPECT_NE(m.find("num_q_heads 4, the model has 8"), std::string::npos) << m;
    EngineConfig cfg;
    cfg.backend = Backend::Cpu;
    EXPECT_NE(message_of([&] { make_engine(Method::Saap, shape, cfg, &b); }).find("num_q_heads"),
              std::string::npos);
  }
}

TEST(SaapParts, FoldedBatchNormMatchesTheUnfoldedLayer) {
  const ModelShape shape = saap_test::scene_shape(2, 4, 2, 64);
  const SaapParts p = saap_test::random_parts(shape, 8, 16, 4);
  const FoldedMlp f = fold_batch_norm(p, 0);
  const SaapLayerParts& l = p.per_layer[0];
  const std::vector<bf16> q = saap_test::random_bf16(64, 5);
  for (int h = 0; h < 4; ++h)
    for (int j = 0; j < 16; ++j) {
      const size_t r = size_t(h) * 16 + j;
      double x = l.b1[r], y = f.b1[r];
      for (int k = 0; k < 64; ++k) {
        x += double(l.w1[r * 64 + k]) * bf16_to_float(q[size_t(k)]);
        y += double(f.w1[r * 64 + k]) * bf16_to_float(q[size_t(k)]);
      }
      const double bn =
          (x - l.bn_mean[r]) / std::sqrt(double(l.bn_var[r]) + p.bn_eps) * l.bn_weight[r] +
          l.bn_bias[r];
      EXPECT_NEAR(y, bn, 1e-4 * (1 + std::abs(bn)));
    }
}

// ---- engine -------------------------------------------------------------------------------

struct Scene {
  ModelShape shape = saap_test::scene_shape();
  SaapParts parts;
  std::vector<bf16> k, v;
  int T = 0;
  std::vector<int32_t> table{0};
  std::vector<int32_t> len{0};
  PagedKV kv;

  Scene(int tokens, int C, uint64_t seed) : T(tokens) {
    parts = saap_test::random_parts(shape, C, 32, seed);
    saap_test::clustered_kv(shape, parts, 0, T, seed + 1, k, v);
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.seq_lens = len.data();
    kv.batch = 1;
    kv.num_pages = 1;
    kv.page_size = T;
    kv.num_kv_heads = shape.num_kv_heads;
    kv.head_dim = shape.head_dim;
    kv.max_pages_per_seq = 1;
  }
};

EngineConfig cpu_config(int probes, int sink, int recent) {
  EngineConfig cfg;
  cfg.backend = Backend::Cpu;
  cfg.saap.probes = probes;
  cfg.saap.sink_tokens = sink;
  cfg.saap.recent_tokens = recent;
  cfg.saap.max_context = 2048;
  cfg.saap.router_weights = SaapWeights::Bf16;  // the trained floats (fp8: its own test)
  return cfg;
}

TEST(SaapEngineCpu, AttendsSinkWindowAndExactlyTheTopClustersThenIndexesLeavingTokens) {
  Scene s(700, 16, 10);
  const int sink = 2, recent = 100, l = 3, hq = 8, hkv = 2, d = 128, g = 4;
  EngineConfig cfg = cpu_config(l, sink, recent);
  cfg.saap.index_every = 1;  // each leaving token is indexed at once
  SaapEngine e(s.shape, cfg, s.parts);
  s.len[0] = 600;
  e.prefill(1, s.kv, nullptr);
  const sk::IndexState& st = e.index_state(1);
  EXPECT_EQ(st.indexed_len[0], 500);
  const std::vector<float> inv = rope_inv_freq(s.shape.rope, d);
  const SaapLayerParts& lp = s.parts.per_layer[0];
  const FoldedMlp mlp = fold_batch_norm(s.parts, 0);
  std::vector<float> key(static_cast<size_t>(d));
  for (int step = 0; step < 5; ++step) {
    s.len[0] = 601 + step;
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 100 + step);
    const std::vector<bf16> q_pre = saap_test::random_bf16(size_t(hq) * d, 200 + step);
    std::vector<bf16> out(size_t(hq) * d);
    std::vector<float> lse(static_cast<size_t>(hq));
    e.decode(1, q.data(), q_pre.data(), s.kv, out.data(), lse.data(), nullptr);
    const auto read = e.last_read(1, 0);
    ASSERT_EQ(read.size(), size_t(hq));
    for (int h = 0; h < hkv; ++h) {
      // The token that left the window was indexed with its nearest centroid.
      const int t = 500 + step;
      EXPECT_EQ(st.indexed_len[h], t + 1);
      sk::deroped_key_cpu(s.kv, 0, h, t, inv.data(), key.data());
      std::vector<float> norms(16);
      for (int c = 0; c < 16; ++c) {
        double n2 = 0;
        for (int j = 0; j < d; ++j)
          n2 += double(lp.centroids[(size_t(h) * 16 + c) * d + j]) *
                lp.centroids[(size_t(h) * 16 + c) * d + j];
        norms[size_t(c)] = float(n2);
      }
      EXPECT_EQ(st.assign_of(0, h)[t],
                sk::nearest_centroid_cpu(key.data(), lp.centroids.data() + size_t(h) * 16 * d,
                                         norms.data(), 16, d));
      // Independent top-l: summed softmax of the group's (folded) MLP logits.
      std::vector<double> score(16, 0.0);
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        std::vector<double> hid(32), z(16);
        for (int r = 0; r < 32; ++r) {
          double a = mlp.b1[size_t(qh) * 32 + r];
          for (int k = 0; k < d; ++k)
            a += double(mlp.w1[(size_t(qh) * 32 + r) * d + k]) *
                 bf16_to_float(q_pre[size_t(qh) * d + k]);
          hid[size_t(r)] = std::max(0.0, a);
        }
        double m = -1e300, sum = 0;
        for (int c = 0; c < 16; ++c) {
          double a = mlp.b2[size_t(qh) * 16 + c];
          for (int r = 0; r < 32; ++r)
            a += double(mlp.w2[(size_t(qh) * 16 + c) * 32 + r]) * hid[size_t(r)];
          z[size_t(c)] = a;
          m = std::max(m, a);
        }
        for (int c = 0; c < 16; ++c) sum += std::exp(z[size_t(c)] - m);
        for (int c = 0; c < 16; ++c) score[size_t(c)] += std::exp(z[size_t(c)] - m) / sum;
      }
      std::vector<int> order(16);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return score[size_t(a)] > score[size_t(b)]; });
      const std::vector<int32_t> got = e.last_clusters(1, 0, h);
      ASSERT_EQ(got.size(), size_t(l));
      std::set<int> top(order.begin(), order.begin() + l);
      for (int c : got) EXPECT_TRUE(top.count(c)) << "cluster " << c;
      // The attention read the index before the step indexed t: t itself is still dense.
      std::vector<int32_t> expect;
      const int n = s.len[0];
      for (int t2 = 0; t2 < n; ++t2) {
        const bool dense = t2 < sink || t2 >= t;
        if (dense || top.count(st.assign_of(0, h)[t2])) expect.push_back(t2);
      }
      EXPECT_EQ(read[size_t(h) * g], expect) << "kv head " << h << " step " << step;
      // Output: exact attention over that set.
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        std::vector<float> qf(static_cast<size_t>(d));
        for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[size_t(qh) * d + i]);
        std::vector<double> o(static_cast<size_t>(d));
        double ref_lse;
        kernels::attend_cpu(qf.data(), s.kv, 0, h, expect.data(), int(expect.size()),
                            s.shape.scale(), o.data(), &ref_lse);
        EXPECT_NEAR(lse[size_t(qh)], ref_lse, 1e-4);
        for (int i = 0; i < d; ++i)
          EXPECT_NEAR(bf16_to_float(out[size_t(qh) * d + i]), o[size_t(i)],
                      1e-2 * (1 + std::abs(o[size_t(i)])));
      }
    }
  }
  const EngineStats stats = e.stats();
  EXPECT_EQ(stats.decode_calls, 5u);
  EXPECT_GT(stats.kv_rows_read, 0u);
  EXPECT_LT(stats.kv_rows_read, stats.kv_rows_context);
}

// index_every E: the tokens that leave the window are assigned on the steps where the tokens
// past the window + the layer's phase (layer 1: 1) are a multiple of E, all pending at once
// (E of them after the first such step), after the step's attention, each to the cluster a
// per-token index gives it; until the step after that they are attended in full. Against an
// engine that indexes every token at once, fed the same steps: the same clusters chosen, and
// the tokens read are that engine's plus exactly the ones it had indexed before the step and
// this one had not, where its clusters were not chosen. With the fold (F 37) the CSR keeps up
// too.
TEST(SaapEngineCpu, IndexesLeavingTokensInBatchesOfIndexEvery) {
  Scene s(700, 16, 60);
  const int sink = 2, recent = 100, E = 7, F = 37, hkv = 2, hq = 8, d = 128, g = 4;
  EngineConfig cfg = cpu_config(3, sink, recent);
  cfg.saap.fold_every = F;
  cfg.saap.index_every = E;
  SaapEngine e(s.shape, cfg, s.parts);
  cfg.saap.fold_every = 0;
  cfg.saap.index_every = 1;
  SaapEngine each(s.shape, cfg, s.parts);
  s.len[0] = 300;
  e.prefill(1, s.kv, nullptr);
  each.prefill(1, s.kv, nullptr);
  const sk::IndexState& st = e.index_state(1);
  const sk::IndexState& ref = each.index_state(1);
  const int phase = e.index_phase(1);
  ASSERT_EQ(phase, 1);
  ASSERT_EQ(st.index_phase, 1);
  ASSERT_EQ(e.index_phase(2), 2);  // another layer, on other steps
  for (int step = 0; step < 120; ++step) {
    s.len[0] = 301 + step;
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 700 + step);
    const std::vector<bf16> q_pre = saap_test::random_bf16(size_t(hq) * d, 1700 + step);
    std::vector<bf16> out(size_t(hq) * d);
    e.decode(1, q.data(), q_pre.data(), s.kv, out.data(), nullptr, nullptr);
    each.decode(1, q.data(), q_pre.data(), s.kv, out.data(), nullptr, nullptr);
    const int assigned = saap_test::indexed_after(200, 201 + step, E, phase) - 200;
    for (int h = 0; h < hkv; ++h) {
      const std::string what = "step " + std::to_string(step) + " h " + std::to_string(h);
      const int64_t slot = st.slot(0, h);
      const int indexed = st.indexed_len[slot];
      ASSERT_EQ(indexed, 200 + assigned) << what;
      ASSERT_EQ(ref.indexed_len[slot], 201 + step) << what;
      ASSERT_EQ(st.csr_len[slot], 200 + assigned / F * F) << what;
      for (int t = sink; t < indexed; ++t)
        ASSERT_EQ(st.assign_of(0, h)[t], ref.assign_of(0, h)[t]) << what << " t " << t;
      const std::vector<int32_t> clusters = e.last_clusters(1, 0, h);
      ASSERT_EQ(clusters, each.last_clusters(1, 0, h)) << what;
      const std::set<int32_t> chosen(clusters.begin(), clusters.end());
      std::vector<int32_t> got = e.last_read(1, 0)[size_t(h) * g];
      std::vector<int32_t> want = each.last_read(1, 0)[size_t(h) * g];
      // What each engine's attention had indexed: the steps before this one's assignments.
      for (int t = saap_test::indexed_after(200, 200 + step, E, phase); t < 200 + step; ++t)
        if (!chosen.count(ref.assign_of(0, h)[t])) want.push_back(t);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << what;
    }
  }
  for (int bad : {0, sk::kMaxIndexStep + 1}) {
    cfg.saap.index_every = bad;
    EXPECT_NE(message_of([&] { SaapEngine x(s.shape, cfg, s.parts); }).find("index_every must be"),
              std::string::npos)
        << bad;
  }
  cfg.saap.index_every = 8;
  cfg.saap.fold_every = 5;
  EXPECT_NE(message_of([&] { SaapEngine x(s.shape, cfg, s.parts); })
                .find("index_every (8) must not exceed fold_every (5)"),
            std::string::npos);
  cfg.saap.fold_every = 64;
  for (int bad : {-2, 8}) {
    cfg.saap.index_phase = bad;
    EXPECT_NE(
        message_of([&] { SaapEngine x(s.shape, cfg, s.parts); })
            .find("index_phase must be -1 (a phase per layer) or in [0, index_every 8), got " +
                  std::to_string(bad)),
        std::string::npos)
        << bad;
  }
  cfg.saap.index_phase = 3;  // every layer on the same steps
  const SaapEngine aligned(s.shape, cfg, s.parts);
  EXPECT_EQ(aligned.index_phase(1), 3);
  EXPECT_EQ(aligned.index_phase(2), 3);
  EngineConfig knob = cpu_config(3, sink, recent);
  set_knob(knob, Method::Saap, "index_phase", "2");
  EXPECT_EQ(knob.saap.index_phase, 2);
  EXPECT_TRUE(knob.saap.member_rows);
  set_knob(knob, Method::Saap, "member_rows", "0");
  EXPECT_FALSE(knob.saap.member_rows);
}

// The CUDA engine refuses an MLP wider than its router GEMVs stage, before touching a device
// (so this runs without one), and names the width.
TEST(SaapEngineCpu, CudaEngineRefusesAHiddenLayerWiderThanItsRouterTakes) {
  const ModelShape shape = saap_test::scene_shape();
  SaapParts parts = saap_test::random_parts(shape, 16, sk::kMaxHiddenCuda + 8, 3);
  EngineConfig cfg = cpu_config(4, 1, 50);
  cfg.backend = Backend::Cuda;
  EXPECT_NE(message_of([&] { SaapEngine x(shape, cfg, parts); })
                .find("hidden_dim " + std::to_string(sk::kMaxHiddenCuda + 8) + " above " +
                      std::to_string(sk::kMaxHiddenCuda)),
            std::string::npos);
}

// The fold (kernels/saap/saap.h): with fold_every F, every F post-prefill assignments are
// merged into the CSR. After every step the CSR must equal the stable counting sort of
// assign[sink, csr_len) (what a prefill of those assignments builds), fewer than F
// assignments stay outside it, and the engine attends the same tokens, from the same
// clusters, as an engine that never folds, fed the same steps.
TEST(SaapEngineCpu, FoldMergesEveryFAssignmentsIntoTheCsrAndKeepsTheSelection) {
  Scene s(700, 16, 40);
  const int sink = 2, recent = 100, F = 37, C = 16, hq = 8, hkv = 2, d = 128, g = 4;
  EngineConfig cfg = cpu_config(3, sink, recent);
  cfg.saap.fold_every = F;
  cfg.saap.index_every = 1;
  SaapEngine e(s.shape, cfg, s.parts);
  cfg.saap.fold_every = 0;
  SaapEngine never(s.shape, cfg, s.parts);
  s.len[0] = 300;
  e.prefill(1, s.kv, nullptr);
  never.prefill(1, s.kv, nullptr);
  const sk::IndexState& st = e.index_state(1);
  constexpr int kSteps = 400;
  for (int step = 0; step < kSteps; ++step) {
    s.len[0] = 301 + step;
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 500 + step);
    const std::vector<bf16> q_pre = saap_test::random_bf16(size_t(hq) * d, 1500 + step);
    std::vector<bf16> out(size_t(hq) * d);
    e.decode(1, q.data(), q_pre.data(), s.kv, out.data(), nullptr, nullptr);
    never.decode(1, q.data(), q_pre.data(), s.kv, out.data(), nullptr, nullptr);
    for (int h = 0; h < hkv; ++h) {
      const std::string what = "step " + std::to_string(step) + " h " + std::to_string(h);
      const int64_t slot = st.slot(0, h);
      const int indexed = st.indexed_len[slot], csr = st.csr_len[slot];
      ASSERT_EQ(indexed, 201 + step) << what;
      ASSERT_EQ(csr, 200 + F * ((step + 1) / F)) << what;
      const saap_test::Csr want = saap_test::csr_of(st.assign_of(0, h), sink, csr, C);
      ASSERT_EQ(want.members.size(), size_t(csr - sink)) << what;
      ASSERT_EQ(std::vector<int32_t>(st.offsets_of(0, h), st.offsets_of(0, h) + C + 1),
                want.offsets)
          << what;
      ASSERT_EQ(std::vector<int32_t>(st.members_of(0, h), st.members_of(0, h) + csr - sink),
                want.members)
          << what;
      EXPECT_EQ(e.last_clusters(1, 0, h), never.last_clusters(1, 0, h)) << what;
      std::vector<int32_t> got = e.last_read(1, 0)[size_t(h) * g];
      std::vector<int32_t> ref = never.last_read(1, 0)[size_t(h) * g];
      std::sort(got.begin(), got.end());
      std::sort(ref.begin(), ref.end());
      EXPECT_EQ(got, ref) << what;
    }
  }
  EXPECT_EQ(st.csr_len[0], 200 + F * (kSteps / F));  // 10 folds
  // Folding before F assignments have piled up is a logic error, named as such.
  EXPECT_NE(message_of([&] { sk::fold_cpu(0, 0, st); }).find("fewer than fold_every 37"),
            std::string::npos);
  for (int bad : {-1, sk::kMaxFold + 1}) {
    cfg.saap.fold_every = bad;
    EXPECT_NE(message_of([&] { SaapEngine x(s.shape, cfg, s.parts); }).find("fold_every must be"),
              std::string::npos)
        << bad;
  }
  EngineConfig knob = cpu_config(3, sink, recent);
  set_knob(knob, Method::Saap, "fold_every", "64");
  EXPECT_EQ(knob.saap.fold_every, 64);
}

// A key with a NaN scores NaN against every centroid: it gets no cluster (-1, the GPU's rule),
// stays out of the CSR at the prefill and at a fold, and the prefill names it in its error.
TEST(SaapEngineCpu, KeysThatScoreNaNGetNoClusterAndThePrefillNamesThem) {
  Scene s(700, 16, 60);
  const int sink = 2, recent = 100, C = 16, hq = 8, hkv = 2, d = 128, F = 5;
  const int bad_prefill = 50, bad_decode = 502;
  for (const int t : {bad_prefill, bad_decode})
    s.k[(size_t(t) * hkv + 1) * d + 7] = float_to_bf16(std::nanf(""));
  EngineConfig cfg = cpu_config(3, sink, recent);
  cfg.saap.index_every = 1;
  cfg.saap.fold_every = F;
  SaapEngine e(s.shape, cfg, s.parts);
  s.len[0] = 600;
  const std::string msg = message_of([&] { e.prefill(1, s.kv, nullptr); });
  EXPECT_NE(msg.find("layer 1: 1 keys score NaN"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sequence 0, kv head 1, token 50;"), std::string::npos) << msg;
  const sk::IndexState& st = e.index_state(1);
  // The index is whole without it: every other key in its nearest cluster, in token order.
  auto expect_csr = [&](int h, const std::string& what) {
    const saap_test::Csr want =
        saap_test::csr_of(st.assign_of(0, h), sink, st.csr_len[st.slot(0, h)], C);
    ASSERT_EQ(std::vector<int32_t>(st.offsets_of(0, h), st.offsets_of(0, h) + C + 1), want.offsets)
        << what;
    ASSERT_EQ(std::vector<int32_t>(st.members_of(0, h), st.members_of(0, h) + want.members.size()),
              want.members)
        << what;
  };
  EXPECT_EQ(st.assign_of(0, 1)[bad_prefill], -1);
  EXPECT_EQ(st.offsets_of(0, 1)[C], 500 - sink - 1);
  EXPECT_EQ(st.offsets_of(0, 0)[C], 500 - sink);
  for (int h = 0; h < hkv; ++h) expect_csr(h, "prefill h " + std::to_string(h));
  // Decode: token 502 is attended (and makes kv head 1's rows NaN) while in the window and the
  // tail not yet indexed, is assigned -1 by the third step's index step, and the fold of
  // assignments 500..504 leaves it out. From the fourth step on, nothing reads it.
  for (int step = 0; step < 2 * F; ++step) {
    s.len[0] = 601 + step;
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 700 + step);
    std::vector<bf16> out(size_t(hq) * d);
    e.decode(1, q.data(), q.data(), s.kv, out.data(), nullptr, nullptr);
    const std::vector<int32_t>& read = e.last_read(1, 0)[size_t(1) * (hq / hkv)];
    EXPECT_EQ(std::count(read.begin(), read.end(), bad_prefill), 0) << "step " << step;
    EXPECT_EQ(std::count(read.begin(), read.end(), bad_decode), step <= 2 ? 1 : 0)
        << "step " << step;
    if (step > 2) {
      for (const bf16 x : out) ASSERT_TRUE(std::isfinite(bf16_to_float(x))) << "step " << step;
    }
  }
  EXPECT_EQ(st.assign_of(0, 1)[bad_decode], -1);
  EXPECT_EQ(st.csr_len[st.slot(0, 1)], 500 + 2 * F);
  for (int h = 0; h < hkv; ++h) expect_csr(h, "after two folds h " + std::to_string(h));
  EXPECT_EQ(st.offsets_of(0, 1)[C], 500 + 2 * F - sink - 2);
}

// Prefills layer 2 with the whole scene, then decodes one step with query q (q_pre = q).
void decode_whole_scene(SaapEngine& e, Scene& s, const std::vector<bf16>& q) {
  s.len[0] = s.T;
  e.prefill(2, s.kv, nullptr);
  std::vector<bf16> out(q.size());
  e.decode(2, q.data(), q.data(), s.kv, out.data(), nullptr, nullptr);
}

TEST(SaapEngineCpu, NearestCentroidRouterProbesTheCentroidsNearestTheMeanQuery) {
  Scene s(400, 16, 20);
  EngineConfig cfg = cpu_config(4, 1, 50);
  cfg.saap.query_router = SaapRouter::NearestCentroid;
  SaapEngine e(s.shape, cfg, s.parts);
  const std::vector<bf16> q = saap_test::random_bf16(8 * 128, 7);
  decode_whole_scene(e, s, q);
  const SaapLayerParts& lp = s.parts.per_layer[1];
  for (int h = 0; h < 2; ++h) {
    std::vector<double> dist(16);
    for (int c = 0; c < 16; ++c) {
      double d2 = 0;
      for (int i = 0; i < 128; ++i) {
        double m = 0;
        for (int j = 0; j < 4; ++j) m += bf16_to_float(q[size_t(h * 4 + j) * 128 + i]);
        const double diff = m / 4 - lp.centroids[(size_t(h) * 16 + c) * 128 + i];
        d2 += diff * diff;
      }
      dist[size_t(c)] = d2;
    }
    std::vector<int> order(16);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return dist[size_t(a)] < dist[size_t(b)]; });
    const std::vector<int32_t> got = e.last_clusters(2, 0, h);
    EXPECT_EQ(std::set<int>(got.begin(), got.end()),
              std::set<int>(order.begin(), order.begin() + 4));
  }
}

// attend_cuda's split of a slot's parts between members and window, on the host (the same
// function runs on the device): every side with rows gets a part, whatever the estimate
// rounds to, and the split follows the sizes.
TEST(SaapAttendSplit, EverySideWithRowsGetsAPartAndTheSplitFollowsTheSizes) {
  // The benchmark's 128K slot: 32 of 1024 clusters over 129023 indexed tokens (about 4031
  // members) and a window of 2048 rows weighing 1.7 members' each, over 32 parts:
  // round(32 * 4031 / (4031 + 3481)) = 17.
  EXPECT_EQ(sk::attend_member_parts(32, 32, 1024, 129023, 2048), 17);
  // Batch 8's three shared parts a slot keep two member parts: round(3 * 4031 / 7512) = 2.
  EXPECT_EQ(sk::attend_member_parts(3, 32, 1024, 129023, 2048), 2);
  // A short prompt: 32 probes x 8 tokens / 1024 clusters rounds to no member, yet the
  // clusters the route chooses may hold some of the 8.
  EXPECT_EQ(sk::attend_member_parts(32, 32, 1024, 8, 129), 1);
  EXPECT_EQ(sk::attend_member_parts(2, 6, 64, 1, 130), 1);
  // No CSR: no member can exist; no window: every part takes members.
  EXPECT_EQ(sk::attend_member_parts(32, 32, 1024, 0, 129), 0);
  EXPECT_EQ(sk::attend_member_parts(32, 32, 1024, 5000, 0), 32);
  EXPECT_EQ(sk::attend_member_parts(32, 32, 1024, 0, 0), 0);
  // Members far beyond the window still leave the window one part, and the reverse.
  EXPECT_EQ(sk::attend_member_parts(32, 1024, 1024, 2000000, 1), 31);
  EXPECT_EQ(sk::attend_member_parts(32, 1, 1024, 1024, 100000), 1);
  for (int shared : {2, 3, 32, 63})
    for (int probes : {1, 8, 32, 40})
      for (int C : {8, 64, 1024, 4096})
        for (int in_csr : {0, 1, 7, 100, 5000, 500000})
          for (int W : {0, 1, 128, 2048, 100000}) {
            const int pm = sk::attend_member_parts(shared, probes, C, in_csr, W);
            const std::string at = "shared " + std::to_string(shared) + " probes " +
                                   std::to_string(probes) + " C " + std::to_string(C) + " in_csr " +
                                   std::to_string(in_csr) + " W " + std::to_string(W);
            ASSERT_GE(pm, 0) << at;
            ASSERT_LE(pm, shared) << at;
            // A member part exactly when the CSR holds any (the chosen clusters' members may
            // be there), and then a window part exactly when the window has rows.
            ASSERT_EQ(pm >= 1, in_csr > 0) << at;
            if (in_csr > 0) {
              ASSERT_EQ(pm == shared, W == 0) << at;
            }
          }
}

// The route's shared memory that keeps attention CTAs off its SMs, with an H200's figures (228
// KiB an SM, 1 KiB reserved per CTA, 227 KiB at most a CTA): asked for only while the route's
// CTAs are at most one SM in 16, and then just too much for an attention CTA to fit beside it.
TEST(SaapRouteAlone, AskedOnlyForFewRouteCtasAndJustKeepsTheAttentionOut) {
  const size_t sm = 233472, reserved = 1024, optin = 232448;
  for (size_t attend : {size_t(107000), size_t(60000), size_t(4096)}) {
    const size_t alone = sk::route_alone_smem_bytes(8, 132, sm, reserved, optin, attend);
    ASSERT_GT(alone, 0u) << attend;
    EXPECT_GT(alone + reserved + attend + reserved, sm) << attend;
    EXPECT_LE(alone + reserved + attend + reserved, sm + 256) << attend;
    EXPECT_LE(alone, optin);
  }
  // Batch 1 of Llama-3 (8 kv heads) on 132 SMs pays; 9 route CTAs (and batch 8's 64) do not.
  EXPECT_GT(sk::route_alone_smem_bytes(1, 16, sm, reserved, optin, 107000), 0u);
  EXPECT_EQ(sk::route_alone_smem_bytes(9, 132, sm, reserved, optin, 107000), 0u);
  EXPECT_EQ(sk::route_alone_smem_bytes(64, 132, sm, reserved, optin, 107000), 0u);
  EXPECT_EQ(sk::route_alone_smem_bytes(0, 132, sm, reserved, optin, 107000), 0u);
  // An attention CTA that fills an SM alone leaves nothing to keep out; a CTA limit below
  // what it would take makes the route ask for nothing more.
  EXPECT_EQ(sk::route_alone_smem_bytes(8, 132, sm, reserved, optin, sm - 2 * reserved), 0u);
  EXPECT_EQ(sk::route_alone_smem_bytes(8, 132, sm, reserved, 100000, 50000), 0u);
}

// fp8 router weights: every weight within e4m3's rounding (half a unit in the last of its 3
// mantissa bits, or half the smallest subnormal step) of the original, each row's largest
// magnitude kept, a zero row exact, a value on the e4m3 grid exact, and a non-finite weight
// refused naming its row.
TEST(SaapRouterWeights, E4m3RowsRoundWithinHalfAStepAndKeepEachRowsMaximum) {
  constexpr int kRows = 5, K = 48;
  std::vector<float> w(size_t(kRows) * K);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < K; ++k) w[size_t(r) * K + k] = n(rng) * std::pow(10.f, float(r - 2));
  for (int k = 0; k < K; ++k) w[size_t(3) * K + k] = 0.f;  // a zero row
  w[size_t(4) * K] = 448.f;  // row 4: scale 1, so on-grid values stay exact
  w[size_t(4) * K + 1] = -0.875f;
  w[size_t(4) * K + 2] = 0.001953125f;  // 2^-9, e4m3's smallest subnormal
  std::vector<uint8_t> q(w.size());
  std::vector<float> scale(kRows), deq(w.size());
  sk::quantize_rows_e4m3(w.data(), kRows, K, q.data(), scale.data(), deq.data());
  for (int r = 0; r < kRows; ++r) {
    float amax = 0.f;
    for (int k = 0; k < K; ++k) amax = std::max(amax, std::fabs(w[size_t(r) * K + k]));
    EXPECT_FLOAT_EQ(scale[size_t(r)], amax > 0.f ? amax / 448.f : 1.f) << "row " << r;
    for (int k = 0; k < K; ++k) {
      const float x = w[size_t(r) * K + k], y = deq[size_t(r) * K + k];
      const float bound = std::max(std::fabs(x) / 16.f, scale[size_t(r)] / 1024.f) * 1.0001f;
      EXPECT_LE(std::fabs(y - x), bound) << "row " << r << " weight " << k;
      if (std::fabs(x) == amax) {
        EXPECT_NEAR(y, x, 1e-6f * amax) << "row " << r << ": its maximum";
      }
    }
  }
  EXPECT_EQ(deq[size_t(4) * K], 448.f);
  EXPECT_EQ(deq[size_t(4) * K + 1], -0.875f);
  EXPECT_EQ(deq[size_t(4) * K + 2], 0.001953125f);
  for (int k = 0; k < K; ++k) EXPECT_EQ(deq[size_t(3) * K + k], 0.f);
  w[size_t(2) * K + 7] = std::nanf("");
  const std::string msg = message_of(
      [&] { sk::quantize_rows_e4m3(w.data(), kRows, K, q.data(), scale.data(), deq.data()); });
  EXPECT_NE(msg.find("weight 7 of row 2 is not finite"), std::string::npos) << msg;
}

// The second GEMV's layout: block (h, blk) holds column k's kColumnBlock rows contiguously,
// position 8g + j row g + 8j (a lane's load: one row of each of the block's 8 groups of 8),
// rows past the matrix zero, in both weight formats.
TEST(SaapRouterWeights, ColumnBlocksHoldEachColumnsRowsContiguously) {
  constexpr int kHeads = 3, kRows = 100, K = 24, kBlocks = 2;  // 100 rows: a padded block
  std::vector<float> w(size_t(kHeads) * kRows * K);
  std::vector<uint8_t> q(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = float(i % 251) - 125.f;  // exact in bf16
    q[i] = uint8_t(1 + i % 200);    // never the padding's 0
  }
  ASSERT_EQ(sk::column_blocks_bytes(kHeads, kRows, K, true), size_t(kHeads) * kBlocks * 64 * K);
  ASSERT_EQ(sk::column_blocks_bytes(kHeads, kRows, K, false), 2 * size_t(kHeads) * kBlocks * 64 * K);
  std::vector<bf16> wb(sk::column_blocks_bytes(kHeads, kRows, K, false) / 2);
  std::vector<uint8_t> qb(sk::column_blocks_bytes(kHeads, kRows, K, true));
  sk::pack_column_blocks(w.data(), kHeads, kRows, K, wb.data());
  sk::pack_column_blocks_e4m3(q.data(), kHeads, kRows, K, qb.data());
  for (int h = 0; h < kHeads; ++h)
    for (int blk = 0; blk < kBlocks; ++blk)
      for (int k = 0; k < K; ++k)
        for (int i = 0; i < sk::kColumnBlock; ++i) {
          const size_t at = ((size_t(h) * kBlocks + blk) * K + k) * sk::kColumnBlock + i;
          const int r = blk * sk::kColumnBlock + (i % 8) * 8 + i / 8;
          const size_t from = (size_t(h) * kRows + r) * K + k;
          EXPECT_EQ(bf16_to_float(wb[at]), r < kRows ? w[from] : 0.f) << h << " " << r << " " << k;
          EXPECT_EQ(qb[at], r < kRows ? q[from] : 0) << h << " " << r << " " << k;
        }
}

// The engine with fp8 weights routes with the dequantized rows: on the CPU it picks the
// clusters that an independent fp64 scoring with those rows picks, and the knob parses.
TEST(SaapEngineCpu, Fp8RouterWeightsRouteWithTheDequantizedRows) {
  Scene s(400, 16, 20);
  EngineConfig cfg = cpu_config(4, 1, 50);
  set_knob(cfg, Method::Saap, "router_weights", "fp8");
  ASSERT_EQ(cfg.saap.router_weights, SaapWeights::Fp8);
  SaapEngine e(s.shape, cfg, s.parts);
  const std::vector<bf16> q = saap_test::random_bf16(8 * 128, 7);
  decode_whole_scene(e, s, q);
  FoldedMlp f = fold_batch_norm(s.parts, 1);
  const int hidden = s.parts.hidden_dim, C = 16;
  for (auto [wp, K] : {std::pair{&f.w1, 128}, std::pair{&f.w2, hidden}}) {
    std::vector<uint8_t> qb(wp->size());
    std::vector<float> sc(wp->size() / size_t(K));
    sk::quantize_rows_e4m3(wp->data(), int64_t(sc.size()), K, qb.data(), sc.data(), wp->data());
  }
  for (int h = 0; h < 2; ++h) {
    std::vector<double> score(C, 0.0);
    for (int j = 0; j < 4; ++j) {
      const int head = h * 4 + j;
      std::vector<double> hid(static_cast<size_t>(hidden)), logit(static_cast<size_t>(C));
      for (int u = 0; u < hidden; ++u) {
        double a = f.b1[size_t(head) * hidden + u];
        for (int i = 0; i < 128; ++i)
          a += double(f.w1[(size_t(head) * hidden + u) * 128 + i]) *
               bf16_to_float(q[size_t(head) * 128 + i]);
        hid[size_t(u)] = std::max(a, 0.0);
      }
      double m = -INFINITY;
      for (int c = 0; c < C; ++c) {
        double a = f.b2[size_t(head) * C + c];
        for (int u = 0; u < hidden; ++u)
          a += double(f.w2[(size_t(head) * C + c) * hidden + u]) * hid[size_t(u)];
        logit[size_t(c)] = a;
        m = std::max(m, a);
      }
      double z = 0;
      for (int c = 0; c < C; ++c) z += std::exp(logit[size_t(c)] - m);
      for (int c = 0; c < C; ++c) score[size_t(c)] += std::exp(logit[size_t(c)] - m) / z;
    }
    std::vector<int> order(C);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return score[size_t(a)] > score[size_t(b)]; });
    const std::vector<int32_t> got = e.last_clusters(2, 0, h);
    EXPECT_EQ(std::set<int>(got.begin(), got.end()),
              std::set<int>(order.begin(), order.begin() + 4))
        << "kv head " << h;
  }
  // The router's reads count one byte per weight (and a scale per row): fewer than with the
  // trained floats.
  EngineConfig plain = cpu_config(4, 1, 50);
  plain.collect_stats = cfg.collect_stats = true;
  SaapEngine ef(s.shape, cfg, s.parts), e32(s.shape, plain, s.parts);
  for (SaapEngine* x : {&ef, &e32}) decode_whole_scene(*x, s, q);
  EXPECT_LT(ef.stats().selection_bytes_read, e32.stats().selection_bytes_read);
  EXPECT_EQ(ef.last_clusters(2, 0, 0), e.last_clusters(2, 0, 0));
  EngineConfig bad = cpu_config(4, 1, 50);
  const std::string msg =
      message_of([&] { set_knob(bad, Method::Saap, "router_weights", "int4"); });
  EXPECT_NE(msg.find("'int4' (known: bf16, fp8)"), std::string::npos) << msg;
}

TEST(SaapEngineCpu, DenseLayersShortSequencesAndErrors) {
  Scene s(120, 8, 30);
  SaapEngine e(s.shape, cpu_config(2, 1, 200), s.parts);
  s.len[0] = 120;  // shorter than sink + window: everything is dense
  e.prefill(1, s.kv, nullptr);
  const std::vector<bf16> q = saap_test::random_bf16(8 * 128, 8);
  std::vector<bf16> out(8 * 128);
  e.decode(1, q.data(), q.data(), s.kv, out.data(), nullptr, nullptr);
  EXPECT_EQ(e.last_read(1, 0)[0].size(), 120u);
  e.prefill(0, s.kv, nullptr);  // dense layer: no index, q_pre not needed
  e.decode(0, q.data(), nullptr, s.kv, out.data(), nullptr, nullptr);
  EXPECT_TRUE(e.last_read(0, 0).empty());
  EXPECT_NE(message_of([&] {
              e.decode(1, q.data(), nullptr, s.kv, out.data(), nullptr, nullptr);
            }).find("q_pre"),
            std::string::npos);
  EngineConfig cfg = cpu_config(2, 1, 200);
  cfg.saap.dense_layers = {};
  SaapEngine f(s.shape, cfg, s.parts);
  EXPECT_NE(message_of([&] { f.prefill(0, s.kv, nullptr); }).find("layer 0 has no SAAP index"),
            std::string::npos);
  cfg.saap.probes = 9;
  EXPECT_NE(message_of([&] { SaapEngine bad(s.shape, cfg, s.parts); }).find("probes"),
            std::string::npos);
}

// kvs-eval's replay (what `kvs-eval --methods saap --bundle b.h5` runs) on the CPU backend.
TEST(SaapEngineCpu, ReplaysACaptureFromABundle) {
  TempDir tmp;
  const ModelShape shape = saap_test::scene_shape();
  const SaapParts p = saap_test::random_parts(shape, 16, 32, 40);
  write_bundle(tmp.path("b.h5"), shape, p);
  const int T = 300, decode_start = 290;
  {
    CaptureMeta meta;
    meta.shape = shape;
    meta.layers = {0, 1};
    meta.vocab_size = 256;
    CaptureWriter w(tmp.path("c.h5"), meta);
    std::vector<int32_t> tokens(static_cast<size_t>(T), 65);
    w.begin_sequence(tokens, decode_start, "synthetic");
    for (int l : {0, 1}) {
      // Pre-RoPE rows: what a capture stores.
      const std::vector<bf16> q = saap_test::random_bf16(size_t(T) * 8 * 128, 50 + l);
      const std::vector<bf16> k = saap_test::random_bf16(size_t(T) * 2 * 128, 60 + l);
      const std::vector<bf16> v = saap_test::random_bf16(size_t(T) * 2 * 128, 70 + l);
      w.append_qkv(l, T, q.data(), k.data(), v.data());
      std::vector<float> pooled(size_t(8) * ((T + 15) / 16), 0.f);
      for (int st = 0; st < T - decode_start; ++st) w.append_attn_row(l, pooled.data());
    }
    w.commit();
  }
  const CaptureFile cap = CaptureFile::open(tmp.path("c.h5"));
  eval::ReplayConfig rc;
  rc.methods = {"saap"};
  rc.bundle = tmp.path("b.h5");
  rc.engine.backend = Backend::Cpu;
  rc.engine.saap.recent_tokens = 64;
  rc.engine.saap.probes = 4;
  rc.budget_fractions = {};
  const eval::Aggregator agg = eval::replay_capture(cap, rc);
  bool layer1 = false;
  for (const eval::ResultRow& r : agg.rows())
    if (r.method == "saap" && r.layer == 1) {
      layer1 = true;
      EXPECT_EQ(r.steps, T - decode_start);
      EXPECT_LT(r.kv_read_fraction_mean, 1.0);
      EXPECT_GT(r.mass_recall_mean, 0.0);
    }
  EXPECT_TRUE(layer1);
}

}  // namespace
}  // namespace kvs
