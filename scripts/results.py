#!/usr/bin/env python3
"""Writes kvsparse's results as Markdown from a folder of the programs' JSON output.

    scripts/results.py DIR [-o REPORT.md] [--plots FOLDER] [--gnuplot PROGRAM | --no-plots]

DIR holds any subset of the files below (their formats: docs/formats.md). A file that is
absent is skipped with a note; one that is malformed is an error naming the file and what
is wrong (exit status 1, no report written). The report (default DIR/results.md) has the
fidelity tables, perplexity deltas against dense with the KV read fraction, pass key
accuracy, dense decode against torch SDPA, and one speed table per method beside the dense
kernel's time of the same run, each with the device, shapes and command its JSON records.
Plots are PNG files drawn by gnuplot into --plots (default: the report's folder); without
gnuplot they are skipped with a note. Python 3 standard library only.

  eval.json                 kvs-eval --json                        fidelity vs fp64 dense
  ppl.json                  kvs-eval ppl --json                    bits per byte vs dense
  needle.json               kvs-eval needle --json                 pass key retrieval
  kvs_bench.json            kvs-bench --json                       dense decode speed
  kvs_bench_shuffled.json   kvs-bench --page-order shuffled --json (random page table)
  sdpa_bench.json           scripts/bench_sdpa.py --json           torch SDPA, timed the same way
  sdpa_prefill.json         scripts/bench_sdpa.py --prefill --json torch SDPA causal prefill,
                            Tactic's clustering time's dense reference
  kvs_bench_tactic.json     kvs-bench --method tactic --json       each method against the
  kvs_bench_tactic_capture.json  the same with --capture (a 16K capture of kvs-tiny-a)
  kvs_bench_mac.json        kvs-bench-mac --json                   dense kernel in the same run
  kvs_bench_magicpig.json   kvs-bench-magicpig --json
  kvs_bench_saap.json       kvs-bench-saap --json
  kvs_bench_saap_index.json kvs-bench-saap --restore-index --timed-step index, the step
  kvs_bench_saap_fold.json  that only indexes and the one that folds (--generated k F - 1
                            - index_every and k F - 1): with kvs_bench_saap.json, SAAP's
                            average step over a generation, the fold's share included
  kvs_bench_attnpred.json   kvs-bench-attnpred --json
  kvs_bench_attnpred_*.json kvs-bench-attnpred --json with --predict-interval 4 (_p4),
                            --group-history (_grouped) or both (_grouped_p4), and
                            --calibration-keys e4m3 or int4 (_grouped_p4_e4m3,
                            _grouped_p4_int4)
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

class InputError(Exception):
    """A result file that cannot be used; the message names the file."""


# A column: (JSON key, header, format). The format also fixes the JSON type: "str" a
# string; "int", "ctx" (a context length) and "g" a number; the others a number or null
# (what the writers put for NaN).
FIDELITY_COLUMNS = [
    ("method", "method", "str"), ("knob", "knob", "str"), ("steps", "steps", "int"),
    ("rel_l2_mean", "rel L2", "f4"), ("rel_l2_p50", "p50", "f4"), ("rel_l2_p90", "p90", "f4"),
    ("mass_recall_mean", "mass recall", "f3"), ("mass_recall_p10", "p10", "f3"),
    ("kv_read_fraction_mean", "KV read", "f3"), ("tokens_selected_mean", "tokens/head", "f1"),
    ("budget_tokens_mean", "budget", "f1"), ("read_reuse_mean", "reuse", "f3"),
]
# Columns that rows of older programs may lack: shown as "-" there.
OPTIONAL_KEYS = {"read_reuse_mean", "ap_gpu_eager_us", "recluster_ms"}
PPL_COLUMNS = [
    ("context", "context", "ctx"), ("method", "method", "str"), ("knobs", "knobs", "str"),
    ("windows", "windows", "int"), ("tokens", "tokens", "int"),
    ("bits_per_token", "bits/byte", "f4"), ("delta_vs_dense", "vs dense", "pct2"),
    ("kv_read_fraction", "KV read", "f3"), ("tokens_per_second", "tokens/s", "f1"),
]
NEEDLE_COLUMNS = [
    ("method", "method", "str"), ("knobs", "knobs", "str"), ("context", "context", "ctx"),
    ("depth", "depth", "g"), ("trials", "trials", "int"), ("correct", "correct", "int"),
    ("accuracy", "accuracy", "f3"), ("kv_read_fraction", "KV read", "f3"),
]
PREFILL_COLUMNS = [
    ("context", "context", "ctx"), ("batch", "batch", "int"), ("ms", "ms", "f2"),
    ("tflops", "TFLOPS", "f1"),
]
DENSE_COLUMNS = [
    ("context", "context", "ctx"), ("batch", "batch", "int"), ("us", "us", "f1"),
    ("gbps", "GB/s", "f0"), ("frac_copy", "frac copy", "f3"), ("sets", "sets", "int"),
    ("calls", "calls", "int"),
]

# The method benchmarks: file, meta.impl, title, columns, the speedup over dense to plot.
ATTNPRED_COLUMNS = [
    ("context", "context", "ctx"), ("batch", "batch", "int"),
    ("dense_us", "dense us", "f1"), ("ap_gpu_us", "GPU us", "f1"),
    ("speedup_gpu", "speedup", "x2"), ("ap_gpu_eager_us", "GPU eager us", "f1"),
    ("sparse_attn_us", "sparse attn us", "f1"),
    ("predictor_us", "predictor us", "f1"), ("full_row_us", "full row us", "f1"),
    ("offload_copy_us", "offload copy us", "f1"),
    ("offload_zero_copy_us", "zero-copy us", "f1"),
    ("ap_offload_us", "offload us", "f1"), ("speedup_offload", "vs copy", "x2"),
    ("late_fraction", "late", "f3"), ("blocks_per_step", "blocks/step", "f1"),
]

TACTIC_COLUMNS = [
    ("context", "context", "ctx"), ("batch", "batch", "int"),
    ("dense_us", "dense us", "f1"), ("tactic_us", "tactic us", "f1"),
    ("speedup", "speedup", "x2"), ("select_us", "select us", "f1"),
    ("attn_us", "attn us", "f1"), ("head_pct", "head %", "f2"),
    ("union_pct", "union %", "f2"), ("mass_mean", "mass", "f3"),
    ("mass_min", "mass min", "f3"), ("cluster_ms", "cluster ms", "f2"),
    ("prefill_est_ms", "prefill est ms", "f2"), ("cluster_ratio", "cluster/prefill", "f3"),
    ("kmeans_tflop", "k-means TFLOP", "f2"), ("recluster_ms", "re-cluster ms", "f2"),
    ("selection_mb", "selection MB", "f1"),
]

METHODS = [
    ("kvs_bench_tactic.json", "kvs_tactic", "Tactic", TACTIC_COLUMNS, "speedup"),
    ("kvs_bench_tactic_capture.json", "kvs_tactic",
     "Tactic on captured keys, values and queries (kvs-bench --capture)", TACTIC_COLUMNS,
     "speedup"),
    ("kvs_bench_mac.json", "kvs_mac", "MAC-Attention", [
        ("context", "context", "ctx"), ("batch", "batch", "int"),
        ("hit_rate", "hit rate", "f2"), ("head_hit_pct", "head hits %", "f1"),
        ("dense_us", "dense us", "f1"), ("mac_us", "mac us", "f1"),
        ("speedup", "speedup", "x2"), ("rows_read_pct", "rows read %", "f2"),
    ], "speedup"),
    ("kvs_bench_magicpig.json", "kvs_magicpig", "MagicPIG", [
        ("context", "context", "ctx"), ("batch", "batch", "int"), ("mode", "mode", "str"),
        ("dense_us", "dense us", "f1"), ("magicpig_us", "magicpig us", "f1"),
        ("speedup", "speedup", "x2"), ("retrieval_rate", "retrieval", "f4"),
        ("candidates_per_head", "candidates/head", "f0"), ("tables_mib", "tables MiB", "f1"),
        ("table_bytes_per_token", "B/token", "f1"), ("prefill_s", "prefill s", "f2"),
        ("isa", "isa", "str"),
    ], "speedup"),
    ("kvs_bench_saap.json", "kvs_saap", "SAAP", [
        ("context", "context", "ctx"), ("batch", "batch", "int"),
        ("dense_us", "dense us", "f1"), ("saap_us", "saap us", "f1"),
        ("speedup", "speedup", "x2"), ("tokens_per_kv_head", "tokens/kv head", "f0"),
        ("kv_mb", "KV MB", "f1"), ("router_mb", "router MB", "f1"),
        ("prefill_ms", "prefill ms", "f1"),
    ], "speedup"),
    ("kvs_bench_attnpred.json", "kvs_attnpred", "AttentionPredictor", ATTNPRED_COLUMNS,
     "speedup_gpu"),
    ("kvs_bench_attnpred_p4.json", "kvs_attnpred",
     "AttentionPredictor, a prediction every 4 steps", ATTNPRED_COLUMNS, "speedup_gpu"),
    ("kvs_bench_attnpred_grouped.json", "kvs_attnpred",
     "AttentionPredictor, a history per kv head", ATTNPRED_COLUMNS, "speedup_gpu"),
    ("kvs_bench_attnpred_grouped_p4.json", "kvs_attnpred",
     "AttentionPredictor, a history per kv head, a prediction every 4 steps", ATTNPRED_COLUMNS,
     "speedup_gpu"),
    ("kvs_bench_attnpred_grouped_p4_e4m3.json", "kvs_attnpred",
     "AttentionPredictor, a history per kv head, a prediction every 4 steps, calibration rows "
     "from e4m3 keys", ATTNPRED_COLUMNS, "speedup_gpu"),
    ("kvs_bench_attnpred_grouped_p4_int4.json", "kvs_attnpred",
     "AttentionPredictor, a history per kv head, a prediction every 4 steps, calibration rows "
     "from int4 keys", ATTNPRED_COLUMNS, "speedup_gpu"),
]

# The SAAP steps that only index and that fold, for the generation's average (saap_cycle).
SAAP_CYCLE_INPUTS = ["kvs_bench_saap_index.json", "kvs_bench_saap_fold.json"]

INPUTS = ["eval.json", "ppl.json", "needle.json", "kvs_bench.json", "kvs_bench_shuffled.json",
          "sdpa_bench.json", "sdpa_prefill.json"] + [m[0] for m in METHODS] + SAAP_CYCLE_INPUTS


# ---------------------------------------------------------------------------- reading

def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_rows(name, rows, columns):
    if not isinstance(rows, list):
        raise InputError(f"{name}: 'rows' is {type(rows).__name__}, expected a list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{name}: rows[{i}] is {type(row).__name__}, expected an object")
        for key, _, fmt in columns:
            if key not in row:
                if key in OPTIONAL_KEYS:
                    continue
                raise InputError(f"{name}: rows[{i}] has no '{key}'")
            v = row[key]
            if fmt == "str":
                ok, want = isinstance(v, str), "a string"
            elif fmt in ("int", "ctx", "g"):
                ok, want = is_number(v), "a number"
            else:
                ok, want = v is None or is_number(v), "a number or null"
            if not ok:
                raise InputError(f"{name}: rows[{i}].{key} is {json.dumps(v)}, expected {want}")
    return rows


def check_meta(name, data, required, impl=None):
    meta = data.get("meta")
    if not isinstance(meta, dict):
        raise InputError(f"{name}: no 'meta' object (the JSON of an older program? rerun it)")
    for key in required:
        if not isinstance(meta.get(key), str):
            raise InputError(f"{name}: meta.{key} is missing or not a string")
    if impl is not None and meta["impl"] != impl:
        raise InputError(f"{name}: meta.impl is '{meta['impl']}', expected '{impl}' "
                         f"(is this file misnamed?)")
    return meta


def read_json(path):
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{name}: not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{name}: cannot read: {e}") from None


def load_object(path, columns, meta_keys, impl=None):
    """{"meta": {...}, "rows": [...], "skipped"?: [...]}, checked; returns the dict."""
    name = os.path.basename(path)
    data = read_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{name}: the top level is {type(data).__name__}, expected an object "
                         f"with 'meta' and 'rows'")
    check_meta(name, data, meta_keys, impl)
    if "rows" not in data:
        raise InputError(f"{name}: no 'rows'")
    check_rows(name, data["rows"], columns)
    skipped = data.setdefault("skipped", [])
    if not isinstance(skipped, list) or not all(isinstance(s, str) for s in skipped):
        raise InputError(f"{name}: 'skipped' is not a list of strings")
    return data


def load_bench(path, impl):
    """A kvs-bench* or bench_sdpa.py file: its meta.impl must be `impl`."""
    columns = DENSE_COLUMNS if impl in ("kvs_dense", "torch_sdpa") else \
        next(m[3] for m in METHODS if m[1] == impl)
    return load_object(path, columns, ("impl", "device", "command"), impl)


def load_eval(path):
    """kvs-eval's fidelity rows: a list (as kvs-eval writes it) or {"meta", "rows"}."""
    name = os.path.basename(path)
    data = read_json(path)
    columns = FIDELITY_COLUMNS + [("layer", "layer", "int")]
    if isinstance(data, list):
        return {"meta": {}, "rows": check_rows(name, data, columns), "skipped": []}
    if isinstance(data, dict):
        return load_object(path, columns, ())
    raise InputError(f"{name}: the top level is {type(data).__name__}, expected a list of rows")


