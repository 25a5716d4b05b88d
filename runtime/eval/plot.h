// Fidelity plots through gnuplot (run as a separate program, so no plotting library is linked).
#pragma once

#include <string>
#include <vector>

#include "runtime/eval/report.h"

namespace kvs::eval {

struct PlotConfig {
  std::string gnuplot = "gnuplot";  ///< program name (looked up on PATH) or path
  int width = 1400;                 ///< PNG width in pixels
  int height = 560;                 ///< PNG height in pixels
  std::string title;                ///< optional title over both panels
};

// True when `program` is an executable file (a path) or found on PATH.
bool gnuplot_available(const std::string& program = "gnuplot");

// Writes a PNG with two panels over the fraction of KV read: attention mass recall, and the
// mean relative L2 output error, one series per method (its knobs as points, ordered by
// read fraction). Rows must all be of one layer (or all pooled,
// layer -1). The generated gnuplot script and data are kept next to the PNG as
// <png>.gp and <png>.dat so a plot can be re-made or restyled by hand.
// Throws std::runtime_error naming the program when gnuplot is missing or fails (with its
// messages), and std::invalid_argument for empty or mixed-layer rows.
void plot_fidelity(const std::vector<ResultRow>& rows, const std::string& png_path,
                   const PlotConfig& cfg = {});

}  // namespace kvs::eval
