// Tactic on the GPU against the CPU reference: k-means (same init: same partition on
// separated data, WCSS within 1% in general), selection and attention on the same cluster
// state (ragged batches, GQA 4 and 8, head dims 64 and 128), P = 1 as dense, and a CUDA-graph
// replay of decode steps during which a recent block is re-clustered inside the graph.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dense/dense_decode.h"
#include "kernels/tactic/tactic.h"
#include "runtime/engine.h"
#include "runtime/kv_cache.h"
#include "runtime/tactic_engine.h"
#include "tests/common/test_util.h"
#include "tests/cuda/captured_replay.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

namespace tk = kernels::tactic;
using test::DeviceBuffer;

ModelShape shape(int hq, int hkv, int d) {
  ModelShape s;
  s.num_layers = 2;
  s.num_q_heads = hq;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.max_position = 8192;
  return s;
}

KVCacheConfig cache_config(const ModelShape& s, int batch, int capacity, Device dev) {
  return test::cache_config(s, 16, batch, capacity, dev);
}

// The same keys in a CPU and a GPU cache: per (sequence, kv head) a mixture of 64 Gaussian
// centres (spread 0.3) with a per-centre scale, so that query scores spread over several
// units; interleaved reservations make the page tables non-contiguous.
struct Pair {
  ModelShape s;
  std::vector<int> lens;
  KVCache cpu, gpu;
  std::vector<bf16> q;
  std::mt19937 gen;

  Pair(const ModelShape& shape_, const std::vector<int>& lens_, int capacity, uint32_t seed)
      : s(shape_),
        lens(lens_),
        cpu(cache_config(shape_, int(lens_.size()), capacity, Device::Cpu)),
        gpu(cache_config(shape_, int(lens_.size()), capacity, Device::Cuda)),
        gen(seed) {
    std::normal_distribution<float> N01(0.f, 1.f);
    const int B = int(lens.size()), d = s.head_dim, row = s.num_kv_heads * d;
    for (int b = 0; b < B; ++b) {
      cpu.reserve(b, capacity / 2);
      gpu.reserve(b, capacity / 2);
    }
    for (int b = 0; b < B; ++b) {
      cpu.reserve(b, capacity);
      gpu.reserve(b, capacity);
    }
    for (int b = 0; b < B; ++b) {
      const int n = lens[size_t(b)];
      std::vector<float> centres(size_t(64) * d), scale(64);
      std::uniform_int_distribution<int> pick(0, 63);
      for (int l = 0; l < s.num_layers; ++l) {
        std::vector<bf16> k(size_t(n) * row), v(k.size());
        for (int h = 0; h < s.num_kv_heads; ++h) {
          for (auto& x : centres) x = N01(gen);
          for (auto& x : scale) x = 0.5f + 1.5f * std::abs(N01(gen));
          for (int t = 0; t < n; ++t) {
            const int c = pick(gen);
            for (int j = 0; j < d; ++j) {
              k[size_t(t) * row + h * d + j] =
                  float_to_bf16(scale[size_t(c)] * centres[size_t(c) * d + j] + 0.3f * N01(gen));
              v[size_t(t) * row + h * d + j] = float_to_bf16(N01(gen));
            }
          }
        }
        cpu.write(l, b, 0, n, k.data(), v.data());
        DeviceBuffer<bf16> dk(k), dv(v);
        gpu.write(l, b, 0, n, dk.get(), dv.get());
      }
    }
    cpu.set_lengths(lens);
    gpu.set_lengths(lens);
    q.resize(size_t(B) * s.num_q_heads * d);
    for (auto& x : q) x = float_to_bf16(0.8f * N01(gen));
  }
};

struct HostState {
  std::vector<bf16> cent;
  std::vector<int32_t> off, mem, nc, cl;
  tk::ClusterState view;
};

HostState download(const tk::ClusterState& d) {
  HostState h;
  const size_t slots = size_t(d.max_batch) * d.num_kv_heads;
  h.cent.resize(slots * d.max_clusters * d.head_dim);
  h.off.resize(slots * (size_t(d.max_clusters) + 1));
  h.mem.resize(slots * d.max_tokens);
  h.nc.resize(slots);
  h.cl.resize(slots);
  auto get = [](auto& v, const void* src) {
    KVS_CUDA_CHECK(cudaMemcpy(v.data(), src, v.size() * sizeof(v[0]), cudaMemcpyDeviceToHost));
  };
  get(h.cent, d.centroids);
  get(h.off, d.offsets);
  get(h.mem, d.members);
  get(h.nc, d.num_clusters);
  get(h.cl, d.clustered_len);
  h.view = d;
  h.view.centroids = h.cent.data();
  h.view.offsets = h.off.data();
  h.view.members = h.mem.data();
  h.view.num_clusters = h.nc.data();
  h.view.clustered_len = h.cl.data();
  return h;
}

// WCSS of the clusters [c0, c1) of (b, h) over the keys of kv (host).
double wcss(const PagedKV& kv, const tk::ClusterState& st, int b, int h, int c0, int c1) {
  double sum = 0.0;
  const int32_t* off = st.offsets_of(b, h);
  const int32_t* mem = st.members_of(b, h);
  for (int c = c0; c < c1; ++c) {
    const bf16* mu = st.centroid(b, h, c);
    for (int m = off[c]; m < off[c + 1]; ++m) {
      const bf16* k = kv.k + kv.offset(b, mem[m], h);
      for (int j = 0; j < kv.head_dim; ++j) {
        const double diff = double(bf16_to_float(k[j])) - bf16_to_float(mu[j]);
        sum += diff * diff;
      }
    }
  }
  return sum;
}

