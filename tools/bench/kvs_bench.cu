// kvs-bench: dense decode latency and bandwidth on the GPU.
//
// For each (context, batch): N dense_decode_cuda calls are captured in one CUDA graph, call
// i reading KV set i % S, where the S sets together exceed twice the L2 so that no replay
// finds its KV in cache. CUDA events around each replay, warm-up first, median over
// --iters replays; the time per call is the median replay time / N. Effective bandwidth
// counts the KV bytes read plus q and o; it is also given as a fraction of the
// device-to-device copy bandwidth (bytes read + written) measured in the same run.
// scripts/bench_sdpa.py times torch SDPA the same way with the same columns and JSON keys.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/dense/dense_decode.h"
#include "tools/bench/bench_common.h"
#include "tools/bench/bench_tactic.h"

namespace po = boost::program_options;

namespace kvs {
namespace {

using bench::DeviceBuffer;
using bench::fill_random;
using bench::parse_counts;
using bench::time_calls;
using bench::time_graph;

// Device-to-device copy of a large buffer; GB/s counting bytes read + written.
double copy_bandwidth_gbps(cudaStream_t stream) {
  size_t free_bytes = 0, total = 0;
  KVS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  const size_t bytes = std::min<size_t>(size_t(1) << 30, free_bytes / 4);
  DeviceBuffer<char> a(bytes), b(bytes);
  KVS_CUDA_CHECK(cudaMemsetAsync(a.p, 1, bytes, stream));
  // 3 untimed copies warm up, then the median of 20.
  const float ms = time_calls(
      [&] {
        KVS_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, stream));
      },
      3, 20, stream);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

struct Shape {
  int hq, hkv, d, page_size, iters;
  bool shuffled_pages;
};

struct Row {
  int context, batch, sets, calls;
  double us, gbps, frac;
};

// Times one (context, batch); returns false (with a note) when it does not fit.
bool bench_one(const Shape& s, int context, int batch, size_t l2_bytes, double copy_gbps,
               cudaStream_t stream, Row* row, std::string* note) {
  const int pages_per_seq = (context + s.page_size - 1) / s.page_size;
  const int64_t num_pages = int64_t(batch) * pages_per_seq;
  const size_t kv_elems = size_t(num_pages) * s.page_size * s.hkv * s.d;
  const size_t set_bytes = 2 * kv_elems * sizeof(bf16);
  const int sets = int(2 * l2_bytes / set_bytes) + 1;
  const int calls = sets * ((8 + sets - 1) / sets);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(batch, s.hq, s.d);
  const size_t need = size_t(sets) * (set_bytes + num_pages * sizeof(int32_t)) + ws_bytes +
                      size_t(batch) * s.hq * (2 * s.d * sizeof(bf16) + sizeof(float));
  size_t free_bytes = 0, total = 0;
  KVS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (num_pages * s.page_size * s.hkv >= (int64_t(1) << 31) || need + (512u << 20) > free_bytes) {
    std::ostringstream os;
    os << "skipped context " << context << " batch " << batch << ": needs " << need / (1 << 20)
       << " MiB for " << sets << " KV set(s), " << free_bytes / (1 << 20) << " MiB free";
    *note = os.str();
    return false;
  }

  std::vector<std::unique_ptr<DeviceBuffer<bf16>>> k, v;
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> tables;
  std::mt19937_64 rng(1234 + context + batch);
  for (int i = 0; i < sets; ++i) {
    k.push_back(std::make_unique<DeviceBuffer<bf16>>(kv_elems));
    v.push_back(std::make_unique<DeviceBuffer<bf16>>(kv_elems));
    fill_random(k.back()->p, kv_elems, 2 * i + 1);
    fill_random(v.back()->p, kv_elems, 2 * i + 2);
    // Sequential pages lay each sequence out contiguously, as SDPA's tensors are; shuffled
    // pages are what a paged allocator leaves after a while (random 2 MiB TLB pages too).
    std::vector<int32_t> table(static_cast<size_t>(num_pages));
    std::iota(table.begin(), table.end(), 0);
    if (s.shuffled_pages) std::shuffle(table.begin(), table.end(), rng);
    tables.push_back(std::make_unique<DeviceBuffer<int32_t>>(table.size()));
    KVS_CUDA_CHECK(cudaMemcpy(tables.back()->p, table.data(), table.size() * sizeof(int32_t),
                              cudaMemcpyHostToDevice));
  }
  const std::vector<int32_t> lens_host(batch, context);
  DeviceBuffer<int32_t> lens(batch);
  KVS_CUDA_CHECK(
      cudaMemcpy(lens.p, lens_host.data(), batch * sizeof(int32_t), cudaMemcpyHostToDevice));
  DeviceBuffer<bf16> q(size_t(batch) * s.hq * s.d), o(size_t(batch) * s.hq * s.d);
  DeviceBuffer<float> lse(size_t(batch) * s.hq);
  DeviceBuffer<char> ws(ws_bytes);
  fill_random(q.p, size_t(batch) * s.hq * s.d, 99);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());

