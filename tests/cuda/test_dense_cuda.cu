// dense_decode_cuda against the fp64 CPU reference on fresh random inputs: a grid of batch
// sizes, ragged lengths, page sizes (shuffled page assignment), GQA groups and head dims;
// CUDA-graph replay with new lengths; argument validation; run-to-run determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/dense/dense_decode.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

using test::DeviceBuffer;

struct DenseCase {
  std::string name;
  int batch;
  std::vector<int> lens;  // the first lengths; the rest drawn uniformly from [lo, hi]
  int lo, hi;
  int page_size;  // 0: contiguous (page_size == capacity, one page per sequence)
  int hq, hkv, d;
};

// Host copy of a paged cache whose pages are handed out in a shuffled order; padded page
// table slots hold -1 so that a read past a sequence's pages faults instead of passing.
struct HostCache {
  int batch = 0, page_size = 0, hkv = 0, d = 0, max_pages = 0, num_pages = 0;
  std::vector<bf16> k, v;
  std::vector<int32_t> table, lens;

  PagedKV view() const {
    PagedKV kv;
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.seq_lens = lens.data();
    kv.batch = batch;
    kv.num_pages = num_pages;
    kv.page_size = page_size;
    kv.num_kv_heads = hkv;
    kv.head_dim = d;
    kv.max_pages_per_seq = max_pages;
    return kv;
  }
};

// Keys with a per-token scale (log-normal, a few 3x outliers) so that scores spread over
// several units and some tokens dominate, as in real attention; values and queries N(0,1).
HostCache make_cache(const std::vector<int>& capacity, int page_size, int hkv, int d,
                     std::mt19937_64& rng) {
  HostCache c;
  c.batch = int(capacity.size());
  c.hkv = hkv;
  c.d = d;
  const int max_cap = std::max(1, *std::max_element(capacity.begin(), capacity.end()));
  c.page_size = page_size > 0 ? page_size : max_cap;
  c.max_pages = (max_cap + c.page_size - 1) / c.page_size;
  int needed = 0;
  for (int cap : capacity) needed += (cap + c.page_size - 1) / c.page_size;
  c.num_pages = needed + 3;  // a few pages nobody owns
  std::vector<int32_t> order(c.num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  c.table.assign(size_t(c.batch) * c.max_pages, -1);
  int next = 0;
  for (int b = 0; b < c.batch; ++b)
    for (int p = 0; p < (capacity[b] + c.page_size - 1) / c.page_size; ++p)
      c.table[size_t(b) * c.max_pages + p] = order[next++];

  const size_t rows = size_t(c.num_pages) * c.page_size * hkv;
  c.k.resize(rows * d);
  c.v.resize(rows * d);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  for (size_t r = 0; r < rows; ++r) {
    float scale = 1.5f * std::exp(0.5f * normal(rng));
    if (uni(rng) < 0.02f) scale *= 3.f;
    for (int i = 0; i < d; ++i) {
      c.k[r * d + i] = float_to_bf16(scale * normal(rng));
      c.v[r * d + i] = float_to_bf16(normal(rng));
    }
  }
  return c;
}

std::vector<bf16> random_q(int batch, int hq, int d, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<bf16> q(size_t(batch) * hq * d);
  for (auto& x : q) x = float_to_bf16(normal(rng));
  return q;
}

// Device copies of a HostCache; seq_lens can be replaced in place.
struct DeviceCache {
  DeviceBuffer<bf16> k, v;
  DeviceBuffer<int32_t> table, lens;
  explicit DeviceCache(const HostCache& h) : k(h.k), v(h.v), table(h.table), lens(h.lens) {}
  PagedKV view(const HostCache& h) const {
    PagedKV kv = h.view();
    kv.k = k.get();
    kv.v = v.get();
    kv.page_table = table.get();
    kv.seq_lens = lens.get();
    return kv;
  }
};

constexpr double kMaxRelL2 = 1e-2;  // bf16 P and bf16 output: errors near 2e-3 expected
constexpr double kMaxLseErr = 1e-3;

// Compares CUDA outputs with the CPU reference row by row (sequence, query head).
void expect_matches_reference(const HostCache& cache, const std::vector<bf16>& q, int hq,
                              float scale, const std::vector<bf16>& o,
                              const std::vector<float>& lse) {
  const int d = cache.d;
  std::vector<float> o_ref(size_t(cache.batch) * hq * d), lse_ref(size_t(cache.batch) * hq);
  kernels::dense_decode_cpu(q.data(), hq, cache.view(), scale, o_ref.data(), lse_ref.data());
  int failures = 0;
  double worst = 0.0;
  for (int b = 0; b < cache.batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      const size_t row = size_t(b) * hq + h;
      if (cache.lens[b] == 0) {
        bool zero = true;
        for (int i = 0; i < d; ++i) zero = zero && bf16_to_float(o[row * d + i]) == 0.f;
        if (!zero || lse[row] != -std::numeric_limits<float>::infinity()) {
          if (++failures <= 5)
            ADD_FAILURE() << "empty sequence b=" << b << " h=" << h
                          << ": expected o = 0 and lse = -inf, got lse " << lse[row];
        }
        continue;
      }
      double num = 0.0, den = 0.0;
      for (int i = 0; i < d; ++i) {
        const double x = bf16_to_float(o[row * d + i]), r = o_ref[row * d + i];
        num += (x - r) * (x - r);
        den += r * r;
      }
      const double rel = std::sqrt(num / std::max(den, 1e-30));
      const double lse_err = std::abs(double(lse[row]) - double(lse_ref[row]));
      worst = std::max(worst, std::isnan(rel) ? 1e30 : rel);
      if (!(rel < kMaxRelL2) || !(lse_err < kMaxLseErr)) {
        if (++failures <= 5)
          ADD_FAILURE() << "b=" << b << " h=" << h << " len=" << cache.lens[b]
                        << ": relative L2 error " << rel << " (max " << kMaxRelL2 << "), lse "
                        << lse[row] << " vs reference " << lse_ref[row];
      }
    }
  }
  EXPECT_EQ(failures, 0) << "rows failing; worst relative L2 error " << worst;
}