// Same clustering up to rare near-ties: equal sizes, WCSS within 1%, most members equal.
void expect_same_clustering(const PagedKV& kv, const tk::ClusterState& ref,
                            const tk::ClusterState& got, int b, int h, int c0, int c1,
                            const std::string& where) {
  ASSERT_EQ(ref.num_clusters[ref.slot(b, h)], got.num_clusters[got.slot(b, h)]) << where;
  ASSERT_EQ(ref.clustered_len[ref.slot(b, h)], got.clustered_len[got.slot(b, h)]) << where;
  const int lo = ref.offsets_of(b, h)[c0], hi = ref.offsets_of(b, h)[c1];
  ASSERT_EQ(got.offsets_of(b, h)[c0], lo) << where;
  ASSERT_EQ(got.offsets_of(b, h)[c1], hi) << where;
  // A valid partition of [lo, hi), ascending within each cluster.
  std::vector<int> seen(size_t(hi - lo), 0);
  for (int c = c0; c < c1; ++c)
    for (int m = got.offsets_of(b, h)[c]; m < got.offsets_of(b, h)[c + 1]; ++m) {
      const int t = got.members_of(b, h)[m];
      ASSERT_TRUE(t >= lo && t < hi) << where << " token " << t;
      ++seen[size_t(t - lo)];
      if (m > got.offsets_of(b, h)[c]) {
        ASSERT_LT(got.members_of(b, h)[m - 1], t) << where;
      }
    }
  for (int i = 0; i < hi - lo; ++i) ASSERT_EQ(seen[size_t(i)], 1) << where << " token " << lo + i;
  int same = 0;
  for (int m = lo; m < hi; ++m) same += ref.members_of(b, h)[m] == got.members_of(b, h)[m];
  EXPECT_GE(same, 0.9 * (hi - lo)) << where;
  const double w_ref = wcss(kv, ref, b, h, c0, c1), w_got = wcss(kv, got, b, h, c0, c1);
  EXPECT_NEAR(w_got, w_ref, 0.01 * w_ref) << where;
}

std::unique_ptr<Engine> make(const ModelShape& s, Backend backend, int batch, double P,
                             int interval = 2048, int max_context = 4096, bool member_rows = true,
                             int cluster_size = 16) {
  EngineConfig c;
  c.backend = backend;
  c.max_batch = batch;
  c.collect_stats = true;
  c.tactic.target = P;
  c.tactic.max_context = max_context;
  c.tactic.recluster_interval = interval;
  c.tactic.member_rows = member_rows;
  c.tactic.cluster_size = cluster_size;
  return make_engine(Method::Tactic, s, c);
}

// last_read() and stats() right after a decode queued on a non-blocking stream behind other
// work (a kernel that spins about 50 ms) see that decode: they wait for the whole device. A
// plain cudaMemcpy on the legacy stream would copy the lists of the decode before and the
// counts from before the reset.
TEST(TacticCuda, InspectionWaitsForADecodeOnANonBlockingStream) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  Pair p(s, {3000}, 4096, 23);
  auto ge = make(s, Backend::Cuda, 1, 0.9);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  ge->prefill(1, p.gpu.view(1), nullptr);
  std::vector<bf16> other(p.q.rbegin(), p.q.rend());  // other queries, another selection
  DeviceBuffer<bf16> qa(p.q), qb(other), out(p.q.size());
  const auto decode = [&](const DeviceBuffer<bf16>& q, cudaStream_t stream) {
    ge->decode(1, q.get(), nullptr, p.gpu.view(1), out.get(), nullptr, stream);
  };
  // What the decode of qb reads and counts, on the legacy stream.
  ge->reset_stats();
  decode(qb, nullptr);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const uint64_t rows_b = ge->stats().kv_rows_read;
  const std::vector<std::vector<int32_t>> lists_b = ge->last_read(1, 0);
  ASSERT_GT(rows_b, 0u);
  cudaStream_t late = nullptr;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&late, cudaStreamNonBlocking));
  const long long cycles = 100'000'000;  // about 50 ms
  for (const bool lists : {true, false}) {
    decode(qa, nullptr);
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    ASSERT_NE(ge->last_read(1, 0), lists_b) << "the test needs decodes that read differently";
    ge->reset_stats();
    test::spin_then_copy<<<1, 1, 0, late>>>(nullptr, nullptr, cycles);
    KVS_CUDA_CHECK(cudaGetLastError());
    decode(qb, late);
    // One inspection call a round: the first one waits for the decode either way.
    if (lists)
      EXPECT_EQ(ge->last_read(1, 0), lists_b) << "last_read copied before the decode ran";
    else
      EXPECT_EQ(ge->stats().kv_rows_read, rows_b) << "stats copied before the decode ran";
    KVS_CUDA_CHECK(cudaStreamSynchronize(late));
  }
  KVS_CUDA_CHECK(cudaStreamDestroy(late));
}

TEST(TacticCuda, PrefillKMeansMatchesCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  for (int d : {64, 128}) {
    Pair p(shape(8, 2, d), {1000, 333, 2048}, 2100, 11 + d);
    auto ge = make(p.s, Backend::Cuda, 3, 0.9), ce = make(p.s, Backend::Cpu, 3, 0.9);
    ge->prefill(0, p.gpu.view(0), nullptr);
    ce->prefill(0, p.cpu.view(0), nullptr);
    const HostState got = download(dynamic_cast<TacticEngine&>(*ge).cluster_state(0));
    const tk::ClusterState& ref = dynamic_cast<TacticEngine&>(*ce).cluster_state(0);
    for (int b = 0; b < 3; ++b)
      for (int h = 0; h < 2; ++h)
        expect_same_clustering(
            p.cpu.view(0), ref, got.view, b, h, 0, ref.num_clusters[ref.slot(b, h)],
            "d " + std::to_string(d) + " b " + std::to_string(b) + " h " + std::to_string(h));
  }
}