LOADERS = {
    "eval.json": load_eval,
    "ppl.json": lambda p: load_object(p, PPL_COLUMNS, ("command", "device")),
    "needle.json": lambda p: load_object(p, NEEDLE_COLUMNS, ("command", "device")),
    "kvs_bench.json": lambda p: load_bench(p, "kvs_dense"),
    "kvs_bench_shuffled.json": lambda p: load_bench(p, "kvs_dense"),
    "sdpa_bench.json": lambda p: load_bench(p, "torch_sdpa"),
    "sdpa_prefill.json": lambda p: load_object(p, PREFILL_COLUMNS, ("impl", "device", "command"),
                                               "torch_sdpa_prefill"),
}
for _file, _impl, *_ in METHODS:
    LOADERS[_file] = lambda p, impl=_impl: load_bench(p, impl)
for _file in SAAP_CYCLE_INPUTS:
    LOADERS[_file] = lambda p: load_bench(p, "kvs_saap")


def load_folder(folder):
    """Returns ({file: data}, notes); raises InputError listing every bad file."""
    found, notes, errors = {}, [], []
    for name in INPUTS:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            notes.append(f"{name}: absent, skipped")
            continue
        try:
            found[name] = LOADERS[name](path)
        except InputError as e:
            errors.append(str(e))
    others = sorted(f for f in os.listdir(folder) if f.endswith(".json") and f not in INPUTS)
    if others:
        notes.append("not read (unknown names): " + ", ".join(others))
    if errors:
        raise InputError("\n".join(errors))
    if not found:
        raise InputError(f"{folder}: none of the result files is there ({', '.join(INPUTS)})")
    return found, notes