class DenseCuda : public ::testing::TestWithParam<DenseCase> {};

TEST_P(DenseCuda, MatchesCpuReference) {
  KVS_SKIP_WITHOUT_CUDA();
  const DenseCase& tc = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (KVS_TEST_SEED replays it)");
  std::mt19937_64 rng(seed);

  std::vector<int> lens = tc.lens;
  std::uniform_int_distribution<int> pick(tc.lo, tc.hi);
  while (int(lens.size()) < tc.batch) lens.push_back(pick(rng));
  HostCache cache = make_cache(lens, tc.page_size, tc.hkv, tc.d, rng);
  cache.lens.assign(lens.begin(), lens.end());
  const std::vector<bf16> q = random_q(tc.batch, tc.hq, tc.d, rng);
  const float scale = 1.f / std::sqrt(float(tc.d));

  DeviceCache dc(cache);
  DeviceBuffer<bf16> dq(q), d_o(size_t(tc.batch) * tc.hq * tc.d);
  DeviceBuffer<float> d_lse(size_t(tc.batch) * tc.hq);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(tc.batch, tc.hq, tc.d);
  DeviceBuffer<char> ws(ws_bytes);
  ws.poison();
  d_o.poison();
  d_lse.poison();
  ASSERT_EQ(kernels::dense_decode_cuda(dq.get(), tc.hq, dc.view(cache), scale, d_o.get(),
                                       d_lse.get(), ws.get(), ws_bytes, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(cache, q, tc.hq, scale, d_o.download(), d_lse.download());
}

std::vector<DenseCase> dense_cases() {
  return {
      {"b1_len1_p16_g1_d128", 1, {1}, 0, 0, 16, 8, 8, 128},
      {"b1_len15_p1_g2_d64", 1, {15}, 0, 0, 1, 16, 8, 64},
      {"b1_len17_p16_g4_d128", 1, {17}, 0, 0, 16, 32, 8, 128},
      {"b1_len1000_p64_g8_d128", 1, {1000}, 0, 0, 64, 8, 1, 128},
      {"b1_len4097_contig_g4_d128", 1, {4097}, 0, 0, 0, 32, 8, 128},
      {"b1_len4097_p16_g8_d64", 1, {4097}, 0, 0, 16, 64, 8, 64},
      {"b1_len100000_p16_g4_d128", 1, {100000}, 0, 0, 16, 8, 2, 128},
      // Batch 1: group 8 with page size 1, an empty sequence, 16 and 32 kv heads.
      {"b1_len8191_p1_g8_d128_hkv8", 1, {8191}, 0, 0, 1, 64, 8, 128},
      {"b1_empty_p16_g4_d128_hkv8", 1, {0}, 0, 0, 16, 32, 8, 128},
      {"b1_len70000_p16_g2_d128_hkv16", 1, {70000}, 0, 0, 16, 32, 16, 128},
      {"b1_len3000_p64_g1_d64_hkv32", 1, {3000}, 0, 0, 64, 32, 32, 64},
      {"b3_short_p1_g1_d64", 3, {1, 15, 17}, 0, 0, 1, 4, 4, 64},
      {"b3_with_empty_p16_g2_d128", 3, {1000, 4097, 0}, 0, 0, 16, 8, 4, 128},
      {"b3_contig_g8_d128", 3, {4097, 17, 1000}, 0, 0, 0, 16, 2, 128},
      {"b3_long_p64_g4_d64", 3, {40000, 1, 20000}, 0, 0, 64, 8, 2, 64},
      {"b17_ragged_p16_g4_d128", 17, {1, 15, 17}, 1, 1200, 16, 32, 8, 128},
      {"b17_ragged_p64_g4_d64", 17, {0, 1, 4097}, 0, 1000, 64, 8, 2, 64},
      {"b17_ragged_p1_g1_d128", 17, {17, 1}, 1, 600, 1, 16, 16, 128},
      {"b17_ragged_contig_g2_d64", 17, {4097, 15}, 1, 2000, 0, 16, 8, 64},
      {"b64_ragged_p16_g4_d128", 64, {1, 15, 17, 1000}, 1, 700, 16, 32, 8, 128},
      {"b64_ragged_p64_g8_d64", 64, {4097, 4097, 0, 1}, 1, 1000, 64, 16, 2, 64},
      {"b64_ragged_contig_g1_d64", 64, {1, 300}, 1, 300, 0, 8, 8, 64},
      {"b64_ragged_p1_g2_d128", 64, {17, 15}, 1, 400, 1, 8, 4, 128},
  };
}

INSTANTIATE_TEST_SUITE_P(Grid, DenseCuda, ::testing::ValuesIn(dense_cases()),
                         [](const ::testing::TestParamInfo<DenseCase>& info) {
                           return info.param.name;
                         });

// One capture, then new lengths written to device memory between replays: the split plan
// must follow the new lengths (here the total changes, so the chunk length changes too).
void expect_replays_follow_new_lens(const std::vector<int>& lens_a,
                                    const std::vector<int>& lens_b) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int hq = 32, hkv = 8, d = 128, batch = int(lens_a.size());
  std::vector<int> capacity(batch);
  for (int b = 0; b < batch; ++b) capacity[b] = std::max(lens_a[b], lens_b[b]);
  HostCache cache = make_cache(capacity, 16, hkv, d, rng);
  cache.lens.assign(lens_a.begin(), lens_a.end());
  const std::vector<bf16> q = random_q(batch, hq, d, rng);
  const float scale = 1.f / std::sqrt(float(d));

  DeviceCache dc(cache);
  DeviceBuffer<bf16> dq(q), d_o(size_t(batch) * hq * d);
  DeviceBuffer<float> d_lse(size_t(batch) * hq);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(batch, hq, d);
  DeviceBuffer<char> ws(ws_bytes);
  ws.poison();

  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const cudaError_t launch = kernels::dense_decode_cuda(
      dq.get(), hq, dc.view(cache), scale, d_o.get(), d_lse.get(), ws.get(), ws_bytes, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(launch, cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (const auto* lens : {&lens_a, &lens_b, &lens_a}) {
    cache.lens.assign(lens->begin(), lens->end());
    dc.lens.upload(cache.lens);
    d_o.poison();
    d_lse.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    expect_matches_reference(cache, q, hq, scale, d_o.download(), d_lse.download());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(DenseCudaGraph, ReplayFollowsNewSeqLens) {
  KVS_SKIP_WITHOUT_CUDA();
  expect_replays_follow_new_lens({100, 4097, 1, 3000, 17}, {4097, 0, 2000, 1, 3500});
}

// Batch 1: the chunk length follows the one sequence's new length.
TEST(DenseCudaGraph, BatchOneReplayFollowsNewSeqLen) {
  KVS_SKIP_WITHOUT_CUDA();
  expect_replays_follow_new_lens({20000}, {1});
  expect_replays_follow_new_lens({0}, {4097});
}

// Same inputs twice must give the same bits: a difference means a race or an unwritten
// output.
TEST(DenseCudaDeterminism, RepeatedCallsAreBitwiseIdentical) {
  KVS_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  const int hq = 32, hkv = 8, d = 128;
  const std::vector<int> lens = {30000, 5, 7777};
  HostCache cache = make_cache(lens, 16, hkv, d, rng);
  cache.lens = lens;
  const std::vector<bf16> q = random_q(3, hq, d, rng);
  DeviceCache dc(cache);
  DeviceBuffer<bf16> dq(q), d_o(size_t(3) * hq * d);
  DeviceBuffer<float> d_lse(size_t(3) * hq);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(3, hq, d);
  DeviceBuffer<char> ws(ws_bytes);
  std::vector<bf16> first_o;
  std::vector<float> first_lse;
  for (int run = 0; run < 3; ++run) {
    d_o.poison();
    d_lse.poison();
    ASSERT_EQ(kernels::dense_decode_cuda(dq.get(), hq, dc.view(cache), 0.088f, d_o.get(),
                                         d_lse.get(), ws.get(), ws_bytes, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto o = d_o.download();
    const auto lse = d_lse.download();
    if (run == 0) {
      first_o = o;
      first_lse = lse;
      continue;
    }
    for (size_t i = 0; i < o.size(); ++i) ASSERT_EQ(o[i].bits, first_o[i].bits) << "o[" << i << "]";
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_EQ(lse[i], first_lse[i]) << "lse[" << i << "]";
  }
}

// Calls queued back to back on one stream share the workspace: a call must not overwrite
// the split states (or the plan) before the previous call's merge has read them, however
// the kernels overlap (the decode kernel may be launched with programmatic dependent launch).
TEST(DenseCudaStream, BackToBackCallsShareWorkspace) {
  KVS_SKIP_WITHOUT_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int hq = 32, hkv = 8, d = 128;
  const std::vector<std::vector<int>> lens = {{30000, 700}, {5000, 1, 20000, 64}};
  std::vector<HostCache> caches;
  std::vector<std::unique_ptr<DeviceCache>> device;
  std::vector<std::vector<bf16>> qs;
  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> dq, d_o;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> d_lse;
  size_t ws_bytes = 0;
  for (const auto& l : lens) {
    caches.push_back(make_cache(l, 16, hkv, d, rng));
    caches.back().lens = l;
    device.push_back(std::make_unique<DeviceCache>(caches.back()));
    const int batch = int(l.size());
    qs.push_back(random_q(batch, hq, d, rng));
    dq.push_back(std::make_unique<DeviceBuffer<bf16>>(qs.back()));
    ws_bytes = std::max(ws_bytes, kernels::dense_decode_workspace_bytes(batch, hq, d));
  }
  DeviceBuffer<char> ws(ws_bytes);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const float scale = 1.f / std::sqrt(float(d));
  // Six calls alternating between the two inputs, each into its own output buffers.
  const int calls = 6;
  for (int c = 0; c < calls; ++c) {
    const int batch = int(lens[c % 2].size());
    d_o.push_back(std::make_unique<DeviceBuffer<bf16>>(size_t(batch) * hq * d));
    d_lse.push_back(std::make_unique<DeviceBuffer<float>>(size_t(batch) * hq));
    d_o.back()->poison();
    d_lse.back()->poison();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int c = 0; c < calls; ++c)
    ASSERT_EQ(
        kernels::dense_decode_cuda(dq[c % 2]->get(), hq, device[c % 2]->view(caches[c % 2]), scale,
                                   d_o[c]->get(), d_lse[c]->get(), ws.get(), ws_bytes, stream),
        cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (int c = 0; c < calls; ++c) {
    SCOPED_TRACE("call " + std::to_string(c));
    expect_matches_reference(caches[c % 2], qs[c % 2], hq, scale, d_o[c]->download(),
                             d_lse[c]->download());
  }
  cudaStreamDestroy(stream);
}

TEST(DenseCudaArgs, RejectsUnsupportedShapesAndSmallWorkspace) {
  KVS_SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(1);
  HostCache cache = make_cache({64}, 16, 2, 128, rng);
  cache.lens = {64};
  DeviceCache dc(cache);
  const int hq = 8;
  DeviceBuffer<bf16> dq(size_t(hq) * 128), d_o(size_t(hq) * 128);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(1, 32, 128);
  DeviceBuffer<char> ws(ws_bytes);
  auto call = [&](int num_q_heads, PagedKV kv, size_t bytes) {
    return kernels::dense_decode_cuda(dq.get(), num_q_heads, kv, 0.1f, d_o.get(), nullptr, ws.get(),
                                      bytes, nullptr);
  };
  const PagedKV good = dc.view(cache);
  EXPECT_EQ(call(hq, good, ws_bytes), cudaSuccess);
  PagedKV bad = good;
  bad.head_dim = 96;
  EXPECT_EQ(call(hq, bad, ws_bytes), cudaErrorInvalidValue) << "head_dim 96";
  EXPECT_EQ(call(32, good, ws_bytes), cudaErrorInvalidValue) << "group 16";
  EXPECT_EQ(call(7, good, ws_bytes), cudaErrorInvalidValue) << "Hq not a multiple of Hkv";
  EXPECT_EQ(call(hq, good, kernels::dense_decode_workspace_bytes(1, hq, 128) - 1),
            cudaErrorInvalidValue)
      << "workspace one byte short";
  bad = good;
  bad.page_size = 0;
  EXPECT_EQ(call(hq, bad, ws_bytes), cudaErrorInvalidValue) << "page_size 0";
  EXPECT_THROW(kernels::dense_decode_workspace_bytes(1, 32, 96), std::invalid_argument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace kvs