// The prefill's CSR where most clusters are empty and one sequence of the batch is: keys
// that take 5 distinct rows per (sequence, kv head), so that the initial centroids repeat,
// every token goes to the lowest-numbered copy of its row and the other copies stay empty.
// Both backends then cluster identically, so the offsets (across the runs of empty clusters
// and at the problems' edges) and the members are compared exactly.
TEST(TacticCuda, PrefillCsrWithEmptyClustersAndAnEmptySequence) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  const std::vector<int> lens = {640, 0, 480, 1};
  Pair p(s, lens, 2048, 5);
  std::normal_distribution<float> N01(0.f, 1.f);
  const int d = s.head_dim, row = s.num_kv_heads * d;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int n = lens[b];
    if (n == 0) continue;
    std::vector<bf16> distinct(size_t(5) * row), k(size_t(n) * row), v(k.size());
    for (auto& x : distinct) x = float_to_bf16(N01(p.gen));
    for (auto& x : v) x = float_to_bf16(N01(p.gen));
    for (int t = 0; t < n; ++t)
      std::copy_n(distinct.begin() + (t * 7 % 5) * row, row, k.begin() + size_t(t) * row);
    p.cpu.write(0, int(b), 0, n, k.data(), v.data());
    DeviceBuffer<bf16> dk(k), dv(v);
    p.gpu.write(0, int(b), 0, n, dk.get(), dv.get());
  }
  auto ge = make(s, Backend::Cuda, int(lens.size()), 0.9),
       ce = make(s, Backend::Cpu, int(lens.size()), 0.9);
  ge->prefill(0, p.gpu.view(0), nullptr);
  ce->prefill(0, p.cpu.view(0), nullptr);
  const HostState got = download(dynamic_cast<TacticEngine&>(*ge).cluster_state(0));
  const tk::ClusterState& ref = dynamic_cast<TacticEngine&>(*ce).cluster_state(0);
  int empty = 0;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int h = 0; h < s.num_kv_heads; ++h) {
      const std::string where = "b " + std::to_string(b) + " h " + std::to_string(h);
      const int C = ref.num_clusters[ref.slot(int(b), h)];
      ASSERT_EQ(got.nc[size_t(got.view.slot(int(b), h))], C) << where;
      ASSERT_EQ(got.cl[size_t(got.view.slot(int(b), h))], lens[b]) << where;
      if (lens[b] == 0) continue;
      for (int c = 0; c <= C; ++c)
        ASSERT_EQ(got.view.offsets_of(int(b), h)[c], ref.offsets_of(int(b), h)[c])
            << where << " offset " << c;
      for (int c = 0; c < C; ++c)
        empty += ref.offsets_of(int(b), h)[c + 1] == ref.offsets_of(int(b), h)[c];
      for (int m = 0; m < lens[b]; ++m)
        ASSERT_EQ(got.view.members_of(int(b), h)[m], ref.members_of(int(b), h)[m])
            << where << " member " << m;
    }
  // 40 + 30 + 1 clusters per kv head, at most 5 + 5 + 1 of them used.
  EXPECT_GE(empty, 2 * (40 + 30 + 1 - 11));
}

// The decode-time re-clustering of a block of 2048 tokens (the default interval: a cluster of
// 8 CTAs, one pass; head_dim 128 and 64) and of 2560 (two passes, the second on two of the 8
// CTAs), called directly on prefilled states rewound by one block: the new clusters against
// the CPU k-means of the block's keys from the same initialisation (a valid partition,
// ascending members, at least 90 % of members placed alike, WCSS within 1 %), and the earlier
// clusters untouched.
TEST(TacticCuda, ReclusteringOfLargeBlocksMatchesCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<int, int>> cases = {{2048, 128}, {2560, 128}, {2048, 64}};
  for (const auto& [T, head_dim] : cases) {
    const ModelShape s = shape(8, 2, head_dim);
    const std::vector<int> lens = {4096, 3000};
    Pair p(s, lens, 4096, 17 + T + head_dim);
    auto ge = make(s, Backend::Cuda, 2, 0.9, T, 4096);
    auto& te = dynamic_cast<TacticEngine&>(*ge);
    ge->prefill(0, p.gpu.view(0), nullptr);
    const tk::ClusterState& st = te.cluster_state(0);
    const HostState before = download(st);
    std::vector<int32_t> nc(before.nc), cl(before.cl);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        cl[size_t(b * 2 + h)] = lens[size_t(b)] - T;
        nc[size_t(b * 2 + h)] = tk::kmeans_num_clusters(lens[size_t(b)] - T, 16);
      }
    KVS_CUDA_CHECK(cudaMemcpy(st.num_clusters, nc.data(), nc.size() * 4, cudaMemcpyHostToDevice));
    KVS_CUDA_CHECK(cudaMemcpy(st.clustered_len, cl.data(), cl.size() * 4, cudaMemcpyHostToDevice));
    tk::KMeansParams km;
    km.seed = te.tactic_config().seed;
    KVS_CUDA_CHECK(tk::recluster_blocks_cuda(p.gpu.view(0), 0, T, km, st, nullptr));
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    const HostState got = download(st);
    const PagedKV kv = p.cpu.view(0);
    const int d = s.head_dim, C = T / 16;
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        const std::string where = "T " + std::to_string(T) + " d " + std::to_string(head_dim) +
                                  " b " + std::to_string(b) + " h " + std::to_string(h);
        const size_t slot = size_t(b * 2 + h);
        const int start = cl[slot], c0 = nc[slot];
        ASSERT_EQ(got.cl[slot], start + T) << where;
        ASSERT_EQ(got.nc[slot], c0 + C) << where;
        for (int c = 0; c < c0; ++c)
          ASSERT_EQ(got.view.offsets_of(b, h)[c], before.view.offsets_of(b, h)[c]) << where;
        std::vector<float> keys(size_t(T) * d);
        for (int i = 0; i < T; ++i)
          for (int j = 0; j < d; ++j)
            keys[size_t(i) * d + j] = bf16_to_float(kv.k[kv.offset(b, start + i, h) + j]);
        std::vector<bf16> cent(size_t(C) * d);
        std::vector<int32_t> off(size_t(C) + 1), mem(static_cast<size_t>(T));
        tk::kmeans_cpu(keys.data(), T, d, C, km.iterations, tk::kmeans_stream(km.seed, 0, h, start),
                       cent.data(), off.data(), mem.data());
        // The CPU's CSR of the block, shifted to the state's numbering, as a reference state.
        HostState ref = download(st);
        for (int c = 0; c <= C; ++c) ref.view.offsets_of(b, h)[c0 + c] = start + off[size_t(c)];
        for (int i = 0; i < T; ++i) ref.view.members_of(b, h)[start + i] = start + mem[size_t(i)];
        std::copy(cent.begin(), cent.end(), ref.view.centroid(b, h, c0));
        expect_same_clustering(kv, ref.view, got.view, b, h, c0, c0 + C, where);
      }
  }
}

