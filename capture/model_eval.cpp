#include "capture/model_eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <ostream>
#include <stdexcept>

#include "capture/engine_attention.h"
#include "capture/tokens.h"
#include "runtime/eval/report.h"
#include "runtime/knobs.h"

namespace kvs {
namespace {

// One engine per method for one prompt, all prefilled from the same runner cache.
struct MethodRuns {
  std::vector<MethodSpec> specs;
  std::vector<std::unique_ptr<EngineAttention>> engines;
  int queries_wanted = 0;

  MethodRuns(const LlamaModel& model, const ModelEvalConfig& config, const Bundle* bundle,
             int max_tokens) {
    for (const std::string& text : config.methods) {
      specs.push_back(parse_method_spec(text));
      engines.push_back(
          std::make_unique<EngineAttention>(model, text, config.engine, bundle, max_tokens));
      queries_wanted = std::max(queries_wanted, engines.back()->prompt_queries_wanted());
    }
  }
};

std::unique_ptr<Bundle> open_bundle(const std::string& path) {
  return path.empty() ? nullptr : std::make_unique<Bundle>(Bundle::open(path));
}

// Prefills `prompt` into a fresh cache with the runner's dense attention, recording the last
// queries the engines want.
struct Prefilled {
  KvCache cache;
  std::unique_ptr<PromptQueryRecorder> queries;
};

Prefilled prefill_prompt(const LlamaModel& model, const std::vector<int32_t>& prompt,
                         int reserve, int queries_wanted, int chunk) {
  Prefilled p{model.new_cache(reserve), nullptr};
  p.queries = std::make_unique<PromptQueryRecorder>(model.shape().num_layers,
                                                    int64_t(prompt.size()), queries_wanted);
  PrefillOptions opts;
  opts.chunk = chunk;
  opts.logits = LogitsMode::None;
  model.prefill(prompt, p.cache, opts, p.queries.get());
  return p;
}

double nll_of(const torch::Tensor& logits, int32_t next) {
  const torch::Tensor lp = torch::log_softmax(logits.to(torch::kCPU, torch::kFloat64), 0);
  return -lp[next].item<double>();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The question after the haystack; the answer follows it directly.
const char* const kNeedleQuestion = "\nThe pass key is ";

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// {"meta": {...}, "rows": [...]}: write_row(os, row) writes one row's fields.
template <class Row, class F>
void write_rows_json(std::ostream& os, const EvalMeta& meta, const std::vector<Row>& rows,
                     F write_row) {
  os << "{\n  \"meta\": " << eval::json_meta(meta) << ",\n  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    os << "    {\"method\": " << eval::json_quote(rows[i].method)
       << ", \"knobs\": " << eval::json_quote(rows[i].knobs);
    write_row(os, rows[i]);
    os << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
  }
  os << "  ]\n}\n";
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, x);
  return buf;
}

}  // namespace

std::vector<PplRow> eval_perplexity(const LlamaModel& model,
                                    const std::vector<std::vector<int32_t>>& windows,
                                    const PplConfig& ppl, const ModelEvalConfig& config,
                                    const EvalProgress& progress) {
  if (ppl.context < 1 || ppl.steps < 1)
    throw std::invalid_argument("ppl: context and steps must be >= 1, got " +
                                std::to_string(ppl.context) + " and " + std::to_string(ppl.steps));
  if (windows.empty()) throw std::invalid_argument("ppl: no windows");
  const size_t need = size_t(ppl.context) + size_t(ppl.steps) + 1;
  for (size_t w = 0; w < windows.size(); ++w)
    if (windows[w].size() < need)
      throw std::invalid_argument("ppl: window " + std::to_string(w) + " has " +
                                  std::to_string(windows[w].size()) + " tokens, context " +
                                  std::to_string(ppl.context) + " + steps " +
                                  std::to_string(ppl.steps) + " + 1 need " + std::to_string(need));
  const std::unique_ptr<Bundle> bundle = open_bundle(config.bundle);
  const size_t M = config.methods.size();
  std::vector<double> nll(M, 0.0), secs(M, 0.0);
  std::vector<uint64_t> rows_read(M, 0), rows_ctx(M, 0);
  const int max_tokens = ppl.context + ppl.steps + 1;
  for (size_t w = 0; w < windows.size(); ++w) {
    const std::vector<int32_t>& ids = windows[w];
    MethodRuns runs(model, config, bundle.get(), max_tokens);
    if (progress)
      progress("ppl window " + std::to_string(w) + ": prefill " + std::to_string(ppl.context) +
               " tokens");
    const std::vector<int32_t> prompt(ids.begin(), ids.begin() + ppl.context);
    Prefilled pre = prefill_prompt(model, prompt, max_tokens, runs.queries_wanted,
                                   config.prefill_chunk);
    for (size_t m = 0; m < M; ++m) {
      EngineAttention& ea = *runs.engines[m];
      ea.start(pre.cache, pre.queries.get());
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < ppl.steps; ++s) {
        const size_t at = size_t(ppl.context) + size_t(s);
        const torch::Tensor logits = model.decode(ids[at], pre.cache, nullptr, &ea);
        nll[m] += nll_of(logits, ids[at + 1]);
      }
      secs[m] += seconds_since(t0);
      const EngineStats st = ea.stats();
      rows_read[m] += st.kv_rows_read;
      rows_ctx[m] += st.kv_rows_context;
      pre.cache.truncate(ppl.context);
      if (progress)
        progress("ppl window " + std::to_string(w) + ": " + config.methods[m] + " done");
    }
  }
  std::vector<PplRow> rows;
  const int64_t tokens = int64_t(windows.size()) * ppl.steps;
  double dense_bits = 0.0;
  for (size_t m = 0; m < M; ++m) {
    const MethodSpec spec = parse_method_spec(config.methods[m]);
    PplRow r;
    r.method = spec.name;
    r.knobs = spec.label();
    r.context = ppl.context;
    r.windows = int(windows.size());
    r.tokens = tokens;
    r.bits_per_token = nll[m] / double(tokens) / std::log(2.0);
    r.kv_read_fraction = rows_ctx[m] ? double(rows_read[m]) / double(rows_ctx[m]) : 0.0;
    r.tokens_per_second = secs[m] > 0 ? double(tokens) / secs[m] : 0.0;
    if (spec.method == Method::Dense && dense_bits == 0.0) dense_bits = r.bits_per_token;
    rows.push_back(r);
  }
  if (dense_bits > 0.0)
    for (PplRow& r : rows) r.delta_vs_dense = r.bits_per_token / dense_bits - 1.0;
  return rows;
}

