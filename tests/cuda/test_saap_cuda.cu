// SAAP on CUDA against the CPU engine: the prefill index (assignments, CSR), the decode-time
// indexing, the router's top-l (bf16 weights: clusters may differ only at near-ties of the
// CPU's fp64 scores), the token lists, and the attention output against exact attention over
// the lists CUDA chose; the last decode step runs as a CUDA-graph replay. Paged cache, batch 2.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <set>

#include "kernels/common/kv_update.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/saap/saap.h"
#include "runtime/kv_cache.h"
#include "runtime/saap_engine.h"
#include "tests/cpu/saap_scene.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

namespace sk = kernels::saap;

template <typename T>
std::vector<T> download(const T* p, size_t n) {
  std::vector<T> h(n);
  KVS_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

struct Pair {
  ModelShape shape;
  SaapParts parts;
  std::unique_ptr<KVCache> cpu_cache, gpu_cache;
  std::unique_ptr<SaapEngine> cpu, gpu;
  std::unique_ptr<test::DeviceBuffer<char>> ws;
  int layer = 1;
  bool member_rows;

  SaapWeights weights;

  // edit, when given, changes the random parts before the engines are built.
  Pair(SaapRouter router, const std::vector<int>& lens, int C, int hidden, int probes,
       SaapWeights weights_, int max_context = 2048, int fold_every = SaapConfig().fold_every,
       int index_every = SaapConfig().index_every, const std::function<void(SaapParts&)>& edit = {},
       const ModelShape& shape_ = saap_test::scene_shape(2), bool member_rows_ = true)
      : shape(shape_), member_rows(member_rows_), weights(weights_) {
    const int batch = int(lens.size());
    parts = saap_test::random_parts(shape, C, hidden, 11);
    if (edit) edit(parts);
    EngineConfig cfg;
    cfg.max_batch = batch;
    cfg.saap.probes = probes;
    cfg.saap.sink_tokens = 4;
    cfg.saap.recent_tokens = 128;
    cfg.saap.max_context = max_context;
    cfg.saap.fold_every = fold_every;
    cfg.saap.index_every = index_every;
    cfg.saap.member_rows = member_rows;
    cfg.saap.query_router = router;
    cfg.saap.router_weights = weights;
    cfg.collect_stats = true;
    cfg.backend = Backend::Cpu;
    cpu = std::make_unique<SaapEngine>(shape, cfg, parts);
    cfg.backend = Backend::Cuda;
    gpu = std::make_unique<SaapEngine>(shape, cfg, parts);
    ws = std::make_unique<test::DeviceBuffer<char>>(gpu->workspace_bytes());
    gpu->bind_workspace({ws->get(), gpu->workspace_bytes()});
    for (int dev = 0; dev < 2; ++dev) {
      KVCacheConfig cc;
      cc.num_layers = shape.num_layers;
      cc.num_kv_heads = shape.num_kv_heads;
      cc.head_dim = shape.head_dim;
      cc.page_size = 16;
      cc.max_batch = batch;
      cc.max_seq_len = max_context;
      cc.device = dev == 0 ? Device::Cpu : Device::Cuda;
      auto cache = std::make_unique<KVCache>(cc);
      for (int b = 0; b < batch; ++b) {
        cache->reserve(b, max_context);
        std::vector<bf16> k, v;
        saap_test::clustered_kv(shape, parts, 0, lens[size_t(b)], 100 + b, k, v);
        if (dev == 0) {
          cache->write(layer, b, 0, lens[size_t(b)], k.data(), v.data());
        } else {
          test::DeviceBuffer<bf16> kd(k), vd(v);
          cache->write(layer, b, 0, lens[size_t(b)], kd.get(), vd.get());
        }
      }
      cache->set_lengths(lens);
      (dev == 0 ? cpu_cache : gpu_cache) = std::move(cache);
    }
  }

  // CPU fp64 route scores of (b, h) for q_pre (host, [B, Hq, d]), with the weights the
  // engines use (fp8: the dequantized e4m3 rows).
  std::vector<double> scores(const std::vector<bf16>& q_pre, int b, int h, bool mlp) const {
    FoldedMlp f = fold_batch_norm(parts, 0);
    if (weights == SaapWeights::Fp8)
      for (auto [w, K] : {std::pair{&f.w1, shape.head_dim}, std::pair{&f.w2, parts.hidden_dim}}) {
        std::vector<uint8_t> q(w->size());
        std::vector<float> scale(w->size() / size_t(K));
        sk::quantize_rows_e4m3(w->data(), int64_t(scale.size()), K, q.data(), scale.data(),
                               w->data());
      }
    const SaapLayerParts& lp = parts.per_layer[0];
    const int C = parts.num_clusters, d = shape.head_dim, g = shape.group_size();
    std::vector<float> norms(size_t(shape.num_kv_heads) * C);
    for (size_t c = 0; c < norms.size(); ++c) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += double(lp.centroids[c * d + j]) * lp.centroids[c * d + j];
      norms[c] = float(s);
    }
    sk::Router<float> r;
    r.centroids = lp.centroids.data();
    r.centroid_norms = norms.data();
    r.w1 = f.w1.data();
    r.b1 = f.b1.data();
    r.w2 = f.w2.data();
    r.b2 = f.b2.data();
    r.num_q_heads = shape.num_q_heads;
    r.num_kv_heads = shape.num_kv_heads;
    r.head_dim = d;
    r.hidden = parts.hidden_dim;
    r.num_clusters = C;
    r.use_mlp = mlp;
    std::vector<float> qg(size_t(g) * d);
    for (size_t i = 0; i < qg.size(); ++i)
      qg[i] = bf16_to_float(q_pre[(size_t(b) * shape.num_q_heads + h * g) * d + i]);
    std::vector<double> s(static_cast<size_t>(C));
    sk::route_scores_cpu(r, h, qg.data(), s.data());
    return s;
  }
};

// Clusters chosen on the GPU and the CPU may differ only where the CPU's scores are within
// `tol` (relative) of the l-th best score.
void expect_same_clusters(const std::vector<int32_t>& gpu, const std::vector<int32_t>& cpu,
                          const std::vector<double>& score, double tol, const std::string& what) {
  std::vector<double> sorted = score;
  std::sort(sorted.rbegin(), sorted.rend());
  const double lth = sorted[cpu.size() - 1];
  std::set<int> g(gpu.begin(), gpu.end()), c(cpu.begin(), cpu.end());
  ASSERT_EQ(g.size(), cpu.size()) << what << ": duplicate clusters";
  for (int x : g)
    if (!c.count(x))
      EXPECT_LE(std::abs(score[size_t(x)] - lth), tol * (std::abs(lth) + 1e-12)) << what;
  for (int x : c)
    if (!g.count(x))
      EXPECT_LE(std::abs(score[size_t(x)] - lth), tol * (std::abs(lth) + 1e-12)) << what;
}