// Selection, union and attention of the GPU against the CPU reference run on the GPU's own
// cluster state (so that only the selection and attention arithmetic is compared).
void check_decode(int hq, int hkv, int d, const std::vector<int>& lens, double P, uint32_t seed,
                  int max_context = 4096, bool zero_queries = false, int cluster_size = 16) {
  const ModelShape s = shape(hq, hkv, d);
  const int B = int(lens.size()), g = hq / hkv;
  Pair p(s, lens, std::max(4096, *std::max_element(lens.begin(), lens.end())), seed);
  if (zero_queries) std::fill(p.q.begin(), p.q.end(), float_to_bf16(0.f));
  auto ge = make(s, Backend::Cuda, B, P, 2048, max_context, true, cluster_size);
  auto& te = dynamic_cast<TacticEngine&>(*ge);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  ge->prefill(1, p.gpu.view(1), nullptr);
  DeviceBuffer<bf16> dq(p.q), dout(p.q.size());
  DeviceBuffer<float> dlse(size_t(B) * hq);
  dout.poison();
  ge->decode(1, dq.get(), nullptr, p.gpu.view(1), dout.get(), dlse.get(), nullptr);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16> out = dout.download();
  const std::vector<float> lse = dlse.download();
  const HostState st = download(te.cluster_state(1));
  const tk::Selection sel = te.last_selection();
  std::vector<int32_t> counts(size_t(B) * hkv);
  KVS_CUDA_CHECK(cudaMemcpy(counts.data(), sel.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
  const PagedKV kv = p.cpu.view(1);
  tk::FitParams fit;
  fit.target = P;
  const std::string tag = "hq " + std::to_string(hq) + " d " + std::to_string(d) + " P " +
                          std::to_string(P) + " clusters of " + std::to_string(cluster_size);
  int exact_sets = 0;
  uint64_t rows = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < hkv; ++h) {
      const int slot = b * hkv + h;
      std::vector<int32_t> tokens(static_cast<size_t>(counts[size_t(slot)]));
      KVS_CUDA_CHECK(cudaMemcpy(tokens.data(), sel.tokens + int64_t(slot) * sel.max_tokens,
                                tokens.size() * 4, cudaMemcpyDeviceToHost));
      rows += tokens.size();
      std::vector<uint8_t> flags(size_t(st.nc[size_t(slot)]), 0);
      for (int j = 0; j < g; ++j) {
        std::vector<float> qf(static_cast<size_t>(d));
        for (int i = 0; i < d; ++i)
          qf[size_t(i)] = bf16_to_float(p.q[(size_t(b) * hq + h * g + j) * d + i]);
        tk::select_clusters_cpu(qf.data(), kv, b, h, s.scale(), fit, st.view, flags.data(),
                                nullptr);
      }
      const std::vector<int32_t> want = tk::selected_tokens_cpu(kv, b, h, st.view, flags.data());
      const std::set<int32_t> a(tokens.begin(), tokens.end()), e(want.begin(), want.end());
      ASSERT_EQ(a.size(), tokens.size()) << tag << ": duplicate tokens in the selection";
      if (a == e) ++exact_sets;
      // A near-tie of scores or budgets may move the cut by a cluster or two, never more.
      std::vector<int32_t> diff;
      std::set_symmetric_difference(a.begin(), a.end(), e.begin(), e.end(),
                                    std::back_inserter(diff));
      EXPECT_LE(diff.size(), size_t(6 * cluster_size)) << tag << " b " << b << " h " << h;
      for (int t = st.cl[size_t(slot)]; t < lens[size_t(b)]; ++t) EXPECT_TRUE(a.count(t));
      // Attention over exactly the GPU's tokens.
      for (int j = 0; j < g; ++j) {
        const size_t row = size_t(b) * hq + h * g + j;
        std::vector<float> qf(static_cast<size_t>(d));
        for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(p.q[row * d + i]);
        std::vector<double> o(static_cast<size_t>(d));
        double l;
        kernels::attend_cpu(qf.data(), kv, b, h, tokens.data(), int(tokens.size()), s.scale(),
                            o.data(), &l);
        double num = 0.0, den = 0.0;
        for (int i = 0; i < d; ++i) {
          const double x = bf16_to_float(out[row * d + i]);
          ASSERT_FALSE(std::isnan(x)) << tag << " row " << row;
          num += (x - o[size_t(i)]) * (x - o[size_t(i)]);
          den += o[size_t(i)] * o[size_t(i)];
        }
        EXPECT_LT(std::sqrt(num / den), 2e-2) << tag << " row " << row;
        EXPECT_NEAR(lse[row], l, 2e-3 * std::max(1.0, std::abs(l))) << tag << " row " << row;
      }
    }
  EXPECT_GE(exact_sets, (B * hkv * 9) / 10) << tag;
  const EngineStats stats = ge->stats();
  EXPECT_EQ(stats.kv_rows_read, rows);
  uint64_t ctx = 0;
  for (int n : lens) ctx += uint64_t(n) * hkv;
  EXPECT_EQ(stats.kv_rows_context, ctx);
  EXPECT_GT(stats.selection_bytes_read, 0u);
}

TEST(TacticCuda, SelectionAndAttentionMatchCpuGqa4) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(8, 2, 128, {1500, 200, 777}, 0.9, 21);
  check_decode(8, 2, 64, {3000, 65}, 0.5, 22);
}

TEST(TacticCuda, SelectionAndAttentionMatchCpuGqa8) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(16, 2, 128, {2500, 1, 900}, 0.9, 23);
  check_decode(32, 4, 64, {1200}, 0.75, 24);
}

