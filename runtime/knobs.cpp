#include "runtime/knobs.h"

#include <functional>
#include <map>
#include <stdexcept>

namespace kvs {
namespace {

double to_double(const std::string& key, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty())
    throw std::invalid_argument("knob " + key + ": '" + v + "' is not a number");
  return x;
}

int to_int(const std::string& key, const std::string& v) {
  size_t used = 0;
  long x = 0;
  try {
    x = std::stol(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty())
    throw std::invalid_argument("knob " + key + ": '" + v + "' is not an integer");
  return int(x);
}

bool to_bool(const std::string& key, const std::string& v) {
  if (v == "1" || v == "true") return true;
  if (v == "0" || v == "false") return false;
  throw std::invalid_argument("knob " + key + ": '" + v + "' is not 0, 1, true or false");
}

std::vector<int> to_ints(const std::string& key, const std::string& v) {
  // Lists use '/' inside a knob string, since ',' separates knobs: dense_layers=0/2.
  std::vector<int> out;
  std::string cur;
  for (char c : v + "/") {
    if (c == '/') {
      if (!cur.empty()) out.push_back(to_int(key, cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

using Setter = std::function<void(EngineConfig&, const std::string&, const std::string&)>;
using Table = std::map<std::string, Setter>;

const Table& knob_table(Method m) {
  static const Table none;
  static const Table tactic = {
      {"target", [](EngineConfig& c, auto& k, auto& v) { c.tactic.target = to_double(k, v); }},
      {"cluster_size",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.cluster_size = to_int(k, v); }},
      {"iterations",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.kmeans_iterations = to_int(k, v); }},
      {"seed", [](EngineConfig& c, auto& k, auto& v) { c.tactic.seed = uint64_t(to_int(k, v)); }},
      {"exact_fraction",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.exact_fraction = to_double(k, v); }},
      {"recluster_interval",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.recluster_interval = to_int(k, v); }},
      {"dense_layers",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.dense_layers = to_ints(k, v); }},
      {"member_rows",
       [](EngineConfig& c, auto& k, auto& v) { c.tactic.member_rows = to_bool(k, v); }},
  };
  static const Table mac = {
      {"tau", [](EngineConfig& c, auto& k, auto& v) { c.mac.tau = to_double(k, v); }},
      {"window", [](EngineConfig& c, auto& k, auto& v) { c.mac.window = to_int(k, v); }},
      {"band", [](EngineConfig& c, auto& k, auto& v) { c.mac.band = to_int(k, v); }},
      {"min_context", [](EngineConfig& c, auto& k, auto& v) { c.mac.min_context = to_int(k, v); }},
      {"threshold", [](EngineConfig& c, auto&, auto& v) { c.mac.threshold = mac_threshold_from_string(v); }},
      {"min_queries", [](EngineConfig& c, auto& k, auto& v) { c.mac.min_queries = to_int(k, v); }},
  };
  static const Table attnpred = {
      {"budget_tokens",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.budget_tokens = to_int(k, v); }},
      {"sink_tokens",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.sink_tokens = to_int(k, v); }},
      {"recent_tokens",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.recent_tokens = to_int(k, v); }},
      {"calibration_period",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.calibration_period = to_int(k, v); }},
      {"warmup_steps",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.warmup_steps = to_int(k, v); }},
      {"predict_interval",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.predict_interval = to_int(k, v); }},
      {"group_history",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.group_history = to_bool(k, v) ? 1 : 0; }},
      {"dense_layers",
       [](EngineConfig& c, auto& k, auto& v) { c.attnpred.dense_layers = to_ints(k, v); }},
      {"calibration_keys",
       [](EngineConfig& c, auto&, auto& v) {
         c.attnpred.calibration_keys = calibration_keys_from_string(v);
       }},
  };
  static const Table saap = {
      {"probes", [](EngineConfig& c, auto& k, auto& v) { c.saap.probes = to_int(k, v); }},
      {"sink_tokens", [](EngineConfig& c, auto& k, auto& v) { c.saap.sink_tokens = to_int(k, v); }},
      {"recent_tokens",
       [](EngineConfig& c, auto& k, auto& v) { c.saap.recent_tokens = to_int(k, v); }},
      {"dense_layers",
       [](EngineConfig& c, auto& k, auto& v) { c.saap.dense_layers = to_ints(k, v); }},
      {"router",
       [](EngineConfig& c, auto&, auto& v) { c.saap.query_router = saap_router_from_string(v); }},
      {"router_weights", [](EngineConfig& c, auto&,
                            auto& v) { c.saap.router_weights = saap_weights_from_string(v); }},
      {"max_context", [](EngineConfig& c, auto& k, auto& v) { c.saap.max_context = to_int(k, v); }},
      {"fold_every", [](EngineConfig& c, auto& k, auto& v) { c.saap.fold_every = to_int(k, v); }},
      {"index_every", [](EngineConfig& c, auto& k, auto& v) { c.saap.index_every = to_int(k, v); }},
      {"index_phase", [](EngineConfig& c, auto& k, auto& v) { c.saap.index_phase = to_int(k, v); }},
      {"member_rows",
       [](EngineConfig& c, auto& k, auto& v) { c.saap.member_rows = to_bool(k, v); }},
  };
  static const Table magicpig = {
      {"bits", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.bits = to_int(k, v); }},
      {"tables", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.tables = to_int(k, v); }},
      {"sink_tokens", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.sink_tokens = to_int(k, v); }},
      {"local_tokens", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.local_tokens = to_int(k, v); }},
      {"dense_layers", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.dense_layers = to_ints(k, v); }},
      {"seed", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.seed = uint64_t(to_int(k, v)); }},
      {"epsilon", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.epsilon = to_double(k, v); }},
      {"mode", [](EngineConfig& c, auto&, auto& v) { c.magicpig.mode = magicpig_mode_from_string(v); }},
      {"threads", [](EngineConfig& c, auto& k, auto& v) { c.magicpig.threads = to_int(k, v); }},
      {"cpu_isa", [](EngineConfig& c, auto&, auto& v) { c.magicpig.cpu_isa = v; }},
  };
  switch (m) {
    case Method::Tactic: return tactic;
    case Method::MagicPig: return magicpig;
    case Method::Saap: return saap;
    case Method::AttnPred: return attnpred;
    case Method::Mac: return mac;
    default: return none;
  }
}

}  // namespace

