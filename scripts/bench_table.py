#!/usr/bin/env python3
"""Joins the JSON of kvs-bench and scripts/bench_sdpa.py on (context, batch) and prints one
table: our time, SDPA's, their ratio (ours / SDPA: < 1 means we are faster), and each
one's effective bandwidth as a fraction of the copy bandwidth measured in its own run.

    scripts/bench_table.py OURS.json SDPA.json [OURS_SHUFFLED.json]

The optional third file (kvs-bench --page-order shuffled) adds our time with a random page
table as a last column. scripts/results.py makes the same join into Markdown.
"""
import sys

from results import InputError, context_text, dense_vs_sdpa, load_bench


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    try:
        ours = load_bench(sys.argv[1], "kvs_dense")
        sdpa = load_bench(sys.argv[2], "torch_sdpa")
        shuffled = load_bench(sys.argv[3], "kvs_dense") if len(sys.argv) == 4 else None
    except InputError as e:
        sys.exit(f"bench_table.py: error: {e}")
    m, s = ours["meta"], sdpa["meta"]
    print(f"dense decode on {m['device']}: Hq {m['hq']} Hkv {m['hkv']} d {m['head_dim']}, "
          f"page {m['page_size']}; copy {m['copy_gbps']:.0f} GB/s (ours' run), "
          f"{s['copy_gbps']:.0f} GB/s (SDPA's run, {s['mode']})")
    print(f"{'context':>8} {'batch':>5} {'ours us':>9} {'sdpa us':>9} {'ours/sdpa':>9} "
          f"{'ours GB/s':>9} {'ours frac':>9} {'sdpa frac':>9} {'shuf us':>9}")
    for j in dense_vs_sdpa(ours, sdpa, shuffled):
        if "ours" not in j:
            continue
        r, s, sh = j["ours"], j.get("sdpa"), j.get("shuffled")
        sh_us = f"{sh['us']:>9.1f}" if sh else f"{'-':>9}"
        ctx = context_text(r["context"])
        if s is None:
            print(f"{ctx:>8} {r['batch']:>5} {r['us']:>9.1f} {'-':>9} {'-':>9} "
                  f"{r['gbps']:>9.0f} {r['frac_copy']:>9.3f} {'-':>9} {sh_us}")
            continue
        print(f"{ctx:>8} {r['batch']:>5} {r['us']:>9.1f} {s['us']:>9.1f} {r['us'] / s['us']:>9.3f} "
              f"{r['gbps']:>9.0f} {r['frac_copy']:>9.3f} {s['frac_copy']:>9.3f} {sh_us}")
    for note in ours["skipped"] + sdpa["skipped"]:
        print(note)


if __name__ == "__main__":
    main()