// A full-size list for the one-CTA bucket sort: 8192 clusters per kv head at 128K, whose
// centroids bunch around the data's 64 centres, so that the scores crowd into a few parts
// of their range and many clusters share a bucket (or, past kOrderMaxBucket, the radix-sort
// fallback takes over).
TEST(TacticCuda, FullSizeClusterListsMatchCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(8, 2, 128, {131072}, 0.9, 27, 131072);
}

// Larger clusters than the spec's 16 (TacticConfig::cluster_size): fewer, longer lists of
// members; at 256K, 32 keeps the list at 8192 clusters, in the order kernel's bucket sort
// where 16 would take the radix sort.
TEST(TacticCuda, LargerClustersMatchCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(8, 2, 128, {3000, 777}, 0.9, 31, 4096, false, 32);
  check_decode(8, 2, 64, {2500}, 0.75, 32, 4096, false, 64);
  check_decode(8, 2, 128, {262144}, 0.9, 33, 262144, false, 32);
}

// Cluster capacities above 8192 (contexts beyond 128K) sort every row in one CUB radix sort
// instead of the order kernel's bucket sort; both must give the CPU's order, also when every
// score is equal (ties to the lower cluster id) and past each row's count of clusters. At
// 270,000 tokens (16,875 clusters) the prefix kernel takes its list in two rounds.
TEST(TacticCuda, SegmentedSortPathForLongContexts) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(8, 2, 128, {2000, 300}, 0.9, 25, 140000);
  check_decode(8, 2, 128, {1500, 300}, 0.75, 28, 140000, true);
  check_decode(8, 2, 128, {270000}, 0.9, 29, 270000);
}

// Zero queries score every cluster 0: the bucket sort has no spread to bucket by, and the
// order kernel falls back to its block radix sort, which must keep the CPU's order (ties to
// the lower cluster id) exactly.
TEST(TacticCuda, EqualScoresTakeTheRadixSortFallback) {
  KVS_SKIP_WITHOUT_CUDA();
  check_decode(8, 2, 128, {1500, 300}, 0.75, 26, 4096, true);
}

// The order kernel ranks only the top of each head's order (at least ranked_min clusters) and
// the fit windows; a budget whose cut falls past the top finds it in the order kernel's bucket
// groups, ranking the cut's group itself (tactic.cu). Every ranked_min must give the selection
// of a fully ranked order bit for bit: the tokens, their count and each head's budget, on
// workspaces poisoned beforehand so that a position nobody wrote is caught. ranked_min 0 ranks
// the exact samples' clusters alone, so that most cuts go to the groups.
void check_ranked_top(int hq, int hkv, const std::vector<int>& lens, int max_context, uint32_t seed,
                      bool zero_queries = false, double target = 0.9) {
  const ModelShape s = shape(hq, hkv, 128);
  const int B = int(lens.size());
  Pair p(s, lens, std::max(4096, *std::max_element(lens.begin(), lens.end())), seed);
  if (zero_queries) std::fill(p.q.begin(), p.q.end(), float_to_bf16(0.f));
  auto ge = make(s, Backend::Cuda, B, target, 2048, max_context);
  auto& te = dynamic_cast<TacticEngine&>(*ge);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  ge->prefill(1, p.gpu.view(1), nullptr);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const tk::ClusterState st = te.cluster_state(1);
  const PagedKV kv = p.gpu.view(1);
  DeviceBuffer<bf16> dq(p.q);
  tk::FitParams fit;
  fit.target = target;
  const size_t bytes =
      tk::select_workspace_bytes(B, hq, hkv, 128, st.max_clusters, st.max_tokens, fit);
  struct Out {
    std::vector<int32_t> counts, selected;
    std::vector<std::vector<int32_t>> tokens;
  };
  auto run = [&](int ranked_min) {
    const size_t list = size_t(st.max_tokens);
    DeviceBuffer<int32_t> rows(size_t(B) * hkv * list), tokens(size_t(B) * hkv * list),
        counts(size_t(B) * hkv), selected(size_t(B) * hq);
    DeviceBuffer<char> scratch(bytes);
    scratch.poison();
    tk::Selection sel;
    sel.rows = rows.get();
    sel.tokens = tokens.get();
    sel.counts = counts.get();
    sel.selected = selected.get();
    sel.max_tokens = st.max_tokens;
    KVS_CUDA_CHECK(tk::select_tokens_cuda(dq.get(), hq, kv, s.scale(), fit, st, sel, nullptr,
                                          scratch.get(), bytes, nullptr, ranked_min));
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    Out o;
    o.counts = counts.download();
    o.selected = selected.download();
    const std::vector<int32_t> all = tokens.download();
    for (size_t x = 0; x < o.counts.size(); ++x)
      o.tokens.emplace_back(all.begin() + int64_t(x * list),
                            all.begin() + int64_t(x * list) + o.counts[x]);
    return o;
  };
  const Out one = run(st.max_clusters);  // every cluster ranked
  for (int ranked_min : {0, 1, 17, -1}) {
    const Out got = run(ranked_min);
    const std::string tag =
        "ranked_min " + std::to_string(ranked_min) + ", target " + std::to_string(target);
    EXPECT_EQ(got.selected, one.selected) << tag;
    EXPECT_EQ(got.counts, one.counts) << tag;
    EXPECT_EQ(got.tokens, one.tokens) << tag;
  }
  // The budgets are not trivially empty or whole, and some cut falls well past the exact
  // samples' clusters, where ranked_min 0 leaves it to the groups.
  bool past_top = false;
  for (size_t r = 0; r < one.selected.size(); ++r) {
    const int n = lens[r / size_t(hq)];
    EXPECT_GT(one.selected[r], 0) << "row " << r;
    EXPECT_LE(one.selected[r], n) << "row " << r;
    past_top = past_top || one.selected[r] > n / 10;
  }
  EXPECT_TRUE(past_top);
  EXPECT_EQ(tk::select_tokens_cuda(dq.get(), hq, kv, s.scale(), fit, st, te.last_selection(),
                                   nullptr, ws.get(), bytes, nullptr, -2),
            cudaErrorInvalidValue);
}