std::vector<std::string> knob_names(Method method) {
  std::vector<std::string> out;
  for (const auto& [name, setter] : knob_table(method)) out.push_back(name);
  return out;
}

void set_knob(EngineConfig& config, Method method, const std::string& key,
              const std::string& value) {
  const Table& t = knob_table(method);
  const auto it = t.find(key);
  if (it == t.end()) {
    std::string known;
    for (const auto& n : knob_names(method)) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument(std::string("method '") + to_string(method) + "' has no knob '" +
                                key + "' (knobs: " + (known.empty() ? "none" : known) + ")");
  }
  try {
    it->second(config, key, value);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(to_string(method)) + " " + e.what());
  }
}

MethodSpec parse_method_spec(const std::string& text) {
  MethodSpec s;
  const size_t colon = text.find(':');
  s.name = text.substr(0, colon);
  s.method = method_from_string(s.name);
  if (colon != std::string::npos) s.knobs = text.substr(colon + 1);
  return s;
}

EngineConfig apply_knobs(const EngineConfig& base, const MethodSpec& spec) {
  EngineConfig c = base;
  std::string cur;
  for (char ch : spec.knobs + ",") {
    if (ch != ',') {
      cur += ch;
      continue;
    }
    if (cur.empty()) continue;
    const size_t eq = cur.find('=');
    if (eq == std::string::npos || eq == 0)
      throw std::invalid_argument("method '" + spec.name + "': knob '" + cur +
                                  "' is not key=value");
    set_knob(c, spec.method, cur.substr(0, eq), cur.substr(eq + 1));
    cur.clear();
  }
  return c;
}

}  // namespace kvs
