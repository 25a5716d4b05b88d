// End-to-end evaluation of the methods inside a model's decode loop (kvs-eval ppl, needle):
// the runner prefills a prompt with its own dense attention once, and each method then
// decodes from that same prompt with its engine in every layer (capture/engine_attention.h).
// The dense row is the runtime's dense engine, so every method is compared with dense
// attention over the same bf16 KV cache.
#pragma once

#include <functional>
#include <iosfwd>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "capture/llama.h"
#include "runtime/engine.h"
#include "runtime/eval/report.h"

namespace kvs {

struct ModelEvalConfig {
  std::vector<std::string> methods{"dense"};  ///< "name" or "name:knob=value,..."
  EngineConfig engine;                        ///< base knobs for every method
  std::string bundle;                         ///< for methods with stored parts
  int prefill_chunk = 512;                    ///< runner prefill chunk (tokens)
};

using EvalProgress = std::function<void(const std::string&)>;

// ---- perplexity ---------------------------------------------------------------------------

// Teacher-forced: per window of context + steps + 1 tokens, the first `context` are the
// prompt, then `steps` decode steps with the method, each scored on the next token.
struct PplConfig {
  int context = 8192;
  int steps = 64;
};

struct PplRow {
  std::string method, knobs;
  int context = 0;
  int windows = 0;
  int64_t tokens = 0;            ///< scored tokens (windows x steps)
  double bits_per_token = 0.0;   ///< = bits per byte for a byte-level model
  /// bits_per_token / dense's - 1; NaN without a dense row (null in JSON, "-" in the table)
  double delta_vs_dense = std::numeric_limits<double>::quiet_NaN();
  double kv_read_fraction = 0.0; ///< KV rows read over a dense read, all layers
  double tokens_per_second = 0.0;  ///< decode steps per second (runner + engine)
};

// windows: token ids, each at least context + steps + 1 long. Throws naming the window
// when one is too short.
std::vector<PplRow> eval_perplexity(const LlamaModel& model,
                                    const std::vector<std::vector<int32_t>>& windows,
                                    const PplConfig& ppl, const ModelEvalConfig& config,
                                    const EvalProgress& progress = {});

// ---- needle (pass key retrieval) ----------------------------------------------------------

// A byte-level task: a haystack of held-out text with the needle line "The pass key is
// NNNNN." (three times) inserted at `depth` (a fraction of the haystack), then the cue
// "\nThe pass key is " decoded with the method (teacher-forced) and 5 greedy tokens compared
// with the key. The cue repeats the needle's own words, so a model without instruction
// following answers by copying (induction), which is what long-context retrieval tests;
// the digits can only come from the needle.
struct NeedleConfig {
  std::vector<int> contexts{4096};
  std::vector<double> depths{0.1, 0.5, 0.9};
  int trials = 3;          ///< keys (and haystack offsets) per (context, depth)
  uint64_t seed = 1234;
};

struct NeedleRow {
  std::string method, knobs;
  int context = 0;
  double depth = 0.0;
  int trials = 0;
  int correct = 0;
  double accuracy() const { return trials ? double(correct) / trials : 0.0; }
  double kv_read_fraction = 0.0;
};

// haystack: held-out text, longer than the largest context. Throws when the model is not
// byte-level or the text is too short.
std::vector<NeedleRow> eval_needle(const LlamaModel& model, const std::string& haystack,
                                   const NeedleConfig& needle, const ModelEvalConfig& config,
                                   const EvalProgress& progress = {});

// The needle's prompt pieces (exposed for tests): the text before the answer and the key.
struct NeedlePrompt {
  std::string prompt;    ///< haystack with the needle, ending before the question
  std::string question;  ///< decoded teacher-forced by the method
  std::string key;       ///< the 5 digits
};
NeedlePrompt make_needle_prompt(const std::string& haystack, int64_t offset, int bytes,
                                double depth, uint64_t key_seed);

// Tables and JSON: {"meta": {key: value, ...}, "rows": [{...}, ...]}; meta says what made
// the rows (command, model, device).
using EvalMeta = eval::JsonMeta;
void write_ppl_table(std::ostream& os, const std::vector<PplRow>& rows);
void write_ppl_json(std::ostream& os, const std::vector<PplRow>& rows, const EvalMeta& meta);
void write_needle_table(std::ostream& os, const std::vector<NeedleRow>& rows);
void write_needle_json(std::ostream& os, const std::vector<NeedleRow>& rows,
                       const EvalMeta& meta);

}  // namespace kvs