// Which path of the route's best 32 the steps' scores send a (b, h) to: route_top_candidates
// when at most 256 clusters score at least the smallest of the maxima of the 32 warps' 32
// consecutive clusters, route_top32 past that (kRouteCandidates, saap.cu). Counted from the CPU's
// scores with a margin, since the GPU's differ in the last bits: a test that asks for one path
// fails if its scores do not send the route there.
struct RoutePaths {
  int candidates = 0, fallback = 0;
  void count(const std::vector<double>& score) {
    if (score.size() != 1024) return;
    double t = 1e300;
    for (size_t w = 0; w < 32; ++w)
      t = std::min(t, *std::max_element(score.begin() + w * 32, score.begin() + w * 32 + 32));
    const auto k = std::count_if(score.begin(), score.end(), [&](double x) { return x >= t; });
    if (k <= 200) ++candidates;
    if (k > 320) ++fallback;
  }
};

// One decode step of both engines (just run; q, q_pre and the GPU's output on the host):
// the same index lengths, the same clusters up to near-ties of the CPU's scores, the same
// token lists where the clusters and the index agree, and the GPU's output equal to an
// fp64 attention over the GPU's own token list.
void expect_decode_matches(Pair& p, SaapRouter router, const std::vector<bf16>& q,
                           const std::vector<bf16>& q_pre, const std::vector<bf16>& out_gpu,
                           bool same_index, const std::string& label, RoutePaths* paths = nullptr) {
  const int hq = p.shape.num_q_heads, hkv = p.shape.num_kv_heads, d = p.shape.head_dim;
  const int g = p.shape.group_size(), batch = p.cpu_cache->config().max_batch;
  const sk::IndexState& cs = p.cpu->index_state(p.layer);
  const sk::IndexState& gs = p.gpu->index_state(p.layer);
  const std::vector<int32_t> g_idx2 = download(gs.indexed_len, size_t(batch) * hkv);
  const PagedKV cview = p.cpu_cache->view(p.layer);
  for (int b = 0; b < batch; ++b) {
    const auto read_gpu = p.gpu->last_read(p.layer, b);
    const auto read_cpu = p.cpu->last_read(p.layer, b);
    for (int h = 0; h < hkv; ++h) {
      const std::string what = label + " b " + std::to_string(b) + " h " + std::to_string(h);
      EXPECT_EQ(g_idx2[size_t(cs.slot(b, h))], cs.indexed_len[cs.slot(b, h)]) << what;
      const auto gc = p.gpu->last_clusters(p.layer, b, h);
      const auto cc = p.cpu->last_clusters(p.layer, b, h);
      const std::vector<double> scores = p.scores(q_pre, b, h, router == SaapRouter::Mlp);
      expect_same_clusters(gc, cc, scores, router == SaapRouter::Mlp ? 3e-2 : 1e-4, what);
      if (paths) paths->count(scores);
      if (same_index && std::set<int>(gc.begin(), gc.end()) == std::set<int>(cc.begin(), cc.end()))
        EXPECT_EQ(read_gpu[size_t(h) * g], read_cpu[size_t(h) * g]) << what;
      const std::vector<int32_t>& tokens = read_gpu[size_t(h) * g];
      for (int j = 0; j < g; ++j) {
        const size_t row = size_t(b) * hq + h * g + j;
        std::vector<float> qf(static_cast<size_t>(d));
        for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
        std::vector<double> o(static_cast<size_t>(d));
        double lse;
        kernels::attend_cpu(qf.data(), cview, b, h, tokens.data(), int(tokens.size()),
                            p.shape.scale(), o.data(), &lse);
        for (int i = 0; i < d; ++i)
          ASSERT_NEAR(bf16_to_float(out_gpu[row * d + i]), o[size_t(i)],
                      2e-2 * (1 + std::abs(o[size_t(i)])))
              << what << " head " << j << " dim " << i;
      }
    }
  }
}

// The GPU index's member_rows (SaapConfig::member_rows, on by default) against the page rows
// of its members through the GPU cache's page table: sequence b, kv head h, the first n.
void expect_member_rows(Pair& p, int b, int h, int n, const std::string& at) {
  const sk::IndexState& gs = p.gpu->index_state(p.layer);
  if (!p.member_rows) {
    ASSERT_EQ(gs.member_rows, nullptr) << "the engine keeps member rows it was told not to";
    return;
  }
  ASSERT_NE(gs.member_rows, nullptr) << "the engine keeps no member rows";
  const PagedKV kv = p.gpu_cache->view(p.layer);
  const std::vector<int32_t> table =
      download(kv.page_table + int64_t(b) * kv.max_pages_per_seq, size_t(kv.max_pages_per_seq));
  const std::vector<int32_t> members = download(gs.members_of(b, h), size_t(n));
  const std::vector<int32_t> rows = download(gs.member_rows_of(b, h), size_t(n));
  for (int i = 0; i < n; ++i) {
    const int t = members[size_t(i)];
    ASSERT_EQ(rows[size_t(i)], table[size_t(t / kv.page_size)] * kv.page_size + t % kv.page_size)
        << at << ": sequence " << b << " kv head " << h << " member " << i << " (token " << t
        << ")";
  }
}

