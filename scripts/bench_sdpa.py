#!/usr/bin/env python3
"""Times torch.nn.functional.scaled_dot_product_attention decode the way kvs-bench times
dense_decode_cuda, so that the two tables join on (context, batch).

Per (context, batch): q [B, Hq, 1, d], K/V [B, Hkv, L, d] bf16 (GQA through enable_gqa, or
repeat_interleave where this torch lacks it). N calls are captured in one CUDA graph, call i
reading KV set i % S, the S sets together larger than twice the L2; CUDA events around each
replay, warm-up first, median over --iters replays, time per call = median / N. GB/s counts
the KV bytes plus q and o; frac_copy divides it by a device-to-device copy bandwidth (bytes
read + written) measured in the same run. --json writes the form of every kvs-bench*
program (docs/formats.md, "Benchmark results").

--prefill times causal prefill attention instead, the dense reference for the clustering
time at prefill that kvs-bench --method tactic reports (one layer's attention over a context
of L tokens): q [B, Hq, L, d], K/V [B, Hkv, L, d] bf16, is_causal, on a fused backend (flash,
cuDNN or memory-efficient; never the math backend, which would materialise L x L scores),
CUDA events around each call, warm-up first, median over --iters calls. TFLOPS counts the
causal half of the two products: 2 * B * Hq * d * L * (L + 1).
"""
import argparse
import json
import math
import os
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F


def parse_list(text, option):
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        mult = 1
        if item[-1] in "kK":
            mult, item = 1024, item[:-1]
        elif item[-1] in "mM":
            mult, item = 1024 * 1024, item[:-1]
        if not item.isdigit() or int(item) <= 0:
            sys.exit(f"bench_sdpa.py: --{option}: '{item}' is not a positive count (e.g. 8K,32K)")
        out.append(int(item) * mult)
    if not out:
        sys.exit(f"bench_sdpa.py: --{option} is empty")
    return out


def time_events(fn, warmup, iters):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth_gbps():
    free, _ = torch.cuda.mem_get_info()
    nbytes = min(1 << 30, free // 4)
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_events(lambda: b.copy_(a), 3, 20)
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def gqa_call(mode, hq, hkv):
    group = hq // hkv
    if mode == "enable_gqa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def pick_mode(hq, hkv, d):
    q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, 64, d, device="cuda", dtype=torch.bfloat16)
    try:
        gqa_call("enable_gqa", hq, hkv)(q, k, k)
        return "enable_gqa"
    except (TypeError, RuntimeError):
        return "repeat_interleave"