# ---------------------------------------------------------------------------- formatting

def context_text(n):
    n = int(n)
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def cell(v, fmt):
    if fmt == "str":
        return v.replace("|", "\\|") if v else ""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if fmt == "ctx":
        return context_text(v)
    if fmt == "int":
        return str(int(v))
    if fmt == "pct2":
        return f"{100 * v:+.2f} %"
    if fmt == "x2":
        return f"{v:.2f}x"
    if fmt == "g":
        return f"{v:g}"
    return f"{v:.{int(fmt[1:])}f}"


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def column_table(rows, columns):
    return md_table([h for _, h, _ in columns],
                    [[cell(r.get(k), f) for k, _, f in columns] for r in rows])


def source_line(name, meta, shown=("device", "command")):
    """What made the file: device, command and the rest of meta (shapes and knobs)."""
    parts = [f"`{name}`"]
    if meta.get("device"):
        parts.append(f"device {meta['device']}")
    if meta.get("command"):
        parts.append(f"command `{meta['command']}`")
    rest = [f"{k} {v:g}" if is_number(v) else f"{k} {v}"
            for k, v in meta.items() if k not in shown and k != "impl"]
    if rest:
        parts.append(", ".join(rest))
    return "Source: " + "; ".join(parts) + "."


def skipped_lines(data):
    return [f"- {s}" for s in data.get("skipped", [])]