// lens: one sequence per entry; hidden: the MLP router's width (the GEMVs' K and rows); C
// clusters, of which probes are taken (the route ranks the best 32 among its threshold
// candidates, or by merging sorted warp lists when they overflow; more by a full sort);
// paths, when given, counts the routes' paths (RoutePaths).
void run_pair(SaapRouter router, const std::vector<int>& lens, int hidden, int C = 64,
              int probes = 6, SaapWeights weights = SaapWeights::Bf16,
              const std::function<void(SaapParts&)>& edit = {},
              const ModelShape& shape = saap_test::scene_shape(2), RoutePaths* paths = nullptr,
              bool graph_step = true) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const int batch = int(lens.size());
  Pair p(router, lens, C, hidden, probes, weights, 2048, SaapConfig().fold_every,
         SaapConfig().index_every, edit, shape);
  const int hq = p.shape.num_q_heads, hkv = p.shape.num_kv_heads, d = p.shape.head_dim;
  p.cpu->prefill(p.layer, p.cpu_cache->view(p.layer), nullptr);
  p.gpu->prefill(p.layer, p.gpu_cache->view(p.layer), nullptr);
  const sk::IndexState& cs = p.cpu->index_state(p.layer);
  const sk::IndexState& gs = p.gpu->index_state(p.layer);
  const size_t slots = size_t(batch) * hkv;
  const std::vector<int32_t> g_assign = download(gs.assign, slots * 2048);
  const std::vector<int32_t> g_off = download(gs.offsets, slots * (C + 1));
  const std::vector<int32_t> g_mem = download(gs.members, slots * 2048);
  const std::vector<int32_t> g_idx = download(gs.indexed_len, slots);
  int mismatches = 0, total = 0;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < hkv; ++h) {
      const int64_t s = cs.slot(b, h);
      ASSERT_EQ(g_idx[size_t(s)], cs.indexed_len[s]);
      EXPECT_EQ(cs.indexed_len[s], lens[size_t(b)] - 128);
      for (int t = 4; t < cs.indexed_len[s]; ++t, ++total)
        mismatches += g_assign[size_t(s) * 2048 + t] != cs.assign_of(b, h)[t];
      if (mismatches == 0)
        for (int c = 0; c <= C; ++c)
          ASSERT_EQ(g_off[size_t(s) * (C + 1) + c], cs.offsets_of(b, h)[c]);
      if (mismatches == 0)
        for (int i = 0; i < cs.indexed_len[s] - 4; ++i)
          ASSERT_EQ(g_mem[size_t(s) * 2048 + i], cs.members_of(b, h)[i]) << "member " << i;
      expect_member_rows(p, b, h, cs.indexed_len[s] - 4, "prefill");
    }
  EXPECT_LE(mismatches, total / 200) << "assignments differing between CPU and CUDA";

  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < 4; ++step) {
    const std::vector<bf16> kn = saap_test::random_bf16(batch * size_t(hkv) * d, 500 + step);
    const std::vector<bf16> vn = saap_test::random_bf16(batch * size_t(hkv) * d, 600 + step);
    const std::vector<bf16> q = saap_test::random_bf16(batch * size_t(hq) * d, 700 + step);
    const std::vector<bf16> q_pre = saap_test::random_bf16(batch * size_t(hq) * d, 800 + step);
    p.cpu_cache->begin_step(nullptr);
    p.cpu_cache->append(p.layer, kn.data(), vn.data(), nullptr);
    test::DeviceBuffer<bf16> knd(kn), vnd(vn), qd(q), qpd(q_pre), outd(batch * size_t(hq) * d);
    p.gpu_cache->begin_step(stream);
    p.gpu_cache->append(p.layer, knd.get(), vnd.get(), stream);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<bf16> out_cpu(batch * size_t(hq) * d);
    p.cpu->decode(p.layer, q.data(), q_pre.data(), p.cpu_cache->view(p.layer), out_cpu.data(),
                  nullptr, nullptr);
    const PagedKV gview = p.gpu_cache->view(p.layer);
    if (step < 3 || !graph_step) {
      p.gpu->decode(p.layer, qd.get(), qpd.get(), gview, outd.get(), nullptr, stream);
    } else {  // the whole decode as a CUDA-graph replay
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      p.gpu->decode(p.layer, qd.get(), qpd.get(), gview, outd.get(), nullptr, stream);
      KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_decode_matches(p, router, q, q_pre, outd.download(), mismatches == 0,
                          "step " + std::to_string(step), paths);
  }
  const EngineStats st = p.gpu->stats();
  uint64_t context = 0;  // rows a dense read of the 4 steps reads: len + 1 + s per sequence
  for (int s = 0; s < 4; ++s)
    for (int len : lens) context += uint64_t(len + 1 + s) * hkv;
  EXPECT_EQ(st.kv_rows_context, context);
  EXPECT_GT(st.kv_rows_read, 0u);
  EXPECT_LT(st.kv_rows_read, st.kv_rows_context);
  EXPECT_GT(st.selection_bytes_read, 0u);
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Head counts the decode step cannot serve are refused before any launch, so this needs no
// device: every pointer is host memory that a launch would fault on.
TEST(SaapCuda, DecodeSelectRefusesHeadCountsItCannotServe) {
  std::vector<char> ws(size_t(1) << 20);
  std::vector<bf16> q(32 * 128);
  std::vector<int32_t> sel(64);
  auto call = [&](int hq, int hkv) {
    sk::Router<bf16> r;
    r.num_q_heads = hq;
    r.num_kv_heads = hkv;
    r.head_dim = 128;
    r.hidden = 64;
    r.num_clusters = 64;
    return sk::decode_select_cuda(q.data(), 1, r, 8, sel.data(), ws.data(), ws.size(), nullptr);
  };
  EXPECT_EQ(call(32, 0), cudaErrorInvalidValue) << "no kv heads";
  EXPECT_EQ(call(30, 8), cudaErrorInvalidValue) << "Hq not a multiple of Hkv";
  EXPECT_EQ(call(0, 8), cudaErrorInvalidValue) << "no query heads";
}

// An index for the route's prefetch that is not the router's shape is refused the same way.
TEST(SaapCuda, DecodeSelectRefusesAnIndexOfAnotherShape) {
  std::vector<char> ws(size_t(1) << 20);
  std::vector<bf16> q(32 * 128);
  std::vector<int32_t> sel(64), offsets(2 * 65), members(16);
  sk::Router<bf16> r;
  r.num_q_heads = 32;
  r.num_kv_heads = 8;
  r.head_dim = 128;
  r.hidden = 64;
  r.num_clusters = 64;
  auto call = [&](int hkv, int C, int max_batch) {
    sk::IndexState st;
    st.offsets = offsets.data();
    st.members = members.data();
    st.num_kv_heads = hkv;
    st.num_clusters = C;
    st.max_batch = max_batch;
    st.max_tokens = 2;
    return sk::decode_select_cuda(q.data(), 1, r, 8, sel.data(), ws.data(), ws.size(), nullptr,
                                  &st);
  };
  EXPECT_EQ(call(4, 64, 1), cudaErrorInvalidValue) << "other kv heads";
  EXPECT_EQ(call(8, 128, 1), cudaErrorInvalidValue) << "other clusters";
  EXPECT_EQ(call(8, 64, 0), cudaErrorInvalidValue) << "fewer sequences than the batch";
}

TEST(SaapCuda, MlpRouterMatchesTheCpuEngine) { run_pair(SaapRouter::Mlp, {900, 1300}, 32); }
// Layer 1 of 3 is not the last sparse layer: its decode, index step included, is whole in
// itself, so a graph of that layer's decode alone, captured right after eager decodes of it,
// matches the CPU engine (when the index step ran on a branch that the last sparse layer
// joined, such a capture was refused).
TEST(SaapCuda, GraphOfALayerBeforeTheLastMatchesTheCpuEngine) {
  run_pair(SaapRouter::Mlp, {900, 1300}, 32, 64, 6, SaapWeights::Bf16, {},
           saap_test::scene_shape(3), nullptr, /*graph_step=*/true);
}
TEST(SaapCuda, NearestCentroidRouterMatchesTheCpuEngine) {
  run_pair(SaapRouter::NearestCentroid, {900, 1300}, 32);
}
// Batch 1 with a router 320 wide: 20 steps of 16 columns in the second GEMV (not a multiple
// of the 8 steps loaded at once).
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineAtBatchOneWideHidden) {
  run_pair(SaapRouter::Mlp, {1300}, 320);
}
// The default shape of the route: the best 32 of 1024 clusters, ranked among the threshold
// candidates on the random router's scores.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineThirtyTwoOfAThousandClusters) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  RoutePaths paths;
  run_pair(SaapRouter::Mlp, {1300}, 32, 1024, 32, SaapWeights::Bf16, {}, saap_test::scene_shape(2),
           &paths);
  EXPECT_GT(paths.candidates, 0) << "no route took the candidates' path";
}
// The default route (the best 32 of 1024 clusters) on the random router with its second layer
// scaled by w2_scale and its bias b2(c) for cluster c in every head; returns the routes' paths.
RoutePaths run_pair_with_bias(float w2_scale, const std::function<float(int)>& b2) {
  RoutePaths paths;
  run_pair(
      SaapRouter::Mlp, {1300}, 32, 1024, 32, SaapWeights::Bf16,
      [&](SaapParts& parts) {
        const int C = parts.num_clusters;
        for (SaapLayerParts& l : parts.per_layer) {
          for (float& w : l.w2) w *= w2_scale;
          for (size_t i = 0; i < l.b2.size(); ++i) l.b2[i] = b2(int(i % size_t(C)));
        }
      },
      saap_test::scene_shape(2), &paths);
  return paths;
}
// Exact ties at the route's threshold: with w2 zero every head's logits are b2, so the 32
// clusters 32 w + 5 score the same, the best of every warp; they are the only candidates and
// must come out in ascending id, as on the CPU (the token lists' order follows it).
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithTiedScores) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const RoutePaths paths = run_pair_with_bias(0.f, [](int c) {
    return c % 32 == 5 ? 4.f : c % 32 == 9 ? 2.f : -1.f - 0.001f * float(c);
  });
  EXPECT_GT(paths.candidates, 0) << "the tied clusters did not take the candidates' path";
}
// The best 32 of 1024 in one warp of the route: clusters 0-31 get logits near 8 (0.05 apart),
// the others' fall with the id, so nearly every cluster scores at least the smallest warp
// maximum (warp 31's first), the candidates overflow, and warp 0's whole sorted list must win
// all five merges of route_top32; the softmax's warp maxima differ by orders of magnitude.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWhenOneWarpHoldsTheBestClusters) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const RoutePaths paths = run_pair_with_bias(
      0.01f, [](int c) { return c < 32 ? 8.f + 0.05f * float(c) : -0.004f * float(c); });
  EXPECT_GT(paths.fallback, 0) << "no route overflowed its candidates";
}
// Groups of 8 and of 2 query heads (the scene's are 4): the route's kernels unrolled for 8
// heads and for 4 with two of them empty, at the default route (32 of 1024) and at 40 probes.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithGroupsOfEight) {
  run_pair(SaapRouter::Mlp, {1300}, 32, 1024, 32, SaapWeights::Bf16, {},
           saap_test::scene_shape(2, 16, 2));
  run_pair(SaapRouter::Mlp, {900, 1300}, 32, 64, 40, SaapWeights::Bf16, {},
           saap_test::scene_shape(2, 16, 2));
}
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithGroupsOfTwo) {
  run_pair(SaapRouter::Mlp, {1300}, 32, 1024, 32, SaapWeights::Bf16, {},
           saap_test::scene_shape(2, 4, 2));
  run_pair(SaapRouter::Mlp, {900, 1300}, 32, 64, 40, SaapWeights::Bf16, {},
           saap_test::scene_shape(2, 4, 2));
}
// 2048 clusters: more than the route sorts in registers (kRouteThreads, 1024), so it takes
// the shared-memory bitonic sort.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithTwoThousandClusters) {
  run_pair(SaapRouter::Mlp, {2000}, 32, 2048, 32);
}
// Short prompts (sink 4, recent 128): the CSRs hold 8 and 1 tokens per kv head, so 32 probes
// of 1024 clusters of the average size come to no member at all; the parts must still cover
// the members that the chosen clusters have.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithATinyIndex) {
  run_pair(SaapRouter::Mlp, {140, 133}, 32, 1024, 32);
}
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineWithFortyProbes) {
  run_pair(SaapRouter::Mlp, {900, 1300}, 32, 64, 40);
}
// fp8 router weights (both engines route with the dequantized e4m3 rows): the default shape
// of the route at batch 1 with a 320-wide router (10 loads of 32 columns a row in the second
// GEMV), a 1024-wide one, and batch 2 with 40 hidden units (padded to 48 rows and 64 columns).
TEST(SaapCuda, Fp8RouterMatchesTheCpuEngineAtBatchOne) {
  run_pair(SaapRouter::Mlp, {1300}, 320, 1024, 32, SaapWeights::Fp8);
}
TEST(SaapCuda, Fp8RouterMatchesTheCpuEngineAtBatchOneWideHidden) {
  run_pair(SaapRouter::Mlp, {1300}, 1024, 64, 6, SaapWeights::Fp8);
}
TEST(SaapCuda, Fp8RouterMatchesTheCpuEngineAtBatchTwo) {
  run_pair(SaapRouter::Mlp, {900, 1300}, 40, 64, 6, SaapWeights::Fp8);
}

