#include "tools/eval/eval_model.h"

#include <boost/program_options.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "capture/model_eval.h"
#include "capture/recorder.h"
#include "capture/tokens.h"
#include "tools/common/cli.h"

namespace po = boost::program_options;

namespace kvs::tools {
namespace {

// What ppl and needle share: the model, where it runs, the methods and the output.
struct Common {
  std::string model_dir, device, dtype, bundle, json;
  std::vector<std::string> methods{"dense"};
  int chunk = 512;

  void add(po::options_description& opts) {
    opts.add_options()
        ("help,h", "show this help")
        ("model", po::value(&model_dir)->default_value("models/kvs-tiny-a"), "Hugging Face Llama folder")
        ("methods", po::value(&methods)->multitoken()->default_value(methods, "dense"),
         "engines, each 'name' or 'name:knob=value,...'; dense (the runtime's dense engine) is the reference")
        ("bundle", po::value(&bundle), "bundle from kvs-indexbuild (methods with stored parts)")
        ("device", po::value(&device)->default_value("auto"), "cpu, cuda or auto (engines run on the same backend)")
        ("dtype", po::value(&dtype)->default_value("auto"), "bf16, fp32 or auto (bf16 on cuda, fp32 on cpu)")
        ("chunk", po::value(&chunk)->default_value(512), "prefill chunk in tokens")
        ("json", po::value(&json), "write the rows as JSON");
  }

  ModelEvalConfig config() const {
    ModelEvalConfig c;
    c.methods = methods;
    c.bundle = bundle;
    c.prefill_chunk = chunk;
    return c;
  }

  // argv of the subcommand (argv[0] is "ppl" or "needle"): the whole command is kvs-eval's.
  EvalMeta meta(int argc, char** argv, const LlamaModel& model) const {
    return {{"command", "kvs-eval " + cli::command_line(argc, argv)},
            {"model", model.shape().name},
            {"device", model.device().is_cuda() ? "cuda" : "cpu"},
            {"dtype", model.dtype() == torch::kBFloat16 ? "bf16" : "fp32"}};
  }
};

LlamaModel load(const Common& c) {
  const RunnerPlacement place = parse_placement(c.device, c.dtype);
  return LlamaModel::load(c.model_dir, place.device, place.dtype);
}

void progress(const std::string& what) { std::fprintf(stderr, "kvs-eval: %s\n", what.c_str()); }

template <class Row>
void write_json(const std::string& path, void (*writer)(std::ostream&, const std::vector<Row>&, const EvalMeta&),
                const std::vector<Row>& rows, const EvalMeta& meta) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  writer(f, rows, meta);
  if (!f) throw std::runtime_error("writing " + path + " failed");
}

}  // namespace

int run_ppl(int argc, char** argv) {
  Common c;
  std::string text_path, ids_path, contexts = "8192";
  int steps = 64, windows = 2;
  int64_t offset = 0;
  po::options_description opts(
      "kvs-eval ppl: bits per token (= bits per byte for a byte-level model) of held-out text, "
      "teacher-forced decode steps with each method after a dense prefill");
  c.add(opts);
  opts.add_options()
      ("text", po::value(&text_path), "held-out text (.gz read transparently), byte-level models")
      ("ids", po::value(&ids_path), "or token ids: a text file of whitespace-separated ids")
      ("contexts", po::value(&contexts)->default_value(contexts), "prompt lengths, comma-separated")
      ("steps", po::value(&steps)->default_value(steps), "scored decode steps per window")
      ("windows", po::value(&windows)->default_value(windows), "windows per context")
      ("offset", po::value(&offset)->default_value(offset), "first byte (or id) of the first window");
  if (!cli::parse_options(argc, argv, opts)) return 0;
  if (text_path.empty() == ids_path.empty())
    throw std::invalid_argument("give exactly one of --text and --ids");
  if (steps < 1 || windows < 1 || offset < 0)
    throw std::invalid_argument("--steps and --windows must be >= 1 and --offset >= 0");
  torch::NoGradGuard no_grad;
  const LlamaModel model = load(c);
  const HfConfig& cfg = model.config();
  // One stream of ids to cut windows from: the text's bytes (each window then gets BOS, as
  // kvs-capture makes its windows) or the ids file as it is.
  const bool text = !text_path.empty();
  std::vector<int32_t> stream;
  const bool bos = text && cfg.bos_token_id >= 0;
  if (text) {
    stream = byte_tokens(cfg, read_text_file(text_path));  // refuses a non-byte-level model
    if (bos) stream.erase(stream.begin());
  } else {
    stream = load_token_ids(ids_path, cfg.vocab_size);
  }
  const std::string source = text ? text_path : ids_path;
  std::vector<PplRow> rows;
  for (int context : cli::parse_int_list(contexts, "contexts")) {
    PplConfig pc;
    pc.context = context;
    pc.steps = steps;
    const int64_t per = int64_t(context) + steps + 1 - (bos ? 1 : 0);
    if (offset + windows * per > int64_t(stream.size()))
      throw std::invalid_argument(source + " has " + std::to_string(stream.size()) +
                                  (text ? " bytes; " : " ids; ") + std::to_string(windows) +
                                  " windows of " + std::to_string(per) + " from offset " +
                                  std::to_string(offset) + " need more");
    std::vector<std::vector<int32_t>> ws;
    for (int w = 0; w < windows; ++w) {
      const auto first = stream.begin() + (offset + w * per);
      std::vector<int32_t> ids;
      if (bos) ids.push_back(cfg.bos_token_id);
      ids.insert(ids.end(), first, first + per);
      ws.push_back(std::move(ids));
    }
    const std::vector<PplRow> part = eval_perplexity(model, ws, pc, c.config(), progress);
    rows.insert(rows.end(), part.begin(), part.end());
  }
  std::cout << "Perplexity (" << source << ", " << windows
            << " windows x " << steps << " steps per context):\n";
  write_ppl_table(std::cout, rows);
  if (!c.json.empty()) write_json(c.json, write_ppl_json, rows, c.meta(argc, argv, model));
  return 0;
}

int run_needle(int argc, char** argv) {
  Common c;
  std::string text_path, contexts = "4096", depths = "0.1,0.5,0.9";
  NeedleConfig nc;
  po::options_description opts(
      "kvs-eval needle: pass key retrieval from a haystack of held-out text (byte-level models), "
      "the cue and the answer decoded with each method after a dense prefill");
  c.add(opts);
  opts.add_options()
      ("text", po::value(&text_path)->required(), "haystack text (.gz read transparently)")
      ("contexts", po::value(&contexts)->default_value(contexts), "prompt lengths, comma-separated")
      ("depths", po::value(&depths)->default_value(depths), "needle depths in [0, 1], comma-separated")
      ("trials", po::value(&nc.trials)->default_value(nc.trials), "keys per (context, depth)")
      ("seed", po::value(&nc.seed)->default_value(nc.seed), "keys and haystack offsets");
  if (!cli::parse_options(argc, argv, opts)) return 0;
  nc.contexts = cli::parse_int_list(contexts, "contexts");
  nc.depths = cli::parse_double_list(depths, "depths");
  torch::NoGradGuard no_grad;
  const LlamaModel model = load(c);
  const std::vector<NeedleRow> rows =
      eval_needle(model, read_text_file(text_path), nc, c.config(), progress);
  std::cout << "Needle (" << text_path << ", " << nc.trials << " trials per cell):\n";
  write_needle_table(std::cout, rows);
  if (!c.json.empty())
    write_json(c.json, write_needle_json, rows, c.meta(argc, argv, model));
  return 0;
}

}  // namespace kvs::tools
