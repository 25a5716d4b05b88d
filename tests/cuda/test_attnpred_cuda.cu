// AttentionPredictor on CUDA against the CPU reference: the CNN (to fp32 rounding), the engine's
// outputs, history and selections, GPU-resident and offloaded; each step's output and history
// row also against an fp64 reference over the GPU's own selection (so wrong cached rows show
// even where a near-tie flipped a selection), and after each prefetch the resident blocks are
// the next step's blocks with the host cache's rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "kernels/attnpred/attnpred.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/e4m3.h"
#include "kernels/common/int_rows.h"
#include "kernels/dense/dense_decode.h"
#include "runtime/attnpred_engine.h"

namespace kvs {
namespace {

namespace ap = kernels::attnpred;

// The key copy's format of a calibration_keys other than bf16.
ap::KeyFormat format_of(CalibrationKeys k) {
  return k == CalibrationKeys::Int4 ? ap::KeyFormat::Int4 : ap::KeyFormat::E4m3;
}

template <class T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) { KVS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); }
  Dev(const std::vector<T>& h) : Dev(h.size()) {
    KVS_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> get(size_t n) const {
    std::vector<T> h(n);
    KVS_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<float> random_params(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.2f);
  std::vector<float> p(ap::kParamCount);
  for (auto& w : p) w = nd(rng);
  return p;
}

// CUDA and CPU CNN scores differ only by conv2's fp32 summation order (attnpred.h): about
// 1e-6 of the scores' size; a wrong tap, channel or row would be off by orders more.
bool close_score(float got, float want) {
  return std::abs(got - want) <= 1e-4f + 1e-4f * std::abs(want);
}

TEST(AttnPredCuda, CnnMatchesCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> p = random_params(1);
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(0.f, 0.1f);
  for (int W : {1, 5, 64, 65, 200}) {
    for (int H : {1, 7, 64}) {
      const int n = 3;
      std::vector<float> x(size_t(n) * H * W);
      for (auto& v : x) v = u(rng);
      std::vector<float> y(size_t(n) * W);
      ap::cnn_forward_cpu(p.data(), x.data(), n, H, W, y.data());
      Dev<float> dp(p), dx(x), dy(y.size());
      KVS_CUDA_CHECK(ap::cnn_forward_cuda(dp.p, dx.p, n, H, W, dy.p, nullptr));
      const std::vector<float> g = dy.get(y.size());
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_PRED2(close_score, g[i], y[i]) << "H " << H << " W " << W << " at " << i;
    }
  }
}

// The incremental CUDA predictor (CnnCache) after every step: bit for bit its own full
// recompute (a second cache, reset before each prediction), and the CPU CNN over the gathered
// history within close_score. The steps cover a short history filling up (zero rows), the ring
// wrapping, the slice end moving by 0, 1 or 2 blocks (stored rows fixed up) and by 3 (all
// recomputed), a slice that starts empty, a prediction repeated without an append, several
// rows appended between two predictions (predict_interval > 1; the sequences differ): 2, 4,
// H - 4 and H - 3 (at most H - 4 stay incremental, fewer where whole bands would reach the
// edge rows), and a cache reset. Both kernel forms: for a prediction every step (several
// rows appended: recomputed) and every 4th (incremental).
TEST(AttnPredCuda, IncrementalPredictorEqualsFullRecomputeEveryStep) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> p = random_params(3);
  Dev<float> dp(p);
  const ap::Geometry g{0, 16, 64, 64};
  const int B = 2, hq = 2, mb = 120;
  const int growth[] = {1, 0, 1, 16, 1, 32, 1, 48, 5, 2};
  const int histories[] = {1, 3, 5, 6, 13, 64};
  for (int run = 0; run < 12; ++run) {
    const int rows_between = run < 6 ? 1 : 4, H = histories[run % 6];
    ap::Geometry geo = g;
    geo.history = H;
    std::vector<float> rows(size_t(B) * hq * H * mb, 0.f);
    std::vector<int32_t> count(B, 0), tokens = {50, 300};
    ap::HistoryState hh{rows.data(), count.data(), tokens.data(), B, hq, H, mb};
    Dev<float> drows(rows.size());
    Dev<int32_t> dcount(B), dtokens(B);
    ap::HistoryState dh{drows.p, dcount.p, dtokens.p, B, hq, H, mb};
    Dev<float> cs(ap::CnnCache::s_floats(dh)), ce(ap::CnnCache::edge_floats(dh));
    Dev<int32_t> cc(B), cend(B);
    Dev<long long> csum(ap::CnnCache::sum_values(dh));
    Dev<uint32_t> cfrags(ap::kCnnFragWords), ffrags(ap::kCnnFragWords);
    const ap::CnnCache cache{cs.p, ce.p, cc.p, cend.p, csum.p, cfrags.p};
    KVS_CUDA_CHECK(ap::reset_cnn_cache_cuda(dp.p, cache, B, nullptr));
    Dev<float> fs(ap::CnnCache::s_floats(dh)), fe(ap::CnnCache::edge_floats(dh));
    Dev<int32_t> fc(B), fend(B);
    Dev<long long> fsum(ap::CnnCache::sum_values(dh));
    const ap::CnnCache full{fs.p, fe.p, fc.p, fend.p, fsum.p, ffrags.p};
    Dev<float> dscores(size_t(B) * hq * mb), dfull(size_t(B) * hq * mb);
    std::mt19937 rng(uint32_t(40 + H));
    std::uniform_real_distribution<float> u(0.f, 0.1f);
    auto append = [&](int b) {
      for (int h = 0; h < hq; ++h) {
        std::vector<float> row(size_t(geo.num_blocks(tokens[size_t(b)])));
        for (auto& v : row) v = u(rng);
        ap::append_row_cpu(hh, b, h, row.data(), int(row.size()));
      }
      count[size_t(b)] += 1;
    };
    auto check = [&](int step) {
      KVS_CUDA_CHECK(cudaMemcpy(drows.p, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(cudaMemcpy(dcount.p, count.data(), B * 4, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(cudaMemcpy(dtokens.p, tokens.data(), B * 4, cudaMemcpyHostToDevice));
      KVS_CUDA_CHECK(ap::predict_cuda(dp.p, dh, cache, B, geo, dscores.p, rows_between, nullptr));
      KVS_CUDA_CHECK(ap::reset_cnn_cache_cuda(dp.p, full, B, nullptr));
      KVS_CUDA_CHECK(ap::predict_cuda(dp.p, dh, full, B, geo, dfull.p, rows_between, nullptr));
      const std::vector<float> got = dscores.get(size_t(B) * hq * mb);
      const std::vector<float> want = dfull.get(size_t(B) * hq * mb);
      for (int b = 0; b < B; ++b) {
        const int c0 = geo.candidate_begin(), c1 = geo.candidate_end(tokens[size_t(b)]);
        if (c1 <= c0) continue;
        for (int h = 0; h < hq; ++h) {
          std::vector<float> x(size_t(H) * (c1 - c0)), y(size_t(c1 - c0));
          ap::gather_input_cpu(hh, b, h, c0, c1, x.data());
          ap::cnn_forward_cpu(p.data(), x.data(), 1, H, c1 - c0, y.data());
          for (int c = c0; c < c1; ++c) {
            const size_t i = (size_t(b) * hq + h) * mb + size_t(c);
            ASSERT_EQ(got[i], want[i])
                << "form " << rows_between << " H " << H << " step " << step << " seq " << b
                << " head " << h << " column " << c << " (slice [" << c0 << ", " << c1 << "), "
                << count[size_t(b)] << " rows)";
            ASSERT_PRED2(close_score, got[i], y[size_t(c - c0)])
                << "H " << H << " step " << step << " seq " << b << " head " << h << " column "
                << c;
          }
        }
      }
    };
    // Rows appended before a prediction, besides the step's own.
    const int extra[] = {0, 0, 1, 0, 3, 0, 0, std::max(0, H - 5), 0, std::max(0, H - 4), 0};
    for (int step = 0; step < H + 12; ++step) {
      for (int b = 0; b < B; ++b) {
        tokens[size_t(b)] += growth[(step + 3 * b) % 10];
        append(b);
        for (int i = 0; i < extra[(step + 5 * b) % 11]; ++i) append(b);
      }
      if (step == H / 2 + 4) KVS_CUDA_CHECK(ap::reset_cnn_cache_cuda(dp.p, cache, B, nullptr));
      check(step);
      if (step % 5 == 2) check(step);
    }
    ASSERT_LT(geo.candidate_end(tokens[1]), mb);
  }
}

TEST(AttnPredCuda, TopBlocksEqualCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const int hq = 4, hkv = 2, mb = 700;
  const ap::Geometry g{64, 16, 64, 64};
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> ui(0, 40);  // many ties
  std::vector<float> scores(size_t(hq) * mb);
  for (auto& s : scores) s = float(ui(rng)) * 0.25f - 3.f;
  for (int k : {0, 1, 7, 100, 5000}) {
    const int tokens = 700 * 16 - 5;
    std::vector<int32_t> count = {10}, tok = {tokens};
    Dev<float> ds(scores), rows(1);
    Dev<int32_t> dc(count), dt(tok);
    ap::HistoryState h{rows.p, dc.p, dt.p, 1, hq, 64, mb};
    Dev<uint8_t> flags(size_t(hkv) * mb);
    KVS_CUDA_CHECK(ap::select_blocks_cuda(ds.p, h, 1, hkv, g, k, flags.p, nullptr));
    std::vector<uint8_t> want(size_t(hkv) * mb, 0);
    const int c0 = g.candidate_begin(), c1 = g.candidate_end(tokens);
    for (int qh = 0; qh < hq; ++qh)
      ap::select_top_blocks_cpu(scores.data() + size_t(qh) * mb + c0, c1 - c0, k, c0,
                                want.data() + size_t(qh / 2) * mb);
    EXPECT_EQ(flags.get(want.size()), want) << "k " << k;
  }
}

// The block list (build_selection_cuda) against the CPU token rule, over lists long enough to
// span several of the kernel's parts (256 blocks each): sequences of 9,001, 0, 4,096 and 300
// tokens, random flags; pages of 8 tokens (a block spans two pages) and of 32; the lists cut
// at max_tokens with the cut counted as errors; and offload's block slots (rows inside the
// slots, unassigned slots counted as errors).
TEST(AttnPredCuda, BlockListEqualsCpuAcrossParts) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const ap::Geometry g{64, 16, 64, 64};
  const int B = 4, hkv = 2, d = 8, mb = 600;
  const std::vector<int32_t> lens = {9001, 0, 4096, 300};
  std::mt19937 rng(17);
  std::vector<uint8_t> flags(size_t(B) * hkv * mb);
  for (auto& f : flags) f = rng() % 10 < 3;
  std::vector<int32_t> slots(flags.size());
  for (auto& x : slots) x = int32_t(rng() % 50) - 5;  // some blocks without a slot
  for (int page : {8, 32}) {
    for (int max_tokens : {9001, 1000}) {
      for (bool offload : {false, true}) {
        const int pages_per_seq = (9001 + page - 1) / page;
        std::vector<int32_t> table(size_t(B) * pages_per_seq);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng);
        Dev<int32_t> dtable(table), dlens(lens), dslots(slots);
        Dev<uint8_t> dflags(flags);
        PagedKV kv;
        kv.page_table = dtable.p;
        kv.seq_lens = dlens.p;
        kv.batch = B;
        kv.num_pages = int(table.size());
        kv.page_size = page;
        kv.num_kv_heads = hkv;
        kv.head_dim = d;
        kv.max_pages_per_seq = pages_per_seq;
        Dev<int32_t> rows(size_t(B) * hkv * max_tokens), toks(size_t(B) * hkv * max_tokens);
        Dev<int32_t> counts(size_t(B) * hkv);
        Dev<unsigned long long> counters(2);
        KVS_CUDA_CHECK(cudaMemset(counters.p, 0, 2 * sizeof(unsigned long long)));
        kernels::tactic::Selection sel;
        sel.rows = rows.p;
        sel.tokens = toks.p;
        sel.counts = counts.p;
        sel.max_tokens = max_tokens;
        KVS_CUDA_CHECK(ap::build_selection_cuda(kv, dflags.p, mb, g, offload ? dslots.p : nullptr,
                                                sel, counters.p, nullptr));
        const std::vector<int32_t> got_rows = rows.get(size_t(B) * hkv * max_tokens);
        const std::vector<int32_t> got_toks = toks.get(size_t(B) * hkv * max_tokens);
        const std::vector<int32_t> got_counts = counts.get(size_t(B) * hkv);
        const std::vector<unsigned long long> got_counters = counters.get(2);
        unsigned long long want_read = 0, want_errors = 0;
        PagedKV host = kv;
        host.page_table = table.data();
        for (int b = 0; b < B; ++b) {
          for (int h = 0; h < hkv; ++h) {
            const size_t bh = size_t(b) * hkv + size_t(h);
            const std::vector<int32_t> all =
                ap::selected_tokens_cpu(g, lens[size_t(b)], flags.data() + bh * mb);
            const int count = std::min(int(all.size()), max_tokens);
            want_read += unsigned(count);
            want_errors += all.size() - size_t(count);
            const std::string where = "page " + std::to_string(page) + " max_tokens " +
                                      std::to_string(max_tokens) + " offload " +
                                      std::to_string(offload) + " seq " + std::to_string(b) +
                                      " kv head " + std::to_string(h);
            ASSERT_EQ(got_counts[bh], count) << where;
            // Offload: a block without a slot counts its attended tokens as errors when its
            // first one made the list.
            for (size_t i = 0; offload && i < all.size(); ++i) {
              const int j = all[i] / 16;
              if (slots[bh * mb + size_t(j)] < 0 && (i == 0 || all[i - 1] / 16 != j) &&
                  int(i) < max_tokens)
                for (size_t e = i; e < all.size() && all[e] / 16 == j; ++e) ++want_errors;
            }
            for (int i = 0; i < count; ++i) {
              const int t = all[size_t(i)], slot = slots[bh * mb + size_t(t / 16)];
              const int32_t want_row =
                  offload ? std::max(slot, 0) * 16 + t % 16 : int32_t(host.offset(b, t, h) / d);
              ASSERT_EQ(got_toks[bh * size_t(max_tokens) + size_t(i)], t) << where << " at " << i;
              ASSERT_EQ(got_rows[bh * size_t(max_tokens) + size_t(i)], want_row)
                  << where << " token " << t;
            }
          }
        }
        EXPECT_EQ(got_counters[0], want_read) << "page " << page << " offload " << offload;
        EXPECT_EQ(got_counters[1], want_errors) << "page " << page << " offload " << offload;
      }
    }
  }
}

// One sequence in a paged cache (page 16), host copy for the CPU engine, device or mapped
// pinned copy for the CUDA engine.
struct Scene {
  ModelShape shape;
  int cap = 1200;
  std::vector<bf16> k, v;
  std::vector<int32_t> table;
  Scene() {
    shape.name = "attnpred-cuda-test";
    shape.num_layers = 2;
    shape.num_q_heads = 8;
    shape.num_kv_heads = 2;
    shape.head_dim = 128;
    shape.max_position = cap;
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.f, 1.f);
    k.resize(size_t(cap) * 2 * 128);
    v.resize(k.size());
    for (auto& x : k) x = float_to_bf16(nd(rng));
    for (auto& x : v) x = float_to_bf16(nd(rng));
    const int pages = cap / 16;
    table.resize(size_t(pages));
    for (int i = 0; i < pages; ++i) table[size_t(i)] = (i * 7) % pages;  // scattered pages
    // Store tokens where the scattered table says: physical copy of the logical arrays.
    std::vector<bf16> pk(k.size()), pv(v.size());
    for (int t = 0; t < cap; ++t)
      for (int e = 0; e < 2 * 128; ++e) {
        const size_t dst = (size_t(table[size_t(t / 16)]) * 16 + t % 16) * 256 + e;
        pk[dst] = k[size_t(t) * 256 + e];
        pv[dst] = v[size_t(t) * 256 + e];
      }
    k.swap(pk);
    v.swap(pv);
  }
  PagedKV view(const bf16* kp, const bf16* vp, const int32_t* tab, const int32_t* len) const {
    PagedKV kv;
    kv.k = kp;
    kv.v = vp;
    kv.page_table = tab;
    kv.seq_lens = len;
    kv.batch = 1;
    kv.num_pages = cap / 16;
    kv.page_size = 16;
    kv.num_kv_heads = 2;
    kv.head_dim = 128;
    kv.max_pages_per_seq = cap / 16;
    return kv;
  }
};

// The engine tests' stored parts: random CNN weights, budget 256, calibration every 3rd step,
// layer 0 dense.
AttnPredParams engine_params(uint32_t seed) {
  AttnPredParams params;
  params.cnn = random_params(seed);
  params.budget_tokens = 256;
  params.calibration_period = 3;
  params.dense_layers = {0};
  return params;
}

// grouped: AttnPredConfig::group_history (a history per kv head, the group's largest row).
// keys: AttnPredConfig::calibration_keys (the fp64 reference rounds the full rows' keys too).
void run_against_cpu(bool offload, int predict_interval = 1, bool grouped = false,
                     CalibrationKeys keys = CalibrationKeys::Bf16) {
  Scene sc;
  const AttnPredParams params = engine_params(3);
  EngineConfig cc;
  cc.backend = Backend::Cpu;
  cc.attnpred.predict_interval = predict_interval;
  cc.attnpred.group_history = grouped ? 1 : 0;
  cc.attnpred.calibration_keys = keys;
  EngineConfig gc = cc;
  gc.backend = Backend::Cuda;
  gc.attnpred.offload = offload;
  AttnPredEngine cpu(sc.shape, cc, params), gpu(sc.shape, gc, params);
  Dev<char> ws(gpu.workspace_bytes());
  gpu.bind_workspace({ws.p, gpu.workspace_bytes()});

  bf16 *hk = nullptr, *hv = nullptr;  // the CUDA engine's cache: mapped pinned or device
  int32_t* len_dev = nullptr;
  Dev<bf16> dk(sc.k), dv(sc.v);
  if (offload) {
    KVS_CUDA_CHECK(cudaHostAlloc(&hk, sc.k.size() * sizeof(bf16), cudaHostAllocMapped));
    KVS_CUDA_CHECK(cudaHostAlloc(&hv, sc.v.size() * sizeof(bf16), cudaHostAllocMapped));
    std::copy(sc.k.begin(), sc.k.end(), hk);
    std::copy(sc.v.begin(), sc.v.end(), hv);
  }
  Dev<int32_t> tab(sc.table), len(1);
  len_dev = len.p;
  int32_t host_len = 900;
  const PagedKV ckv = sc.view(sc.k.data(), sc.v.data(), sc.table.data(), &host_len);
  const PagedKV gkv = sc.view(offload ? hk : dk.p, offload ? hv : dv.p, tab.p, len_dev);
  KVS_CUDA_CHECK(cudaMemcpy(len_dev, &host_len, sizeof(int32_t), cudaMemcpyHostToDevice));
  cpu.prefill(1, ckv, nullptr);
  gpu.prefill(1, gkv, nullptr);
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<bf16> q(size_t(8) * 128), oc(q.size());
  Dev<bf16> dq(q.size()), dout(q.size());
  int same_selection = 0, sparse_steps = 0;
  bool diverged = false;  // once a near-tie flips a selection, the two histories differ
  for (int step = 0; step < 14; ++step) {
    host_len = 900 + step;
    KVS_CUDA_CHECK(cudaMemcpy(len_dev, &host_len, sizeof(int32_t), cudaMemcpyHostToDevice));
    for (auto& x : q) x = float_to_bf16(nd(rng));
    KVS_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), q.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    cpu.decode(1, q.data(), nullptr, ckv, oc.data(), nullptr, nullptr);
    gpu.decode(1, dq.p, nullptr, gkv, dout.p, nullptr, nullptr);
    const auto rc = cpu.last_read(1, 0), rg = gpu.last_read(1, 0);
    ASSERT_EQ(rc.empty(), rg.empty()) << "step " << step;
    if (!rc.empty()) {
      ++sparse_steps;
      same_selection += rc == rg;
    }
    diverged |= rc != rg;
    if (!diverged) {
      const std::vector<bf16> og = dout.get(q.size());
      for (size_t i = 0; i < q.size(); ++i)
        ASSERT_NEAR(bf16_to_float(og[i]), bf16_to_float(oc[i]),
                    2e-2 + 2e-2 * std::abs(bf16_to_float(oc[i])))
            << "step " << step << " at " << i;
    }
    // History rows agree to fp32 rounding.
    const auto hc = cpu.history_rows(1), hg = gpu.history_rows(1);
    for (size_t i = 0; i < hc.size() && !diverged; ++i)
      ASSERT_NEAR(hg[i], hc[i], 1e-5 + 1e-4 * hc[i]) << "step " << step << " at " << i;
    // The GPU's attention and history row against an fp64 reference over the GPU's OWN
    // selection, from the host cache: whatever rows the attention read (block cache slots,
    // the on-demand newest-token block) must hold the host's data, even after a near-tie
    // made the two engines' selections differ.
    {
      const std::vector<bf16> og = dout.get(q.size());
      const std::vector<float> hg = gpu.history_rows(1);
      const int count = gpu.history_count(1)[0];
      ASSERT_EQ(count, step + 1);
      // Layer 1 calibrates on the warm-up step and then every period, its phase one step on.
      const bool full_row = step == 0 || (step + 2) % params.calibration_period == 0;
      const int mb = gpu.max_blocks(), n = host_len, hist_group = grouped ? 4 : 1;
      ASSERT_EQ(hg.size(), size_t(8 / hist_group) * 64 * mb);
      std::vector<float> want(size_t(8 / hist_group) * mb, 0.f);  // the newest row per history
      for (int qh = 0; qh < 8; ++qh) {
        std::vector<float> qf(128);
        for (int e = 0; e < 128; ++e) qf[size_t(e)] = bf16_to_float(q[size_t(qh) * 128 + e]);
        const std::vector<int32_t>* attended = rg.empty() ? nullptr : &rg[size_t(qh)];
        std::vector<double> o(128);
        double l = 0;
        kernels::attend_cpu(qf.data(), ckv, 0, qh / 4, attended ? attended->data() : nullptr,
                            attended ? int(attended->size()) : 0, sc.shape.scale(), o.data(), &l);
        for (int e = 0; e < 128; ++e)
          ASSERT_NEAR(bf16_to_float(og[size_t(qh) * 128 + e]), o[size_t(e)],
                      2e-2 + 2e-2 * std::abs(o[size_t(e)]))
              << "step " << step << " q head " << qh << " dim " << e;
        std::vector<int32_t> row_tokens;
        if (full_row || !attended) {
          for (int t = 0; t < n; ++t) row_tokens.push_back(t);
        } else {
          row_tokens = *attended;
        }
        std::vector<double> logit(row_tokens.size());
        double m = -INFINITY;
        const bool rounded = full_row && keys != CalibrationKeys::Bf16;
        std::vector<float> kf(128), qr = qf;
        if (rounded) ap::round_query_cpu(format_of(keys), qf.data(), 128, qr.data());
        for (size_t i = 0; i < row_tokens.size(); ++i) {
          const bf16* kr = sc.k.data() + ckv.offset(0, row_tokens[i], qh / 4);
          if (rounded) {
            ap::round_key_cpu(format_of(keys), kr, 128, kf.data());
          } else {
            for (int e = 0; e < 128; ++e) kf[size_t(e)] = bf16_to_float(kr[e]);
          }
          double dot = 0;
          for (int e = 0; e < 128; ++e) dot += double(qr[size_t(e)]) * kf[size_t(e)];
          logit[i] = dot * sc.shape.scale();
          m = std::max(m, logit[i]);
        }
        double z = 0;
        for (double x : logit) z += std::exp(x - m);
        std::vector<float> probs(size_t(n), 0.f), pooled(size_t(mb), 0.f);
        for (size_t i = 0; i < row_tokens.size(); ++i)
          probs[size_t(row_tokens[i])] = float(std::exp(logit[i] - m) / z);
        pool_attention_row(probs.data(), n, n, pooled.data());
        float* w = want.data() + size_t(qh / hist_group) * mb;
        for (int j = 0; j < mb; ++j) w[j] = std::max(w[j], pooled[size_t(j)]);
      }
      for (int hh = 0; hh < 8 / hist_group; ++hh) {
        const float* newest = hg.data() + ((size_t(hh) * 64) + size_t((count - 1) % 64)) * mb;
        for (int j = 0; j < mb; ++j)
          ASSERT_NEAR(newest[j], want[size_t(hh) * mb + j], 1e-5 + 1e-4 * want[size_t(hh) * mb + j])
              << "step " << step << " history " << hh << " block " << j;
      }
    }
    if (offload) {
      // After the cross-token prefetch (decode returned; the inspection waits for it): the
      // resident blocks are exactly the next step's blocks (minus its newest-token block,
      // copied at decode), and each slot holds the host's K and V rows of its block. The
      // slots the step just attended may have been reused by the prefetch already, so this
      // is checked here rather than on the attended rows.
      const std::vector<uint8_t> flags = gpu.block_flags(1);
      const ap::Geometry& g = gpu.geometry();
      const int n_next = host_len + 1;
      for (int h = 0; h < 2; ++h) {
        std::vector<int32_t> want;
        for (int j = 0; j < g.num_blocks(n_next) - 1; ++j) {
          bool any = false;
          for (int t = j * 16; t < (j + 1) * 16; ++t)
            any |= g.attended_token(t, n_next, flags.data() + size_t(h) * gpu.max_blocks());
          if (any) want.push_back(j);
        }
        std::vector<int32_t> blocks;
        std::vector<bf16> keys, values;
        gpu.resident_rows(1, 0, h, &blocks, &keys, &values);
        EXPECT_EQ(blocks, want) << "step " << step << " kv head " << h;
        for (size_t i = 0; i < blocks.size(); ++i) {
          ASSERT_LE((blocks[i] + 1) * 16, host_len)
              << "resident block " << blocks[i] << " is not complete, step " << step;
          for (int r = 0; r < 16; ++r) {
            const int t = blocks[i] * 16 + r;
            const size_t src = size_t(ckv.offset(0, t, h));
            for (int e = 0; e < 128; ++e) {
              const size_t dst = (i * 16 + size_t(r)) * 128 + size_t(e);
              ASSERT_EQ(keys[dst].bits, hk[src + size_t(e)].bits)
                  << "K of token " << t << " kv head " << h << " step " << step;
              ASSERT_EQ(values[dst].bits, hv[src + size_t(e)].bits)
                  << "V of token " << t << " kv head " << h << " step " << step;
            }
          }
        }
      }
    }
  }
  // The scores agree to fp32 rounding given equal histories; that and fp32 vs fp64 history
  // rows may flip a near-tie, so most (not necessarily all) sparse steps select identically.
  EXPECT_GE(same_selection * 4, sparse_steps * 3) << same_selection << " of " << sparse_steps;
  if (offload) {
    const auto os = gpu.offload_stats();
    EXPECT_EQ(os.selection_errors, 0u);
    EXPECT_EQ(os.prefetches, 14u);
    EXPECT_GT(os.blocks_prefetched, 0u);
    cudaFreeHost(hk);
    cudaFreeHost(hv);
  }
}