NeedlePrompt make_needle_prompt(const std::string& haystack, int64_t offset, int bytes,
                                double depth, uint64_t key_seed) {
  if (depth < 0.0 || depth > 1.0)
    throw std::invalid_argument("needle: depth " + fmt("%g", depth) + " is outside [0, 1]");
  NeedlePrompt p;
  const uint64_t r = splitmix64(key_seed);
  p.key = std::to_string(10000 + r % 90000);
  const std::string line = "The pass key is " + p.key + ".";
  const std::string needle = "\n" + line + " " + line + " " + line + "\n";
  p.question = kNeedleQuestion;
  const int64_t filler = int64_t(bytes) - int64_t(needle.size());
  if (filler < 1)
    throw std::invalid_argument("needle: " + std::to_string(bytes) +
                                " bytes leave no room for a haystack around the needle");
  if (offset < 0 || offset + filler > int64_t(haystack.size()))
    throw std::invalid_argument("needle: the haystack text has " +
                                std::to_string(haystack.size()) + " bytes, " +
                                std::to_string(offset + filler) + " needed");
  const std::string hay = haystack.substr(size_t(offset), size_t(filler));
  // At a line end near the depth, so the needle is a line of its own.
  size_t at = size_t(std::llround(depth * double(hay.size())));
  const size_t nl = hay.find('\n', at);
  if (nl != std::string::npos && nl - at < 200) at = nl;
  p.prompt = hay.substr(0, at) + needle + hay.substr(at);
  return p;
}

