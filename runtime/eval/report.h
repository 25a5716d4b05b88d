// Aggregating step metrics into result rows, and writing them as a text table, JSON or CSV.
#pragma once

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/eval/metrics.h"

namespace kvs::eval {

// One (layer, method, knob) cell. Percentiles pool every (step, query head) sample and
// interpolate linearly between order statistics (numpy's default). A mean or percentile over
// no samples, and budget_tokens_mean where no step had a budget, are NaN; writers print NaN
// and infinities as null (JSON) or nan/inf (text, CSV).
struct ResultRow {
  std::string method;  ///< e.g. "quest", "tactic"
  std::string knob;    ///< free text naming the setting, e.g. "tokens=256"
  int layer = -1;      ///< -1: pooled over layers
  int64_t steps = 0;
  double rel_l2_mean = 0, rel_l2_p50 = 0, rel_l2_p90 = 0;
  double mass_recall_mean = 0, mass_recall_p10 = 0;
  double kv_read_fraction_mean = 0;  ///< per-step fraction, averaged over steps
  double tokens_selected_mean = 0;   ///< tokens per query head actually read
  double budget_tokens_mean = 0;     ///< tokens per head asked for (compare with the above)
  double read_reuse_mean = 0;        ///< StepMetrics::read_reuse over the steps that have it
};

// Collects StepMetrics by (method, knob, layer); rows come out in first-seen order.
class Aggregator {
 public:
  void add(const std::string& method, const std::string& knob, int layer, const StepMetrics& m);
  std::vector<ResultRow> rows() const;
  // One row per (method, knob), pooling all layers' samples; layer = -1.
  std::vector<ResultRow> rows_over_layers() const;

 private:
  struct Samples {
    int64_t steps = 0;
    std::vector<double> rel_l2, mass_recall, tokens;  // per (step, head)
    std::vector<double> read_fraction, budget;        // per step (budget: steps that had one)
    std::vector<double> reuse;                        // per step that measured it
  };
  using Key = std::tuple<std::string, std::string, int>;
  std::vector<Key> order_;
  std::map<Key, Samples> cells_;
};

// Percentile p in [0, 100] of values (linear interpolation; NaN for no values).
double percentile(std::vector<double> values, double p);

// Columns in the order of ResultRow's fields; all three writers use the same names.
void write_table(std::ostream& out, const std::vector<ResultRow>& rows);
// Where a result came from (command, device, inputs): string pairs, in order.
using JsonMeta = std::vector<std::pair<std::string, std::string>>;

// {"meta": {...}, "rows": [{...}, ...]} (docs/formats.md, "Fidelity rows").
void write_json(std::ostream& out, const std::vector<ResultRow>& rows, const JsonMeta& meta);
void write_csv(std::ostream& out,
               const std::vector<ResultRow>& rows);  // RFC 4180 quoting, header row, \n line ends

// The string as a JSON string literal, quotes included (escapes ", \ and control bytes).
std::string json_quote(const std::string& s);

// The meta pairs as one JSON object: {"key": "value", ...}.
std::string json_meta(const JsonMeta& meta);

}  // namespace kvs::eval