// A generation of `steps` decode steps after a `prefill`-token prefill (sink 4, recent 128)
// on both engines, checked every `check_every` steps and at the end: the same index lengths
// (the pending tokens assigned on the layer's index steps, saap_test::indexed_after, csr_len
// advanced by fold_every at each fold); assignments equal up to rare near-ties of
// the GPU's fp32 and the CPU's fp64 scores; the GPU's CSR equal to the stable counting sort
// of its own assignments [sink, csr_len) (what a prefill of them builds); and
// expect_decode_matches (whose token lists must be equal where the assignments are).
// C clusters, `probes` of them probed.
void run_generation(int prefill, int steps, int fold_every, int check_every, int C = 64,
                    int probes = 6, int index_every = SaapConfig().index_every,
                    const ModelShape& shape = saap_test::scene_shape(2), bool member_rows = true) {
  constexpr int kRecent = 128, kSink = 4;
  Pair p(SaapRouter::Mlp, {prefill}, C, 32, probes, SaapWeights::Fp8, prefill + steps, fold_every,
         index_every, {}, shape, member_rows);
  const int hq = p.shape.num_q_heads, hkv = p.shape.num_kv_heads, d = p.shape.head_dim;
  ASSERT_EQ(p.parts.num_clusters, C);
  p.cpu->prefill(p.layer, p.cpu_cache->view(p.layer), nullptr);
  p.gpu->prefill(p.layer, p.gpu_cache->view(p.layer), nullptr);
  const sk::IndexState& cs = p.cpu->index_state(p.layer);
  const sk::IndexState& gs = p.gpu->index_state(p.layer);
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < steps; ++step) {
    const std::vector<bf16> kn = saap_test::random_bf16(size_t(hkv) * d, 10000 + step);
    const std::vector<bf16> vn = saap_test::random_bf16(size_t(hkv) * d, 20000 + step);
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 30000 + step);
    const std::vector<bf16> q_pre = saap_test::random_bf16(size_t(hq) * d, 40000 + step);
    p.cpu_cache->begin_step(nullptr);
    p.cpu_cache->append(p.layer, kn.data(), vn.data(), nullptr);
    test::DeviceBuffer<bf16> knd(kn), vnd(vn), qd(q), qpd(q_pre), outd(size_t(hq) * d);
    p.gpu_cache->begin_step(stream);
    p.gpu_cache->append(p.layer, knd.get(), vnd.get(), stream);
    std::vector<bf16> out_cpu(size_t(hq) * d);
    p.cpu->decode(p.layer, q.data(), q_pre.data(), p.cpu_cache->view(p.layer), out_cpu.data(),
                  nullptr, nullptr);
    p.gpu->decode(p.layer, qd.get(), qpd.get(), p.gpu_cache->view(p.layer), outd.get(), nullptr,
                  stream);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (step % check_every != check_every - 1 && step != steps - 1) continue;
    const std::string at = "step " + std::to_string(step);
    const int m0 = prefill - kRecent;  // tokens past the window at the prefill
    const int assigned =
        saap_test::indexed_after(m0, m0 + step + 1, index_every, p.gpu->index_phase(p.layer)) - m0;
    const int csr = prefill - kRecent + (fold_every > 0 ? assigned / fold_every * fold_every : 0);
    const std::vector<int32_t> g_csr = download(gs.csr_len, size_t(hkv));
    int mismatches = 0;
    for (int h = 0; h < hkv; ++h) {
      const int64_t s = cs.slot(0, h);
      const int indexed = cs.indexed_len[s];
      ASSERT_EQ(indexed, prefill - kRecent + assigned) << at;
      ASSERT_EQ(cs.csr_len[s], csr) << at;
      ASSERT_EQ(g_csr[size_t(s)], csr) << at;
      const std::vector<int32_t> ga = download(gs.assign_of(0, h), size_t(indexed));
      for (int t = kSink; t < indexed; ++t) mismatches += ga[size_t(t)] != cs.assign_of(0, h)[t];
      const saap_test::Csr want = saap_test::csr_of(ga.data(), kSink, csr, C);
      ASSERT_EQ(download(gs.offsets_of(0, h), size_t(C) + 1), want.offsets) << at << " h " << h;
      ASSERT_EQ(download(gs.members_of(0, h), want.members.size()), want.members)
          << at << " h " << h;
      expect_member_rows(p, 0, h, int(want.members.size()), at);
    }
    EXPECT_LE(mismatches, (prefill + step) * hkv / 100) << at;
    expect_decode_matches(p, SaapRouter::Mlp, q, q_pre, outd.download(), mismatches == 0, at);
  }
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Without the fold, 2300 steps leave about 2300 assignments outside the CSR: the last steps
// scan more than one round of the token lists' scan (256 threads x 8). Index steps of 4
// tokens, where the others take the default.
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineAfterALongGeneration) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(200, 2300, 0, 512, 64, 6, 4);
}