// The full row of sequence b (n tokens) that went to ring slot `slot` of each of its histories
// (rows [heads, H, mb] of b) against fp64: each query head's softmax of score(qh, t) (already
// scaled) over every token, max-pooled into blocks of blk, over the group's query heads when
// grouped; columns past the sequence's blocks are 0.
template <class Score>
void expect_full_rows(const float* rows, int slot, int H, int mb, int hq, int hist_group, int blk,
                      int n, int b, Score&& score) {
  const int heads = hq / hist_group, nb = (n + blk - 1) / blk;
  std::vector<double> want(size_t(heads) * mb, 0.0);
  for (int qh = 0; qh < hq; ++qh) {
    std::vector<double> sc(static_cast<size_t>(n));
    double m = -INFINITY;
    for (int t = 0; t < n; ++t) m = std::max(m, sc[size_t(t)] = score(qh, t));
    double z = 0;
    for (double v : sc) z += std::exp(v - m);
    double* w = want.data() + size_t(qh / hist_group) * mb;
    for (int j = 0; j < nb; ++j)
      for (int t = j * blk; t < std::min(n, j * blk + blk); ++t)
        w[j] = std::max(w[j], std::exp(sc[size_t(t)] - m) / z);
  }
  for (int hh = 0; hh < heads; ++hh) {
    const float* row = rows + (size_t(hh) * H + slot) * mb;
    for (int j = 0; j < mb; ++j) {
      const double w = want[size_t(hh) * mb + j];
      if (j >= nb) {
        ASSERT_EQ(row[j], 0.f) << "b " << b << " history " << hh << " block " << j;
      } else {
        ASSERT_NEAR(row[j], w, 1e-6 + 1e-4 * w) << "b " << b << " history " << hh << " block " << j;
      }
    }
  }
}