def bench_one(args, mode, context, batch, l2_bytes, copy_gbps):
    d, hq, hkv = args.head_dim, args.hq, args.hkv
    set_bytes = 2 * batch * context * hkv * d * 2
    sets = int(2 * l2_bytes // set_bytes) + 1
    calls = sets * math.ceil(8 / sets)
    need = sets * set_bytes + 4 * batch * hq * d * 2 * calls
    free, _ = torch.cuda.mem_get_info()
    if need + (1 << 30) > free:
        return None, (f"skipped context {context} batch {batch}: needs {need >> 20} MiB for "
                      f"{sets} KV set(s), {free >> 20} MiB free")
    ks = [torch.empty(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
          for _ in range(sets)]
    vs = [torch.empty_like(ks[0]).uniform_(-2, 2) for _ in range(sets)]
    q = torch.empty(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
    call = gqa_call(mode, hq, hkv)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(q, ks[i % sets], vs[i % sets])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(graph):
        for c in range(calls):
            outs.append(call(q, ks[c % sets], vs[c % sets]))
    ms = time_events(graph.replay, 3, args.iters)
    del graph, outs, ks, vs
    torch.cuda.empty_cache()
    us = ms * 1e3 / calls
    nbytes = set_bytes + batch * hq * d * 2 * 2
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"context": context, "batch": batch, "us": us, "gbps": gbps,
            "frac_copy": gbps / copy_gbps, "sets": sets, "calls": calls}, None


def bench_prefill(args, mode, context, batch):
    d, hq, hkv = args.head_dim, args.hq, args.hkv
    need = batch * context * d * 2 * (2 * hq + 2 * hkv)  # q, o, k, v
    free, _ = torch.cuda.mem_get_info()
    if need + (1 << 30) > free:
        return None, (f"skipped prefill context {context} batch {batch}: needs {need >> 20} MiB, "
                      f"{free >> 20} MiB free")
    q = torch.empty(batch, hq, context, d, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
    k = torch.empty(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16).uniform_(-2, 2)
    v = torch.empty_like(k).uniform_(-2, 2)
    group = hq // hkv
    if mode == "enable_gqa":
        call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        call = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):
        try:
            ms = time_events(call, 2, args.iters)
        except RuntimeError as e:
            sys.exit(f"bench_sdpa.py --prefill: no fused SDPA backend takes context {context} "
                     f"batch {batch} (Hq {hq}, Hkv {hkv}, d {d}, {mode}): {e}")
    del q, k, v
    torch.cuda.empty_cache()
    flops = 2.0 * batch * hq * d * context * (context + 1)
    return {"context": context, "batch": batch, "ms": ms,
            "tflops": flops / (ms * 1e-3) / 1e12}, None


def main_prefill(args, contexts, batches, prop):
    mode = pick_mode(args.hq, args.hkv, args.head_dim)
    print(f"torch SDPA causal prefill ({mode}): {prop.name}, torch {torch.__version__}; "
          f"Hq {args.hq} Hkv {args.hkv} d {args.head_dim}")
    print(f"{'context':>8} {'batch':>6} {'ms/call':>10} {'TFLOPS':>8}")
    rows, skipped = [], []
    for context in contexts:
        for batch in batches:
            row, note = bench_prefill(args, mode, context, batch)
            if row is None:
                print(note)
                skipped.append(note)
                continue
            print(f"{context:>8} {batch:>6} {row['ms']:>10.2f} {row['tflops']:>8.1f}", flush=True)
            rows.append(row)
    return {"impl": "torch_sdpa_prefill", "mode": mode}, rows, skipped


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="8K,32K,128K,512K")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, help="timed calls, median (default 50; 5 with --prefill)")
    p.add_argument("--json", help="also write the table as JSON to this path")
    p.add_argument("--prefill", action="store_true",
                   help="time causal prefill attention over each context instead of decode")
    args = p.parse_args()
    if args.iters is None:
        args.iters = 5 if args.prefill else 50
    if args.iters < 1:
        sys.exit("bench_sdpa.py: --iters must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("bench_sdpa.py: no CUDA device")
    if args.hkv < 1 or args.hq % args.hkv:
        sys.exit(f"bench_sdpa.py: --hq ({args.hq}) must be a positive multiple of --hkv ({args.hkv})")
    contexts = parse_list(args.contexts, "contexts")
    batches = parse_list(args.batches, "batches")
    prop = torch.cuda.get_device_properties(0)
    if args.prefill:
        meta, rows, skipped = main_prefill(args, contexts, batches, prop)
        write_json(args, meta, rows, skipped, prop)
        return
    l2_bytes = prop.L2_cache_size
    copy_gbps = copy_bandwidth_gbps()
    mode = pick_mode(args.hq, args.hkv, args.head_dim)
    print(f"torch SDPA decode ({mode}): {prop.name}, torch {torch.__version__}, "
          f"L2 {l2_bytes / 2**20:.0f} MiB; Hq {args.hq} Hkv {args.hkv} d {args.head_dim}")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'context':>8} {'batch':>6} {'us/call':>12} {'GB/s':>10} {'frac_copy':>10} {'sets':>5} {'calls':>6}")
    rows, skipped = [], []
    for context in contexts:
        for batch in batches:
            row, note = bench_one(args, mode, context, batch, l2_bytes, copy_gbps)
            if row is None:
                print(note)
                skipped.append(note)
                continue
            print(f"{context:>8} {batch:>6} {row['us']:>12.1f} {row['gbps']:>10.0f} "
                  f"{row['frac_copy']:>10.3f} {row['sets']:>5} {row['calls']:>6}", flush=True)
            rows.append(row)
    write_json(args, {"impl": "torch_sdpa", "mode": mode, "copy_gbps": copy_gbps}, rows,
               skipped, prop)


def write_json(args, meta, rows, skipped, prop):
    if not args.json:
        return
    command = shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    meta = {"impl": meta["impl"], "device": prop.name, "command": command, "mode": meta["mode"],
            "torch": torch.__version__,
            **{k: v for k, v in meta.items() if k not in ("impl", "mode")},
            "hq": args.hq, "hkv": args.hkv, "head_dim": args.head_dim, "iters": args.iters}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows, "skipped": skipped}, f, indent=2)


if __name__ == "__main__":
    main()