// Folds every 90 assignments (steps 89, 179, 269, 359), checked around each, with every
// leaving token indexed at once.
TEST(SaapCuda, FoldKeepsTheCsrEqualToTheCpuEngines) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(200, 360, 90, 45, 64, 6, 1);
}

// More clusters than the merge CTA has threads (300: the fold's prefix sums over C + 1 counts
// take two passes) and more members than a round of its moves (about 5,900 a kv head against
// 4,096: two rounds, the lower one partial); folds every 32 assignments (steps 31 and 63).
TEST(SaapCuda, FoldOfManyClustersInTwoRounds) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(6000, 64, 32, 32, 300, 6, 1);
}

// The same with SaapConfig::member_rows off: the attention resolves the members through the
// page table, and the prefill and the folds keep no rows.
TEST(SaapCuda, FoldKeepsTheCsrEqualToTheCpuEnginesWithoutMemberRows) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(200, 360, 90, 45, 64, 6, 1, saap_test::scene_shape(2), false);
}

// The index step at its largest batch: layer 1 (phase 1) assigns 23 tokens on step 22, the
// first after the prefill, then 32 on steps 54, 86 and 118 (the last also folds 90 of the 119
// assignments), checked every 16 steps, so most checks fall between batches.
TEST(SaapCuda, IndexStepOfThirtyTwoTokensMatchesTheCpuEngine) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(200, 130, 90, 16, 64, 6, sk::kMaxIndexStep);
}

// The same at head dim 64: the index step's keys and centroid rows half as wide, the
// attention's tiles of 64 columns.
TEST(SaapCuda, IndexStepOfThirtyTwoTokensAtHeadDimSixtyFour) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(200, 130, 90, 16, 64, 6, sk::kMaxIndexStep, saap_test::scene_shape(2, 8, 2, 64));
}