// append_row_cuda's full row against fp64: the softmax of q.k * scale over every token,
// max-pooled into blocks, for head_dim 64 and 128, GQA groups 1, 4 and 8, keys in device
// memory (the tensor-core scores) and in mapped host memory (the lane form), two sequences
// whose lengths are not multiples of the page, the block or the kernels' 256-key chunks.
// Blocks of 8, 16 and 32 take the block maxima pooled inside the score kernel (device keys);
// blocks of 4 take the per-token scores and the pool kernel, as host keys always do.
// The slot the row goes to starts as garbage, so unwritten columns show; columns past a
// sequence's blocks must be 0; count and tokens advance. Grouped (a history per kv head), the
// row is the largest over the group's query heads.
TEST(AttnPredCuda, FullRowEqualsFp64AcrossShapes) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const int B = 2, hq = 8, page = 16, H = 4;
  // 9001 tokens: 36 chunks of 256 keys, more than the one wave of score CTAs a kv head gets at
  // 8 kv heads (2 CTAs per SM over batch x kv heads), so its CTAs walk several chunks.
  const int lens[B] = {700, 9001};
  const int pages_per_seq = (9001 + page - 1) / page, num_pages = B * pages_per_seq;
  for (int blk : {16, 8, 32, 4})
    for (int d : {64, 128})
      for (int hkv : {8, 2, 1})
        for (int form = 0; form < 4; ++form) {
          const bool on_host = form & 1, grouped = form & 2;
          if (blk != 16 && on_host) continue;  // the lane form has one pooling path
          if (grouped && hkv == hq) continue;  // groups of one: the same as not grouped
          SCOPED_TRACE("block " + std::to_string(blk) + " d " + std::to_string(d) + " hkv " +
                       std::to_string(hkv) + (on_host ? " host keys" : " device keys") +
                       (grouped ? " grouped" : ""));
          const ap::Geometry geo{H, blk, 64, 64};
          const int mb = (9001 + blk - 1) / blk + 8;  // columns past the longer row stay 0
          const int group = hq / hkv, hist_group = grouped ? group : 1, heads = hq / hist_group;
          std::mt19937 rng(uint32_t(d * 100 + hkv * 10 + form));
          std::normal_distribution<float> nd(0.f, 1.f);
          std::vector<bf16> q(size_t(B) * hq * d), k(size_t(num_pages) * page * hkv * d);
          for (auto& x : q) x = float_to_bf16(nd(rng));
          for (auto& x : k) x = float_to_bf16(nd(rng));
          std::vector<int32_t> table(static_cast<size_t>(num_pages));
          for (int i = 0; i < num_pages; ++i) table[size_t(i)] = i;
          std::shuffle(table.begin(), table.end(), rng);
          const std::vector<int32_t> len_h(lens, lens + B), count_h = {1, 6};
          std::vector<float> rows_h(size_t(B) * heads * H * mb, 7.f);
          Dev<bf16> dq(q), dk(k);
          bf16* hk = nullptr;
          if (on_host) {
            KVS_CUDA_CHECK(cudaHostAlloc(&hk, k.size() * sizeof(bf16), cudaHostAllocMapped));
            std::copy(k.begin(), k.end(), hk);
          }
          Dev<int32_t> dtable(table), dlen(len_h), dcount(count_h), dtokens(B);
          Dev<float> drows(rows_h);
          const bf16* keys = on_host ? hk : dk.p;  // also as V: the row reads only K
          const PagedKV view{keys,      keys, dtable.p, dlen.p, B,
                             num_pages, page, hkv,      d,      pages_per_seq};
          const ap::HistoryState hist{drows.p, dcount.p, dtokens.p, B, heads, H, mb, hist_group};
          const size_t scratch_bytes = ap::row_scratch_bytes(B, hq, mb * geo.block);
          Dev<char> scratch(scratch_bytes);
          const float scale = 1.f / std::sqrt(float(d));
          KVS_CUDA_CHECK(ap::append_row_cuda(dq.p, hq, view, nullptr, 0, dlen.p, B, hkv, scale, geo,
                                             hist, scratch.p, scratch_bytes, on_host, nullptr));
          KVS_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<float> got = drows.get(rows_h.size());
          const std::vector<int32_t> count = dcount.get(B), tokens = dtokens.get(B);
          for (int b = 0; b < B; ++b) {
            EXPECT_EQ(count[size_t(b)], count_h[size_t(b)] + 1);
            EXPECT_EQ(tokens[size_t(b)], lens[b]);
            const float* rows = got.data() + size_t(b) * heads * H * mb;
            expect_full_rows(rows, count_h[size_t(b)] % H, H, mb, hq, hist_group, blk, lens[b], b,
                             [&](int h, int t) {
                               const int pg = table[size_t(b * pages_per_seq + t / page)];
                               const bf16* kr =
                                   k.data() +
                                   ((size_t(pg) * page + t % page) * hkv + h / group) * d;
                               const bf16* qr = q.data() + (size_t(b) * hq + h) * d;
                               double dot = 0;
                               for (int e = 0; e < d; ++e)
                                 dot += double(bf16_to_float(qr[e])) * double(bf16_to_float(kr[e]));
                               return dot * scale;
                             });
          }
          if (hk) cudaFreeHost(hk);
        }
}

