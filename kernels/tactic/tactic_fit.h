// Tactic's per-query-head budget math, shared by the CPU reference and the CUDA kernels
// (host-device, no CUDA headers): which sorted positions a head samples, the y = a/x + b fit
// of the sampled exponentials, and the closed-form token budget K (spec tactic.md 2.4, 8.1,
// 8.7, 8.8). Also the k-means initialisation, so both backends start from the same keys.
//
// Positions x are 1-based ranks in the cluster-sorted token list of one query head: clusters
// in descending q.centroid order, members of a cluster in ascending token id.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace kvs::kernels::tactic {

// The knobs of Algorithm 1 (defaults are TacticConfig's; see runtime/tactic_engine.h).
struct FitParams {
  double target = 0.9;            ///< P: cumulative attention mass to reach, in (0, 1]
  double exact_fraction = 0.015;  ///< N = ceil(exact_fraction * n) leading tokens exact
  double centre1 = 0.10;          ///< first sampling window centre, fraction of n
  double centre2 = 0.60;          ///< second sampling window centre, fraction of n
  int window_min = 32;            ///< window width w = max(window_min, ceil(window_fraction*n))
  double window_fraction = 0.005;
};

// H_m = sum_{i=1}^{m} 1/i: exact below 64, the asymptotic series above (error < 1e-14).
// One division and one log above 64: the budget search evaluates it many times per step.
KVS_HOST_DEVICE double harmonic(int64_t m) {
  if (m <= 0) return 0.0;
  if (m < 64) {
    double h = 0.0;
    // Rolled on the device: unrolled, each inlined call site of this loop was up to 63
    // double-precision divisions of straight-line code (the budget kernel had 110 KB of SASS).
#ifdef __CUDA_ARCH__
#pragma unroll 1
#endif
    for (int64_t i = m; i >= 1; --i) h += 1.0 / double(i);
    return h;
  }
  const double x = double(m), r = 1.0 / x, r2 = r * r;
  return log(x) + 0.57721566490153286061 + 0.5 * r - r2 * (1.0 / 12.0) +
         r2 * r2 * (1.0 / 120.0);
}

// What one query head samples. fitted == false is the exact mode (spec 8.7): for short lists
// (N + 2w >= n, or windows that cannot be placed disjointly after the exact prefix) every
// position is computed exactly, which costs no more than sampling would.
struct FitPlan {
  int n = 0;          ///< clustered tokens in the list
  int num_exact = 0;  ///< positions 1..num_exact are computed exactly
  int w = 0;          ///< window width (0 in exact mode)
  int lo1 = 0;        ///< first window: positions [lo1, lo1 + w)
  int lo2 = 0;        ///< second window: positions [lo2, lo2 + w)
  bool fitted = false;

  KVS_HOST_DEVICE int num_samples() const { return num_exact + 2 * w; }
  // 1-based sorted position of sample s in [0, num_samples()).
  KVS_HOST_DEVICE int position(int s) const {
    if (s < num_exact) return s + 1;
    s -= num_exact;
    return s < w ? lo1 + s : lo2 + (s - w);
  }
  // Fit abscissae: the x at which a/x + b equals the model's mean over each window, i.e.
  // the harmonic mean of the window's positions. With it the fit is exact for curves of
  // the model's form, whatever the window width (the arithmetic centre is biased by about
  // w^2 / (12 x^2)).
  KVS_HOST_DEVICE double x1() const { return window_x(lo1); }
  KVS_HOST_DEVICE double x2() const { return window_x(lo2); }
  KVS_HOST_DEVICE double window_x(int lo) const {
    return double(w) / (harmonic(lo + w - 1) - harmonic(lo - 1));
  }
};

