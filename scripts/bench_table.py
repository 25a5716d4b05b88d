#!/usr/bin/env python3
"""Joins the JSON of kvs-bench and scripts/bench_sdpa.py on (context, batch) and prints one
table: our time, SDPA's, their ratio (ours / SDPA: < 1 means we are faster), and each
one's effective bandwidth as a fraction of the copy bandwidth measured in its own run.

    scripts/bench_table.py OURS.json SDPA.json [OURS_SHUFFLED.json]

The optional third file (kvs-bench --page-order shuffled) adds our time with a random page
table as a last column.
"""
import json
import sys


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        ours = json.load(f)
    with open(sys.argv[2]) as f:
        sdpa = json.load(f)
    theirs = {(r["context"], r["batch"]): r for r in sdpa["rows"]}
    shuffled = {}
    if len(sys.argv) == 4:
        with open(sys.argv[3]) as f:
            shuffled = {(r["context"], r["batch"]): r for r in json.load(f)["rows"]}
    print(f"dense decode on {ours['device']}: Hq {ours['hq']} Hkv {ours['hkv']} d {ours['head_dim']}, "
          f"page {ours['page_size']}; copy {ours['copy_gbps']:.0f} GB/s (ours' run), "
          f"{sdpa['copy_gbps']:.0f} GB/s (SDPA's run, {sdpa['mode']})")
    print(f"{'context':>8} {'batch':>5} {'ours us':>9} {'sdpa us':>9} {'ours/sdpa':>9} "
          f"{'ours GB/s':>9} {'ours frac':>9} {'sdpa frac':>9} {'shuf us':>9}")
    for r in ours["rows"]:
        s = theirs.get((r["context"], r["batch"]))
        sh = shuffled.get((r["context"], r["batch"]))
        sh_us = f"{sh['us']:>9.1f}" if sh else f"{'-':>9}"
        ctx = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else str(r["context"])
        if s is None:
            print(f"{ctx:>8} {r['batch']:>5} {r['us']:>9.1f} {'-':>9} {'-':>9} "
                  f"{r['gbps']:>9.0f} {r['frac_copy']:>9.3f} {'-':>9} {sh_us}")
            continue
        print(f"{ctx:>8} {r['batch']:>5} {r['us']:>9.1f} {s['us']:>9.1f} {r['us'] / s['us']:>9.3f} "
              f"{r['gbps']:>9.0f} {r['frac_copy']:>9.3f} {s['frac_copy']:>9.3f} {sh_us}")
    for note in ours.get("skipped", []) + sdpa.get("skipped", []):
        print(note)


if __name__ == "__main__":
    main()
