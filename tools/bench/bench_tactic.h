// kvs-bench --method tactic: Tactic decode (selection + sparse attention) against dense decode
// in the same run, and the prefill clustering time; see bench_tactic.cu.
#pragma once

#include <string>
#include <vector>

#include "kernels/tactic/tactic.h"
#include "kernels/tactic/tactic_fit.h"

namespace kvs {

struct TacticBenchArgs {
  std::vector<int> contexts;
  std::vector<int> batches;
  int hq = 32, hkv = 8, d = 128, page_size = 16;
  int iters = 50;               ///< timed graph replays (median)
  double p = 0.9;               ///< target cumulative attention mass P
  int layers = 4;               ///< KV sets (layers) per replay, rotated to defeat the L2
  int components = 512;         ///< Gaussian key components per (sequence, kv head)
  /// KMeansParams::cluster_size: average tokens per cluster at prefill (the spec's 16)
  int cluster_size = kernels::tactic::KMeansParams{}.cluster_size;
  // The fit's sampling knobs (TacticConfig's), defaults from FitParams.
  double exact_fraction = kernels::tactic::FitParams{}.exact_fraction;    ///< N / n
  double window_fraction = kernels::tactic::FitParams{}.window_fraction;  ///< w / n
  int window_min = kernels::tactic::FitParams{}.window_min;               ///< w at least this
  double prefill_tflops = 500;  ///< assumed dense prefill attention throughput (estimate)
  /// TacticConfig::member_rows: the state keeps each member's page row (--no-member-rows:
  /// the sampled keys and the union's rows through the page table)
  bool member_rows = true;
  /// --capture: the scene from a capture file instead of the synthetic keys (bench_tactic.cu).
  /// The options below say which of the shape options were given on the command line: a
  /// capture sets what was not, and refuses what disagrees with it.
  std::string capture;
  bool contexts_given = false, batches_given = false, shape_given = false;
  std::string json_path;        ///< --json: write the rows here (empty: no file)
  std::string command;          ///< the command line, for the JSON's meta
};

// Prints the table (and writes JSON when json_path is set); returns the process exit code.
int run_tactic_bench(const TacticBenchArgs& args);

}  // namespace kvs