  auto view = [&](int i) {
    PagedKV kv;
    kv.k = k[i]->p;
    kv.v = v[i]->p;
    kv.page_table = tables[i]->p;
    kv.seq_lens = lens.p;
    kv.batch = batch;
    kv.num_pages = int(num_pages);
    kv.page_size = s.page_size;
    kv.num_kv_heads = s.hkv;
    kv.head_dim = s.d;
    kv.max_pages_per_seq = pages_per_seq;
    return kv;
  };
  const float scale = 1.f / std::sqrt(float(s.d));
  // One eager call first: reports a bad shape as an error rather than a broken capture.
  KVS_CUDA_CHECK(
      kernels::dense_decode_cuda(q.p, s.hq, view(0), scale, o.p, lse.p, ws.p, ws_bytes, stream));
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));

  const float replay_ms = time_graph(stream, s.iters, [&] {
    for (int c = 0; c < calls; ++c)
      KVS_CUDA_CHECK(kernels::dense_decode_cuda(q.p, s.hq, view(c % sets), scale, o.p, lse.p,
                                                ws.p, ws_bytes, stream));
  });

  const double us = replay_ms * 1e3 / calls;
  const double bytes = double(set_bytes) + double(batch) * s.hq * s.d * sizeof(bf16) * 2;
  *row = Row{context, batch, sets, calls, us, bytes / (us * 1e-6) / 1e9, 0.0};
  row->frac = row->gbps / copy_gbps;
  return true;
}

