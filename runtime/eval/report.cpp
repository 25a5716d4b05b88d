#include "runtime/eval/report.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace kvs::eval {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double mean(const std::vector<double>& v) {
  if (v.empty()) return kNaN;
  return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

template <typename T>
void append(std::vector<T>& to, const std::vector<T>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// One field of a row: text, or a number (integral ones print without a fraction).
struct Cell {
  bool is_text = false;
  bool is_integer = false;
  std::string text;
  double number = 0;
};

// The single list of columns: the three writers differ only in how they print a cell.
const std::vector<std::string>& column_names() {
  // clang-format off
  static const std::vector<std::string> names = {
      "method", "knob", "layer", "steps",
      "rel_l2_mean", "rel_l2_p50", "rel_l2_p90",
      "mass_recall_mean", "mass_recall_p10",
      "kv_read_fraction_mean", "tokens_selected_mean", "budget_tokens_mean",
      "read_reuse_mean"};
  // clang-format on
  return names;
}

std::vector<Cell> cells(const ResultRow& r) {
  const auto text = [](const std::string& s) {
    Cell c;
    c.is_text = true;
    c.text = s;
    return c;
  };
  const auto integer = [](int64_t v) {
    Cell c;
    c.is_integer = true;
    c.number = double(v);
    return c;
  };
  const auto real = [](double v) {
    Cell c;
    c.number = v;
    return c;
  };
  return {text(r.method),
          text(r.knob),
          integer(r.layer),
          integer(r.steps),
          real(r.rel_l2_mean),
          real(r.rel_l2_p50),
          real(r.rel_l2_p90),
          real(r.mass_recall_mean),
          real(r.mass_recall_p10),
          real(r.kv_read_fraction_mean),
          real(r.tokens_selected_mean),
          real(r.budget_tokens_mean),
          real(r.read_reuse_mean)};
}

std::string non_finite_text(double v) {
  if (std::isnan(v)) return "nan";
  return v > 0 ? "inf" : "-inf";
}

// Shortest text that reads back to the same double (machine-readable outputs).
std::string exact_number(const Cell& c) {
  if (!std::isfinite(c.number)) return non_finite_text(c.number);
  char buf[64];
  const auto res = c.is_integer ? std::to_chars(buf, buf + sizeof buf, int64_t(c.number))
                                : std::to_chars(buf, buf + sizeof buf, c.number);
  return std::string(buf, res.ptr);
}

// Four significant digits, for people.
std::string short_number(const Cell& c) {
  if (c.is_integer) return exact_number(c);
  if (!std::isfinite(c.number)) return non_finite_text(c.number);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", c.number);
  return buf;
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char ch : s) {
    if (ch == '"') q += '"';
    q += ch;
  }
  return q + "\"";
}

}  // namespace

double percentile(std::vector<double> values, double p) {
  if (!(p >= 0.0 && p <= 100.0)) {
    throw std::invalid_argument("kvs::eval::percentile: p must be in [0, 100], got " +
                                std::to_string(p));
  }
  if (values.empty()) return kNaN;
  std::sort(values.begin(), values.end());
  const double pos = p / 100.0 * double(values.size() - 1);
  const size_t lo = size_t(std::floor(pos));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = pos - double(lo);
  // Interpolating between equal infinities would give inf - inf = NaN.
  if (frac == 0.0 || values[lo] == values[hi]) return values[lo];
  return values[lo] + (values[hi] - values[lo]) * frac;
}

void Aggregator::add(const std::string& method, const std::string& knob, int layer,
                     const StepMetrics& m) {
  const size_t heads = m.rel_l2.size();
  if (heads == 0 || m.mass_recall.size() != heads || m.tokens_selected.size() != heads) {
    throw std::invalid_argument("kvs::eval::Aggregator::add: step metrics for " + method + " (" +
                                knob + ", layer " + std::to_string(layer) + ") have " +
                                std::to_string(m.rel_l2.size()) + " rel_l2, " +
                                std::to_string(m.mass_recall.size()) + " mass_recall and " +
                                std::to_string(m.tokens_selected.size()) +
                                " tokens_selected values; expected the same "
                                "non-zero count (one per query head)");
  }
  Key key{method, knob, layer};
  auto it = cells_.find(key);
  if (it == cells_.end()) {
    order_.push_back(key);
    it = cells_.emplace(key, Samples{}).first;
  }
  Samples& s = it->second;
  ++s.steps;
  append(s.rel_l2, m.rel_l2);
  append(s.mass_recall, m.mass_recall);
  for (int t : m.tokens_selected) s.tokens.push_back(t);
  s.read_fraction.push_back(m.kv_read_fraction);
  if (m.budget_tokens >= 0) s.budget.push_back(m.budget_tokens);
  if (!std::isnan(m.read_reuse)) s.reuse.push_back(m.read_reuse);
}

namespace {

ResultRow make_row(const std::string& method, const std::string& knob, int layer,
                   const std::vector<const std::vector<double>*>& rel,
                   const std::vector<const std::vector<double>*>& rec,
                   const std::vector<const std::vector<double>*>& tok,
                   const std::vector<const std::vector<double>*>& frac,
                   const std::vector<const std::vector<double>*>& bud,
                   const std::vector<const std::vector<double>*>& reuse, int64_t steps) {
  const auto pool = [](const std::vector<const std::vector<double>*>& parts) {
    std::vector<double> all;
    for (const auto* p : parts) append(all, *p);
    return all;
  };
  const std::vector<double> rel_all = pool(rel), rec_all = pool(rec);
  ResultRow r;
  r.method = method;
  r.knob = knob;
  r.layer = layer;
  r.steps = steps;
  r.rel_l2_mean = mean(rel_all);
  r.rel_l2_p50 = percentile(rel_all, 50);
  r.rel_l2_p90 = percentile(rel_all, 90);
  r.mass_recall_mean = mean(rec_all);
  r.mass_recall_p10 = percentile(rec_all, 10);
  r.kv_read_fraction_mean = mean(pool(frac));
  r.tokens_selected_mean = mean(pool(tok));
  r.budget_tokens_mean = mean(pool(bud));
  r.read_reuse_mean = mean(pool(reuse));
  return r;
}

}  // namespace