// append_full_row_from_copy_cuda against fp64 over the keys (and, int4, the queries) rounded as
// round_key_cpu (round_query_cpu) rounds them: the copy is filled at lengths {300, 5003} (a
// prefill's fill_key_copy_cuda) and the row taken at {700, 9001} quantizes the keys since (or all
// of them, from an empty copy), its bytes and scales equal the CPU rounding bit for bit and len
// follows the lengths, and the second row is the pooled softmax over every key, for both
// formats, head_dim 64 and 128, blocks of 8 and 16, GQA groups 1, 4 and 8, grouped or not.
// Query heads far outside fp16's range (2^40 and 2^-40 times the rest) check the e4m3 kernel's
// power-of-two scaling of q and the int4 kernel's scale per head.
TEST(AttnPredCuda, FullRowFromKeyCopyEqualsFp64OverRoundedKeys) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const int B = 2, hq = 8, page = 16, H = 4;
  const int first[B] = {300, 5003}, lens[B] = {700, 9001};
  const int pages_per_seq = (9001 + page - 1) / page, num_pages = B * pages_per_seq;
  for (ap::KeyFormat fmt : {ap::KeyFormat::E4m3, ap::KeyFormat::Int4})
    for (int blk : {16, 8})
      for (int d : {64, 128})
        for (int hkv : {8, 2, 1})
          for (bool grouped : {false, true}) {
            if (grouped && hkv == hq) continue;
            const bool int4 = fmt == ap::KeyFormat::Int4;
            SCOPED_TRACE(std::string(int4 ? "int4" : "e4m3") + " block " + std::to_string(blk) +
                         " d " + std::to_string(d) + " hkv " + std::to_string(hkv) +
                         (grouped ? " grouped" : ""));
            const ap::Geometry geo{H, blk, 64, 64};
            const int mb = (9001 + blk - 1) / blk + 8;
            const int group = hq / hkv, hist_group = grouped ? group : 1, heads = hq / hist_group;
            std::mt19937 rng(uint32_t(d * 100 + hkv * 10 + grouped));
            std::normal_distribution<float> nd(0.f, 1.f);
            std::vector<bf16> q(size_t(B) * hq * d), k(size_t(num_pages) * page * hkv * d);
            for (size_t i = 0; i < q.size(); ++i) {
              const int qh = int(i / d) % hq;
              q[i] = float_to_bf16(nd(rng) * (qh == 1 ? 0x1p40f : qh == 2 ? 0x1p-40f : 1.f));
            }
            for (auto& x : k) x = float_to_bf16(nd(rng) * (1 + 3 * (rng() % 2)));
            std::vector<int32_t> table(static_cast<size_t>(num_pages));
            for (int i = 0; i < num_pages; ++i) table[size_t(i)] = i;
            std::shuffle(table.begin(), table.end(), rng);
            std::vector<int32_t> len_h(first, first + B);
            const std::vector<int32_t> count_h = {1, 6};
            std::vector<float> rows_h(size_t(B) * heads * H * mb, 7.f);
            Dev<bf16> dq(q), dk(k);
            Dev<int32_t> dtable(table), dlen(len_h), dcount(count_h), dtokens(B);
            Dev<float> drows(rows_h);
            const PagedKV view{dk.p,      dk.p, dtable.p, dlen.p, B,
                               num_pages, page, hkv,      d,      pages_per_seq};
            const ap::HistoryState hist{drows.p, dcount.p, dtokens.p, B, heads, H, mb, hist_group};
            ap::KeyCopy copy;
            copy.max_batch = B;
            copy.num_kv_heads = hkv;
            copy.head_dim = d;
            copy.max_tokens = mb * blk;
            copy.format = fmt;
            const size_t keys = size_t(B) * hkv * copy.max_tokens, kb = size_t(copy.key_bytes());
            Dev<uint8_t> ck(keys * kb);
            Dev<float> cs(keys);
            Dev<int32_t> cl(B);
            copy.k = ck.p;
            copy.scale = cs.p;
            copy.len = cl.p;
            const size_t scratch_bytes = ap::row_scratch_bytes(B, hq, mb * geo.block);
            Dev<char> scratch(scratch_bytes);
            const float scale = 1.f / std::sqrt(float(d));
            // A prefill's fill at the first lengths, then the row at the longer ones, which
            // quantizes the keys since; or (kv heads 2) the row from an empty copy.
            if (hkv == 2) {
              KVS_CUDA_CHECK(cudaMemset(cl.p, 0, B * sizeof(int32_t)));
            } else {
              KVS_CUDA_CHECK(ap::fill_key_copy_cuda(view, copy, B, nullptr));
            }
            len_h.assign(lens, lens + B);
            KVS_CUDA_CHECK(
                cudaMemcpy(dlen.p, len_h.data(), B * sizeof(int32_t), cudaMemcpyHostToDevice));
            KVS_CUDA_CHECK(ap::append_full_row_from_copy_cuda(
                dq.p, hq, view, B, scale, geo, hist, copy, scratch.p, scratch_bytes, nullptr));
            KVS_CUDA_CHECK(cudaDeviceSynchronize());
            EXPECT_EQ(cl.get(B), len_h);
            const std::vector<uint8_t> got_k = ck.get(keys * kb);
            const std::vector<float> got_s = cs.get(keys);
            const std::vector<float> got = drows.get(rows_h.size());
            const std::vector<int32_t> count = dcount.get(B), tokens = dtokens.get(B);
            std::vector<float> kr(static_cast<size_t>(d));
            for (int b = 0; b < B; ++b) {
              EXPECT_EQ(count[size_t(b)], count_h[size_t(b)] + 1);
              EXPECT_EQ(tokens[size_t(b)], lens[b]);
              const int n = lens[b];
              // The copy: each key's scale and bytes (int4: nibbles, the lower dim in the low
              // one), exactly the CPU rule's.
              for (int h = 0; h < hkv; ++h)
                for (int t = 0; t < n; ++t) {
                  const int pg = table[size_t(b * pages_per_seq + t / page)];
                  const bf16* kp = k.data() + ((size_t(pg) * page + t % page) * hkv + h) * d;
                  float amax = 0.f;
                  for (int e = 0; e < d; ++e)
                    amax = std::max(amax, std::fabs(bf16_to_float(kp[e])));
                  const size_t key = size_t(copy.key_index(b, h, t));
                  const float sk = int4 ? kernels::int_row_scale(amax, kernels::kInt4Max)
                                        : kernels::e4m3_row_scale(amax);
                  ASSERT_EQ(got_s[key], sk) << "b " << b << " kv head " << h << " key " << t;
                  for (int e = 0; e < d; ++e) {
                    const float x = bf16_to_float(kp[e]);
                    const int got = int4 ? (got_k[key * kb + e / 2] >> (4 * (e % 2))) & 0xf
                                         : got_k[key * kb + e];
                    const int want = int4 ? kernels::to_int_level(x, sk, kernels::kInt4Max) & 0xf
                                          : kernels::to_e4m3(x, sk);
                    ASSERT_EQ(got, want)
                        << "b " << b << " kv head " << h << " key " << t << " dim " << e;
                  }
                }
              const float* rows = got.data() + size_t(b) * heads * H * mb;
              std::vector<float> qr(size_t(hq) * d);  // the query heads as the kernel takes them
              for (int qh = 0; qh < hq; ++qh) {
                std::vector<float> qf(static_cast<size_t>(d));
                for (int e = 0; e < d; ++e)
                  qf[size_t(e)] = bf16_to_float(q[(size_t(b) * hq + qh) * d + size_t(e)]);
                ap::round_query_cpu(fmt, qf.data(), d, qr.data() + size_t(qh) * d);
              }
              expect_full_rows(
                  rows, count_h[size_t(b)] % H, H, mb, hq, hist_group, blk, n, b,
                  [&](int qh, int t) {
                    const int pg = table[size_t(b * pages_per_seq + t / page)];
                    ap::round_key_cpu(
                        fmt, k.data() + ((size_t(pg) * page + t % page) * hkv + qh / group) * d, d,
                        kr.data());
                    double dot = 0;
                    for (int e = 0; e < d; ++e)
                      dot += double(qr[size_t(qh) * d + size_t(e)]) * kr[size_t(e)];
                    return dot * scale;
                  });
            }
          }
}