# ---------------------------------------------------------------------------- joins

def dense_vs_sdpa(ours, sdpa, shuffled=None):
    """Dense rows joined on (context, batch): ours, SDPA's and our shuffled-page time (each
    None where that run has no such row), in the order ours then SDPA list them."""
    index = {}
    for src, data in (("ours", ours), ("sdpa", sdpa), ("shuffled", shuffled)):
        for r in (data or {}).get("rows", []):
            index.setdefault((r["context"], r["batch"]), {})[src] = r
    return [dict(context=k[0], batch=k[1], **v) for k, v in index.items()]


# ---------------------------------------------------------------------------- sections

def fidelity_section(name, data, plots):
    rows = data["rows"]
    pooled = [r for r in rows if r["layer"] == -1]
    per_layer = [r for r in rows if r["layer"] != -1]
    out = ["## Fidelity against fp64 dense attention (kvs-eval)", ""]
    if data["meta"]:
        out.append(source_line(name, data["meta"]))
    else:
        out.append(f"Source: `{name}` (a list-form file from before kvs-eval wrote its meta: no device or command).")
    out += ["", "All layers pooled. rel L2: relative L2 error of the attention output (mean, "
            "p50, p90); mass recall: attention mass of the keys read (mean, p10); KV read: "
            "fraction of KV rows read; `x@method`: baseline x at that method's own KV read.", ""]
    out.append(column_table(pooled, FIDELITY_COLUMNS) if pooled else "(no pooled rows)")
    if per_layer:
        layers = sorted({r["layer"] for r in per_layer})
        cells = {}
        for r in per_layer:
            cells.setdefault((r["method"], r["knob"]), {})[r["layer"]] = r
        out += ["", "Per layer: mass recall / KV read.", ""]
        out.append(md_table(
            ["method", "knob"] + [f"layer {l}" for l in layers],
            [[cell(m, "str"), cell(k, "str")] +
             [f"{cell(c[l]['mass_recall_mean'], 'f3')} / {cell(c[l]['kv_read_fraction_mean'], 'f3')}"
              if l in c else "-" for l in layers] for (m, k), c in cells.items()]))
    if pooled:
        plots.append(("fidelity.png", "mass recall and output error against KV read",
                      lambda png, tmp: plot_fidelity(pooled, png, tmp)))
    return out