int run(int argc, char** argv) {
  std::string contexts_text, batches_text, json_path, page_order;
  std::string method = "dense";  // --method tactic: tools/bench/bench_tactic.cu
  TacticBenchArgs tactic;
  bool no_member_rows = false;
  Shape s;
  po::options_description desc(
      "kvs-bench: dense decode (split-KV, paged bf16 KV) timed as CUDA-graph replays over\n"
      "rotating KV sets larger than 2x L2; median per call, effective GB/s and fraction of\n"
      "the device-to-device copy bandwidth measured in the same run.\nOptions");
  desc.add_options()("help,h", "this text")(
      "contexts", po::value(&contexts_text)->default_value("8K,32K,128K,512K"),
      "context lengths (tokens per sequence), K = 1024")(
      "batches", po::value(&batches_text)->default_value("1,8,32"), "batch sizes")(
      "hq", po::value(&s.hq)->default_value(32), "query heads")(
      "hkv", po::value(&s.hkv)->default_value(8), "kv heads")(
      "head-dim", po::value(&s.d)->default_value(128), "head dim (64 or 128)")(
      "page-size", po::value(&s.page_size)->default_value(16), "tokens per KV page")(
      "page-order", po::value(&page_order)->default_value("sequential"),
      "sequential (each sequence's pages in order) or shuffled (random page table)")(
      "iters", po::value(&s.iters)->default_value(50), "timed graph replays (median)")(
      "json", po::value(&json_path), "also write the table as JSON to this path")(
      "method", po::value(&method)->default_value("dense"),
      "dense, or tactic (Tactic selection + sparse attention vs dense, and prefill clustering)")(
      "p", po::value(&tactic.p)->default_value(0.9), "tactic: target attention mass P")(
      "layers", po::value(&tactic.layers)->default_value(4),
      "tactic: KV sets (layers) decoded per graph replay")(
      "components", po::value(&tactic.components)->default_value(512),
      "tactic: Gaussian key components per sequence and kv head")(
      "cluster-size", po::value(&tactic.cluster_size)->default_value(tactic.cluster_size),
      "tactic: average tokens per cluster of the prefill's k-means")(
      "exact-fraction", po::value(&tactic.exact_fraction)->default_value(tactic.exact_fraction),
      "tactic: leading sorted tokens with exact exponentials, fraction of the list")(
      "window-fraction", po::value(&tactic.window_fraction)->default_value(tactic.window_fraction),
      "tactic: fit window width, fraction of the list")(
      "window-min", po::value(&tactic.window_min)->default_value(tactic.window_min),
      "tactic: smallest fit window width (tokens)")(
      "capture", po::value(&tactic.capture),
      "tactic: keys, values and queries from this capture file (kvs-capture) instead of the "
      "synthetic scene; its head counts and head dim, and unless given, its shortest sequence "
      "as the context and the batches its sequences serve; the --layers KV sets cycle through "
      "its captured layers")(
      "no-member-rows", po::bool_switch(&no_member_rows),
      "tactic: resolve the sampled keys and the union's members to KV rows through the page "
      "table (TacticConfig::member_rows off) instead of the page rows kept with the clusters");
  po::variables_map vm;
  if (!cli::parse_options(argc, argv, desc, &vm)) return 0;
  const auto given = [&](const char* name) { return vm.count(name) && !vm[name].defaulted(); };
  const std::vector<int> contexts = parse_counts(contexts_text, "contexts");
  const std::vector<int> batches = parse_counts(batches_text, "batches");
  if (page_order != "sequential" && page_order != "shuffled")
    throw std::invalid_argument("--page-order must be sequential or shuffled, not '" + page_order +
                                "'");
  s.shuffled_pages = page_order == "shuffled";
  if (s.iters < 1) throw std::invalid_argument("--iters must be >= 1");
  if (s.page_size < 1) throw std::invalid_argument("--page-size must be >= 1");
  if (s.hkv < 1 || s.hq % s.hkv != 0)
    throw std::invalid_argument("--hq (" + std::to_string(s.hq) +
                                ") must be a positive multiple of --hkv (" + std::to_string(s.hkv) +
                                ")");
  if (method == "tactic") {
    tactic.contexts = contexts;
    tactic.batches = batches;
    tactic.hq = s.hq;
    tactic.hkv = s.hkv;
    tactic.d = s.d;
    tactic.page_size = s.page_size;
    tactic.iters = s.iters;
    tactic.contexts_given = given("contexts");
    tactic.batches_given = given("batches");
    tactic.shape_given = given("hq") || given("hkv") || given("head-dim");
    tactic.member_rows = !no_member_rows;
    tactic.json_path = json_path;
    tactic.command = cli::command_line(argc, argv);
    return run_tactic_bench(tactic);
  }
  if (method != "dense")
    throw std::invalid_argument("--method must be dense or tactic, got '" + method + "'");
  if (!tactic.capture.empty()) throw std::invalid_argument("--capture needs --method tactic");
  if (!cuda_device_available()) throw std::runtime_error("kvs-bench needs a CUDA device");

  int dev = 0;
  KVS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  cudaStream_t stream;
  KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbps = copy_bandwidth_gbps(stream);
  bench::BenchReport report("kvs_dense", cli::command_line(argc, argv), json_path);
  report.meta().add({{"copy_gbps", copy_gbps},
                     {"hq", s.hq},
                     {"hkv", s.hkv},
                     {"head_dim", s.d},
                     {"page_size", s.page_size},
                     {"page_order", page_order},
                     {"iters", s.iters}});
  report.save();
  std::printf("kvs-bench dense decode: %s, %d SMs, L2 %.0f MiB; Hq %d Hkv %d d %d page %d (%s)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1048576.0, s.hq, s.hkv, s.d,
              s.page_size, page_order.c_str());
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", copy_gbps);
  std::printf("%8s %6s %12s %10s %10s %5s %6s\n", "context", "batch", "us/call", "GB/s",
              "frac_copy", "sets", "calls");
  for (int context : contexts) {
    for (int batch : batches) {
      Row row;
      std::string note;
      if (!bench_one(s, context, batch, size_t(prop.l2CacheSize), copy_gbps, stream, &row, &note)) {
        std::printf("%s\n", note.c_str());
        report.add_skipped(note);
        continue;
      }
      std::printf("%8d %6d %12.1f %10.0f %10.3f %5d %6d\n", row.context, row.batch, row.us,
                  row.gbps, row.frac, row.sets, row.calls);
      std::fflush(stdout);
      report.add_row({{"context", row.context},
                      {"batch", row.batch},
                      {"us", row.us},
                      {"gbps", row.gbps},
                      {"frac_copy", row.frac},
                      {"sets", row.sets},
                      {"calls", row.calls}});
    }
  }
  cudaStreamDestroy(stream);

  return 0;
}

}  // namespace
}  // namespace kvs

int main(int argc, char** argv) {
  try {
    return kvs::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "kvs-bench: " << e.what() << "\n";
    return 1;
  }
}