KVS_HOST_DEVICE FitPlan make_fit_plan(int n, const FitParams& p) {
  FitPlan f;
  f.n = n;
  if (n <= 0) return f;
  int exact = int(ceil(p.exact_fraction * double(n)));
  exact = exact < 1 ? 1 : (exact > n ? n : exact);
  int w = int(ceil(p.window_fraction * double(n)));
  if (w < p.window_min) w = p.window_min;
  const int c1 = int(floor(p.centre1 * double(n) + 0.5));
  const int c2 = int(floor(p.centre2 * double(n) + 0.5));
  // Clip the windows into [exact + 1, n] without overlapping (spec 8.7).
  int lo1 = c1 - w / 2;
  if (lo1 < exact + 1) lo1 = exact + 1;
  int lo2 = c2 - w / 2;
  if (lo2 < lo1 + w) lo2 = lo1 + w;
  if (lo2 + w - 1 > n) lo2 = n - w + 1;
  if (w >= 1 && exact + 2 * w < n && lo2 >= lo1 + w) {
    f.num_exact = exact;
    f.w = w;
    f.lo1 = lo1;
    f.lo2 = lo2;
    f.fitted = true;
  } else {
    f.num_exact = n;
  }
  return f;
}

// y(x) = a / x + b for positions num_exact < x <= end, 0 beyond `end`.
struct TailModel {
  double a = 0.0;
  double b = 0.0;
  int end = 0;
};

// Solves a, b from the window means (mu1 at x1, mu2 at x2), with the guards of spec 8.7:
// a <= 0 (the second window is as heavy as the first: no decay to exploit) falls back to a
// flat tail at the windows' mean, which spreads the remaining mass evenly and so asks for a
// conservative (large) K; b < 0 clamps y at 0 from x0 = a / -b on. span = fit_span(x1, x2),
// which the CUDA budget kernel computes before its inputs arrive.
KVS_HOST_DEVICE double fit_span(double x1, double x2) { return 1.0 / x1 - 1.0 / x2; }

KVS_HOST_DEVICE TailModel fit_tail_span(double mu1, double mu2, double x1, double span, int n) {
  TailModel t;
  t.a = (mu1 - mu2) / span;
  t.b = mu1 - t.a / x1;
  t.end = n;
  if (!(t.a > 0.0)) {
    t.a = 0.0;
    t.b = 0.5 * (mu1 + mu2);
  }
  if (t.b < 0.0) {
    const double x0 = t.a / -t.b;
    if (x0 < double(n)) t.end = int(floor(x0));
  }
  return t;
}

KVS_HOST_DEVICE TailModel fit_tail(double mu1, double mu2, double x1, double x2, int n) {
  return fit_tail_span(mu1, mu2, x1, fit_span(x1, x2), n);
}

// sum_{x = from+1}^{to} y(x) for to <= t.end, closed form through harmonic numbers: h_from =
// harmonic(from), h_to = harmonic(to).
KVS_HOST_DEVICE double tail_sum_known(const TailModel& t, int from, double h_from, int to,
                                      double h_to) {
  if (to <= from) return 0.0;
  return t.a * (h_to - h_from) + t.b * double(to - from);
}

// The same for any `to` (searches over `to` compute h_from once).
KVS_HOST_DEVICE double tail_sum_from(const TailModel& t, int from, double h_from, int to) {
  if (to > t.end) to = t.end;
  return to > from ? tail_sum_known(t, from, h_from, to, harmonic(to)) : 0.0;
}

KVS_HOST_DEVICE double tail_sum(const TailModel& t, int from, int to) {
  return tail_sum_from(t, from, harmonic(from), to);
}

// The budget K: the fewest leading sorted tokens whose modelled mass reaches target times
// the modelled total. exact_prefix(k) (k in [1, num_exact]) is the inclusive prefix sum of
// the exact exponentials, all taken relative to one common max logit (spec 8.8; K does not
// depend on that shift). target >= 1 selects all n tokens: P = 1 is dense attention.
//
// BudgetSearch is the search problem: K is the smallest k in [lo, hi] with reaches(k), a
// predicate monotone in k that holds at hi. budget_tokens solves it by bisection; the CUDA
// budget kernel solves the same problem with the whole block (block_budget_tokens).
template <typename ExactPrefix>
struct BudgetSearch {
  ExactPrefix exact_prefix;
  TailModel tail;
  int num_exact = 0;
  int lo = 0, hi = 0;
  bool in_exact = false;  ///< the exact prefix alone reaches the goal
  double exact_sum = 0.0, goal = 0.0, h_exact = 0.0;

