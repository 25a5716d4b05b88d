// kvs-eval: fidelity of the runtime's methods and the baselines on captured decode steps,
// against fp64 dense attention. Prints a table; writes JSON, CSV and a PNG plot on request.
#include <boost/program_options.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "kernels/common/cuda_check.h"
#include "runtime/eval/plot.h"
#include "runtime/eval/replay.h"
#include "tools/common/cli.h"

namespace po = boost::program_options;

namespace {

void write_file(const std::string& path, void (*writer)(std::ostream&, const std::vector<kvs::eval::ResultRow>&),
                const std::vector<kvs::eval::ResultRow>& rows) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  writer(f, rows);
  if (!f) throw std::runtime_error("writing " + path + " failed");
}

}  // namespace

int main(int argc, char** argv) try {
  std::string capture_path, backend, bundle, layers, budgets, json, csv, plot;
  std::vector<std::string> methods{"dense"};
  int steps = 0, sequences = 0;
  po::options_description opts("kvs-eval: method fidelity on captured decode steps");
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
  if (vm.count("json")) write_file(json, kvs::eval::write_json, all);
  if (vm.count("csv")) write_file(csv, kvs::eval::write_csv, all);
  if (vm.count("plot")) {
    kvs::eval::PlotConfig pc;
    pc.title = "kvs-eval: " + capture_path;
    kvs::eval::plot_fidelity(pooled, plot, pc);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-eval: error: %s\n", e.what());
  return 1;
}
