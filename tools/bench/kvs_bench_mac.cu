// kvs-bench-mac: MAC-Attention decode (match + amend/complete + rectify-append, the whole
// attention phase of one layer) against our dense kernel (kernels::dense_decode_cuda) in the
// same run, timed as CUDA-graph replays.
//
// Scene per (context, batch): every sequence has `context` tokens (the current one
// included) of random bf16 K/V in 16-token pages, and a full query ring (W positions
// t - W .. t - 1 of random pre-RoPE queries, components uniform in [-2, 2): far apart under
// the paper's threshold, which this program uses). A fraction `hit rate` of the (sequence,
// kv group)s get, for every head of the group, exactly the ring query at t - gap (a hit: the
// group reads B + gap tokens); the others get fresh random queries (a miss: the group reads
// everything). Hits are per group because one missing head makes its group read all (spec
// 2.9). The measured hit fraction is read back from the device counters and printed.
//
// `layers` sets (KV + rings) are decoded in sequence inside one graph, so that the L2 never
// holds the next call's data; time per call = median replay time / layers. The dense column
// replays dense_decode_cuda over the same KV sets the same way. --json writes every row with
// its (context, batch)'s dense time (docs/formats.md).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <boost/program_options.hpp>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/mac/mac.h"
#include "tools/bench/bench_common.h"

namespace po = boost::program_options;

namespace kvs {
namespace {

namespace mk = kernels::mac;

template <typename T>
using Dev = bench::DeviceBuffer<T>;
using bench::fill_random;
using bench::parse_counts;
using bench::time_graph;

std::vector<double> parse_doubles(const std::string& text, const char* option) {
  std::vector<double> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size())
      throw std::invalid_argument(std::string("--") + option + ": '" + item + "' is not a number");
    out.push_back(v);
  }
  if (out.empty()) throw std::invalid_argument(std::string("--") + option + " is empty");
  return out;
}

struct Args {
  std::vector<int> contexts, batches;
  std::vector<double> hit_rates;
  int hq = 32, hkv = 8, d = 128, page_size = 16;
  int window = 512, band = 256, gap = 256, layers = 4, iters = 50;
  double tau = 0.45;
};

// One layer's KV and rings.
struct LayerSet {
  std::unique_ptr<Dev<bf16>> k, v, ring_q, ring_o;
  std::unique_ptr<Dev<float>> ring_lse, mean, sq;
  std::unique_ptr<Dev<int32_t>> pos, count, last_start, last_len;
  mk::RingState st;
  PagedKV kv;
};