def ppl_section(name, data, plots):
    rows = sorted(data["rows"], key=lambda r: r["context"])  # stable: the methods keep order
    out = ["## Perplexity with each method in the decode loop (kvs-eval ppl)", "",
           source_line(name, data["meta"]), "",
           "bits/byte: bits per token of the teacher-forced decode steps (bits per byte for a "
           "byte-level model); vs dense: relative to dense at the same context; KV read: rows "
           "read over a dense read, all layers.", "", column_table(rows, PPL_COLUMNS)]
    if rows:
        plots.append(("ppl.png", "bits per byte against dense, by KV read",
                      lambda png, tmp: plot_ppl(rows, png, tmp)))
    return out


def needle_section(name, data, plots):
    rows = data["rows"]
    cols = []
    for r in rows:
        if (r["context"], r["depth"]) not in cols:
            cols.append((r["context"], r["depth"]))
    table = {}
    for r in rows:
        table.setdefault((r["method"], r["knobs"]), {})[(r["context"], r["depth"])] = r
    body = []
    for (m, k), c in table.items():
        trials = sum(r["trials"] for r in c.values())
        correct = sum(r["correct"] for r in c.values())
        reads = [r["kv_read_fraction"] for r in c.values() if r["kv_read_fraction"] is not None]
        body.append([cell(m, "str"), cell(k, "str")] +
                    [f"{int(c[x]['correct'])}/{int(c[x]['trials'])}" if x in c else "-"
                     for x in cols] +
                    [cell(correct / trials if trials else None, "f3"),
                     cell(sum(reads) / len(reads) if reads else None, "f3")])
    return ["## Pass key retrieval (kvs-eval needle)", "", source_line(name, data["meta"]), "",
            "Correct / trials per context @ depth of the needle in the haystack.", "",
            md_table(["method", "knobs"] + [f"{context_text(c)} @ {d:g}" for c, d in cols] +
                     ["accuracy", "KV read"], body)]


def dense_section(found, plots):
    ours, sdpa = found.get("kvs_bench.json"), found.get("sdpa_bench.json")
    shuffled = found.get("kvs_bench_shuffled.json")
    out = ["## Dense decode against torch SDPA (kvs-bench, scripts/bench_sdpa.py)", ""]
    for name in ("kvs_bench.json", "sdpa_bench.json", "kvs_bench_shuffled.json"):
        if name in found:
            out += [source_line(name, found[name]["meta"]), ""]
    out += ["Microseconds per call (CUDA-graph replays over KV sets larger than the L2, "
            "median); frac copy: effective bandwidth over the device-to-device copy bandwidth "
            "of the same run; ours / SDPA < 1: ours is faster.", ""]
    joined = dense_vs_sdpa(ours, sdpa, shuffled)

    def us(r, src, key="us", fmt="f1"):
        return cell(r[src][key], fmt) if src in r else "-"
    headers = ["context", "batch", "ours us", "SDPA us", "ours / SDPA", "ours GB/s",
               "ours frac copy", "SDPA frac copy"] + (["shuffled us"] if shuffled else [])
    body = []
    for r in joined:
        ratio = (r["ours"]["us"] / r["sdpa"]["us"] if "ours" in r and "sdpa" in r
                 and r["ours"]["us"] is not None and r["sdpa"]["us"] else None)
        body.append([cell(r["context"], "ctx"), cell(r["batch"], "int"), us(r, "ours"),
                     us(r, "sdpa"), cell(ratio, "f3"), us(r, "ours", "gbps", "f0"),
                     us(r, "ours", "frac_copy", "f3"), us(r, "sdpa", "frac_copy", "f3")] +
                    ([us(r, "shuffled")] if shuffled else []))
    out.append(md_table(headers, body))
    notes = sum((skipped_lines(d) for d in (ours, sdpa, shuffled) if d), [])
    if notes:
        out += ["", "Skipped:", ""] + notes
    if joined:
        plots.append(("dense_sdpa.png", "dense decode and torch SDPA, time per call",
                      lambda png, tmp: plot_dense(joined, png, tmp)))
    return out


