#include "capture/hf_config.h"

#include <sys/stat.h>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kvs {

namespace pt = boost::property_tree;

namespace {

// PropertyTree keeps every JSON scalar as text (null as "null"); these read it back strictly
// and name the file and key when the value is not what the key needs.
class ConfigReader {
 public:
  ConfigReader(const pt::ptree& root, std::string source)
      : root_(root), source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("config '" + source_ + "': " + what);
  }

  // The node for `key` in `tree`, or null when absent or JSON null.
  static const pt::ptree* find(const pt::ptree& tree, const std::string& key) {
    const auto it = tree.find(key);  // not get_child: keys are never dotted paths here
    if (it == tree.not_found()) return nullptr;
    if (it->second.empty() && it->second.data() == "null") return nullptr;
    return &it->second;
  }

  const pt::ptree* find(const std::string& key) const { return find(root_, key); }

  double number(const pt::ptree& node, const std::string& key) const {
    if (!node.empty()) fail("'" + key + "' must be a number");
    const std::string& s = node.data();
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
      fail("'" + key + "' must be a number, got '" + s + "'");
    return v;
  }

  int integer(const pt::ptree& node, const std::string& key) const {
    const double v = number(node, key);
    if (v != std::floor(v) || std::abs(v) > 2147483647.0)
      fail("'" + key + "' must be an integer, got '" + node.data() + "'");
    return int(v);
  }

  bool boolean(const pt::ptree& node, const std::string& key) const {
    if (node.empty() && node.data() == "true") return true;
    if (node.empty() && node.data() == "false") return false;
    fail("'" + key + "' must be true or false, got '" + node.data() + "'");
  }

  std::string string(const pt::ptree& node, const std::string& key) const {
    if (!node.empty()) fail("'" + key + "' must be a string");
    return node.data();
  }

  int required_int(const std::string& key) const {
    const pt::ptree* n = find(key);
    if (!n) fail("missing '" + key + "'");
    const int v = integer(*n, key);
    if (v <= 0) fail("'" + key + "' must be > 0, got " + std::to_string(v));
    return v;
  }

  int optional_int(const std::string& key, int fallback) const {
    const pt::ptree* n = find(key);
    return n ? integer(*n, key) : fallback;
  }

  double optional_number(const std::string& key, double fallback) const {
    const pt::ptree* n = find(key);
    return n ? number(*n, key) : fallback;
  }

  bool optional_bool(const std::string& key, bool fallback) const {
    const pt::ptree* n = find(key);
    return n ? boolean(*n, key) : fallback;
  }

  std::string optional_string(const std::string& key) const {
    const pt::ptree* n = find(key);
    return n ? string(*n, key) : std::string();
  }

  // A JSON array of strings, or a single string, as a list.
  std::vector<std::string> strings(const std::string& key) const {
    std::vector<std::string> out;
    const pt::ptree* n = find(key);
    if (!n) return out;
    if (n->empty()) return {n->data()};
    for (const auto& c : *n) {
      if (!c.first.empty() || !c.second.empty()) fail("'" + key + "' must be a list of strings");
      out.push_back(c.second.data());
    }
    return out;
  }

  // A JSON integer or array of integers (eos_token_id is either), as a list.
  std::vector<int> integers(const std::string& key) const {
    std::vector<int> out;
    const pt::ptree* n = find(key);
    if (!n) return out;
    if (n->empty()) return {integer(*n, key)};
    for (const auto& c : *n) {
      if (!c.first.empty()) fail("'" + key + "' must be an integer or a list of integers");
      out.push_back(integer(c.second, key));
    }
    return out;
  }

 private:
  const pt::ptree& root_;
  std::string source_;
};

