// kvs-train attnpred: the AttentionPredictor CNN from capture files (train/attnpred_trainer.h).
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>

#include "tools/common/cli.h"
#include "train/attnpred_trainer.h"

namespace po = boost::program_options;

namespace kvs::tools {

int train_attnpred_main(int argc, char** argv) try {
  train::AttnPredTrainConfig cfg;
  std::string out, dense_layers;
  po::options_description opts("kvs-train attnpred: train the AttentionPredictor CNN");
  opts.add_options()("help,h", "show this help")(
      "capture", po::value(&cfg.captures)->multitoken()->required(), "capture files (kvs-capture)")(
      "out,o", po::value(&out)->default_value("attnpred.h5"), "trained file to write")(
      "epochs", po::value(&cfg.epochs)->default_value(30), "epochs (paper: 30)")(
      "batch-size", po::value(&cfg.batch_size)->default_value(64), "samples per optimiser step")(
      "lr", po::value(&cfg.learning_rate)->default_value(1e-3), "Adam learning rate")(
      "val-fraction", po::value(&cfg.val_fraction)->default_value(0.1),
      "share of (sequence, layer, head) units held out for validation")(
      "max-samples", po::value(&cfg.max_samples)->default_value(0),
      "training samples per epoch (0: all)")("seed", po::value(&cfg.seed)->default_value(0),
                                             "initialisation, split and order seed")(
      "threads", po::value(&cfg.threads)->default_value(1), "torch threads")(
      "history", po::value(&cfg.knobs.history)->default_value(64), "rows the CNN sees (H)")(
      "sink", po::value(&cfg.knobs.sink)->default_value(64), "sink tokens (bundle knob)")(
      "recent", po::value(&cfg.knobs.recent)->default_value(64), "recent tokens (bundle knob)")(
      "budget", po::value(&cfg.knobs.budget_tokens)->default_value(1024),
      "tokens per head (bundle default; validation recovery is measured at it)")(
      "calibration-period", po::value(&cfg.knobs.calibration_period)->default_value(5),
      "full-row period M (bundle knob)")(
      "group-history", po::bool_switch(&cfg.knobs.group_history),
      "train on a history per kv head, the group's largest rows (bundle knob; the runtime's "
      "AttnPredConfig::group_history)")("dense-layers",
                                         po::value(&dense_layers)->default_value("0,1"),
                                         "layers attended densely, not trained on (bundle knob)");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  cfg.knobs.dense_layers = cli::parse_int_list(dense_layers, "--dense-layers");
  const train::AttnPredTrainResult r = train::train_attnpred(
      cfg, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  train::write_attnpred_trained(out, cfg, r);
  std::printf(
      "kvs-train attnpred: %s: best epoch %d (val recovery %.4f at budget %d), %lld train / "
      "%lld validation samples\n",
      out.c_str(), r.best_epoch, r.curve[size_t(r.best_epoch - 1)].val_recovery,
      cfg.knobs.budget_tokens, (long long)r.train_samples, (long long)r.val_samples);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-train attnpred: error: %s\n", e.what());
  return 1;
}

}  // namespace kvs::tools