// SaapEngineCpu.KeysThatScoreNaNGetNoClusterAndThePrefillNamesThem on the GPU engine: a key
// with a NaN in kv head 1 at token 50 (in the prefill's index) and at token 474 (indexed on
// the third decode step, with index_every 1 and folds of 5): the prefill's error is the CPU
// engine's, both assign them -1, and the GPU's CSR, at the prefill and after two folds, is
// the counting sort of its own assignments without them.
TEST(SaapCuda, KeysThatScoreNaNGetNoClusterAsOnTheCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  constexpr int kPrefill = 600, kRecent = 128, kSink = 4, kF = 5, C = 64;
  Pair p(SaapRouter::Mlp, {kPrefill}, C, 32, 6, SaapWeights::Fp8, 2048, kF, 1);
  const int hq = p.shape.num_q_heads, hkv = p.shape.num_kv_heads, d = p.shape.head_dim;
  const int bad_prefill = 50, bad_decode = kPrefill - kRecent + 2;
  std::vector<bf16> k, v;
  saap_test::clustered_kv(p.shape, p.parts, 0, kPrefill, 100, k, v);  // Pair's sequence 0
  for (const int t : {bad_prefill, bad_decode}) {
    const size_t row = size_t(t) * hkv * d;
    k[row + size_t(d) + 7] = float_to_bf16(std::nanf(""));
    p.cpu_cache->write(p.layer, 0, t, 1, k.data() + row, v.data() + row);
    test::DeviceBuffer<bf16> kd(
        std::vector<bf16>(k.begin() + long(row), k.begin() + long(row) + hkv * d));
    test::DeviceBuffer<bf16> vd(
        std::vector<bf16>(v.begin() + long(row), v.begin() + long(row) + hkv * d));
    p.gpu_cache->write(p.layer, 0, t, 1, kd.get(), vd.get());
  }
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string cpu_msg =
      message([&] { p.cpu->prefill(p.layer, p.cpu_cache->view(p.layer), nullptr); });
  const std::string gpu_msg =
      message([&] { p.gpu->prefill(p.layer, p.gpu_cache->view(p.layer), nullptr); });
  EXPECT_NE(cpu_msg.find("1 keys score NaN"), std::string::npos) << cpu_msg;
  EXPECT_NE(cpu_msg.find("kv head 1, token 50;"), std::string::npos) << cpu_msg;
  EXPECT_EQ(gpu_msg, cpu_msg);
  const sk::IndexState& cs = p.cpu->index_state(p.layer);
  const sk::IndexState& gs = p.gpu->index_state(p.layer);
  auto expect_gpu_csr = [&](const std::string& at) {
    const std::vector<int32_t> g_csr = download(gs.csr_len, size_t(hkv));
    for (int h = 0; h < hkv; ++h) {
      const int csr = g_csr[size_t(h)];
      ASSERT_EQ(csr, cs.csr_len[cs.slot(0, h)]) << at;
      const std::vector<int32_t> ga = download(gs.assign_of(0, h), size_t(csr));
      int mismatches = 0;
      for (int t = kSink; t < csr; ++t) mismatches += ga[size_t(t)] != cs.assign_of(0, h)[t];
      EXPECT_LE(mismatches, csr / 100) << at << " h " << h;
      const saap_test::Csr want = saap_test::csr_of(ga.data(), kSink, csr, C);
      ASSERT_EQ(download(gs.offsets_of(0, h), size_t(C) + 1), want.offsets) << at << " h " << h;
      ASSERT_EQ(download(gs.members_of(0, h), want.members.size()), want.members)
          << at << " h " << h;
    }
  };
  EXPECT_EQ(download(gs.assign_of(0, 1) + bad_prefill, 1)[0], -1);
  EXPECT_EQ(cs.assign_of(0, 1)[bad_prefill], -1);
  expect_gpu_csr("prefill");
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int step = 0; step < 2 * kF; ++step) {
    const std::vector<bf16> kn = saap_test::random_bf16(size_t(hkv) * d, 50000 + step);
    const std::vector<bf16> vn = saap_test::random_bf16(size_t(hkv) * d, 60000 + step);
    const std::vector<bf16> q = saap_test::random_bf16(size_t(hq) * d, 70000 + step);
    p.cpu_cache->begin_step(nullptr);
    p.cpu_cache->append(p.layer, kn.data(), vn.data(), nullptr);
    test::DeviceBuffer<bf16> knd(kn), vnd(vn), qd(q), outd(size_t(hq) * d);
    p.gpu_cache->begin_step(stream);
    p.gpu_cache->append(p.layer, knd.get(), vnd.get(), stream);
    std::vector<bf16> out_cpu(size_t(hq) * d);
    p.cpu->decode(p.layer, q.data(), q.data(), p.cpu_cache->view(p.layer), out_cpu.data(), nullptr,
                  nullptr);
    p.gpu->decode(p.layer, qd.get(), qd.get(), p.gpu_cache->view(p.layer), outd.get(), nullptr,
                  stream);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  KVS_CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_EQ(download(gs.assign_of(0, 1) + bad_decode, 1)[0], -1);
  EXPECT_EQ(cs.assign_of(0, 1)[bad_decode], -1);
  expect_gpu_csr("after two folds");
}

// One fold of an index of 150K members per kv head: the copy and the moves take more than
// one round of their grids (8 x 1024 x 8 and 16 x 1024 x 8 members).
TEST(SaapCuda, FoldOfALongIndex) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(150000, 100, 90, 50);
}

// Half of 8 clusters probed over a 150K-token index: about 75K members per kv head, so each
// member part of the attention (at most 64 parts per kv head) takes more than one pass of
// 1024 rows, merged through the part's running state.
TEST(SaapCuda, AttentionPartsOfMoreThanOnePass) {
  KVS_SKIP_WITHOUT_CUDA();
  run_generation(150000, 2, 0, 1, 8, 4);
}

// Shapes the router's tensor-core GEMVs pad: 40 hidden units and 72 clusters (neither a
// multiple of the 16-row tile nor of its 16 columns), and 9 sequences (a second pass of 8
// batch columns).
TEST(SaapCuda, MlpRouterMatchesTheCpuEngineAtPaddedShapesAndNineSequences) {
  run_pair(SaapRouter::Mlp, {900, 1300, 700, 1000, 1100, 800, 1200, 950, 1050}, 40, 72, 6);
}

