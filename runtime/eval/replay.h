// Replays the decode steps recorded in a capture file through the runtime's engines and the
// baseline selectors, measuring every step against fp64 dense attention (kvs-eval's core).
//
// Per sequence and layer: the captured pre-RoPE keys are rotated to post-RoPE and rounded to
// bf16 (what a real KV cache holds), written into a KVCache on the engines' device, and each
// engine is prefilled with the tokens before decode_start. Then for each recorded step p the
// cache length is set to p + 1, the step's query is rotated, and every engine decodes it.
// Baselines (StreamingLLM, Quest page top-k, H2O's accumulated attention mass, the exact TopK
// oracle) run at fixed budgets and at each engine's own per-step read, so methods are always
// compared at equal KV read. H2O is stateful: one selector per baseline row follows the
// sequence's steps, seeded with the dense attention of the prompt's last h2o_warmup queries.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "artifacts/capture_file.h"
#include "runtime/engine.h"
#include "runtime/eval/baselines.h"
#include "runtime/eval/report.h"

namespace kvs::eval {

struct ReplayConfig {
  std::vector<int> layers;         ///< layers to replay; empty: every captured layer
  int max_sequences = 0;           ///< 0: all sequences in the file
  int max_steps = 0;               ///< recorded steps per sequence; 0: all
  std::vector<std::string> methods{"dense"};  ///< engines: "name" or "name:key=value,..." (runtime/knobs.h)
  EngineConfig engine;             ///< backend and per-method knobs for every engine
  std::string bundle;              ///< bundle for methods with stored parts ("" = none)
  std::vector<double> budget_fractions{0.05, 0.1, 0.2};  ///< fixed baseline budgets
  bool baselines_at_method_read = true;  ///< baselines again at each method's read per step
  StreamingConfig streaming;
  QuestConfig quest;
  H2OConfig h2o;
  int h2o_warmup = 32;  ///< prompt queries whose dense attention seeds H2O's accumulated mass
};

// Called once per (sequence, layer) replayed, with a short description.
using ReplayProgress = std::function<void(const std::string&)>;

// Runs the replay and returns the aggregated metrics. Throws, naming the file and the
// layer, when a requested layer was not captured.
Aggregator replay_capture(const CaptureFile& capture, const ReplayConfig& config,
                          const ReplayProgress& progress = {});

}  // namespace kvs::eval
