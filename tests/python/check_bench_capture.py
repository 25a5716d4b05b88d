#!/usr/bin/env python3
"""ctest kvs_bench_tactic_capture_*: kvs-bench --method tactic --capture on the capture
fixture (tests/fixtures/kvs_tiny_a_capture_l1.h5: layer 1, 1 kv head with its 4 query
heads, 640 tokens of kvs-tiny-a). Python 3 standard library only.

    check_bench_capture.py errors KVS_BENCH FIXTURE WORK_DIR
        what the capture cannot serve is refused, naming it (no GPU needed)
    check_bench_capture.py rows KVS_BENCH FIXTURE WORK_DIR
        the rows on a GPU: the capture's shape and length, a selection under the context,
        the mass it reached; exits 77 (skipped) where kvs-bench finds no CUDA device
"""
import json
import os
import subprocess
import sys

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAILED: {what}")


def bench(exe, fixture, *args):
    res = subprocess.run([exe, "--method", "tactic", "--capture", fixture, *args],
                         capture_output=True, text=True)
    return res.returncode, res.stdout, res.stderr


def errors(exe, fixture):
    for args, want in [
        (["--contexts", "1000"], "seq0 has only 640 tokens"),
        (["--batches", "2"], "--batches 2, but it holds 1 sequence(s)"),
        (["--hq", "8"], "disagree with the capture's 4 / 1 / 128"),
        (["--contexts", "512", "--head-dim", "64"], "disagree with the capture's 4 / 1 / 128"),
    ]:
        rc, out, err = bench(exe, fixture, *args)
        check(rc != 0, f"{args}: exit code {rc}, want an error")
        check(want in err and fixture in err, f"{args}: stderr {err.strip()!r} lacks {want!r}")
    # A cluster size the re-clustering cannot take (its blocks of 2048 tokens split into whole
    # clusters) is refused before any GPU work.
    rc, out, err = bench(exe, fixture, "--cluster-size", "3")
    check(rc != 0 and "--cluster-size must divide" in err and "got 3" in err,
          f"--cluster-size 3: exit {rc}, stderr {err.strip()!r}")
    rc, out, err = bench(exe, fixture + ".missing")
    check(rc != 0 and ".missing" in err, f"a missing file: exit {rc}, stderr {err.strip()!r}")


def rows(exe, fixture, work):
    path = os.path.join(work, "kvs_bench_tactic_capture.json")
    # Two KV sets, both of the one captured layer.
    rc, out, err = bench(exe, fixture, "--iters", "3", "--layers", "2", "--json", path)
    if "needs a CUDA device" in err:
        print("skipped: no CUDA device")
        sys.exit(77)
    check(rc == 0, f"exit code {rc}: {err.strip()}")
    if rc != 0:
        return
    print(out)
    with open(path) as f:
        report = json.load(f)
    meta, got = report["meta"], report["rows"]
    check(meta.get("scene") == "capture " + fixture, f"meta scene {meta.get('scene')!r}")
    check((meta.get("hq"), meta.get("hkv"), meta.get("head_dim"), meta.get("layers")) ==
          (4, 1, 128, 2), f"meta shape {meta}")
    check(meta.get("cluster_size") == 16, f"meta cluster_size {meta.get('cluster_size')}")
    check(len(got) == 1, f"{len(got)} rows, want 1 (context 640, batch 1)")
    for r in got:
        check((r["context"], r["batch"]) == (640, 1), f"row at {r['context']}, {r['batch']}")
        check(0 < r["union_pct"] <= 100 and 0 < r["head_pct"] <= r["union_pct"] + 1e-9,
              f"selection {r['head_pct']} % a head, {r['union_pct']} % a group")
        # The selection reaches about P of the mass (the fit's estimate on real scores) and
        # never more than all of it.
        check(0.5 < r["mass_mean"] <= 1.0 + 1e-4 and r["mass_min"] <= r["mass_mean"],
              f"mass {r['mass_mean']} (min {r['mass_min']})")
        check(r["tactic_us"] > 0 and r["dense_us"] > 0 and r["cluster_ms"] > 0,
              f"times {r['tactic_us']} / {r['dense_us']} us, {r['cluster_ms']} ms")


def main():
    mode, exe, fixture, work = sys.argv[1:5]
    os.makedirs(work, exist_ok=True)
    {"errors": lambda: errors(exe, fixture), "rows": lambda: rows(exe, fixture, work)}[mode]()
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