TEST(TacticCuda, CutsPastTheRankedTopGiveTheFullySortedSelection) {
  KVS_SKIP_WITHOUT_CUDA();
  check_ranked_top(8, 2, {1500, 200, 777}, 4096, 41);
  check_ranked_top(8, 2, {131072}, 131072, 42);         // 8192 clusters a list
  check_ranked_top(8, 2, {131072, 5000}, 131072, 44, false, 0.99);  // every cut past the top
  check_ranked_top(8, 2, {1500, 300}, 4096, 43, true);  // the radix-sort fallback
}

TEST(TacticCuda, TargetOneIsDenseAttention) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  Pair p(s, {1234, 50}, 2000, 31);
  auto ge = make(s, Backend::Cuda, 2, 1.0);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  ge->prefill(0, p.gpu.view(0), nullptr);
  DeviceBuffer<bf16> dq(p.q), dout(p.q.size());
  dout.poison();
  ge->decode(0, dq.get(), nullptr, p.gpu.view(0), dout.get(), nullptr, nullptr);
  const std::vector<bf16> out = dout.download();
  std::vector<float> ref(p.q.size());
  kernels::dense_decode_cpu(p.q.data(), 8, p.cpu.view(0), float(s.scale()), ref.data(), nullptr);
  for (int r = 0; r < 16; ++r) {
    double num = 0.0, den = 0.0;
    for (int i = 0; i < 128; ++i) {
      const double x = bf16_to_float(out[size_t(r) * 128 + i]), e = ref[size_t(r) * 128 + i];
      num += (x - e) * (x - e);
      den += e * e;
    }
    EXPECT_LT(std::sqrt(num / den), 2e-2) << "row " << r;
  }
  EXPECT_DOUBLE_EQ(ge->stats().kv_read_fraction(), 1.0);
}

