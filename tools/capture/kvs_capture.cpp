// kvs-capture: runs a Hugging Face Llama-family model over text (or token ids) and writes
// the capture file of DESIGN.md: pre-RoPE q/k, v and the decode steps' attention maps.
#include <torch/torch.h>

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <sys/stat.h>
#include <iostream>

#include "capture/recorder.h"
#include "capture/tokens.h"
#include "tools/common/cli.h"

namespace po = boost::program_options;

int main(int argc, char** argv) try {
  std::string model_dir, text_path, ids_path, ids_dataset, out, layers_arg, heads_arg, device_arg, dtype_arg;
  int context = 0, steps = 0, sequences = 0;
  int64_t offset = 0, chunk = 0;
  po::options_description opts("kvs-capture: record pre-RoPE q/k, v and attention maps");
  opts.add_options()
      ("help,h", "show this help")
      ("model", po::value(&model_dir)->default_value("models/kvs-tiny-a"), "Hugging Face model folder")
      ("text", po::value(&text_path), "text file (.gz read transparently) for a byte-level model")
      ("ids", po::value(&ids_path), "token ids (any model): a text file of whitespace-separated ids, "
       "or an HDF5 file with --ids-dataset")
      ("ids-dataset", po::value(&ids_dataset), "1-D int dataset of the --ids HDF5 file, e.g. /input_ids")
      ("context", po::value(&context)->default_value(4096), "tokens per sequence (BOS included)")
      ("sequences", po::value(&sequences)->default_value(1), "consecutive windows to capture")
      ("offset", po::value(&offset)->default_value(0), "bytes (or ids) of the input to skip first")
      ("decode-steps", po::value(&steps)->default_value(64), "last positions run as recorded decode steps")
      ("greedy", "decode steps continue with the model's argmax instead of the text")
      ("layers", po::value(&layers_arg)->default_value(""), "layers to capture, e.g. 0,2 (default: all)")
      ("kv-heads", po::value(&heads_arg)->default_value(""),
       "KV heads to capture, each with the query heads of its group, e.g. 1 (default: all)")
      ("device", po::value(&device_arg)->default_value("auto"), "cpu, cuda or auto")
      ("dtype", po::value(&dtype_arg)->default_value("auto"), "bf16, fp32 or auto (bf16 on cuda, fp32 on cpu)")
      ("chunk", po::value(&chunk)->default_value(512), "prefill chunk in tokens")
      ("out,o", po::value(&out)->default_value("capture.h5"), "output capture file");
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  if (vm.count("text") == vm.count("ids"))
    throw std::invalid_argument("give exactly one of --text and --ids");
  if (context < 2) throw std::invalid_argument("--context must be >= 2");
  if (sequences < 1) throw std::invalid_argument("--sequences must be >= 1");
  if (offset < 0) throw std::invalid_argument("--offset must be >= 0");
  if (chunk < 1) throw std::invalid_argument("--chunk must be >= 1");

  const kvs::RunnerPlacement place = kvs::parse_placement(device_arg, dtype_arg);
  const bool cuda = place.device.is_cuda();
  const torch::ScalarType dtype = place.dtype;

  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const kvs::LlamaModel model =
      kvs::LlamaModel::load(model_dir, place.device, dtype);
  const kvs::HfConfig& cfg = model.config();

  // The windows: BOS + context-1 bytes each for text; context ids each for an ids file.
  std::vector<std::vector<int32_t>> windows;
  std::string source;
  if (vm.count("text")) {
    const std::string text = kvs::read_text_file(text_path);
    const int64_t per = context - (cfg.bos_token_id >= 0 ? 1 : 0);
    const int64_t need = offset + per * sequences;
    if (int64_t(text.size()) < need)
      throw std::invalid_argument(text_path + " has " + std::to_string(text.size()) +
                                  " bytes; --offset " + std::to_string(offset) + " + " +
                                  std::to_string(sequences) + " x " + std::to_string(per) +
                                  " needs " + std::to_string(need));
    for (int s = 0; s < sequences; ++s)
      windows.push_back(kvs::byte_tokens(cfg, text.substr(size_t(offset + s * per), size_t(per))));
    source = text_path;
  } else {
    const std::vector<int32_t> ids =
        vm.count("ids-dataset") ? kvs::load_token_ids_h5(ids_path, ids_dataset, cfg.vocab_size)
                                : kvs::load_token_ids(ids_path, cfg.vocab_size);
    const int64_t need = offset + int64_t(context) * sequences;
    if (int64_t(ids.size()) < need)
      throw std::invalid_argument(ids_path + " has " + std::to_string(ids.size()) +
                                  " ids; --offset " + std::to_string(offset) + " + " +
                                  std::to_string(sequences) + " x " + std::to_string(context) +
                                  " needs " + std::to_string(need));
    for (int s = 0; s < sequences; ++s)
      windows.emplace_back(ids.begin() + offset + int64_t(s) * context,
                           ids.begin() + offset + int64_t(s + 1) * context);
    source = ids_path;
  }

  kvs::CaptureMeta meta;
  meta.shape = cfg.shape;
  meta.dtype = dtype == torch::kBFloat16 ? "bfloat16" : "float32";
  meta.tokenizer = vm.count("text") ? "bytes" : "ids";
  meta.vocab_size = cfg.vocab_size;
  meta.layers = kvs::cli::parse_int_list(layers_arg, "layers");
  if (meta.layers.empty())
    for (int l = 0; l < cfg.shape.num_layers; ++l) meta.layers.push_back(l);
  meta.kv_heads = kvs::cli::parse_int_list(heads_arg, "kv-heads");

  kvs::RecordOptions ro;
  ro.decode_steps = steps;
  ro.greedy = vm.count("greedy") > 0;
  ro.chunk = chunk;
  kvs::CaptureWriter writer(out, meta);
  for (size_t s = 0; s < windows.size(); ++s) {
    kvs::cli::ProgressLine bar("capture seq " + std::to_string(s + 1) + "/" +
                               std::to_string(windows.size()));
    kvs::record_sequence(model, windows[s], ro, source, writer,
                         [&](int64_t done, int64_t total) { bar.update(done, total, "tokens"); });
    bar.finish();
  }
  writer.commit();
  struct stat st {};
  const double mb = stat(out.c_str(), &st) == 0 ? double(st.st_size) / 1e6 : 0.0;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("kvs-capture: %s: %zu sequence(s) x %d tokens, %d decode steps, layers %zu, "
              "%s %s, %.1f s, %.1f MB\n",
              out.c_str(), windows.size(), context, steps, meta.layers.size(),
              cuda ? "cuda" : "cpu", meta.dtype.c_str(), secs,
              mb);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvs-capture: error: %s\n", e.what());
  return 1;
}