std::vector<NeedleRow> eval_needle(const LlamaModel& model, const std::string& haystack,
                                   const NeedleConfig& needle, const ModelEvalConfig& config,
                                   const EvalProgress& progress) {
  const HfConfig& cfg = model.config();
  if (!is_byte_level(cfg))
    throw std::invalid_argument("needle: model '" + cfg.shape.name +
                                "' is not byte-level (vocab_size " +
                                std::to_string(cfg.vocab_size) + "); the task is built from text");
  if (needle.trials < 1) throw std::invalid_argument("needle: trials must be >= 1");
  const std::unique_ptr<Bundle> bundle = open_bundle(config.bundle);
  const size_t M = config.methods.size();
  std::vector<NeedleRow> rows;
  for (int context : needle.contexts) {
    for (size_t di = 0; di < needle.depths.size(); ++di) {
      const double depth = needle.depths[di];
      std::vector<int> correct(M, 0);
      std::vector<uint64_t> rows_read(M, 0), rows_ctx(M, 0);
      for (int trial = 0; trial < needle.trials; ++trial) {
        const uint64_t seed = splitmix64(needle.seed ^ (uint64_t(context) << 20) ^
                                         (uint64_t(di) << 8) ^ uint64_t(trial));
        const int bos = cfg.bos_token_id >= 0 ? 1 : 0;
        const int bytes = context - bos - int(std::strlen(kNeedleQuestion));
        if (int64_t(haystack.size()) <= bytes)
          throw std::invalid_argument("needle: the haystack text has " +
                                      std::to_string(haystack.size()) + " bytes, context " +
                                      std::to_string(context) + " needs more");
        const int64_t offset = int64_t(seed % uint64_t(int64_t(haystack.size()) - bytes));
        const NeedlePrompt np = make_needle_prompt(haystack, offset, bytes, depth, seed);
        const std::vector<int32_t> prompt = byte_tokens(cfg, np.prompt);
        const int max_tokens = int(prompt.size() + np.question.size() + np.key.size()) + 1;
        MethodRuns runs(model, config, bundle.get(), max_tokens);
        Prefilled pre = prefill_prompt(model, prompt, max_tokens, runs.queries_wanted,
                                       config.prefill_chunk);
        for (size_t m = 0; m < M; ++m) {
          EngineAttention& ea = *runs.engines[m];
          ea.start(pre.cache, pre.queries.get());
          torch::Tensor logits;
          for (unsigned char c : np.question)
            logits = model.decode(int32_t(c), pre.cache, nullptr, &ea);
          std::string answer;
          for (size_t i = 0; i < np.key.size(); ++i) {
            const int32_t tok = int32_t(logits.argmax().item<int64_t>());
            answer.push_back(char(tok));
            if (i + 1 < np.key.size()) logits = model.decode(tok, pre.cache, nullptr, &ea);
          }
          if (answer == np.key) ++correct[m];
          const EngineStats st = ea.stats();
          rows_read[m] += st.kv_rows_read;
          rows_ctx[m] += st.kv_rows_context;
          pre.cache.truncate(int64_t(prompt.size()));
        }
        if (progress)
          progress("needle context " + std::to_string(context) + " depth " + fmt("%.2f", depth) +
                   " trial " + std::to_string(trial) + " done");
      }
      for (size_t m = 0; m < M; ++m) {
        const MethodSpec spec = parse_method_spec(config.methods[m]);
        NeedleRow r;
        r.method = spec.name;
        r.knobs = spec.label();
        r.context = context;
        r.depth = depth;
        r.trials = needle.trials;
        r.correct = correct[m];
        r.kv_read_fraction = rows_ctx[m] ? double(rows_read[m]) / double(rows_ctx[m]) : 0.0;
        rows.push_back(r);
      }
    }
  }
  return rows;
}

void write_ppl_table(std::ostream& os, const std::vector<PplRow>& rows) {
  char line[256];
  std::snprintf(line, sizeof(line), "%-10s %-28s %8s %8s %12s %10s %9s %9s\n", "method", "knobs",
                "context", "tokens", "bits/token", "vs dense", "KV read", "tok/s");
  os << line;
  for (const PplRow& r : rows) {
    char delta[32] = "         -";
    if (std::isfinite(r.delta_vs_dense))
      std::snprintf(delta, sizeof(delta), "%+9.2f%%", 100.0 * r.delta_vs_dense);
    std::snprintf(line, sizeof(line), "%-10s %-28s %8d %8lld %12.4f %10s %9.3f %9.2f\n",
                  r.method.c_str(), r.knobs.c_str(), r.context, static_cast<long long>(r.tokens),
                  r.bits_per_token, delta, r.kv_read_fraction, r.tokens_per_second);
    os << line;
  }
}

void write_ppl_json(std::ostream& os, const std::vector<PplRow>& rows, const EvalMeta& meta) {
  write_rows_json(os, meta, rows, [](std::ostream& o, const PplRow& r) {
    o << ", \"context\": " << r.context << ", \"windows\": " << r.windows
      << ", \"tokens\": " << r.tokens << ", \"bits_per_token\": " << fmt("%.6f", r.bits_per_token)
      << ", \"delta_vs_dense\": "
      << (std::isfinite(r.delta_vs_dense) ? fmt("%.6f", r.delta_vs_dense) : "null")
      << ", \"kv_read_fraction\": " << fmt("%.6f", r.kv_read_fraction)
      << ", \"tokens_per_second\": " << fmt("%.3f", r.tokens_per_second);
  });
}

void write_needle_table(std::ostream& os, const std::vector<NeedleRow>& rows) {
  char line[256];
  std::snprintf(line, sizeof(line), "%-10s %-28s %8s %6s %8s %9s %9s\n", "method", "knobs",
                "context", "depth", "correct", "accuracy", "KV read");
  os << line;
  for (const NeedleRow& r : rows) {
    std::snprintf(line, sizeof(line), "%-10s %-28s %8d %6.2f %5d/%-2d %9.3f %9.3f\n",
                  r.method.c_str(), r.knobs.c_str(), r.context, r.depth, r.correct, r.trials,
                  r.accuracy(), r.kv_read_fraction);
    os << line;
  }
}

void write_needle_json(std::ostream& os, const std::vector<NeedleRow>& rows,
                       const EvalMeta& meta) {
  write_rows_json(os, meta, rows, [](std::ostream& o, const NeedleRow& r) {
    o << ", \"context\": " << r.context << ", \"depth\": " << fmt("%.3f", r.depth)
      << ", \"trials\": " << r.trials << ", \"correct\": " << r.correct
      << ", \"accuracy\": " << fmt("%.4f", r.accuracy())
      << ", \"kv_read_fraction\": " << fmt("%.6f", r.kv_read_fraction);
  });
}

}  // namespace kvs
