#include "runtime/eval/plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

extern char** environ;

namespace kvs::eval {
namespace {

bool is_executable_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// A gnuplot single-quoted string: '' is the only escape; control bytes would end the
// command, so they become spaces.
std::string gp_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) {
    if (ch == '\'') {
      q += "''";
    } else if ((unsigned char)ch < 0x20) {
      q += ' ';
    } else {
      q += ch;
    }
  }
  return q + "'";
}

// gnuplot skips points whose value is the "missing" marker; inf or nan would instead
// stretch or break autoscaling.
std::string gp_number(double v) {
  if (!std::isfinite(v)) return "?";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `program script` with stdout and stderr into log; returns the exit status, or throws
// when the program cannot be started at all.
int run_program(const std::string& program, const std::string& script, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> argv = {const_cast<char*>(program.c_str()), const_cast<char*>(script.c_str()),
                             nullptr};
  pid_t pid;
  const int err = posix_spawnp(&pid, program.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) {
    throw std::runtime_error("kvs::eval::plot_fidelity: cannot run " + program + ": " +
                             std::strerror(err) +
                             (err == ENOENT ? " (install gnuplot, e.g. Debian's gnuplot-nox, or "
                                              "set PlotConfig.gnuplot)"
                                            : ""));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      throw std::runtime_error(std::string("kvs::eval::plot_fidelity: waitpid failed: ") +
                               std::strerror(errno));
    }
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace

bool gnuplot_available(const std::string& program) {
  if (program.empty()) return false;
  if (program.find('/') != std::string::npos) return is_executable_file(program);
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (is_executable_file((dir.empty() ? "." : dir) + "/" + program)) return true;
  }
  return false;
}

void plot_fidelity(const std::vector<ResultRow>& rows, const std::string& png_path,
                   const PlotConfig& cfg) {
  if (rows.empty()) throw std::invalid_argument("kvs::eval::plot_fidelity: no result rows");
  for (const ResultRow& r : rows) {
    if (r.layer != rows.front().layer) {
      throw std::invalid_argument(
          "kvs::eval::plot_fidelity: rows mix layers " + std::to_string(rows.front().layer) +
          " and " + std::to_string(r.layer) +
          "; plot one layer at a time or the pooled rows (Aggregator::rows_over_layers)");
    }
  }
  if (cfg.width < 16 || cfg.height < 16) {
    throw std::invalid_argument("kvs::eval::plot_fidelity: PlotConfig size " +
                                std::to_string(cfg.width) + "x" + std::to_string(cfg.height) +
                                " is too small (at least 16x16 pixels)");
  }
  if (!gnuplot_available(cfg.gnuplot)) {
    throw std::runtime_error("kvs::eval::plot_fidelity: gnuplot program '" + cfg.gnuplot +
                             "' not found (install gnuplot, e.g. Debian's gnuplot-nox, or set "
                             "PlotConfig.gnuplot)");
  }

  std::vector<std::string> methods;
  for (const ResultRow& r : rows) {
    if (std::find(methods.begin(), methods.end(), r.method) == methods.end()) {
      methods.push_back(r.method);
    }
  }
  const std::string dat = png_path + ".dat", gp = png_path + ".gp", log = png_path + ".log";
  {
    // One data block per method (gnuplot "index"), blocks separated by two blank lines.
    std::ofstream out(dat);
    out << "# fraction_kv_read  mass_recall_mean  rel_l2_mean  knob\n";
    for (size_t m = 0; m < methods.size(); ++m) {
      std::vector<const ResultRow*> pts;
      for (const ResultRow& r : rows) {
        if (r.method == methods[m]) pts.push_back(&r);
      }
      std::stable_sort(pts.begin(), pts.end(), [](const ResultRow* a, const ResultRow* b) {
        return a->kv_read_fraction_mean < b->kv_read_fraction_mean;
      });
      out << (m ? "\n\n" : "") << "# " << gp_quote(methods[m]) << '\n';
      for (const ResultRow* r : pts) {
        out << gp_number(r->kv_read_fraction_mean) << ' ' << gp_number(r->mass_recall_mean) << ' '
            << gp_number(r->rel_l2_mean) << ' ' << gp_quote(r->knob) << '\n';
      }
    }
    if (!out) throw std::runtime_error("kvs::eval::plot_fidelity: cannot write " + dat);
  }
  {
    const auto series = [&](const std::string& cols) {
      std::string s;
      for (size_t m = 0; m < methods.size(); ++m) {
        s += (m ? ", \\\n     " : "") + (m ? std::string("''") : gp_quote(dat)) + " index " +
             std::to_string(m) + " using " + cols + " with linespoints title " +
             gp_quote(methods[m]);
      }
      return s;
    };
    std::ofstream out(gp);
    out << "set terminal pngcairo size " << cfg.width << ',' << cfg.height << " noenhanced\n"
        << "set output " << gp_quote(png_path) << '\n'
        << "set datafile missing '?'\n"
        << "set multiplot layout 1,2"
        << (cfg.title.empty() ? std::string() : " title " + gp_quote(cfg.title)) << '\n'
        << "set grid\n"
        << "set xlabel 'fraction of KV rows read'\n"
        << "set xrange [0:1]\n"
        << "set ylabel 'attention mass recall (mean)'\n"
        << "set yrange [0:1.02]\n"
        << "set key bottom right\n"
        << "plot " << series("1:2") << '\n'
        << "set ylabel 'relative L2 error of the output (mean)'\n"
        << "set yrange [0:*]\n"
        << "set key top right\n"
        << "plot " << series("1:3") << '\n'
        << "unset multiplot\n"
        << "set output\n";
    if (!out) throw std::runtime_error("kvs::eval::plot_fidelity: cannot write " + gp);
  }
  std::remove(png_path.c_str());
  const int status = run_program(cfg.gnuplot, gp, log);
  const std::string messages = read_text(log);
  struct stat st;
  if (status != 0 || ::stat(png_path.c_str(), &st) != 0 || st.st_size == 0) {
    throw std::runtime_error("kvs::eval::plot_fidelity: " + cfg.gnuplot + " " + gp +
                             " exited with status " + std::to_string(status) +
                             " and did not write " + png_path + "; its output:\n" + messages);
  }
  std::remove(log.c_str());
}

}  // namespace kvs::eval