def clustering_vs_prefill(tactic, prefill):
    """Tactic's prefill clustering of one layer against torch SDPA's causal prefill attention
    over the same context and batch (measured, where sdpa_prefill.json is there)."""
    if not prefill:
        return []
    by_shape = {(r["context"], r["batch"]): r for r in prefill["rows"]}
    body = []
    for r in tactic["rows"]:
        p = by_shape.get((r["context"], r["batch"]))
        if p is None:
            continue
        ratio = r["cluster_ms"] / p["ms"] if r["cluster_ms"] is not None and p["ms"] else None
        body.append([cell(r["context"], "ctx"), cell(r["batch"], "int"),
                     cell(r["cluster_ms"], "f2"), cell(p["ms"], "f2"), cell(ratio, "f3"),
                     cell(p["tflops"], "f1")])
    out = ["", "Clustering at prefill against dense prefill attention, measured: one layer's "
           "k-means (cluster ms above) against torch SDPA's causal attention over the same "
           "context and batch (Hq, Hkv and d as above).", "",
           source_line("sdpa_prefill.json", prefill["meta"]), ""]
    if body:
        out.append(md_table(["context", "batch", "cluster ms", "SDPA prefill ms",
                             "cluster / prefill", "SDPA TFLOPS"], body))
    else:
        out.append("No shape of the Tactic rows was timed by the prefill run.")
    if prefill["skipped"]:
        out += ["", "Skipped:", ""] + skipped_lines(prefill)
    return out


def saap_cycle(step, index, fold):
    """SAAP's average step over a generation: the step of kvs_bench_saap.json (which, with
    fold_every at most the attention's scan round, costs the same at every point of the fold
    cycle) plus the fold's cost, the step that folds less the step that only indexes, spread
    over the fold_every steps between a layer's folds."""
    if not index or not fold:
        return []
    names = SAAP_CYCLE_INPUTS
    for name, data in zip(names, (index, fold)):
        meta = data["meta"]
        # restore_index: kvs-bench-saap writes its switches as 0 / 1
        if meta.get("timed_step") != "index" or meta.get("restore_index") not in (True, 1):
            raise InputError(f"{name}: needs --timed-step index --restore-index (meta has "
                             f"timed_step {meta.get('timed_step')!r}, restore_index "
                             f"{meta.get('restore_index')!r})")
        for key in ("fold_every", "index_every"):
            if meta.get(key) != step["meta"].get(key):
                raise InputError(f"{name}: meta.{key} {meta.get(key)!r} differs from "
                                 f"kvs_bench_saap.json's {step['meta'].get(key)!r}")
    every, ie = step["meta"].get("fold_every"), step["meta"].get("index_every")
    g_index, g_fold = index["meta"].get("generated"), fold["meta"].get("generated")
    if not is_number(every) or every <= 0 or not is_number(ie):
        raise InputError(f"{names[1]}: fold_every {every!r}: no fold to spread")
    if not is_number(g_fold) or (g_fold + 1) % every != 0 or g_index != g_fold - ie:
        raise InputError(f"{names[1]}: generated {g_fold!r} and {names[0]}'s {g_index!r} are "
                         f"not a step that folds and the index step before it (k * {every} - 1 "
                         f"and {ie} less)")
    def by_shape(data):
        return {(r["context"], r["batch"]): r for r in data["rows"]}
    steps, indexes = by_shape(step), by_shape(index)
    body = []
    for f in fold["rows"]:
        i, s = indexes.get((f["context"], f["batch"])), steps.get((f["context"], f["batch"]))
        if i is None or s is None or None in (f["saap_us"], i["saap_us"], s["saap_us"]):
            continue
        cost = f["saap_us"] - i["saap_us"]
        mean = s["saap_us"] + cost / every
        body.append([cell(f["context"], "ctx"), cell(f["batch"], "int"), cell(s["dense_us"], "f1"),
                     cell(s["saap_us"], "f1"), cell(i["saap_us"], "f1"), cell(f["saap_us"], "f1"),
                     cell(cost, "f1"), cell(mean, "f2"), cell(s["dense_us"] / mean, "x2")])
    out = ["", f"SAAP over a generation: a layer folds once in {every:g} steps (the step that "
           "folds less the step that only indexes, every layer indexing on the timed step), "
           "and the average step is the step above plus that fold's share. Dense is the step "
           "table's.", "", source_line(names[0], index["meta"]), "",
           source_line(names[1], fold["meta"]), ""]
    if body:
        out.append(md_table(["context", "batch", "dense us", "step us", "indexes us",
                             "folds us", "fold us", "average us", "speedup"], body))
    else:
        out.append("No shape of the fold rows was timed by the step table.")
    return out