// The GPU-resident sparse step (sparse_attend_cuda) against fp64 over the tokens the flags
// select: the attention's o and lse, the history row (0 where nothing was attended, the
// group's largest when grouped), the token lists, the rows-read counter and the history's
// advance; with no history, the rows untouched. Lengths cut blocks and recent windows,
// pages of 8 split blocks, flag rows are not 16-byte aligned (the last one ending the flag
// buffer, where a read past the row is memcheck's to report), and denser flags give lists
// spread over several CTAs.
TEST(AttnPredCuda, SparseStepEqualsFp64OverTheSelectedTokens) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const int B = 3, hq = 8, H = 4;
  const int lens[B] = {700, 57, 9001};  // the last row's flags end at the buffer's end
  for (int page : {16, 8})
    for (int blk : {16, 8})
      for (int d : {64, 128})
        for (int hkv : {8, 2, 1})
          // 0 per query head, 1 grouped, 2 no row, 3 and 4 as 0 and 1 with the row apart
          // (a SparseRow, then sparse_row_cuda on another stream)
          for (int form = 0; form < 5; ++form) {
            const bool grouped = form == 1 || form == 4, row = form != 2, apart = form >= 3;
            if (grouped && hkv == hq) continue;
            const double density = d == 64 ? 0.05 : 0.3;
            SCOPED_TRACE("page " + std::to_string(page) + " block " + std::to_string(blk) + " d " +
                         std::to_string(d) + " hkv " + std::to_string(hkv) + " form " +
                         std::to_string(form));
            const ap::Geometry geo{H, blk, 64, 64};
            const int mb = (9001 + blk - 1) / blk;  // flag rows of mb bytes: unaligned
            const int pages_per_seq = (9001 + page - 1) / page, num_pages = B * pages_per_seq;
            const int group = hq / hkv, hist_group = grouped ? group : 1, heads = hq / hist_group;
            std::mt19937 rng(uint32_t(page * 1000 + blk * 100 + d + hkv * 10 + form));
            std::normal_distribution<float> nd(0.f, 1.f);
            std::vector<bf16> q(size_t(B) * hq * d), k(size_t(num_pages) * page * hkv * d),
                v(k.size());
            for (auto& x : q) x = float_to_bf16(2.f * nd(rng));
            for (auto& x : k) x = float_to_bf16(nd(rng));
            for (auto& x : v) x = float_to_bf16(nd(rng));
            std::vector<int32_t> table(static_cast<size_t>(num_pages));
            std::iota(table.begin(), table.end(), 0);
            std::shuffle(table.begin(), table.end(), rng);
            std::vector<uint8_t> flags(size_t(B) * hkv * mb);
            std::uniform_real_distribution<double> u(0.0, 1.0);
            for (auto& f : flags) f = u(rng) < density;
            // The lists, and the tightest cap on their blocks.
            std::vector<std::vector<int32_t>> lists(size_t(B) * hkv);
            int list_cap = 1;
            for (int b = 0; b < B; ++b)
              for (int h = 0; h < hkv; ++h) {
                const size_t bh = size_t(b) * hkv + size_t(h);
                lists[bh] = ap::selected_tokens_cpu(geo, lens[b], flags.data() + bh * mb);
                int blocks = 0;
                for (size_t i = 0; i < lists[bh].size(); ++i)
                  blocks += i == 0 || lists[bh][i] / blk != lists[bh][i - 1] / blk;
                list_cap = std::max(list_cap, blocks);
              }
            const int max_tokens = 9001;
            const std::vector<int32_t> len_h(lens, lens + B), count_h = {1, 6, 0};
            std::vector<float> rows_h(size_t(B) * heads * H * mb, 7.f);
            Dev<bf16> dq(q), dk(k), dv(v), dout(q.size());
            Dev<float> dlse(size_t(B) * hq), drows(rows_h);
            Dev<int32_t> dtable(table), dlen(len_h), dcount(count_h), dtokens(B);
            Dev<uint8_t> dflags(flags);
            Dev<int32_t> toks(size_t(B) * hkv * max_tokens), counts(size_t(B) * hkv);
            Dev<unsigned long long> counters(2);
            KVS_CUDA_CHECK(cudaMemset(counters.p, 0, 2 * sizeof(unsigned long long)));
            kernels::tactic::Selection sel;
            sel.tokens = toks.p;
            sel.counts = counts.p;
            sel.max_tokens = max_tokens;
            const PagedKV kv{dk.p,      dv.p, dtable.p, dlen.p, B,
                             num_pages, page, hkv,      d,      pages_per_seq};
            const ap::HistoryState hist{drows.p, dcount.p, dtokens.p, B, heads, H, mb, hist_group};
            const size_t ws_bytes = ap::sparse_attend_workspace_bytes(B, hq, hkv, d, list_cap);
            Dev<char> ws(ws_bytes);
            const float scale = 1.f / std::sqrt(float(d));
            Dev<float> rmax(size_t(B) * hq * list_cap), rlse(size_t(B) * hq);
            Dev<int32_t> rids(size_t(B) * hkv * list_cap), rcount(size_t(B) * hkv);
            Dev<unsigned int> rdone(1);
            const ap::SparseRow sparse_row{rmax.p, rids.p, rcount.p, rlse.p, rdone.p};
            KVS_CUDA_CHECK(ap::sparse_attend_cuda(dq.p, hq, kv, scale, dflags.p, mb, geo, list_cap,
                                                  row ? &hist : nullptr, sel, counters.p, dout.p,
                                                  dlse.p, ws.p, ws_bytes, nullptr,
                                                  apart ? &sparse_row : nullptr));
            if (apart) {
              // What the next call would reuse of the workspace must not matter any more.
              KVS_CUDA_CHECK(cudaMemset(ws.p, 0xff, ws_bytes));
              cudaStream_t side;
              KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
              KVS_CUDA_CHECK(cudaDeviceSynchronize());
              KVS_CUDA_CHECK(
                  ap::sparse_row_cuda(sparse_row, hist, dlen.p, B, hq, hkv, list_cap, side));
              KVS_CUDA_CHECK(cudaStreamSynchronize(side));
              KVS_CUDA_CHECK(cudaStreamDestroy(side));
            }
            KVS_CUDA_CHECK(cudaDeviceSynchronize());
            const std::vector<bf16> out = dout.get(q.size());
            const std::vector<float> lse = dlse.get(size_t(B) * hq), got = drows.get(rows_h.size());
            const std::vector<int32_t> count = dcount.get(B), tokens = dtokens.get(B),
                                       got_toks = toks.get(size_t(B) * hkv * max_tokens),
                                       got_counts = counts.get(size_t(B) * hkv);
            unsigned long long want_read = 0;
            for (int b = 0; b < B; ++b) {
              EXPECT_EQ(count[size_t(b)], count_h[size_t(b)] + (row ? 1 : 0));
              if (row) EXPECT_EQ(tokens[size_t(b)], lens[b]);
              const int n = lens[b], nb = (n + blk - 1) / blk;
              std::vector<double> want_row(size_t(heads) * mb, 0.0);
              for (int h = 0; h < hq; ++h) {
                const size_t bh = size_t(b) * hkv + size_t(h / group);
                const std::vector<int32_t>& list = lists[bh];
                if (h % group == 0) {
                  want_read += list.size();
                  ASSERT_EQ(got_counts[bh], int(list.size()))
                      << "b " << b << " kv head " << h / group;
                  for (size_t i = 0; i < list.size(); ++i)
                    ASSERT_EQ(got_toks[bh * max_tokens + i], list[i]) << "b " << b << " at " << i;
                }
                std::vector<double> sc(list.size());
                double m = -INFINITY;
                const bf16* qr = q.data() + (size_t(b) * hq + h) * d;
                auto row_of = [&](int t) {
                  const int pg = table[size_t(b * pages_per_seq + t / page)];
                  return ((size_t(pg) * page + t % page) * hkv + h / group) * d;
                };
                for (size_t i = 0; i < list.size(); ++i) {
                  const bf16* kr = k.data() + row_of(list[i]);
                  double dot = 0;
                  for (int e = 0; e < d; ++e)
                    dot += double(bf16_to_float(qr[e])) * double(bf16_to_float(kr[e]));
                  sc[i] = dot * scale;
                  m = std::max(m, sc[i]);
                }
                double z = 0;
                for (double s : sc) z += std::exp(s - m);
                const double want_lse = m + std::log(z);
                ASSERT_NEAR(lse[size_t(b) * hq + h], want_lse, 1e-3) << "b " << b << " head " << h;
                for (int e = 0; e < d; ++e) {
                  double o = 0;
                  for (size_t i = 0; i < list.size(); ++i)
                    o += std::exp(sc[i] - want_lse) *
                         double(bf16_to_float(v[row_of(list[i]) + size_t(e)]));
                  const float g = bf16_to_float(out[(size_t(b) * hq + h) * d + size_t(e)]);
                  ASSERT_NEAR(g, o, 8e-3 + 2e-2 * std::abs(o))
                      << "b " << b << " head " << h << " dim " << e;
                }
                double* w = want_row.data() + size_t(h / hist_group) * mb;
                for (size_t i = 0; i < list.size(); ++i) {
                  double& cell = w[list[i] / blk];
                  cell = std::max(cell, std::exp(sc[i] - want_lse));
                }
              }
              for (int hh = 0; hh < heads; ++hh)
                for (int s = 0; s < H; ++s) {
                  const float* r = got.data() + ((size_t(b) * heads + hh) * H + s) * mb;
                  const bool written = row && s == count_h[size_t(b)] % H;
                  for (int j = 0; j < mb; ++j) {
                    const double w = written ? want_row[size_t(hh) * mb + j] : 7.0;
                    if (!written || j >= nb) {
                      ASSERT_EQ(r[j], float(w))
                          << "b " << b << " history " << hh << " slot " << s << " block " << j;
                    } else {
                      ASSERT_NEAR(r[j], w, 1e-6 + 2e-3 * w)
                          << "b " << b << " history " << hh << " block " << j;
                    }
                  }
                }
            }
            const std::vector<unsigned long long> got_counters = counters.get(2);
            EXPECT_EQ(got_counters[0], want_read);
            EXPECT_EQ(got_counters[1], 0u);
          }
}

