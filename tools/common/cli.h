// Small helpers shared by the command-line tools: option and list parsing, a progress line.
#pragma once

#include <boost/program_options.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace kvs::cli {

// Parses the command line into the variables `desc` binds (and into *vm when given). Prints
// `desc` and returns false when --help was given (the caller then exits 0); throws on an
// unknown or bad option.
bool parse_options(int argc, char** argv, const boost::program_options::options_description& desc,
                   boost::program_options::variables_map* vm = nullptr);

// The program's name (argv[0] without its folder) and its arguments, each quoted for a POSIX
// shell where it needs it: the command that reproduces the run, for result files' meta.
std::string command_line(int argc, char** argv);

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
