// kvs-eval: fidelity of the runtime's methods and the baselines on captured decode steps,
// against fp64 dense attention. Prints a table; writes JSON, CSV and a PNG plot on request.
// Subcommands `ppl` and `needle` (libtorch builds) run the methods inside the model's decode
// loop instead (tools/eval/eval_model.h); `fidelity` (the default) is the capture replay.
#include <boost/program_options.hpp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"
#include "runtime/eval/plot.h"
#include "runtime/eval/replay.h"
#include "tools/common/cli.h"
#ifdef KVS_EVAL_WITH_MODEL
#include "tools/eval/eval_model.h"
#endif

namespace po = boost::program_options;

namespace {

// Writes a result file through writer(stream); throws naming the path when it fails.
template <class F>
void write_file(const std::string& path, F writer) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  writer(f);
  if (!f) throw std::runtime_error("writing " + path + " failed");
}

// The name of the CUDA device the cuda backend runs on.
std::string cuda_device_name() {
  int dev = 0;
  KVS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  KVS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
}

}  // namespace

int run_fidelity(int argc, char** argv);

int main(int argc, char** argv) try {
  const std::string sub = argc > 1 ? argv[1] : "";
  if (sub == "ppl" || sub == "needle") {
#ifdef KVS_EVAL_WITH_MODEL
    return sub == "ppl" ? kvs::tools::run_ppl(argc - 1, argv + 1)
                        : kvs::tools::run_needle(argc - 1, argv + 1);
#else
    throw std::invalid_argument("kvs-eval " + sub +
                                " runs the model and needs a build with libtorch (KVS_WITH_TORCH=ON)");
#endif
  }
  if (sub == "fidelity") return run_fidelity(argc - 1, argv + 1);
  return run_fidelity(argc, argv);
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-eval: error: %s\n", e.what());
  return 1;
}

int run_fidelity(int argc, char** argv) {
  std::string capture_path, backend, bundle, layers, budgets, json, csv, plot;
  std::vector<std::string> methods{"dense"};
  int steps = 0, sequences = 0, h2o_warmup = 32;
  po::options_description opts(
      "kvs-eval [fidelity]: method fidelity on captured decode steps "
      "(also: kvs-eval ppl --help, kvs-eval needle --help)");
  opts.add_options()
      ("help,h", "show this help")
      ("capture", po::value(&capture_path)->required(), "capture file from kvs-capture")
      ("methods", po::value(&methods)->multitoken()->default_value(methods, "dense"),
       "engines to run, each 'name' or 'name:knob=value,knob=value' "
       "(e.g. dense tactic:target=0.75 mac:threshold=paper)")
      ("backend", po::value(&backend)->default_value("cpu"), "cpu (exact reference) or cuda")
      ("bundle", po::value(&bundle), "bundle from kvs-indexbuild (methods with stored parts)")
      ("layers", po::value(&layers)->default_value(""), "layers to replay (default: all captured)")
      ("steps", po::value(&steps)->default_value(0), "decode steps per sequence (0: all recorded)")
      ("sequences", po::value(&sequences)->default_value(0), "sequences (0: all)")
      ("budgets", po::value(&budgets)->default_value("0.05,0.1,0.2"),
       "fixed baseline budgets as fractions of the context")
      ("no-matched-baselines", "skip baselines at each method's own per-step KV read")
      ("h2o-warmup", po::value(&h2o_warmup)->default_value(32),
       "prompt queries whose dense attention seeds the H2O baseline's accumulated mass")
      ("per-layer", "print the per-layer table too")
      ("json", po::value(&json), "write all rows (per layer and pooled) as JSON")
      ("csv", po::value(&csv), "write all rows as CSV")
      ("plot", po::value(&plot), "write a PNG plot of recall and error vs KV read (gnuplot)");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);

  kvs::eval::ReplayConfig cfg;
  cfg.layers = kvs::cli::parse_int_list(layers, "layers");
  cfg.max_steps = steps;
  cfg.max_sequences = sequences;
  cfg.methods = methods;
  cfg.engine.backend = kvs::backend_from_string(backend);
  if (cfg.engine.backend == kvs::Backend::Cuda && !kvs::cuda_device_available())
    throw std::invalid_argument("--backend cuda: no CUDA device on this machine");
  cfg.bundle = bundle;
  cfg.budget_fractions = kvs::cli::parse_double_list(budgets, "budgets");
  cfg.baselines_at_method_read = vm.count("no-matched-baselines") == 0;
  if (h2o_warmup < 0)
    throw std::invalid_argument("--h2o-warmup must be >= 0, got " + std::to_string(h2o_warmup));
  cfg.h2o_warmup = h2o_warmup;

  const kvs::CaptureFile capture = kvs::CaptureFile::open(capture_path);
  const kvs::eval::Aggregator agg = kvs::eval::replay_capture(
      capture, cfg, [](const std::string& what) { std::fprintf(stderr, "kvs-eval: %s\n", what.c_str()); });

  const auto pooled = agg.rows_over_layers();
  const auto per_layer = agg.rows();
  if (vm.count("per-layer")) {
    std::cout << "Per layer:\n";
    kvs::eval::write_table(std::cout, per_layer);
    std::cout << "\n";
  }
  std::cout << "All layers (" << capture_path << ", backend " << backend << "):\n";
  kvs::eval::write_table(std::cout, pooled);
  std::vector<kvs::eval::ResultRow> all = per_layer;
  all.insert(all.end(), pooled.begin(), pooled.end());
  if (vm.count("json")) {
    const kvs::eval::JsonMeta meta = {
        {"command", kvs::cli::command_line(argc, argv)},
        {"capture", capture_path},
        {"backend", backend},
        {"device", cfg.engine.backend == kvs::Backend::Cuda ? cuda_device_name() : "cpu"}};
    write_file(json, [&](std::ostream& o) { kvs::eval::write_json(o, all, meta); });
  }
  if (vm.count("csv")) write_file(csv, [&](std::ostream& o) { kvs::eval::write_csv(o, all); });
  if (vm.count("plot")) {
    kvs::eval::PlotConfig pc;
    pc.title = "kvs-eval: " + capture_path;
    kvs::eval::plot_fidelity(pooled, plot, pc);
  }
  return 0;
}