def methods_section(found, plots):
    out = ["## Each method against the dense kernel, same run (kvs-bench-*)", "",
           "Per layer and decode step, microseconds; speedup = dense / method (the dense "
           "kernel timed in the same process over the same KV)."]
    bars = []
    for name, _, title, columns, speedup in METHODS:
        if name not in found:
            continue
        data = found[name]
        out += ["", f"### {title}", "", source_line(name, data["meta"]), "",
                column_table(data["rows"], columns)]
        if data["skipped"]:
            out += ["", "Skipped:", ""] + skipped_lines(data)
        if name == "kvs_bench_tactic.json":
            out += clustering_vs_prefill(data, found.get("sdpa_prefill.json"))
        if name == "kvs_bench_saap.json":
            out += saap_cycle(data, *(found.get(n) for n in SAAP_CYCLE_INPUTS))
        for r in data["rows"]:
            label = f"{title} {context_text(r['context'])} b{int(r['batch'])}"
            if "mode" in r:
                label += f" {r['mode']}"
            if "hit_rate" in r:
                label += f" hits {cell(r['hit_rate'], 'f2')}"
            bars.append((label, r[speedup]))
    if bars:
        plots.append(("methods_speedup.png", "speedup of each method over dense, same run",
                      lambda png, tmp: plot_speedups(bars, png, tmp)))
    return out


# ---------------------------------------------------------------------------- plots

def gp_quote(s):
    return "'" + str(s).replace("'", "''").replace("\n", " ") + "'"


def gp_number(v):
    return "?" if v is None or not math.isfinite(v) else f"{v:.9g}"


def gp_label(s):  # a string column of a data file
    return '"' + str(s).replace('"', "'") + '"'


def series_plot(png, tmp, blocks, using, style, setup):
    """blocks: [(title, [(x, y), ...])]; one data block per series."""
    dat = os.path.join(tmp, os.path.basename(png) + ".dat")
    with open(dat, "w") as f:
        for i, (_, pts) in enumerate(blocks):
            f.write(("\n\n" if i else "") + "\n".join(
                " ".join(gp_number(v) for v in p) for p in pts) + "\n")
    plot = ", \\\n     ".join(
        f"{gp_quote(dat)} index {i} using {using} with {style} title {gp_quote(t)}"
        for i, (t, _) in enumerate(blocks))
    return setup + "plot " + plot + "\n"


def grouped(rows, key, point):
    blocks = {}
    for r in rows:
        blocks.setdefault(key(r), []).append(point(r))
    return [(k, sorted(v, key=lambda p: (p[0] is None, p[0] or 0))) for k, v in blocks.items()]


def plot_fidelity(pooled, png, tmp):
    blocks = grouped(pooled, lambda r: r["method"],
                     lambda r: (r["kv_read_fraction_mean"], r["mass_recall_mean"], r["rel_l2_mean"]))
    setup = ("set multiplot layout 1,2 title 'fidelity against fp64 dense (all layers)'\n"
             "unset title\nset grid\nset xlabel 'fraction of KV rows read'\n"
             "set xrange [0:1.05]\nset key bottom right\n"
             "set ylabel 'attention mass recall (mean)'\n")
    script = series_plot(png, tmp, blocks, "1:2", "linespoints", setup)
    script += "set ylabel 'relative L2 error of the output (mean)'\nset key top right\n"
    script += series_plot(png, tmp, blocks, "1:3", "linespoints", "")
    return script + "unset multiplot\n"


def plot_ppl(rows, png, tmp):
    blocks = grouped(rows, lambda r: f"{r['method']} {context_text(r['context'])}",
                     lambda r: (r["kv_read_fraction"], 100 * r["delta_vs_dense"]
                                if r["delta_vs_dense"] is not None else None))
    return series_plot(png, tmp, blocks, "1:2", "points pointsize 2", (
        "set grid\nset xlabel 'fraction of KV rows read'\nset xrange [0:1.05]\n"
        "set ylabel 'bits per byte vs dense (%)'\nset key outside right\n"))


def plot_dense(joined, png, tmp):
    blocks = []
    for src, title in (("ours", "kvs dense"), ("sdpa", "torch SDPA"), ("shuffled", "kvs shuffled")):
        blocks += grouped([r for r in joined if src in r], lambda r: f"{title} b{int(r['batch'])}",
                          lambda r: (r["context"], r[src]["us"]))
    return series_plot(png, tmp, blocks, "1:2", "linespoints", (
        "set grid\nset logscale xy 2\nset xlabel 'context (tokens)'\n"
        "set ylabel 'microseconds per call'\nset key top left\n"))


