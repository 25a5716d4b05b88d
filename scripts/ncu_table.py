#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV (--metrics gpu__time_duration.sum --csv --print-units
base): per kernel (template arguments dropped), the launch count and the median, min and
max duration in microseconds, in order of first launch."""
import csv
import statistics
import sys


def short_name(name):
    # "void kvs::kernels::saap::(anonymous namespace)::route_kernel<...>(...)" -> "route_kernel<...>";
    # newer ncu writes the anonymous namespace as "<unnamed>".
    for anon in ("(anonymous namespace)::", "<unnamed>::"):
        name = name.replace(anon, "")
    if name.startswith("void "):
        name = name[5:]
    head = name.split("(")[0]
    if "<" in head:
        base, args = head.split("<", 1)
        base = base.split("::")[-1]
        args = args.rsplit(">", 1)[0]
        return f"{base}<{args[:40]}>"
    return head.split("::")[-1]


def main(path):
    times = {}
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # The program's own output is interleaved: the table starts at ncu's header row.
    start = next((i for i, r in enumerate(rows) if r[:1] == ["ID"]), None)
    if start is None:
        print(f"{path}: no kernels profiled")
        return 1
    header, rows = rows[start], [r for r in rows[start:] if len(r) == len(rows[start])]
    col = {k: i for i, k in enumerate(header)}
    for r in rows[1:]:
        if r[col["Metric Name"]] != "gpu__time_duration.sum":
            continue
        key = (short_name(r[col["Kernel Name"]]), r[col["Grid Size"]], r[col["Block Size"]])
        times.setdefault(key, []).append(float(r[col["Metric Value"]].replace(",", "")) / 1e3)
    print(f"{'kernel':58s} {'grid':>16s} {'block':>12s} {'n':>5s} {'median_us':>10s} "
          f"{'min_us':>8s} {'max_us':>8s}")
    for (name, grid, block), t in times.items():
        print(f"{name[:58]:58s} {grid:>16s} {block:>12s} {len(t):5d} "
              f"{statistics.median(t):10.2f} {min(t):8.2f} {max(t):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