  KVS_HOST_DEVICE bool reaches(int k) const {
    return in_exact ? exact_prefix(k) >= goal
                    : exact_sum + tail_sum_from(tail, num_exact, h_exact, k) >= goal;
  }
};

// h_exact and h_n are harmonic(f.num_exact) and harmonic(f.n), which the CUDA budget kernel
// computes before its inputs arrive.
template <typename ExactPrefix>
KVS_HOST_DEVICE BudgetSearch<ExactPrefix> budget_search(const FitPlan& f, const TailModel& t,
                                                        double target, ExactPrefix exact_prefix,
                                                        double h_exact, double h_n) {
  BudgetSearch<ExactPrefix> s{exact_prefix, t};
  s.num_exact = f.num_exact;
  if (f.n <= 0) return s;  // [0, 0]: K = 0
  if (target >= 1.0) {
    s.lo = s.hi = f.n;
    return s;
  }
  s.exact_sum = exact_prefix(f.num_exact);
  s.h_exact = h_exact;
  const double tail_mass = !f.fitted      ? 0.0
                           : t.end >= f.n ? tail_sum_known(t, f.num_exact, s.h_exact, f.n, h_n)
                                          : tail_sum_from(t, f.num_exact, s.h_exact, f.n);
  const double total = s.exact_sum + tail_mass;
  s.goal = target * total;
  s.in_exact = s.exact_sum >= s.goal;
  s.lo = s.in_exact ? 1 : f.num_exact + 1;
  s.hi = s.in_exact ? f.num_exact : f.n;  // the modelled sum reaches total at n
  return s;
}

template <typename ExactPrefix>
KVS_HOST_DEVICE int budget_tokens(const FitPlan& f, const TailModel& t, double target,
                                  ExactPrefix exact_prefix) {
  const BudgetSearch<ExactPrefix> s =
      budget_search(f, t, target, exact_prefix, harmonic(f.num_exact), harmonic(f.n));
  int lo = s.lo, hi = s.hi;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (s.reaches(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// ---- k-means initialisation -------------------------------------------------------------

KVS_HOST_DEVICE uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The random stream of one clustering problem: the seed, the layer, the kv head and the
// first token of the range. Not the batch slot, so a sequence clusters the same in any slot.
KVS_HOST_DEVICE uint64_t kmeans_stream(uint64_t seed, int layer, int kv_head, int start) {
  uint64_t s = splitmix64(seed);
  s = splitmix64(s ^ uint64_t(uint32_t(layer)));
  s = splitmix64(s ^ (uint64_t(uint32_t(kv_head)) << 20));
  return splitmix64(s ^ (uint64_t(uint32_t(start)) << 32));
}

// Key index (in [0, n)) that initialises centroid c of C: a uniformly random key of the c-th
// of C equal strata of the range. A stratified random sample: distinct keys without
// rejection, each index computable on its own (a GPU thread per centroid, no sort), and the
// same on both backends.
KVS_HOST_DEVICE int kmeans_init_index(uint64_t stream, int c, int n, int C) {
  const int64_t lo = int64_t(c) * n / C, hi = int64_t(c + 1) * n / C;
  const uint64_t r = splitmix64(stream ^ (uint64_t(uint32_t(c)) * 0xD1B54A32D192ED03ull));
  return int(lo + int64_t(r % uint64_t(hi - lo)));
}

KVS_HOST_DEVICE int kmeans_num_clusters(int n, int cluster_size) {
  return n <= 0 ? 0 : (n + cluster_size - 1) / cluster_size;
}

}  // namespace kvs::kernels::tactic