def plot_speedups(bars, png, tmp):
    dat = os.path.join(tmp, "speedups.dat")
    with open(dat, "w") as f:
        for i, (label, v) in enumerate(bars):
            f.write(f"{i} {gp_label(label)} {gp_number(v)}\n")
    return ("set grid ytics\nset logscale y 2\nset ylabel 'dense time / method time'\n"
            f"set xrange [-1:{len(bars)}]\nset xtics rotate by 60 right font ',8'\n"
            "set bmargin 12\nset key bottom right\n"
            f"plot {gp_quote(dat)} using 1:3:xtic(2) with points pointtype 7 pointsize 1.5 "
            "notitle, 1 with lines dashtype 2 title 'dense = 1'\n")


def draw(plots, folder, gnuplot):
    """Draws each plot into folder; returns the written paths. Raises InputError-like
    RuntimeError naming the plot when gnuplot fails."""
    os.makedirs(folder, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for file, title, make in plots:
            png = os.path.join(folder, file)
            script = (f"set terminal pngcairo size 1100,560 noenhanced\n"
                      f"set output {gp_quote(png)}\nset datafile missing '?'\n"
                      f"set title {gp_quote(title)}\n" + make(png, tmp) + "set output\n")
            gp = os.path.join(tmp, file + ".gp")
            with open(gp, "w") as f:
                f.write(script)
            res = subprocess.run([gnuplot, gp], capture_output=True, text=True)
            if res.returncode != 0 or not os.path.isfile(png) or os.path.getsize(png) == 0:
                raise RuntimeError(f"{png}: {gnuplot} exited with status {res.returncode}:\n"
                                   f"{res.stderr.strip()}")
            written.append(png)
    return written


# ---------------------------------------------------------------------------- main

def build_report(found):
    """[(section lines, [(png file, title, make)])] for the inputs found."""
    sections = []

    def add(make_section, *args):
        plots = []
        sections.append((make_section(*args, plots), plots))
    for name, make_section in (("eval.json", fidelity_section), ("ppl.json", ppl_section),
                               ("needle.json", needle_section)):
        if name in found:
            add(make_section, name, found[name])
    if {"kvs_bench.json", "sdpa_bench.json", "kvs_bench_shuffled.json"} & found.keys():
        add(dense_section, found)
    if any(m[0] in found for m in METHODS):
        add(methods_section, found)
    return sections


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="folder of result JSON")
    p.add_argument("-o", "--output", help="report path (default FOLDER/results.md)")
    p.add_argument("--plots", help="folder for the PNG plots (default: the report's folder)")
    p.add_argument("--gnuplot", default="gnuplot", help="gnuplot program (default gnuplot)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    args = p.parse_args()
    prog = "results.py"
    if not os.path.isdir(args.folder):
        sys.exit(f"{prog}: error: {args.folder}: no such folder")
    try:
        found, notes = load_folder(args.folder)
    except InputError as e:
        sys.exit("\n".join(f"{prog}: error: {line}" for line in str(e).splitlines()))
    output = args.output or os.path.join(args.folder, "results.md")
    report_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(report_dir, exist_ok=True)
    try:
        sections = build_report(found)  # also checks what joins files (saap_cycle)
    except InputError as e:
        sys.exit("\n".join(f"{prog}: error: {line}" for line in str(e).splitlines()))

    plots = sum((p for _, p in sections), [])
    drawn = 0
    if plots and args.no_plots:
        notes.append("plots: not drawn (--no-plots)")
    elif plots and shutil.which(args.gnuplot) is None:
        notes.append(f"plots: skipped, gnuplot program '{args.gnuplot}' not found "
                     "(install gnuplot, e.g. Debian's gnuplot-nox)")
        print(f"{prog}: {notes[-1]}", file=sys.stderr)
    elif plots:
        for lines, section_plots in sections:
            try:
                pngs = draw(section_plots, args.plots or report_dir, args.gnuplot)
            except (RuntimeError, OSError) as e:
                sys.exit(f"{prog}: error: plot {e}")
            for png, (_, title, _) in zip(pngs, section_plots):
                lines += ["", f"![{title}]({os.path.relpath(png, report_dir)})"]
            drawn += len(pngs)

    head = ["# kvsparse results", "",
            f"Generated by `scripts/results.py` from the JSON in `{args.folder}` "
            "(docs/gpu.md says how); regenerate it rather than edit it.", "",
            "Inputs: " + ", ".join(f"`{n}`" for n in INPUTS if n in found) + "."]
    if notes:
        head += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    text = "\n\n".join("\n".join(s).rstrip() for s in [head] + [l for l, _ in sections]) + "\n"
    tmp = output + f".tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, output)
    print(f"{prog}: wrote {output} ({len(found)} inputs, {drawn} plots)")


if __name__ == "__main__":
    main()