// Reads one rope scaling object (rope_parameters or rope_scaling) into `rope` (theta aside).
void parse_rope_scaling(const ConfigReader& r, const pt::ptree& s, const std::string& group,
                        RopeParams* rope) {
  if (s.empty()) r.fail("'" + group + "' must be an object");
  const pt::ptree* type_node = ConfigReader::find(s, "rope_type");
  if (!type_node) type_node = ConfigReader::find(s, "type");  // pre-4.45 spelling
  const std::string type = type_node ? r.string(*type_node, group + ".rope_type") : "default";
  try {
    rope->type = rope_type_from_string(type);  // refuses dynamic, yarn, longrope, ...
  } catch (const std::invalid_argument& e) {
    r.fail(group + ": " + e.what());
  }
  auto need = [&](const char* key) {
    const pt::ptree* n = ConfigReader::find(s, key);
    if (!n) r.fail("'" + group + "' of rope_type '" + type + "' needs '" + key + "'");
    return r.number(*n, group + "." + key);
  };
  if (rope->type == RopeType::Linear || rope->type == RopeType::Llama3)
    rope->factor = need("factor");
  if (rope->type == RopeType::Llama3) {
    rope->low_freq_factor = need("low_freq_factor");
    rope->high_freq_factor = need("high_freq_factor");
    const double omp = need("original_max_position_embeddings");
    if (omp != std::floor(omp) || omp <= 0)
      r.fail(group + ".original_max_position_embeddings must be a positive integer");
    rope->original_max_position = int(omp);
  }
  // A partial rotary dimension would change which dimensions rotate.
  if (const pt::ptree* p = ConfigReader::find(s, "partial_rotary_factor"))
    if (r.number(*p, group + ".partial_rotary_factor") != 1.0)
      r.fail(group + ".partial_rotary_factor != 1 is not supported");
}

void parse_rope(const ConfigReader& r, HfConfig* cfg) {
  RopeParams& rope = cfg->shape.rope;
  // Newer transformers nest theta and scaling in rope_parameters; older configs have a
  // top-level rope_theta and an optional rope_scaling. A config may carry both spellings
  // (kvs-tiny-a has theta in both places): they must then agree.
  const pt::ptree* params = r.find("rope_parameters");
  const pt::ptree* scaling = r.find("rope_scaling");
  const pt::ptree* top_theta = r.find("rope_theta");
  const pt::ptree* nested_theta = params ? ConfigReader::find(*params, "rope_theta") : nullptr;
  if (top_theta && nested_theta &&
      r.number(*top_theta, "rope_theta") != r.number(*nested_theta, "rope_parameters.rope_theta"))
    r.fail("'rope_theta' (" + top_theta->data() + ") and 'rope_parameters.rope_theta' (" +
           nested_theta->data() + ") disagree");
  if (nested_theta)
    rope.theta = r.number(*nested_theta, "rope_parameters.rope_theta");
  else if (top_theta)
    rope.theta = r.number(*top_theta, "rope_theta");
  else
    rope.theta = 10000.0;  // LlamaConfig's default

  if (params) parse_rope_scaling(r, *params, "rope_parameters", &rope);
  if (scaling) {
    RopeParams old = rope;
    parse_rope_scaling(r, *scaling, "rope_scaling", &old);
    if (!params) {
      rope = old;
    } else {
      ModelShape a, b;  // compare through the canonical text: one definition of "same RoPE"
      a.rope = rope;
      b.rope = old;
      if (a.canonical() != b.canonical())
        r.fail("'rope_parameters' and 'rope_scaling' disagree:\n" + a.diff(b));
    }
  }
}

}  // namespace