// Decode steps captured once in a CUDA graph (begin step, append, decode for both layers)
// and replayed; the re-clustering interval is 32, so blocks are clustered inside replays.
TEST(TacticCuda, GraphReplayWithReclusteringMatchesCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  const std::vector<int> prompt{700, 301};
  const int B = 2, d = 128, row = s.num_kv_heads * d, steps = 70, interval = 32;
  Pair p(s, prompt, 800, 41);
  auto ge = make(s, Backend::Cuda, B, 0.9, interval);
  auto& te = dynamic_cast<TacticEngine&>(*ge);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  for (int l = 0; l < s.num_layers; ++l) ge->prefill(l, p.gpu.view(l), nullptr);
  const size_t qn = size_t(B) * s.num_q_heads * d, kn = size_t(B) * row;
  DeviceBuffer<bf16> dq(qn), dk(kn * s.num_layers), dv(kn * s.num_layers), dout(qn * s.num_layers);
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  p.gpu.enqueue_step(stream);
  for (int l = 0; l < s.num_layers; ++l) {
    p.gpu.append(l, dk.get() + l * kn, dv.get() + l * kn, stream);
    ge->decode(l, dq.get(), nullptr, p.gpu.view(l), dout.get() + l * qn, nullptr, stream);
  }
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::normal_distribution<float> N01(0.f, 1.f);
  const int layer = s.num_layers - 1;  // the selection buffer holds the last layer's
  for (int step = 1; step <= steps; ++step) {
    std::vector<bf16> q(qn), k(kn * s.num_layers), v(kn * s.num_layers);
    for (auto& x : q) x = float_to_bf16(0.8f * N01(p.gen));
    for (auto& x : k) x = float_to_bf16(N01(p.gen));
    for (auto& x : v) x = float_to_bf16(N01(p.gen));
    dq.upload(q);
    dk.upload(k);
    dv.upload(v);
    dout.poison();
    p.gpu.commit_step();
    KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    p.cpu.begin_step(nullptr);
    for (int l = 0; l < s.num_layers; ++l)
      p.cpu.append(l, k.data() + l * kn, v.data() + l * kn, nullptr);
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    const HostState st = download(te.cluster_state(layer));
    const PagedKV kv = p.cpu.view(layer);
    for (int b = 0; b < B; ++b) {
      const int len = prompt[size_t(b)] + step;
      // Blocks of 32 are clustered as soon as 32 tokens are unclustered.
      const int blocks = step / interval;
      const int C0 = (prompt[size_t(b)] + 15) / 16;
      for (int h = 0; h < 2; ++h) {
        const int slot = b * 2 + h;
        ASSERT_EQ(st.cl[size_t(slot)], prompt[size_t(b)] + blocks * interval) << "step " << step;
        ASSERT_EQ(st.nc[size_t(slot)], C0 + blocks * (interval / 16)) << "step " << step;
      }
      if (step % interval == 0) {
        // The new block against the CPU k-means of its keys, same init.
        const int start = prompt[size_t(b)] + step - interval;
        for (int h = 0; h < 2; ++h) {
          std::vector<float> keys(size_t(interval) * d);
          for (int i = 0; i < interval; ++i)
            for (int j = 0; j < d; ++j)
              keys[size_t(i) * d + j] = bf16_to_float(kv.k[kv.offset(b, start + i, h) + j]);
          std::vector<bf16> cent(size_t(2) * d);
          std::vector<int32_t> off(3), mem(static_cast<size_t>(interval));
          tk::kmeans_cpu(keys.data(), interval, d, 2, 10,
                         tk::kmeans_stream(te.tactic_config().seed, layer, h, start), cent.data(),
                         off.data(), mem.data());
          const double w_ref =
              tk::kmeans_wcss_cpu(keys.data(), interval, d, 2, cent.data(), off.data(), mem.data());
          const int c0 = st.nc[size_t(b * 2 + h)] - 2;
          EXPECT_NEAR(wcss(kv, st.view, b, h, c0, c0 + 2), w_ref, 0.01 * w_ref) << "step " << step;
        }
      }
      // Output of the last layer against attention over the GPU's selection of that layer.
      const tk::Selection sel = te.last_selection();
      const std::vector<bf16> out = [&] {
        std::vector<bf16> o(qn);
        KVS_CUDA_CHECK(
            cudaMemcpy(o.data(), dout.get() + layer * qn, qn * 2, cudaMemcpyDeviceToHost));
        return o;
      }();
      for (int h = 0; h < 2; ++h) {
        const int slot = b * 2 + h;
        int count = 0;
        KVS_CUDA_CHECK(cudaMemcpy(&count, sel.counts + slot, 4, cudaMemcpyDeviceToHost));
        std::vector<int32_t> tokens(static_cast<size_t>(count));
        KVS_CUDA_CHECK(cudaMemcpy(tokens.data(), sel.tokens + int64_t(slot) * sel.max_tokens,
                                  tokens.size() * 4, cudaMemcpyDeviceToHost));
        const std::set<int32_t> a(tokens.begin(), tokens.end());
        for (int t = st.cl[size_t(slot)]; t < len; ++t) ASSERT_TRUE(a.count(t)) << "recent " << t;
        for (int j = 0; j < 4; ++j) {
          const size_t r = size_t(b) * 8 + h * 4 + j;
          std::vector<float> qf(static_cast<size_t>(d));
          for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[r * d + i]);
          std::vector<double> o(static_cast<size_t>(d));
          double l;
          kernels::attend_cpu(qf.data(), kv, b, h, tokens.data(), count, s.scale(), o.data(), &l);
          double num = 0.0, den = 0.0;
          for (int i = 0; i < d; ++i) {
            const double x = bf16_to_float(out[r * d + i]);
            num += (x - o[size_t(i)]) * (x - o[size_t(i)]);
            den += o[size_t(i)] * o[size_t(i)];
          }
          ASSERT_LT(std::sqrt(num / den), 2e-2) << "step " << step << " row " << r;
        }
      }
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The state keeps each member's page row (TacticConfig::member_rows). After the prefill and
// after blocks re-clustered during decode steps, every kept row is the page table's row of its
// member (the Pair's page tables are not contiguous), and an engine that goes through the page
// table instead decodes the same outputs, bit for bit, step by step.
TEST(TacticCuda, MemberRowsFollowThePageTable) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  const std::vector<int> prompt{700, 301};
  const int B = 2, d = 128, row = s.num_kv_heads * d, steps = 40, interval = 32;
  Pair p(s, prompt, 800, 51);
  auto kept = make(s, Backend::Cuda, B, 0.9, interval),
       through = make(s, Backend::Cuda, B, 0.9, interval, 4096, false);
  auto& te = dynamic_cast<TacticEngine&>(*kept);
  DeviceBuffer<char> ws_kept(kept->workspace_bytes()), ws_through(through->workspace_bytes());
  kept->bind_workspace({ws_kept.get(), ws_kept.size()});
  through->bind_workspace({ws_through.get(), ws_through.size()});
  for (int l = 0; l < s.num_layers; ++l) {
    kept->prefill(l, p.gpu.view(l), nullptr);
    through->prefill(l, p.gpu.view(l), nullptr);
  }
  ASSERT_EQ(dynamic_cast<TacticEngine&>(*through).cluster_state(0).member_rows, nullptr);
  const auto check_rows = [&](const std::string& when, int clustered) {
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    const PagedKV kv = p.gpu.view(0);
    std::vector<int32_t> table(size_t(B) * kv.max_pages_per_seq);
    KVS_CUDA_CHECK(
        cudaMemcpy(table.data(), kv.page_table, table.size() * 4, cudaMemcpyDeviceToHost));
    for (int l = 0; l < s.num_layers; ++l) {
      const tk::ClusterState st = te.cluster_state(l);
      ASSERT_NE(st.member_rows, nullptr);
      const HostState h = download(st);
      std::vector<int32_t> rows(h.mem.size());
      KVS_CUDA_CHECK(
          cudaMemcpy(rows.data(), st.member_rows, rows.size() * 4, cudaMemcpyDeviceToHost));
      int checked = 0;
      for (int b = 0; b < B; ++b)
        for (int hh = 0; hh < s.num_kv_heads; ++hh) {
          const size_t slot = size_t(st.slot(b, hh));
          for (int m = 0; m < h.cl[slot]; ++m, ++checked) {
            const size_t at = slot * size_t(st.max_tokens) + size_t(m);
            ASSERT_EQ(rows[at], page_row(table.data() + size_t(b) * kv.max_pages_per_seq,
                                         kv.page_size, h.mem[at]))
                << when << ": layer " << l << " b " << b << " h " << hh << " member " << m;
          }
        }
      EXPECT_EQ(checked, clustered * s.num_kv_heads) << when;
    }
  };
  check_rows("after the prefill", 700 + 301);
  const size_t qn = size_t(B) * s.num_q_heads * d, kn = size_t(B) * row;
  DeviceBuffer<bf16> dq(qn), dk(kn), dv(kn), out_kept(qn), out_through(qn);
  std::normal_distribution<float> N01(0.f, 1.f);
  for (int step = 1; step <= steps; ++step) {
    std::vector<bf16> q(qn), k(kn), v(kn);
    for (auto& x : q) x = float_to_bf16(0.8f * N01(p.gen));
    dq.upload(q);
    p.gpu.begin_step(nullptr);
    for (int l = 0; l < s.num_layers; ++l) {
      for (auto& x : k) x = float_to_bf16(N01(p.gen));
      for (auto& x : v) x = float_to_bf16(N01(p.gen));
      dk.upload(k);
      dv.upload(v);
      p.gpu.append(l, dk.get(), dv.get(), nullptr);
      out_kept.poison();
      out_through.poison();
      kept->decode(l, dq.get(), nullptr, p.gpu.view(l), out_kept.get(), nullptr, nullptr);
      through->decode(l, dq.get(), nullptr, p.gpu.view(l), out_through.get(), nullptr, nullptr);
      const std::vector<bf16> a = out_kept.download(), e = out_through.download();
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_EQ(a[i].bits, e[i].bits) << "step " << step << " layer " << l << " element " << i;
    }
  }
  // Both sequences re-clustered one block of 32 at step 32.
  check_rows("after a block re-clustered", 700 + 301 + 2 * interval);
}

// The step that re-clusters selects from the clusters it appends. A block of keys along the
// queries (16 tokens at 2u, then 16 at 1.5u), re-clustered inside the step, must be scored with
// its new centroids: the 2u cluster then ranks first and is selected, as the CPU's selection
// on the GPU's state says. The state first served a longer prefill, whose clusters 44 and 45
// sit where the block's go, so that stale centroids there would be read as another cluster.
TEST(TacticCuda, StepThatReclustersSelectsFromItsNewClusters) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 128);
  const int d = 128, g = 4, interval = 32, layer = 1, first = 1500, len = 700;
  Pair p(s, {first}, 1600, 61);
  auto ge = make(s, Backend::Cuda, 1, 0.9, interval);
  auto& te = dynamic_cast<TacticEngine&>(*ge);
  DeviceBuffer<char> ws(ge->workspace_bytes());
  ge->bind_workspace({ws.get(), ws.size()});
  DeviceBuffer<bf16> dq(p.q), dout(p.q.size());
  ge->prefill(layer, p.gpu.view(layer), nullptr);
  ge->decode(layer, dq.get(), nullptr, p.gpu.view(layer), dout.get(), nullptr, nullptr);
  p.gpu.set_lengths({len});
  p.cpu.set_lengths({len});
  ge->prefill(layer, p.gpu.view(layer), nullptr);
  // Queries along u (norm about sqrt(d)): logits 0.5 a d scale for keys a u, 11.3 at a = 2.
  std::normal_distribution<float> N01(0.f, 1.f);
  std::vector<float> u(static_cast<size_t>(d));
  for (auto& x : u) x = N01(p.gen);
  std::vector<bf16> q(p.q.size()), k(size_t(s.num_kv_heads) * d), v(k.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = float_to_bf16(0.5f * u[i % size_t(d)]);
  dq.upload(q);
  DeviceBuffer<bf16> dk(k.size()), dv(v.size());
  for (int step = 1; step <= interval; ++step) {
    const float a = step <= interval / 2 ? 2.f : 1.5f;
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = float_to_bf16(a * u[i % size_t(d)] + 0.05f * N01(p.gen));
      v[i] = float_to_bf16(N01(p.gen));
    }
    dk.upload(k);
    dv.upload(v);
    p.gpu.begin_step(nullptr);
    p.gpu.append(layer, dk.get(), dv.get(), nullptr);
    p.cpu.begin_step(nullptr);
    p.cpu.append(layer, k.data(), v.data(), nullptr);
    ge->decode(layer, dq.get(), nullptr, p.gpu.view(layer), dout.get(), nullptr, nullptr);
  }
  const HostState st = download(te.cluster_state(layer));
  const std::vector<std::vector<int32_t>> read = ge->last_read(layer, 0);
  ASSERT_EQ(read.size(), size_t(s.num_q_heads));
  const PagedKV kv = p.cpu.view(layer);
  tk::FitParams fit;  // the engine's defaults
  for (int h = 0; h < s.num_kv_heads; ++h) {
    ASSERT_EQ(st.cl[size_t(h)], len + interval) << "the block was not re-clustered, h " << h;
    const int C = st.nc[size_t(h)];
    ASSERT_EQ(C, (len + 15) / 16 + interval / 16) << "h " << h;
    std::vector<uint8_t> flags(static_cast<size_t>(C), 0);
    for (int j = 0; j < g; ++j) {
      std::vector<float> qf(static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[size_t(h * g + j) * d + i]);
      tk::select_clusters_cpu(qf.data(), kv, 0, h, s.scale(), fit, st.view, flags.data(), nullptr);
    }
    const std::vector<int32_t> want = tk::selected_tokens_cpu(kv, 0, h, st.view, flags.data());
    const auto block = [&](const std::vector<int32_t>& tokens) {
      std::set<int32_t> out;
      for (int32_t t : tokens)
        if (t >= len) out.insert(t);
      return out;
    };
    const std::set<int32_t> expect = block(want);
    ASSERT_GE(expect.size(), size_t(interval / 2)) << "the block's first cluster must be chosen";
    for (int j = 0; j < g; ++j)
      EXPECT_EQ(block(read[size_t(h * g + j)]), expect) << "kv head " << h << " query head " << j;
  }
}

