// Small helpers shared by the command-line tools: list parsing and a progress line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvs::cli {

// "0,2,3" -> {0, 2, 3}; "" -> {}. Throws std::invalid_argument naming the option and the
// element that is not an integer.
std::vector<int> parse_int_list(const std::string& text, const std::string& option);
std::vector<double> parse_double_list(const std::string& text, const std::string& option);
std::vector<std::string> split(const std::string& text, char sep);

// A progress line on stderr: redrawn in place on a terminal, a line per tenth otherwise.
class ProgressLine {
 public:
  explicit ProgressLine(std::string label);
  void update(int64_t done, int64_t total, const std::string& extra = "");
  void finish();

 private:
  std::string label_;
  bool tty_;
  int last_tenth_ = -1;
  double start_;
};

}  // namespace kvs::cli