// A dense layer of the SAAP engine (dense_layers) runs the dense kernel in the engine's own
// workspace, which must hold a full dense decode as well as the part states of the sparse
// layers' attention (attend_workspace_bytes).
TEST(SaapCuda, DenseLayerDecodesInTheEnginesWorkspace) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape shape = saap_test::scene_shape();
  const SaapParts parts = saap_test::random_parts(shape, 64, 32, 11);
  EngineConfig cfg;
  cfg.max_batch = 2;
  cfg.saap.max_context = 2048;
  cfg.saap.dense_layers = {0};
  cfg.backend = Backend::Cuda;
  SaapEngine gpu(shape, cfg, parts);
  test::DeviceBuffer<char> ws(gpu.workspace_bytes());
  gpu.bind_workspace({ws.get(), gpu.workspace_bytes()});
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  const std::vector<int> lens{700, 1500};
  // The same keys and values in a device cache (the engine's) and a host one (the reference's).
  KVCacheConfig cc;
  cc.num_layers = shape.num_layers;
  cc.num_kv_heads = hkv;
  cc.head_dim = d;
  cc.max_batch = 2;
  cc.max_seq_len = 2048;
  KVCache cache(cc);
  cc.device = Device::Cpu;
  KVCache host(cc);
  for (int b = 0; b < 2; ++b) {
    const std::vector<bf16> k = saap_test::random_bf16(size_t(lens[size_t(b)]) * hkv * d, 40 + b);
    const std::vector<bf16> v = saap_test::random_bf16(size_t(lens[size_t(b)]) * hkv * d, 50 + b);
    cache.reserve(b, 2048);
    host.reserve(b, 2048);
    test::DeviceBuffer<bf16> kd(k), vd(v);
    cache.write(0, b, 0, lens[size_t(b)], kd.get(), vd.get());
    host.write(0, b, 0, lens[size_t(b)], k.data(), v.data());
  }
  cache.set_lengths(lens);
  host.set_lengths(lens);
  gpu.prefill(0, cache.view(0), nullptr);
  const std::vector<bf16> q = saap_test::random_bf16(2 * size_t(hq) * d, 60);
  test::DeviceBuffer<bf16> qd(q), outd(2 * size_t(hq) * d);
  gpu.decode(0, qd.get(), qd.get(), cache.view(0), outd.get(), nullptr, nullptr);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16> out = outd.download();
  const PagedKV hview = host.view(0);
  for (int b = 0; b < 2; ++b) {
    const int len = lens[size_t(b)];
    std::vector<int32_t> all(static_cast<size_t>(len));
    for (int t = 0; t < len; ++t) all[size_t(t)] = t;
    for (int h = 0; h < hq; ++h) {
      std::vector<float> qf(static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[(size_t(b) * hq + h) * d + i]);
      std::vector<double> o(static_cast<size_t>(d));
      double lse;
      kernels::attend_cpu(qf.data(), hview, b, h / shape.group_size(), all.data(), len,
                          shape.scale(), o.data(), &lse);
      for (int i = 0; i < d; ++i)
        ASSERT_NEAR(bf16_to_float(out[(size_t(b) * hq + h) * d + i]), o[size_t(i)],
                    2e-2 * (1 + std::abs(o[size_t(i)])))
            << "b " << b << " head " << h << " dim " << i;
    }
  }
}
// A kernel that lets its programmatic dependents launch at once
// (griddepcontrol.launch_dependents), spins for about a millisecond, then copies n 16-bit
// words: the query a step's kernel before the router writes. A GEMV that read it before this
// kernel completed would see the poison it replaces.
__global__ void late_copy_kernel(const unsigned short* src, unsigned short* dst, int n) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long t0 = clock64();
  while (clock64() - t0 < 2000000) {
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// The router MLP on CUDA (mlp_logits_cuda) against fp64 on the host with the same weights. The
// second GEMV reads only the columns of hidden units that are nonzero in some row of its pass
// (up to 16 batch rows), so the hidden layers are shaped: head 0 is all zero (its logits are
// b2 exactly), head 1 has one nonzero unit, the others are about half zero, a different half
// in every batch row. hidden: checked against fp64 of the same weights; logits: against fp64
// from the GPU's own hidden layer rounded as the kernel rounds it (fp16 for e4m3 weights,
// bf16 for bf16), where every product is exact in fp32 and only the sum's rounding differs.
// late_q: the query is written on the call's stream by late_copy_kernel, right before the
// router's first GEMV, which is launched programmatically behind it.
void run_mlp(SaapWeights weights, bool columns, int heads, int d, int hidden, int C, int batch,
             bool late_q = false) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  KVS_CUDA_CHECK(sk::prepare_cuda(hidden));  // as an engine does at construction
  const bool fp8 = weights == SaapWeights::Fp8;
  std::mt19937 rng(uint32_t(heads * 1000 + hidden + C + batch));
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> w1(size_t(heads) * hidden * d), b1(size_t(heads) * hidden),
      w2(size_t(heads) * C * hidden), b2(size_t(heads) * C);
  for (float& x : w1) x = n(rng) / std::sqrt(float(d));
  for (float& x : b1) x = 0.1f * n(rng);
  for (float& x : w2) x = n(rng) / std::sqrt(float(hidden));
  for (float& x : b2) x = 0.1f * n(rng);
  const int lone = hidden / 2 + 3;  // head 1's one nonzero unit
  for (int h = 0; h < std::min(heads, 2); ++h)
    for (int u = 0; u < hidden; ++u) {
      const bool keep = h == 1 && u == lone;
      if (!keep) std::fill_n(w1.begin() + (size_t(h) * hidden + u) * d, d, 0.f);
      b1[size_t(h) * hidden + u] = keep ? 10.f : -1.f;
    }
  // The weights both sides multiply with: e4m3 rows dequantized, or bf16.
  std::vector<uint8_t> q1(w1.size()), q2(w2.size());
  std::vector<float> s1(w1.size() / size_t(d)), s2(w2.size() / size_t(hidden));
  if (fp8) {
    sk::quantize_rows_e4m3(w1.data(), int64_t(s1.size()), d, q1.data(), s1.data(), w1.data());
    sk::quantize_rows_e4m3(w2.data(), int64_t(s2.size()), hidden, q2.data(), s2.data(), w2.data());
  } else {
    for (std::vector<float>* w : {&w1, &w2})
      for (float& x : *w) x = bf16_to_float(float_to_bf16(x));
  }
  std::vector<uint8_t> p1(sk::mma_rows_bytes(heads, hidden, d, fp8)),
      p2(columns ? sk::column_blocks_bytes(heads, C, hidden, fp8)
                 : sk::mma_rows_bytes(heads, C, hidden, fp8));
  bf16* p1b = reinterpret_cast<bf16*>(p1.data());
  bf16* p2b = reinterpret_cast<bf16*>(p2.data());
  if (fp8) {
    sk::pack_mma_rows_e4m3(q1.data(), heads, hidden, d, p1.data());
    if (columns)
      sk::pack_column_blocks_e4m3(q2.data(), heads, C, hidden, p2.data());
    else
      sk::pack_mma_rows_e4m3(q2.data(), heads, C, hidden, p2.data());
  } else {
    sk::pack_mma_rows(w1.data(), heads, hidden, d, p1b);
    if (columns)
      sk::pack_column_blocks(w2.data(), heads, C, hidden, p2b);
    else
      sk::pack_mma_rows(w2.data(), heads, C, hidden, p2b);
  }
  test::DeviceBuffer<uint8_t> p1d(p1), p2d(p2);
  test::DeviceBuffer<float> s1d(s1), s2d(s2), b1d(b1), b2d(b2);
  sk::Router<bf16> r;
  r.b1 = b1d.get();
  r.b2 = b2d.get();
  r.num_q_heads = heads;
  r.num_kv_heads = 1;
  r.head_dim = d;
  r.hidden = hidden;
  r.num_clusters = C;
  r.w2_column_blocks = columns;
  if (fp8) {
    r.w1_e4m3 = p1d.get();
    r.w2_e4m3 = p2d.get();
    r.w1_scale = s1d.get();
    r.w2_scale = s2d.get();
  } else {
    r.w1 = reinterpret_cast<const bf16*>(p1d.get());
    r.w2 = reinterpret_cast<const bf16*>(p2d.get());
  }
  const std::vector<bf16> q =
      saap_test::random_bf16(size_t(batch) * heads * d, uint64_t(batch) + 5);
  test::DeviceBuffer<bf16> qd(q), q_src(q);
  test::DeviceBuffer<float> hid_d(size_t(batch) * heads * hidden), log_d(size_t(batch) * heads * C);
  hid_d.poison();
  log_d.poison();
  cudaStream_t stream = nullptr;
  if (late_q) {
    qd.poison();
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    late_copy_kernel<<<1, 256, 0, stream>>>(reinterpret_cast<const unsigned short*>(q_src.get()),
                                            reinterpret_cast<unsigned short*>(qd.get()),
                                            int(q.size()));
    KVS_CUDA_CHECK(cudaGetLastError());
  }
  KVS_CUDA_CHECK(sk::mlp_logits_cuda(qd.get(), r, batch, hid_d.get(), log_d.get(), stream));
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  if (stream) KVS_CUDA_CHECK(cudaStreamDestroy(stream));
  const std::vector<float> hid = hid_d.download(), logit = log_d.download();
  auto x_rounded = [&](float x) {  // the second GEMV's x
    return fp8 ? __half2float(__float2half_rn(std::min(x, 65504.f)))
               : bf16_to_float(float_to_bf16(x));
  };
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      const size_t row = size_t(b) * heads + h;
      int nonzero = 0;
      for (int u = 0; u < hidden; ++u) {
        const size_t wr = size_t(h) * hidden + u;
        double a = 0.0, mag = 0.0;
        for (int i = 0; i < d; ++i) {
          const double t =
              double(w1[wr * d + i]) *
              (fp8 ? double(__half2float(__float2half_rn(bf16_to_float(q[row * d + i]))))
                   : bf16_to_float(q[row * d + i]));
          a += t;
          mag += std::abs(t);
        }
        a = std::max(a + b1[wr], 0.0);
        const float got = hid[row * hidden + u];
        ASSERT_NEAR(got, a, 1e-4 * (mag + std::abs(b1[wr])) + 1e-6)
            << "b " << b << " head " << h << " unit " << u;
        nonzero += got != 0.f;
      }
      if (h == 0) EXPECT_EQ(nonzero, 0) << "b " << b;
      if (h == 1) EXPECT_EQ(nonzero, 1) << "b " << b;
      if (h >= 2) EXPECT_GT(nonzero, hidden / 4) << "b " << b << " head " << h;
      if (h >= 2) EXPECT_LT(nonzero, hidden * 3 / 4) << "b " << b << " head " << h;
      for (int c = 0; c < C; ++c) {
        const size_t wr = size_t(h) * C + c;
        double a = 0.0, mag = 0.0;
        for (int u = 0; u < hidden; ++u) {
          const double t = double(w2[wr * hidden + u]) * x_rounded(hid[row * hidden + u]);
          a += t;
          mag += std::abs(t);
        }
        const float got = logit[row * C + c];
        if (h == 0) {
          ASSERT_EQ(got, b2[wr]) << "b " << b << " cluster " << c << ": no hidden unit is nonzero";
        } else {
          ASSERT_NEAR(got, a + b2[wr], 1e-4 * mag + 1e-6)
              << "b " << b << " head " << h << " cluster " << c;
        }
      }
    }
}