void bench_one(const Args& a, int context, int batch, cudaStream_t stream,
               bench::BenchReport& report) {
  const int pages_per_seq = (context + a.page_size - 1) / a.page_size;
  const int num_pages = batch * pages_per_seq;
  const size_t kv_elems = size_t(num_pages) * a.page_size * a.hkv * a.d;
  const size_t ring_rows = size_t(batch) * a.window * a.hq;
  const size_t need = size_t(a.layers) * (2 * kv_elems * 2 + 2 * ring_rows * a.d * 2);
  size_t free_bytes = 0, total = 0;
  KVS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (need + (1u << 30) > free_bytes || int64_t(num_pages) * a.page_size * a.hkv >= (1LL << 31)) {
    char note[128];
    std::snprintf(note, sizeof note, "skipped context %d batch %d: needs %.1f GB", context, batch,
                  need / 1e9);
    std::printf("%s\n", note);
    report.add_skipped(note);
    return;
  }
  const int t = context - 1;
  // gap < W: the slot of t - W is rewritten by every replay (entry(t)), so it cannot stay a hit.
  if (t < 2048 || a.gap < 1 || a.gap >= a.window)
    throw std::invalid_argument("--contexts must exceed the 2048-token minimum and --gap must be in [1, W)");

  // Shared: page table (identity), lengths, queries, outputs, workspaces.
  std::vector<int32_t> table(size_t(batch) * pages_per_seq);
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  Dev<int32_t> d_table(table.size()), d_lens(static_cast<size_t>(batch));
  KVS_CUDA_CHECK(cudaMemcpy(d_table.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<int32_t> lens(size_t(batch), context);
  KVS_CUDA_CHECK(cudaMemcpy(d_lens.p, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const size_t qn = size_t(batch) * a.hq * a.d;
  Dev<bf16> q(qn), out(qn), out_dense(qn);
  fill_random(q.p, qn, 7);
  const size_t mac_ws = mk::decode_workspace_bytes(batch, a.hq, a.hkv, a.d, a.window);
  const size_t dense_ws = kernels::dense_decode_workspace_bytes(batch, a.hq, a.d);
  Dev<char> ws(mac_ws), wsd(dense_ws);
  Dev<unsigned long long> counters(mk::kNumCounters);

  std::vector<LayerSet> sets(size_t(a.layers));
  for (int l = 0; l < a.layers; ++l) {
    LayerSet& s = sets[size_t(l)];
    s.k = std::make_unique<Dev<bf16>>(kv_elems);
    s.v = std::make_unique<Dev<bf16>>(kv_elems);
    fill_random(s.k->p, kv_elems, 100 + 2 * l);
    fill_random(s.v->p, kv_elems, 101 + 2 * l);
    s.ring_q = std::make_unique<Dev<bf16>>(ring_rows * a.d);
    s.ring_o = std::make_unique<Dev<bf16>>(ring_rows * a.d);
    fill_random(s.ring_q->p, ring_rows * a.d, 500 + l);
    fill_random(s.ring_o->p, ring_rows * a.d, 600 + l);
    s.ring_lse = std::make_unique<Dev<float>>(ring_rows);
    std::vector<float> lse(ring_rows, 10.f);  // finite: every entry is reusable
    KVS_CUDA_CHECK(cudaMemcpy(s.ring_lse->p, lse.data(), lse.size() * 4, cudaMemcpyHostToDevice));
    s.pos = std::make_unique<Dev<int32_t>>(size_t(batch) * a.window);
    std::vector<int32_t> pos(size_t(batch) * a.window);
    for (int b = 0; b < batch; ++b)
      for (int p = t - a.window; p < t; ++p) pos[size_t(b) * a.window + p % a.window] = p;
    KVS_CUDA_CHECK(cudaMemcpy(s.pos->p, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
    s.mean = std::make_unique<Dev<float>>(size_t(batch) * a.hq * a.d);
    s.sq = std::make_unique<Dev<float>>(size_t(batch) * a.hq);
    s.count = std::make_unique<Dev<int32_t>>(size_t(batch) * a.hq);
    s.last_start = std::make_unique<Dev<int32_t>>(size_t(batch) * a.hq);
    s.last_len = std::make_unique<Dev<int32_t>>(size_t(batch));
    KVS_CUDA_CHECK(cudaMemset(s.mean->p, 0, s.mean->n * 4));
    KVS_CUDA_CHECK(cudaMemset(s.sq->p, 0, s.sq->n * 4));
    KVS_CUDA_CHECK(cudaMemset(s.count->p, 0, s.count->n * 4));
    s.st.q = s.ring_q->p;
    s.st.o = s.ring_o->p;
    s.st.lse = s.ring_lse->p;
    s.st.pos = s.pos->p;
    s.st.q_mean = s.mean->p;
    s.st.q_sq = s.sq->p;
    s.st.q_count = s.count->p;
    s.st.last_start = s.last_start->p;
    s.st.last_len = s.last_len->p;
    s.st.max_batch = batch;
    s.st.window = a.window;
    s.st.num_q_heads = a.hq;
    s.st.head_dim = a.d;
    s.kv.k = s.k->p;
    s.kv.v = s.v->p;
    s.kv.page_table = d_table.p;
    s.kv.seq_lens = d_lens.p;
    s.kv.batch = batch;
    s.kv.num_pages = num_pages;
    s.kv.page_size = a.page_size;
    s.kv.num_kv_heads = a.hkv;
    s.kv.head_dim = a.d;
    s.kv.max_pages_per_seq = pages_per_seq;
  }
  mk::MatchParams mp;
  mp.window = a.window;
  mp.band = a.band;
  mp.min_context = 2048;
  mp.rule = mk::ThresholdRule::Paper;
  mp.tau = float(a.tau);
  const float scale = 1.f / std::sqrt(float(a.d));
  const int group = a.hq / a.hkv;

  // Dense baseline over the same KV sets.
  const float dense_ms = time_graph(stream, a.iters, [&] {
    for (const LayerSet& s : sets)
      KVS_CUDA_CHECK(kernels::dense_decode_cuda(q.p, a.hq, s.kv, scale, out_dense.p, nullptr,
                                                wsd.p, dense_ws, stream));
  });
  const double dense_us = 1e3 * dense_ms / a.layers;
  std::printf("\ncontext %d batch %d (Hq %d, Hkv %d, d %d, W %d, B %d, gap %d): dense %.1f us\n",
              context, batch, a.hq, a.hkv, a.d, a.window, a.band, a.gap, dense_us);
  std::printf("%10s %12s %12s %10s %12s\n", "hit rate", "head hits", "mac us", "dense/mac",
              "rows read");

  Dev<bf16> qp(qn * size_t(a.layers));
  std::mt19937 gen(12345);
  for (double rate : a.hit_rates) {
    // Per layer: hit groups copy the ring query at t - gap, the rest are fresh.
    const int groups = batch * a.hkv;
    const int hit_groups = int(rate * groups + 0.5);
    for (int l = 0; l < a.layers; ++l) {
      bf16* dst = qp.p + size_t(l) * qn;
      fill_random(dst, qn, 900 + 13 * l + int(rate * 1000));
      std::vector<int> order(static_cast<size_t>(groups));
      for (int i = 0; i < groups; ++i) order[size_t(i)] = i;
      std::shuffle(order.begin(), order.end(), gen);
      const int slot = (t - a.gap) % a.window;
      for (int i = 0; i < hit_groups; ++i) {
        const int b = order[size_t(i)] / a.hkv, kvh = order[size_t(i)] % a.hkv;
        for (int h = kvh * group; h < (kvh + 1) * group; ++h)
          KVS_CUDA_CHECK(cudaMemcpy(dst + (size_t(b) * a.hq + h) * a.d,
                                    sets[size_t(l)].st.q + sets[size_t(l)].st.row(b, slot, h) * a.d,
                                    size_t(a.d) * 2, cudaMemcpyDeviceToDevice));
      }
    }
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    // One counted pass (outside the timing) to report what the kernels decided.
    KVS_CUDA_CHECK(cudaMemset(counters.p, 0, counters.n * 8));
    for (int l = 0; l < a.layers; ++l)
      KVS_CUDA_CHECK(mk::decode_cuda(sets[size_t(l)].st, mp, q.p, qp.p + size_t(l) * qn, a.hq,
                                     sets[size_t(l)].kv, scale, out.p, nullptr, counters.p, ws.p,
                                     mac_ws, stream));
    unsigned long long c[mk::kNumCounters];
    KVS_CUDA_CHECK(cudaMemcpy(c, counters.p, sizeof c, cudaMemcpyDeviceToHost));
    const float mac_ms = time_graph(stream, a.iters, [&] {
      for (int l = 0; l < a.layers; ++l)
        KVS_CUDA_CHECK(mk::decode_cuda(sets[size_t(l)].st, mp, q.p, qp.p + size_t(l) * qn, a.hq,
                                       sets[size_t(l)].kv, scale, out.p, nullptr, nullptr, ws.p,
                                       mac_ws, stream));
    });
    const double mac_us = 1e3 * mac_ms / a.layers;
    const double head_hit_pct =
        100.0 * double(c[mk::kHeadHits]) / double(std::max(1ull, c[mk::kHeadSteps]));
    const double rows_read_pct =
        100.0 * double(c[mk::kRowsRead]) / double(std::max(1ull, c[mk::kRowsContext]));
    std::printf("%9.0f%% %11.1f%% %12.1f %9.2fx %11.2f%%\n", 100 * rate, head_hit_pct, mac_us,
                dense_us / mac_us, rows_read_pct);
    report.add_row({{"context", context},
                    {"batch", batch},
                    {"hit_rate", rate},
                    {"head_hit_pct", head_hit_pct},
                    {"mac_us", mac_us},
                    {"dense_us", dense_us},
                    {"speedup", dense_us / mac_us},
                    {"rows_read_pct", rows_read_pct}});
  }
}

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) {
  using namespace kvs;
  Args a;
  std::string contexts, batches, rates, json_path;
  po::options_description desc("kvs-bench-mac: MAC-Attention decode vs dense, CUDA-graph replays");
  desc.add_options()("help", "this text")(
      "contexts", po::value(&contexts)->default_value("128K"), "tokens per sequence, e.g. 32K,128K")(
      "batches", po::value(&batches)->default_value("1,16"), "batch sizes")(
      "hit-rates", po::value(&rates)->default_value("0,0.5,0.9,1"),
      "fractions of (sequence, kv group)s whose queries hit")(
      "hq", po::value(&a.hq)->default_value(32), "query heads")(
      "hkv", po::value(&a.hkv)->default_value(8), "kv heads")(
      "head-dim", po::value(&a.d)->default_value(128), "head dim (64 or 128)")(
      "page-size", po::value(&a.page_size)->default_value(16), "tokens per KV page")(
      "window", po::value(&a.window)->default_value(512), "W: ring slots")(
      "band", po::value(&a.band)->default_value(256), "B: band")(
      "gap", po::value(&a.gap)->default_value(256), "t - j of a hit (recompute B + gap tokens)")(
      "tau", po::value(&a.tau)->default_value(0.45), "paper threshold tolerance")(
      "layers", po::value(&a.layers)->default_value(4), "KV + ring sets rotated per replay")(
      "iters", po::value(&a.iters)->default_value(50), "timed replays (median)")(
      "json", po::value(&json_path), "also write the table as JSON to this path");
  try {
    if (!cli::parse_options(argc, argv, desc)) return 0;
    a.contexts = parse_counts(contexts, "contexts");
    a.batches = parse_counts(batches, "batches");
    a.hit_rates = parse_doubles(rates, "hit-rates");
    for (double r : a.hit_rates)
      if (r < 0 || r > 1) throw std::invalid_argument("--hit-rates: " + std::to_string(r) + " outside [0, 1]");
    if (a.layers < 1 || a.iters < 1) throw std::invalid_argument("--layers and --iters must be >= 1");
    if (!cuda_device_available()) {
      std::cerr << "kvs-bench-mac: no CUDA device\n";
      return 2;
    }
    KVS_CUDA_CHECK(mk::prepare_cuda(a.d));
    bench::BenchReport report("kvs_mac", cli::command_line(argc, argv), json_path);
    report.meta().add({{"hq", a.hq},
                       {"hkv", a.hkv},
                       {"head_dim", a.d},
                       {"page_size", a.page_size},
                       {"window", a.window},
                       {"band", a.band},
                       {"gap", a.gap},
                       {"tau", a.tau},
                       {"layers", a.layers},
                       {"iters", a.iters}});
    report.save();
    cudaStream_t stream;
    KVS_CUDA_CHECK(cudaStreamCreate(&stream));
    for (int ctx : a.contexts)
      for (int b : a.batches) bench_one(a, ctx, b, stream, report);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::cerr << "kvs-bench-mac: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
