#include "tools/common/cli.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <stdexcept>

namespace kvs::cli {

bool parse_options(int argc, char** argv, const boost::program_options::options_description& desc,
                   boost::program_options::variables_map* vm) {
  namespace po = boost::program_options;
  po::variables_map local;
  po::variables_map& m = vm ? *vm : local;
  po::store(po::parse_command_line(argc, argv, desc), m);
  if (m.count("help")) {
    std::cout << desc << "\n";
    return false;
  }
  po::notify(m);
  return true;
}
std::string command_line(int argc, char** argv) {
  std::string line;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i == 0) arg = arg.substr(arg.find_last_of('/') + 1);  // npos + 1 == 0: no folder
    const bool plain = !arg.empty() && arg.find_first_not_of(
                                           "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                           "0123456789_-+=.,:/@%") == std::string::npos;
    if (!plain) {
      std::string q = "'";
      for (char ch : arg) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
      arg = q + "'";
    }
    line += (i ? " " : "") + arg;
  }
  return line;
}

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : text) {
    if (c == sep) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (c != ' ') {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::vector<int> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<int> out;
  for (const std::string& s : split(text, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size()) throw std::invalid_argument("--" + option + ": '" + s + "' is not an integer");
    out.push_back(v);
  }
  return out;
}

std::vector<double> parse_double_list(const std::string& text, const std::string& option) {
  std::vector<double> out;
  for (const std::string& s : split(text, ',')) {
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != s.size()) throw std::invalid_argument("--" + option + ": '" + s + "' is not a number");
    out.push_back(v);
  }
  return out;
}

ProgressLine::ProgressLine(std::string label)
    : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0), start_(now()) {}

void ProgressLine::update(int64_t done, int64_t total, const std::string& extra) {
  const double frac = total > 0 ? double(done) / double(total) : 1.0;
  const double elapsed = now() - start_;
  const double rate = elapsed > 0 ? double(done) / elapsed : 0.0;
  if (tty_) {
    const int width = 30, filled = int(frac * width);
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld %.0f/s %s", label_.c_str(),
                 std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), (long long)done,
                 (long long)total, rate, extra.c_str());
    std::fflush(stderr);
  } else {
    const int tenth = int(frac * 10);
    if (tenth == last_tenth_) return;
    last_tenth_ = tenth;
    std::fprintf(stderr, "%s %3d%% %lld/%lld %.0f/s %s\n", label_.c_str(), tenth * 10,
                 (long long)done, (long long)total, rate, extra.c_str());
  }
}

void ProgressLine::finish() {
  if (tty_) std::fprintf(stderr, "\n");
}

}  // namespace kvs::cli
