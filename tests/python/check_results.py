#!/usr/bin/env python3
"""ctest results_report: scripts/results.py (and bench_table.py, which shares its reading)
on the hand-made JSON of tests/fixtures/results, in the formats the programs write
(docs/formats.md). Checks the report's rows, device and command lines, the plots (or the
note that gnuplot is missing), the note for an absent file, and the error for each kind of
malformed file. Python 3 standard library only; needs no GPU.

    check_results.py SCRIPTS_DIR FIXTURE_DIR WORK_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAILED: {what}")


def run(script, *args):
    res = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    return res.returncode, res.stdout, res.stderr


def tables_are_rectangular(md):
    """Every line of a Markdown table has as many cells as its header."""
    width = None
    for line in md.splitlines():
        if line.startswith("|"):
            n = len(re.findall(r"(?<!\\)\|", line))
            width = width or n
            if n != width:
                return False
        else:
            width = None
    return True


def main():
    scripts, fixtures, work = sys.argv[1:4]
    results, bench_table = (os.path.join(scripts, f) for f in ("results.py", "bench_table.py"))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # The whole fixture folder: every section, every row.
    report = os.path.join(work, "all", "results.md")
    rc, out, err = run(results, fixtures, "-o", report)
    check(rc == 0, f"results.py on the fixtures exits 0 (got {rc}: {err})")
    md = open(report, encoding="utf-8").read() if os.path.exists(report) else ""
    expected = [
        # eval.json, pooled and per layer
        # (read_reuse_mean: a value, null, and absent in the dense row, as older kvs-eval wrote)
        "| tactic | target=0.9 | 64 | 0.0210 | 0.0150 | 0.0510 | 0.978 | 0.945 | 0.370 | 1438.5 | - | 0.838 |",
        "| streaming@tactic | target=0.9 | 64 | 0.0390 | 0.0290 | 0.1030 | 0.960 | 0.905 | 0.370 | 1509.0 | 1509.0 | - |",
        "| dense | default | 64 | 0.0016 | 0.0015 | 0.0022 | 1.000 | 1.000 | 1.000 | 4080.0 | - | - |",
        "| tactic | target=0.9 | 0.975 / 0.410 | 0.981 / 0.330 |",
        # ppl.json: delta vs dense and KV read, by context
        "| 16K | tactic | default | 2 | 128 | 1.2400 | +0.44 % | 0.212 | 30.5 |",
        "| 32700 | tactic | default | 2 | 128 | 1.2090 | +0.67 % | 0.151 | 19.8 |",
        "device cuda; command `kvs-eval ppl --model models/kvs-tiny-a --methods dense tactic mac`",
        # needle.json
        "| method | knobs | 16K @ 0.1 | 16K @ 0.9 | accuracy | KV read |",
        "| saap | recent_tokens=256,probes=8 | 1/3 | 0/3 | 0.167 | 0.080 |",
        # dense vs SDPA, the shuffled run beside them, a skipped shape
        "| 8K | 1 | 18.7 | 16.1 | 1.161 | 1796 | 0.426 | 0.493 | 19.4 |",
        "| 8K | 8 | 71.7 | 66.2 | 1.083 | 3749 | 0.889 | 0.960 | - |",
        "| 128K | 1 | 130.2 | 124.5 | 1.046 | 4128 | 0.979 | 1.020 | 135.9 |",
        "- skipped context 131072 batch 8: needs 9000 MiB for 1 KV set(s), 8000 MiB free",
        "command `bench_sdpa.py --json out/sdpa_bench.json --contexts 8K,128K --batches 1,8`; "
        "mode enable_gqa, torch 2.11.0+cu130",
        # each method beside the dense time of its run, with device, command and knobs
        "### Tactic",
        "| 128K | 8 | 1037.1 | 789.9 | 1.31x | 764.8 | 27.1 | 0.91 | 1.49 | 0.879 | 0.690 |",
        # the step that re-clusters, where the run has it, and "-" where it does not
        "| 0.793 | 1.37 | 3.10 | 12.3 |",
        "| 0.795 | 10.99 | - | 98.4 |",
        # its clustering against the measured prefill attention of the same shape
        "| context | batch | cluster ms | SDPA prefill ms | cluster / prefill | SDPA TFLOPS |",
        "| 128K | 1 | 223.10 | 301.50 | 0.740 | 466.8 |",
        "- skipped prefill context 131072 batch 8: needs 20480 MiB, 16000 MiB free",
        "command `bench_sdpa.py --prefill --contexts 128K --batches 1,8 --json "
        "out/sdpa_prefill.json`; mode enable_gqa, torch 2.11.0+cu130, hq 32, hkv 8, "
        "head_dim 128, iters 5.",
        "### MAC-Attention",
        "Source: `kvs_bench_mac.json`; device NVIDIA H200; command `kvs-bench-mac --batches 1 "
        "--json out/kvs_bench_mac.json`; hq 32, hkv 8, head_dim 128, page_size 16, window 512, "
        "band 256, gap 256, tau 0.45, layers 4, iters 50.",
        "| 128K | 1 | 0.90 | 90.2 | 130.3 | 70.2 | 1.86x | 10.15 |",
        "### MagicPIG",
        "| 96K | 1 | gpu | 105.7 | 401.9 | 0.26x | 0.0251 | 2467 | 450.2 | 4800.0 | 0.80 | avx512 |",
        "- skipped context 98304 batch 8 mode gpu: magicpig: tables need 3.6 GB, 2.0 GB free",
        "### SAAP",
        "| 512K | 1 | 486.7 | 160.5 | 3.03x | 18432 | 75.5 | 75.5 | 11.8 |",
        # the generation's average: the step plus (folds - indexes) / fold_every
        "| 128K | 1 | 131.2 | 101.0 | 43.5 | 211.7 | 168.2 | 101.16 | 1.30x |",
        "### AttentionPredictor",
        # a column older programs lack ("GPU eager us") shows as "-"
        "| 32K | 1 | 43.4 | 3304.8 | 0.01x | - | 38.3 | 3033.0 | 61.2 | 2474.9 | 5120.4 | 3646.8 | 0.68x |",
    ]
    for line in expected:
        check(line in md, f"the report has the line {line!r}")
    check(tables_are_rectangular(md), "every table row has as many cells as its header")
    pngs = ["fidelity.png", "ppl.png", "dense_sdpa.png", "methods_speedup.png"]
    if shutil.which("gnuplot"):
        for png in pngs:
            path = os.path.join(work, "all", png)
            ok = os.path.exists(path) and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            check(ok, f"{png} is a PNG")
            check(f"]({png})" in md, f"the report links {png}")
    else:
        print("gnuplot not installed: checking the note instead of the plots")
        check("gnuplot program 'gnuplot' not found" in md, "the report says gnuplot is missing")

    # No gnuplot: the report is still written, with a note and no plots.
    report = os.path.join(work, "nognuplot", "results.md")
    rc, out, err = run(results, fixtures, "-o", report, "--gnuplot", "kvs-no-such-gnuplot")
    md = open(report, encoding="utf-8").read() if os.path.exists(report) else ""
    check(rc == 0 and "gnuplot program 'kvs-no-such-gnuplot' not found" in md and "png" not in md,
          f"without gnuplot: exit 0, a note, no plots (got {rc}: {err})")
    check(not any(f.endswith(".png") for f in os.listdir(os.path.dirname(report))),
          "without gnuplot no PNG is written")

    # Any subset: absent files are notes, their sections are left out.
    subset = os.path.join(work, "subset")
    os.makedirs(subset)
    for f in ("ppl.json", "kvs_bench_saap.json"):
        shutil.copy(os.path.join(fixtures, f), subset)
    rc, out, err = run(results, subset, "--no-plots")
    md = open(os.path.join(subset, "results.md"), encoding="utf-8").read() if rc == 0 else ""
    check(rc == 0, f"a subset of the files is fine (got {rc}: {err})")
    check("- eval.json: absent, skipped" in md and "- kvs_bench_mac.json: absent, skipped" in md,
          "absent files are noted")
    check("### SAAP" in md and "## Perplexity" in md and "## Dense decode" not in md
          and "### MAC" not in md, "only the sections of the files present")

    # Malformed files: exit 1, no report, a message naming the file and what is wrong.
    def mutated(name, change):
        data = json.load(open(os.path.join(fixtures, name), encoding="utf-8"))
        change(data)
        return json.dumps(data)

    cases = [
        ("needle.json", open(os.path.join(fixtures, "needle.json")).read()[:150],
         "needle.json: not valid JSON"),
        ("ppl.json", mutated("ppl.json", lambda d: d["rows"][1].pop("delta_vs_dense")),
         "ppl.json: rows[1] has no 'delta_vs_dense'"),
        ("kvs_bench.json", mutated("kvs_bench.json", lambda d: d["rows"][0].update(us="fast")),
         'kvs_bench.json: rows[0].us is "fast", expected a number or null'),
        ("kvs_bench_mac.json", mutated("kvs_bench_saap.json", lambda d: None),
         "kvs_bench_mac.json: meta.impl is 'kvs_saap', expected 'kvs_mac'"),
        ("sdpa_bench.json", mutated("sdpa_bench.json", lambda d: d.pop("meta")),
         "sdpa_bench.json: no 'meta' object"),
        ("kvs_bench_tactic.json", mutated("kvs_bench_tactic.json",
                                          lambda d: d["meta"].pop("command")),
         "kvs_bench_tactic.json: meta.command is missing"),
        ("eval.json", '{"rows": 3}', "eval.json: no 'meta' object"),
        ("sdpa_prefill.json", mutated("sdpa_bench.json", lambda d: None),
         "sdpa_prefill.json: meta.impl is 'torch_sdpa', expected 'torch_sdpa_prefill'"),
        ("needle.json", "[]", "needle.json: the top level is list, expected an object"),
    ]
    for i, (name, text, message) in enumerate(cases):
        folder = os.path.join(work, f"bad{i}")
        os.makedirs(folder)
        shutil.copy(os.path.join(fixtures, "kvs_bench_saap.json"), folder)
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
        rc, out, err = run(results, folder)
        check(rc == 1 and message in err, f"malformed {name}: exit 1 and {message!r} (got {rc}: {err})")
        check(not os.path.exists(os.path.join(folder, "results.md")),
              f"malformed {name}: no report written")
    # The SAAP fold rows must be the step that folds and the index step before it, timed as
    # such, with the step table's fold_every.
    saap_cycle_cases = [
        (lambda d: d["meta"].update(generated=1000),
         "kvs_bench_saap_fold.json: generated 1000 and kvs_bench_saap_index.json's 991 are not "
         "a step that folds"),
        (lambda d: d["meta"].update(timed_step="mix"),
         "kvs_bench_saap_fold.json: needs --timed-step index --restore-index"),
        (lambda d: d["meta"].update(fold_every=2048),
         "kvs_bench_saap_fold.json: meta.fold_every 2048 differs from kvs_bench_saap.json's 1024"),
    ]
    for i, (change, message) in enumerate(saap_cycle_cases):
        folder = os.path.join(work, f"bad_cycle{i}")
        os.makedirs(folder)
        for f in ("kvs_bench_saap.json", "kvs_bench_saap_index.json"):
            shutil.copy(os.path.join(fixtures, f), folder)
        with open(os.path.join(folder, "kvs_bench_saap_fold.json"), "w", encoding="utf-8") as f:
            f.write(mutated("kvs_bench_saap_fold.json", change))
        rc, out, err = run(results, folder)
        check(rc == 1 and message in err,
              f"SAAP fold rows: exit 1 and {message!r} (got {rc}: {err})")
        check(not os.path.exists(os.path.join(folder, "results.md")),
              f"SAAP fold rows, case {i}: no report written")
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    rc, out, err = run(results, empty)
    check(rc == 1 and "none of the result files is there" in err, f"an empty folder fails ({err})")

    # bench_table.py reads through results.py.
    rc, out, err = run(bench_table, *(os.path.join(fixtures, f) for f in
                                      ("kvs_bench.json", "sdpa_bench.json", "kvs_bench_shuffled.json")))
    check(rc == 0 and "    128K     1     130.2     124.5     1.046" in out,
          f"bench_table.py joins the fixtures (got {rc}: {out}{err})")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