// Each case in both layouts of w2: column blocks (the nonzero-column GEMV) and fragment order.
void run_mlp_layouts(SaapWeights weights, int heads, int d, int hidden, int C, int batch) {
  for (bool columns : {true, false}) {
    SCOPED_TRACE(columns ? "w2 in column blocks" : "w2 in fragment order");
    run_mlp(weights, columns, heads, d, hidden, C, batch);
  }
}

TEST(SaapCuda, RouterMlpSkipsZeroHiddenUnitsExactly) {
  run_mlp_layouts(SaapWeights::Fp8, 4, 128, 1024, 1024, 1);
  run_mlp_layouts(SaapWeights::Bf16, 4, 128, 1024, 1024, 1);
}
TEST(SaapCuda, RouterMlpAtPaddedShapes) {
  run_mlp_layouts(SaapWeights::Fp8, 3, 64, 200, 100, 3);  // 200 units: a partial tile; 100 rows
  run_mlp_layouts(SaapWeights::Bf16, 3, 64, 200, 100, 3);
}
// Batch 8 is the widest pass of the second GEMV compiled for one n-tile, batch 9 the
// narrowest of the two-tile form (one row in its second tile).
TEST(SaapCuda, RouterMlpAtEightAndNineBatchRows) {
  for (int batch : {8, 9}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    run_mlp_layouts(SaapWeights::Fp8, 2, 128, 1024, 130, batch);
    run_mlp_layouts(SaapWeights::Bf16, 2, 64, 200, 64, batch);
  }
}
TEST(SaapCuda, RouterMlpInTwoPassesOfBatchRows) {
  run_mlp_layouts(SaapWeights::Fp8, 3, 128, 72, 130, 17);
  run_mlp_layouts(SaapWeights::Bf16, 3, 128, 1032, 64, 17);  // 1032 units: two rounds of the scan
}
// The first GEMV is a programmatic launch: right behind a kernel that writes the query late,
// it must still read the query that kernel wrote.
TEST(SaapCuda, RouterMlpReadsTheQueryTheKernelBeforeWrote) {
  for (bool columns : {true, false}) {
    SCOPED_TRACE(columns ? "w2 in column blocks" : "w2 in fragment order");
    run_mlp(SaapWeights::Fp8, columns, 4, 128, 1024, 1024, 1, /*late_q=*/true);
    run_mlp(SaapWeights::Bf16, columns, 3, 128, 200, 100, 3, /*late_q=*/true);
  }
}

// The router's shapes that the CUDA GEMVs cannot serve are refused before any launch.
TEST(SaapCuda, RouterMlpRefusesWidthsItCannotServe) {
  sk::Router<bf16> r;
  r.num_q_heads = 4;
  r.num_kv_heads = 1;
  r.head_dim = 128;
  r.num_clusters = 64;
  r.w1 = r.w2 = reinterpret_cast<const bf16*>(&r);  // host memory: a launch would fault
  float x = 0.f;
  bf16 qv{};
  for (int hidden : {0, 12, sk::kMaxHiddenCuda + 8}) {
    r.hidden = hidden;
    EXPECT_EQ(sk::mlp_logits_cuda(&qv, r, 1, &x, &x, nullptr), cudaErrorInvalidValue) << hidden;
  }
}
}  // namespace
}  // namespace kvs
