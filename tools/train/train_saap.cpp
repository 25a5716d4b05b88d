// kvs-train saap: SAAP's k-means centroids and query MLPs from capture files (train/saap_trainer.h).
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>
#include <memory>

#include "tools/common/cli.h"
#include "tools/train/train_commands.h"
#include "train/saap_trainer.h"

namespace po = boost::program_options;

namespace kvs::tools {

int train_saap_main(int argc, char** argv) try {
  train::SaapTrainOptions o;
  std::vector<std::string> captures;
  std::string out, layers, dense_layers;
  uint64_t seed = o.seed;
  po::options_description opts("kvs-train saap: SAAP centroids and query MLPs from captures");
  opts.add_options()
      ("help,h", "show this help")
      ("capture", po::value(&captures)->multitoken()->required(), "capture files (kvs-capture), one or more")
      ("out,o", po::value(&out)->default_value("saap.h5"), "trained file to write (for kvs-indexbuild)")
      ("layers", po::value(&layers)->default_value(""), "layers to index (default: every captured non-dense layer)")
      ("dense-layers", po::value(&dense_layers)->default_value("0"), "layers attended densely (never indexed)")
      ("clusters", po::value(&o.kmeans.num_clusters)->default_value(o.kmeans.num_clusters), "C: k-means centroids per kv head")
      ("kmeans-iterations", po::value(&o.kmeans.iterations)->default_value(o.kmeans.iterations), "k-means iterations")
      ("kmeans-seed", po::value(&o.kmeans.seed)->default_value(o.kmeans.seed), "k-means seed (mixed with layer and head)")
      ("no-spherical", "plain (not spherical) k-means")
      ("hidden", po::value(&o.hidden)->default_value(o.hidden), "MLP hidden width")
      ("iterations", po::value(&o.iterations)->default_value(o.iterations), "Adam steps per query head")
      ("batch", po::value(&o.batch)->default_value(o.batch), "queries per step (one sequence per step)")
      ("lr", po::value(&o.lr)->default_value(o.lr), "Adam learning rate")
      ("sink", po::value(&o.sink)->default_value(o.sink), "sink tokens (excluded from targets and index)")
      ("recent", po::value(&o.recent)->default_value(o.recent), "dense window: targets are keys before it")
      ("probes", po::value(&o.probes)->default_value(o.probes), "l recorded for the runtime")
      ("val-fraction", po::value(&o.val_fraction)->default_value(o.val_fraction), "held-out share of each sequence's eligible queries")
      ("val-queries", po::value(&o.max_val_queries)->default_value(o.max_val_queries), "validation queries per head")
      ("eval-every", po::value(&o.eval_every)->default_value(0), "validation KL every N steps (0: iterations / 10)")
      ("seed", po::value(&seed)->default_value(seed), "sampling and initialisation seed")
      ("device", po::value(&o.device)->default_value(o.device), "libtorch device: cpu or cuda");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  o.seed = seed;
  o.kmeans.spherical = vm.count("no-spherical") == 0;
  o.layers = cli::parse_int_list(layers, "layers");
  o.dense_layers = cli::parse_int_list(dense_layers, "dense-layers");

  std::unique_ptr<cli::ProgressLine> bar;
  std::string stage;
  const train::SaapTrainResult r = train::train_saap(
      captures, o, [&](const std::string& what, int64_t done, int64_t total, double loss) {
        if (what != stage) {
          if (bar) bar->finish();
          stage = what;
          bar = std::make_unique<cli::ProgressLine>("kvs-train saap: " + what);
        }
        char extra[64];
        std::snprintf(extra, sizeof extra, "loss %.4f", loss);
        bar->update(done, total, done > 0 && total > 1 ? extra : "");
      });
  if (bar) bar->finish();
  train::write_saap_trained(out, r, o);

  // The loss curve: training KL (mean over each tenth of the steps) and validation KL.
  std::printf("kvs-train saap: %s: %zu layers, C %d, hidden %d, %d steps of %d queries\n",
              out.c_str(), r.parts.layers.size(), r.parts.num_clusters, r.parts.hidden_dim,
              o.iterations, o.batch);
  std::printf("%-6s %-5s %8s %8s %9s %9s  train KL by tenth of the steps\n", "layer", "head",
              "train_q", "val_q", "val_init", "val_final");
  for (const train::SaapHeadReport& h : r.heads) {
    std::printf("%-6d %-5d %8d %8d %9.4f %9.4f ", h.layer, h.q_head, h.train_queries,
                h.val_queries, h.val_kl_init, h.val_kl_final);
    const size_t n = h.loss.size();
    for (int k = 0; k < 10 && n > 0; ++k) {
      const size_t a = n * size_t(k) / 10, b = std::max(a + 1, n * size_t(k + 1) / 10);
      double s = 0.0;
      for (size_t i = a; i < b && i < n; ++i) s += h.loss[i];
      std::printf(" %.3f", s / double(std::min(b, n) - a));
    }
    std::printf("\n");
  }
  std::printf("validation KL at steps");
  for (int s : r.val_steps) std::printf(" %d", s);
  std::printf(" is in %s:/training/val_kl; per-step loss in /training/loss\n", out.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-train saap: error: %s\n", e.what());
  return 1;
}

}  // namespace kvs::tools
