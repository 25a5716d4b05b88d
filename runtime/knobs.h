// Method knobs by name, for command lines and result tables: "tactic:target=0.75",
// "mac:threshold=paper,tau=0.5". The one place that maps knob names to the fields of the
// per-method config structs (runtime/<method>_config.h) reachable through EngineConfig.
#pragma once

#include <string>
#include <vector>

#include "runtime/engine.h"

namespace kvs {

// Sets `key` of `method`'s config in `config` from text. Throws std::invalid_argument naming
// the method, the knob and the value when the knob is unknown (listing the known ones) or
// the value does not parse. Range checks stay with each engine's constructor.
void set_knob(EngineConfig& config, Method method, const std::string& key,
              const std::string& value);

// The knob names of `method` (empty for methods without knobs).
std::vector<std::string> knob_names(Method method);

// A method with its knobs, parsed from "name" or "name:key=value,key=value".
struct MethodSpec {
  Method method = Method::Dense;
  std::string name;   ///< the method's name
  std::string knobs;  ///< "key=value,..." as given ("" for defaults)
  std::string label() const { return knobs.empty() ? "default" : knobs; }
};
MethodSpec parse_method_spec(const std::string& text);

// `base` with spec's knobs applied.
EngineConfig apply_knobs(const EngineConfig& base, const MethodSpec& spec);

}  // namespace kvs
