// kvs-indexbuild: the per-model artifact bundle from a model folder and trained parts.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>

#include "artifacts/bundle.h"
#include "capture/hf_config.h"
#include "capture/safetensors.h"
#include "indexbuild/indexbuild.h"

namespace po = boost::program_options;

int main(int argc, char** argv) try {
  std::string model_dir, out;
  std::vector<std::string> trained;
  kvs::MagicPigBundlePart magicpig;
  po::options_description opts("kvs-indexbuild: assemble a versioned per-model bundle");
  opts.add_options()
      ("help,h", "show this help")
      ("model", po::value(&model_dir)->default_value("models/kvs-tiny-a"), "Hugging Face model folder")
      ("trained", po::value(&trained)->multitoken(), "kvs-train outputs to include (any number)")
      ("magicpig", "add MagicPIG's seeded hash projection")
      ("magicpig-bits", po::value(&magicpig.bits)->default_value(magicpig.bits), "MagicPIG K (bits per table)")
      ("magicpig-tables", po::value(&magicpig.tables)->default_value(magicpig.tables), "MagicPIG L (tables)")
      ("magicpig-seed", po::value(&magicpig.seed)->default_value(magicpig.seed), "MagicPIG hyperplane seed")
      ("out,o", po::value(&out)->default_value("bundle.h5"), "bundle to write");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  kvs::IndexbuildInputs in;
  in.shape = kvs::load_hf_config(model_dir).shape;
  in.shape.weights_hash = kvs::SafetensorsModel(model_dir).weights_hash();
  in.trained_files = trained;
  magicpig.include = vm.count("magicpig") > 0;
  in.magicpig = magicpig;
  kvs::build_bundle(out, in);
  const kvs::Bundle b = kvs::Bundle::open(out);
  std::string methods;
  for (const auto& m : b.methods()) methods += (methods.empty() ? "" : ", ") + m;
  std::printf("kvs-indexbuild: %s: model %s (fingerprint %s), format %d, methods: %s\n",
              out.c_str(), in.shape.name.c_str(), b.fingerprint().c_str(), b.format_version(),
              methods.empty() ? "(none)" : methods.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-indexbuild: error: %s\n", e.what());
  return 1;
}