std::vector<ResultRow> Aggregator::rows() const {
  std::vector<ResultRow> out;
  for (const Key& k : order_) {
    const Samples& s = cells_.at(k);
    out.push_back(make_row(std::get<0>(k), std::get<1>(k), std::get<2>(k), {&s.rel_l2},
                           {&s.mass_recall}, {&s.tokens}, {&s.read_fraction}, {&s.budget},
                           {&s.reuse}, s.steps));
  }
  return out;
}

std::vector<ResultRow> Aggregator::rows_over_layers() const {
  std::vector<std::pair<std::string, std::string>> groups;
  for (const Key& k : order_) {
    const std::pair<std::string, std::string> g{std::get<0>(k), std::get<1>(k)};
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  std::vector<ResultRow> out;
  for (const auto& g : groups) {
    std::vector<const std::vector<double>*> rel, rec, tok, frac, bud, reuse;
    int64_t steps = 0;
    for (const Key& k : order_) {
      if (std::get<0>(k) != g.first || std::get<1>(k) != g.second) continue;
      const Samples& s = cells_.at(k);
      rel.push_back(&s.rel_l2);
      rec.push_back(&s.mass_recall);
      tok.push_back(&s.tokens);
      frac.push_back(&s.read_fraction);
      bud.push_back(&s.budget);
      reuse.push_back(&s.reuse);
      steps += s.steps;
    }
    out.push_back(make_row(g.first, g.second, -1, rel, rec, tok, frac, bud, reuse, steps));
  }
  return out;
}

std::string json_quote(const std::string& s) {
  std::string q = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        q += "\\\"";
        break;
      case '\\':
        q += "\\\\";
        break;
      case '\b':
        q += "\\b";
        break;
      case '\f':
        q += "\\f";
        break;
      case '\n':
        q += "\\n";
        break;
      case '\r':
        q += "\\r";
        break;
      case '\t':
        q += "\\t";
        break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          q += buf;
        } else {
          q += char(ch);  // UTF-8 passes through: JSON text is UTF-8.
        }
    }
  }
  return q + "\"";
}

void write_table(std::ostream& out, const std::vector<ResultRow>& rows) {
  const auto& names = column_names();
  std::vector<std::vector<std::string>> text;
  std::vector<bool> left(names.size(), false);
  std::vector<size_t> width(names.size());
  for (size_t c = 0; c < names.size(); ++c) width[c] = names[c].size();
  for (const ResultRow& r : rows) {
    const std::vector<Cell> cs = cells(r);
    std::vector<std::string> line;
    for (size_t c = 0; c < cs.size(); ++c) {
      line.push_back(cs[c].is_text ? cs[c].text : short_number(cs[c]));
      left[c] = cs[c].is_text;
      width[c] = std::max(width[c], line.back().size());
    }
    text.push_back(std::move(line));
  }
  const auto emit = [&](const std::vector<std::string>& line) {
    std::string s;
    for (size_t c = 0; c < line.size(); ++c) {
      const std::string pad(width[c] - line[c].size(), ' ');
      if (c) s += "  ";
      s += left[c] ? line[c] + pad : pad + line[c];
    }
    while (!s.empty() && s.back() == ' ') s.pop_back();
    out << s << '\n';
  };
  emit(names);
  for (const auto& line : text) emit(line);
}

void write_json(std::ostream& out, const std::vector<ResultRow>& rows, const JsonMeta& meta) {
  const auto& names = column_names();
  out << "{\n\"meta\": " << json_meta(meta) << ",\n\"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::vector<Cell> cs = cells(rows[i]);
    out << (i ? ",\n " : "\n ") << '{';
    for (size_t c = 0; c < cs.size(); ++c) {
      out << (c ? ", " : "") << json_quote(names[c]) << ": ";
      if (cs[c].is_text) {
        out << json_quote(cs[c].text);
      } else if (!std::isfinite(cs[c].number)) {
        out << "null";  // JSON has no NaN or infinity
      } else {
        out << exact_number(cs[c]);
      }
    }
    out << '}';
  }
  out << (rows.empty() ? "]\n}\n" : "\n]\n}\n");
}

std::string json_meta(const JsonMeta& meta) {
  std::string t = "{";
  for (size_t i = 0; i < meta.size(); ++i)
    t += (i ? ", " : "") + json_quote(meta[i].first) + ": " + json_quote(meta[i].second);
  return t + "}";
}

void write_csv(std::ostream& out, const std::vector<ResultRow>& rows) {
  const auto& names = column_names();
  for (size_t c = 0; c < names.size(); ++c) out << (c ? "," : "") << names[c];
  out << '\n';
  for (const ResultRow& r : rows) {
    const std::vector<Cell> cs = cells(r);
    for (size_t c = 0; c < cs.size(); ++c) {
      out << (c ? "," : "") << (cs[c].is_text ? csv_field(cs[c].text) : exact_number(cs[c]));
    }
    out << '\n';
  }
}

}  // namespace kvs::eval