HfConfig parse_hf_config(const std::string& json_text, const std::string& source) {
  pt::ptree root;
  try {
    std::istringstream in(json_text);
    pt::read_json(in, root);
  } catch (const pt::json_parser_error& e) {
    throw std::invalid_argument("config '" + source + "': invalid JSON (" + e.message() +
                                " at line " + std::to_string(e.line()) + ")");
  }
  const ConfigReader r(root, source);
  HfConfig cfg;

  cfg.model_type = r.optional_string("model_type");
  const auto archs = r.strings("architectures");
  if (archs.size() > 1) r.fail("more than one architecture listed; expected one");
  cfg.architecture = archs.empty() ? "" : archs[0];
  const bool llama = cfg.architecture == "LlamaForCausalLM" ||
                     (cfg.architecture.empty() && cfg.model_type == "llama");
  const bool mistral = cfg.architecture == "MistralForCausalLM" ||
                       (cfg.architecture.empty() && cfg.model_type == "mistral");
  if (!llama && !mistral)
    r.fail("unsupported architecture '" + cfg.architecture + "' (model_type '" + cfg.model_type +
           "'); supported: LlamaForCausalLM (model_type llama), MistralForCausalLM without a "
           "sliding window");
  if (llama && !cfg.model_type.empty() && cfg.model_type != "llama")
    r.fail("architecture LlamaForCausalLM with model_type '" + cfg.model_type +
           "', expected 'llama'");
  if (mistral && !cfg.model_type.empty() && cfg.model_type != "mistral")
    r.fail("architecture MistralForCausalLM with model_type '" + cfg.model_type +
           "', expected 'mistral'");

  cfg.hidden_size = r.required_int("hidden_size");
  cfg.intermediate_size = r.required_int("intermediate_size");
  cfg.vocab_size = r.required_int("vocab_size");
  cfg.shape.num_layers = r.required_int("num_hidden_layers");
  cfg.shape.num_q_heads = r.required_int("num_attention_heads");
  cfg.shape.num_kv_heads = r.optional_int("num_key_value_heads", cfg.shape.num_q_heads);
  cfg.shape.max_position = r.required_int("max_position_embeddings");
  if (cfg.hidden_size % cfg.shape.num_q_heads != 0 && !r.find("head_dim"))
    r.fail("hidden_size " + std::to_string(cfg.hidden_size) +
           " is not a multiple of num_attention_heads " + std::to_string(cfg.shape.num_q_heads) +
           " and there is no head_dim");
  cfg.shape.head_dim = r.optional_int("head_dim", cfg.hidden_size / cfg.shape.num_q_heads);
  cfg.rms_norm_eps = r.optional_number("rms_norm_eps", 1e-6);
  if (!(cfg.rms_norm_eps > 0)) r.fail("'rms_norm_eps' must be > 0");
  // LlamaConfig defaults to untied; MistralConfig too.
  cfg.tie_word_embeddings = r.optional_bool("tie_word_embeddings", false);
  cfg.bos_token_id = r.optional_int("bos_token_id", -1);
  cfg.eos_token_ids = r.integers("eos_token_id");
  cfg.torch_dtype = r.optional_string("dtype");  // transformers >= 4.56 spelling
  if (cfg.torch_dtype.empty()) cfg.torch_dtype = r.optional_string("torch_dtype");

  // Features the runner does not implement: refuse rather than run a different model.
  const std::string act = r.optional_string("hidden_act");
  if (!act.empty() && act != "silu")
    r.fail("hidden_act '" + act + "' is not supported (expected silu)");
  if (r.optional_bool("attention_bias", false)) r.fail("attention_bias=true is not supported");
  if (r.optional_bool("mlp_bias", false)) r.fail("mlp_bias=true is not supported");
  if (r.optional_int("pretraining_tp", 1) != 1)
    r.fail("pretraining_tp != 1 is not supported");  // changes the linear layers' rounding only
  if (mistral) {
    const int window = r.optional_int("sliding_window", 0);
    if (window > 0 && window < cfg.shape.max_position)
      r.fail("MistralForCausalLM with sliding_window " + std::to_string(window) +
             " < max_position_embeddings is not supported (the runner attends to all tokens)");
  }
  if (cfg.bos_token_id >= cfg.vocab_size)
    r.fail("bos_token_id " + std::to_string(cfg.bos_token_id) + " >= vocab_size " +
           std::to_string(cfg.vocab_size));

  parse_rope(r, &cfg);
  try {
    cfg.shape.validate();
  } catch (const std::invalid_argument& e) {
    r.fail(e.what());
  }
  return cfg;
}

HfConfig load_hf_config(const std::string& folder_or_file) {
  struct stat st;
  std::string path = folder_or_file, folder = folder_or_file;
  if (::stat(folder_or_file.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    path = folder_or_file + (folder_or_file.empty() || folder_or_file.back() == '/' ? "" : "/") +
           "config.json";
  } else {
    const auto slash = folder_or_file.find_last_of('/');
    folder = slash == std::string::npos ? "." : folder_or_file.substr(0, slash);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("config '" + path + "': cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  HfConfig cfg = parse_hf_config(text.str(), path);
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  const auto slash = folder.find_last_of('/');
  cfg.shape.name = slash == std::string::npos ? folder : folder.substr(slash + 1);
  return cfg;
}

}  // namespace kvs