TEST(AttnPredCuda, GpuResidentEngineMatchesCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(false);
}

TEST(AttnPredCuda, OffloadPrefetchesTheSelectedBlocks) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(true);
}

// Four layers (0 dense) against the CPU engine, eager: the last sparse layers defer their
// calibration rows and predictions to the next step (AttnPredEngine::kDeferredLayers), which
// must not change a row, a selection or an output. A deferred row reads the lengths of its own
// step, so the history rows check that snapshot: the context grows by a token a step. Halfway,
// every layer is prefilled again, which drops what its last step deferred (step 7 does not
// complete it, so its deferred branches are pending then).
void deferred_branches_match_cpu(int predict_interval,
                                 CalibrationKeys keys = CalibrationKeys::Bf16) {
  Scene sc;
  sc.shape.num_layers = 4;
  const AttnPredParams params = engine_params(9);
  EngineConfig cc;
  cc.backend = Backend::Cpu;
  cc.attnpred.predict_interval = predict_interval;
  cc.attnpred.calibration_keys = keys;
  EngineConfig gc = cc;
  gc.backend = Backend::Cuda;
  AttnPredEngine cpu(sc.shape, cc, params), gpu(sc.shape, gc, params);
  Dev<char> ws(gpu.workspace_bytes());
  gpu.bind_workspace({ws.p, gpu.workspace_bytes()});
  Dev<bf16> dk(sc.k), dv(sc.v);
  Dev<int32_t> tab(sc.table), len(1);
  int32_t host_len = 900;
  const PagedKV ckv = sc.view(sc.k.data(), sc.v.data(), sc.table.data(), &host_len);
  const PagedKV gkv = sc.view(dk.p, dv.p, tab.p, len.p);
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<bf16> q(size_t(8) * 128), oc(q.size());
  Dev<bf16> dq(q.size()), dout(q.size());
  constexpr int kLayers = 4, kSteps = 16, kPrefillAgain = 8;
  std::vector<char> diverged(kLayers, 0);  // once a near-tie flips a selection, histories differ
  int compared = 0;
  for (int step = 0; step < kSteps; ++step) {
    host_len = 900 + step;
    KVS_CUDA_CHECK(cudaMemcpy(len.p, &host_len, sizeof(int32_t), cudaMemcpyHostToDevice));
    if (step == 0 || step == kPrefillAgain) {
      for (int l = 1; l < kLayers; ++l) {
        cpu.prefill(l, ckv, nullptr);
        gpu.prefill(l, gkv, nullptr);
      }
      std::fill(diverged.begin(), diverged.end(), 0);
    }
    for (int l = 0; l < kLayers; ++l) {
      for (auto& x : q) x = float_to_bf16(nd(rng));
      KVS_CUDA_CHECK(cudaMemcpy(dq.p, q.data(), q.size() * sizeof(bf16), cudaMemcpyHostToDevice));
      cpu.decode(l, q.data(), nullptr, ckv, oc.data(), nullptr, nullptr);
      gpu.decode(l, dq.p, nullptr, gkv, dout.p, nullptr, nullptr);
      const auto rc = cpu.last_read(l, 0), rg = gpu.last_read(l, 0);
      ASSERT_EQ(rc.empty(), rg.empty()) << "step " << step << " layer " << l;
      diverged[size_t(l)] |= rc != rg;
      if (diverged[size_t(l)]) continue;
      ++compared;
      const std::vector<bf16> og = dout.get(q.size());
      for (size_t i = 0; i < q.size(); ++i)
        ASSERT_NEAR(bf16_to_float(og[i]), bf16_to_float(oc[i]),
                    2e-2 + 2e-2 * std::abs(bf16_to_float(oc[i])))
            << "step " << step << " layer " << l << " at " << i;
    }
    // Every layer's history, the deferred rows included (complete_deferred), after every
    // third step: on the others the next step's first sparse layer launches them.
    if (step % 3 != 2) continue;
    gpu.complete_deferred(nullptr);
    for (int l = 1; l < kLayers; ++l) {
      const int since_prefill = step < kPrefillAgain ? step + 1 : step - kPrefillAgain + 1;
      ASSERT_EQ(gpu.history_count(l)[0], since_prefill) << "step " << step << " layer " << l;
      if (diverged[size_t(l)]) continue;
      const auto hc = cpu.history_rows(l), hg = gpu.history_rows(l);
      ASSERT_EQ(hc.size(), hg.size());
      for (size_t i = 0; i < hc.size(); ++i)
        ASSERT_NEAR(hg[i], hc[i], 1e-5 + 1e-4 * hc[i])
            << "step " << step << " layer " << l << " at " << i;
      EXPECT_EQ(cpu.block_flags(l), gpu.block_flags(l)) << "step " << step << " layer " << l;
    }
  }
  // Most layer-steps compared before any near-tie.
  EXPECT_GT(compared, kSteps * kLayers / 2);
}