TEST(TacticCuda, RejectsBadArguments) {
  KVS_SKIP_WITHOUT_CUDA();
  const ModelShape s = shape(8, 2, 96);
  EngineConfig c;
  c.tactic.max_context = 1024;
  EXPECT_THROW(make_engine(Method::Tactic, s, c), std::invalid_argument);  // head_dim 96
  c.tactic.recluster_interval = 1 << 16;
  EXPECT_THROW(make_engine(Method::Tactic, shape(8, 2, 128), c), std::invalid_argument);
}

// Captured data (tests/cuda/captured_replay.h), replayed on the CPU and the CUDA engine at
// three targets, one of them re-clustering every 32 decoded tokens. About 544 clustered
// tokens: 34 clusters, 9 exact tokens and two windows of 32, so the fit runs. The engines
// score clusters and samples in different precisions (bf16 tensor cores against double), so
// a cluster near a cut may fall either way; a flipped cluster moves a step's read by about
// 16 / 600.
TEST(TacticCuda, CapturedQueriesMatchCpu) {
  KVS_SKIP_WITHOUT_CUDA();
  test::ReplayTolerance tol;
  tol.read = 0.03;
  EXPECT_EQ(test::expect_captured_replays_agree({"tactic:target=0.5", "tactic:target=0.9",
                                                 "tactic:target=0.75,recluster_interval=32"},
                                                "tactic", tol),
            3);
}

}  // namespace
}  // namespace kvs
