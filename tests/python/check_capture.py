"""Reads a kvs-capture file with h5py alone and checks the schema of docs/formats.md.

Usage: check_capture.py <capture.h5>. Prints OK and exits 0, or names what is wrong and
exits 1. This is what a user inspecting a capture with h5py sees: bf16 arrays come out as
float32 values, shapes follow the model attributes, attention rows are probabilities.
"""
import sys

import h5py
import numpy as np


def fail(msg):
    print("check_capture: " + msg)
    sys.exit(1)


def main(path):
    with h5py.File(path, "r") as f:
        a = f.attrs
        if a.get("kind") not in ("kvsparse-capture", b"kvsparse-capture"):
            fail(f"{path}: kind attribute is {a.get('kind')!r}")
        d = int(a["head_dim"])
        group = int(a["num_q_heads"]) // int(a["num_kv_heads"])
        kv_heads = [int(h) for h in a["kv_heads"]]  # captured heads; arrays hold only these
        hkv = len(kv_heads)
        hq = hkv * group
        layers = [int(x) for x in a["layers"]]
        nseq = int(a["num_sequences"])
        for s in range(nseq):
            g = f[f"seq{s}"]
            tokens = g["tokens"][:]
            T, start = len(tokens), int(g.attrs["decode_start"])
            if tokens.dtype != np.int32:
                fail(f"seq{s}/tokens dtype {tokens.dtype}")
            for l in layers:
                lg = g[f"layer{l}"]
                for name, heads in (("q_pre", hq), ("k_pre", hkv), ("v", hkv)):
                    x = lg[name].astype("float32")[:]
                    if x.shape != (T, heads, d):
                        fail(f"seq{s}/layer{l}/{name} shape {x.shape}, expected {(T, heads, d)}")
                    if not np.isfinite(x).all() or np.abs(x).max() == 0:
                        fail(f"seq{s}/layer{l}/{name} is not finite or all zero")
                    # bf16 values: the low 16 bits of every float32 are zero.
                    if (x.view(np.uint32) & 0xFFFF).any():
                        fail(f"seq{s}/layer{l}/{name} holds values that are not bf16")
                att = lg["attn_blocks"][:]
                nb = (T + 15) // 16
                if att.shape != (T - start, hq, nb):
                    fail(f"seq{s}/layer{l}/attn_blocks shape {att.shape}, expected {(T - start, hq, nb)}")
                if att.min() < 0 or att.max() > 1 + 1e-6:
                    fail(f"seq{s}/layer{l}/attn_blocks outside [0, 1]")
                for i in range(att.shape[0]):
                    pos = start + i
                    if att[i, :, pos // 16 + 1:].any():
                        fail(f"seq{s}/layer{l}/attn_blocks step {i} has mass past position {pos}")
                    # Max-pooled probabilities: the row maximum is at least 1/(pos+1).
                    if (att[i].max(axis=1) < 1.0 / (pos + 1) - 1e-7).any():
                        fail(f"seq{s}/layer{l}/attn_blocks step {i} is not a softmax row")
    print(f"OK {path}: {nseq} sequence(s), layers {layers}, kv heads {kv_heads}, Hq {hq}, Hkv {hkv}, d {d}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    main(sys.argv[1])