TEST(AttnPredCuda, DeferredBranchesMatchCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_GE(AttnPredEngine::kDeferredLayers, 2);  // layers 2 and 3 defer
  deferred_branches_match_cpu(1);
}

TEST(AttnPredCuda, DeferredBranchesMatchCpuPredictingEverySecondStep) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  deferred_branches_match_cpu(2);
}

// The calibration rows from the e4m3 copy of K, deferred or not, across a prefill that resets
// the copy (kernels/attnpred/attnpred.h KeyCopy).
TEST(AttnPredCuda, DeferredBranchesMatchCpuWithE4m3CalibrationKeys) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  deferred_branches_match_cpu(1, CalibrationKeys::E4m3);
}

TEST(AttnPredCuda, DeferredBranchesMatchCpuWithInt4CalibrationKeys) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  deferred_branches_match_cpu(1, CalibrationKeys::Int4);
}

// A CUDA graph of decode steps over every layer (the way a decode loop runs the engine): the
// predictions on their branch, joined by the last sparse layer's decode, must give exactly
// the eager calls' outputs, histories and selections. Layers 1-3 sparse (0 dense), a
// prediction every 2nd step (the layers' phases staggered), calibration every 3rd: the graph
// covers one whole phase of 6 steps.
// The sparse step's two kernels (and its history row's, on the row lane) carry the device's
// greatest priority on their graph nodes, and
// so do the predictions' (the CNN's two kernels and the top-K) when `urgent_predictions`, else
// kPredictRaise levels above the least; every other kernel node (the calibration rows, the
// dense layer) a lesser one than the step's: the step outranks its branches, and the
// predictions the calibration rows, in a graph instantiated to honour node priorities.
void expect_step_kernels_outrank_the_branches(cudaGraph_t graph, bool urgent_predictions) {
  int least = 0, greatest = 0;
  KVS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  ASSERT_LT(greatest, least) << "the device has a single stream priority";
  size_t n = 0;
  KVS_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  KVS_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  int step = 0, predictions = 0, other = 0;
  const auto has = [](const std::string& s, const char* what) {
    return s.find(what) != std::string::npos;
  };
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    KVS_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeParams kp{};
    KVS_CUDA_CHECK(cudaGraphKernelNodeGetParams(node, &kp));
    const char* name = nullptr;
    KVS_CUDA_CHECK(cudaFuncGetName(&name, kp.func));
    cudaLaunchAttributeValue v{};
    KVS_CUDA_CHECK(cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributePriority, &v));
    const std::string fn = name;
    if (has(fn, "sparse_attend_kernel") || has(fn, "sparse_merge_kernel") ||
        has(fn, "sparse_row_kernel")) {
      ++step;
      EXPECT_EQ(v.priority, greatest) << fn;
    } else if (has(fn, "predict_rows_kernel") || has(fn, "predict_sum_kernel") ||
               has(fn, "select_kernel")) {
      ++predictions;
      const int raised = std::max(greatest, least - AttnPredEngine::kPredictRaise);
      EXPECT_EQ(v.priority, urgent_predictions ? greatest : raised) << fn;
      if (!urgent_predictions) EXPECT_NE(v.priority, greatest) << fn;
    } else {
      ++other;
      EXPECT_NE(v.priority, greatest) << fn;
    }
  }
  EXPECT_GT(step, 0);
  EXPECT_GT(predictions, 0);
  EXPECT_GT(other, 0);
}

// A CUDA graph of 6 steps over 4 layers (1 dense) against the same steps launched eagerly,
// bit for bit, after `eager_steps` eager steps (the warm-up among them). Instantiated to
// honour node priorities, as the README asks of a decode graph.
void graph_of_steps_equals_eager_steps(int period, int interval, int eager_steps,
                                       CalibrationKeys keys = CalibrationKeys::Bf16) {
  Scene sc;
  sc.shape.num_layers = 4;
  const AttnPredParams params = engine_params(5);
  EngineConfig cfg;
  cfg.backend = Backend::Cuda;
  cfg.attnpred.calibration_period = period;
  cfg.attnpred.predict_interval = interval;
  cfg.attnpred.calibration_keys = keys;
  AttnPredEngine eager(sc.shape, cfg, params), graphed(sc.shape, cfg, params);
  Dev<char> ws_e(eager.workspace_bytes()), ws_g(graphed.workspace_bytes());
  eager.bind_workspace({ws_e.p, eager.workspace_bytes()});
  graphed.bind_workspace({ws_g.p, graphed.workspace_bytes()});
  const int num_steps = eager_steps + 6;
  constexpr int kLayers = 4;
  const size_t qn = size_t(8) * 128;
  std::mt19937 rng(23);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<bf16> qs(qn * num_steps);
  for (auto& x : qs) x = float_to_bf16(nd(rng));
  Dev<bf16> dk(sc.k), dv(sc.v), dq(qs), out_e(qn * num_steps * kLayers),
      out_g(qn * num_steps * kLayers);
  Dev<int32_t> tab(sc.table), len_e(1), len_g(1);
  int32_t* lens = nullptr;  // pinned: the graph's copies read it when replayed
  KVS_CUDA_CHECK(cudaHostAlloc(&lens, num_steps * sizeof(int32_t), cudaHostAllocDefault));
  for (int s = 0; s < num_steps; ++s) lens[s] = 900 + s;
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto step = [&](AttnPredEngine& e, int32_t* len, bf16* out, int s) {
    KVS_CUDA_CHECK(
        cudaMemcpyAsync(len, lens + s, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    const PagedKV kv = sc.view(dk.p, dv.p, tab.p, len);
    for (int l = 0; l < kLayers; ++l)
      e.decode(l, dq.p + size_t(s) * qn, nullptr, kv, out + (size_t(s) * kLayers + l) * qn,
               nullptr, stream);
  };
  for (AttnPredEngine* e : {&eager, &graphed}) {
    int32_t* len = e == &eager ? len_e.p : len_g.p;
    KVS_CUDA_CHECK(cudaMemcpyAsync(len, lens, sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    for (int l = 1; l < kLayers; ++l) e->prefill(l, sc.view(dk.p, dv.p, tab.p, len), stream);
    for (int s = 0; s < eager_steps; ++s) step(*e, len, e == &eager ? out_e.p : out_g.p, s);
  }
  for (int s = eager_steps; s < num_steps; ++s) step(eager, len_e.p, out_e.p, s);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVS_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int s = eager_steps; s < num_steps; ++s) step(graphed, len_g.p, out_g.p, s);
  KVS_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  expect_step_kernels_outrank_the_branches(graph,
                                           interval <= AttnPredEngine::kUrgentPredictInterval);
  KVS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));
  KVS_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  // What the last step deferred (kDeferredLayers), run once on both, as an eager loop's end.
  eager.complete_deferred(stream);
  graphed.complete_deferred(stream);
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  const size_t n_out = qn * num_steps * kLayers;
  const std::vector<bf16> oe = out_e.get(n_out), og = out_g.get(n_out);
  for (size_t i = 0; i < n_out; ++i)
    ASSERT_EQ(oe[i].bits, og[i].bits) << "step " << i / (qn * kLayers) << " layer "
                                      << i / qn % kLayers << " at " << i % qn;
  for (int l = 1; l < kLayers; ++l) {
    EXPECT_EQ(eager.block_flags(l), graphed.block_flags(l)) << "layer " << l;
    EXPECT_EQ(eager.history_rows(l), graphed.history_rows(l)) << "layer " << l;
    EXPECT_EQ(graphed.history_count(l)[0], num_steps) << "layer " << l;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFreeHost(lens);
}

TEST(AttnPredCuda, GraphOfStepsEqualsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  graph_of_steps_equals_eager_steps(3, 2, 1);
}

// The e4m3 key copy inside a captured step: each replayed row quantizes the keys since the
// layer's last row from the device lengths, as the eager rows do, bit for bit.
TEST(AttnPredCuda, GraphOfStepsWithE4m3CalibrationKeysEqualsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  graph_of_steps_equals_eager_steps(3, 2, 1, CalibrationKeys::E4m3);
}

TEST(AttnPredCuda, GraphOfStepsWithInt4CalibrationKeysEqualsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  graph_of_steps_equals_eager_steps(3, 2, 1, CalibrationKeys::Int4);
}

// A prediction every step: the three sparse layers' predictions each on a lane of their own
// (predict_lanes(1) is 4), all urgent, joined by the last sparse layer.
TEST(AttnPredCuda, GraphPredictingEveryStepEqualsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_GE(AttnPredEngine::predict_lanes(1), 3);
  graph_of_steps_equals_eager_steps(3, 1, 1);
}

// M 5, P 4 over 3 sparse layers: the graph's first step (each layer's call 4) neither
// calibrates nor predicts, so it must join no branch (joining one it had not forked waited on
// an event recorded outside the capture, and the capture failed).
TEST(AttnPredCuda, GraphStartingOnAStepWithoutBranchesEqualsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  graph_of_steps_equals_eager_steps(5, 4, 4);
}

// A prediction every 3rd (every 2nd) step: the CUDA predictor's incremental update then
// covers several appended rows, and the steps between keep the selection.
TEST(AttnPredCuda, GpuResidentEngineMatchesCpuPredictingEveryThirdStep) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(false, 3);
}

TEST(AttnPredCuda, OffloadPrefetchesTheSelectedBlocksPredictingEverySecondStep) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(true, 2);
}

// A history per kv head (AttnPredConfig::group_history): its rows the largest of the group's
// pooled rows, one prediction and top-K per kv head.
TEST(AttnPredCuda, GroupedHistoryEngineMatchesCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(false, 1, true);
}

TEST(AttnPredCuda, EngineWithE4m3CalibrationKeysMatchesCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(false, 1, true, CalibrationKeys::E4m3);
  run_against_cpu(false, 3, false, CalibrationKeys::E4m3);
}

TEST(AttnPredCuda, EngineWithInt4CalibrationKeysMatchesCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(false, 1, true, CalibrationKeys::Int4);
  run_against_cpu(false, 3, false, CalibrationKeys::Int4);
}

// Blocks of 8 with an odd count of them (max_context 1191: 149 blocks): the key copy still
// holds whole 16-key tiles, and the warm-up row from it is the pooled softmax over the rounded
// keys and queries (fp64; the CPU engine pools by 16 only).
void copied_keys_with_blocks_of_eight(CalibrationKeys keys) {
  SCOPED_TRACE(to_string(keys));
  Scene sc;
  AttnPredParams params = engine_params(4);
  params.block = 8;
  EngineConfig cfg;
  cfg.backend = Backend::Cuda;
  cfg.attnpred.calibration_keys = keys;
  cfg.attnpred.group_history = 0;
  cfg.attnpred.max_context = 1191;
  AttnPredEngine e(sc.shape, cfg, params);
  ASSERT_EQ(e.max_blocks(), 149);
  Dev<char> ws(e.workspace_bytes());
  e.bind_workspace({ws.p, e.workspace_bytes()});
  Dev<bf16> dk(sc.k), dv(sc.v);
  Dev<int32_t> tab(sc.table), len(std::vector<int32_t>{1000});
  const PagedKV kv = sc.view(dk.p, dv.p, tab.p, len.p);
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<bf16> q(size_t(8) * 128);
  for (auto& x : q) x = float_to_bf16(nd(rng));
  Dev<bf16> dq(q), out(q.size());
  e.prefill(1, kv, nullptr);
  e.decode(1, dq.p, nullptr, kv, out.p, nullptr, nullptr);  // the warm-up step: a full row
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> rows = e.history_rows(1);
  const float scale = float(sc.shape.scale());
  std::vector<float> kr(128), qf(q.size()), qr(q.size());
  for (size_t i = 0; i < q.size(); ++i) qf[i] = bf16_to_float(q[i]);
  for (int qh = 0; qh < 8; ++qh)
    ap::round_query_cpu(format_of(keys), qf.data() + qh * 128, 128, qr.data() + qh * 128);
  expect_full_rows(
      rows.data(), 0, params.history, e.max_blocks(), 8, 1, 8, 1000, 0, [&](int qh, int t) {
        ap::round_key_cpu(
            format_of(keys),
            sc.k.data() + sc.view(nullptr, nullptr, sc.table.data(), nullptr).offset(0, t, qh / 4),
            128, kr.data());
        double dot = 0;
        for (int d = 0; d < 128; ++d) dot += double(qr[size_t(qh) * 128 + d]) * kr[size_t(d)];
        return dot * scale;
      });
}

TEST(AttnPredCuda, CopiedCalibrationKeysWithBlocksOfEight) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  for (CalibrationKeys keys : {CalibrationKeys::E4m3, CalibrationKeys::Int4})
    copied_keys_with_blocks_of_eight(keys);
}

TEST(AttnPredCuda, GroupedHistoryOffloadPrefetchesTheSelectedBlocksPredictingEverySecondStep) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  run_against_cpu(true, 2, true);
}

}  // namespace
}  // namespace kvs
