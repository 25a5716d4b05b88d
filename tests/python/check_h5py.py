#!/usr/bin/env python3
"""Reads the fixture written by the C++ test H5pyFixture.Write with h5py and checks that a
third-party reader sees kvsparse files as we mean them: bf16 datasets convert exactly to
float32, the bundle attributes and groups are where the format says.

Usage: check_h5py.py <fixture.h5>. Prints OK, or what differs and exits 1.

h5py chooses its own numpy dtype for a custom float type (float32 in 3.7; a 2-byte float
could map to float16 elsewhere, which cannot hold bf16's range: 3e38 would become inf),
so bf16 is read through astype('float32'): HDF5 then converts the stored type straight to
float32 whatever h5py's choice.
"""
import sys

import h5py
import numpy as np


def read_as_f32(ds):
    # astype() exists in h5py 2.x..3.x; in 3.x it returns a wrapper that reads on slicing.
    return np.asarray(ds.astype("float32")[()], dtype=np.float32)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = sys.argv[1]
    errors = []
    with h5py.File(path, "r") as f:
        root = f.attrs
        if int(root["format_version"]) != 1:
            errors.append(f"format_version {root['format_version']!r}, expected 1")
        fp = root["fingerprint"]
        fp = fp.decode() if isinstance(fp, bytes) else fp
        if not (isinstance(fp, str) and len(fp) == 16 and int(fp, 16) >= 0):
            errors.append(f"fingerprint {fp!r} is not 16 hex digits")
        created = root["created_by"]
        created = created.decode() if isinstance(created, bytes) else created
        if not created.startswith("kvsparse "):
            errors.append(f"created_by {created!r}")
        if int(root["num_q_heads"]) % int(root["num_kv_heads"]) != 0:
            errors.append("num_q_heads is not a multiple of num_kv_heads")
        methods = sorted(k for k in f.keys())
        if methods != ["dense", "saap"]:
            errors.append(f"groups {methods}, expected ['dense', 'saap']")
        dense = f["dense"]
        if int(dense.attrs["num_splits"]) != 8:
            errors.append("dense.num_splits")
        if list(dense.attrs["knob_list"]) != [0.25, 0.5]:
            errors.append("dense.knob_list")

        ds = dense["values_bf16"]
        # h5py picks a numpy dtype for the custom float (3.7: float32); any float will do
        # for astype, which asks HDF5 for float32 whatever h5py's own choice.
        if ds.dtype.kind != "f":
            errors.append(f"values_bf16 has dtype {ds.dtype}, expected a float type")
        ds_dtype = ds.dtype
        bf = read_as_f32(ds)
        ref = np.asarray(dense["values_f32"][()], dtype=np.float32)
        if dense["values_f32"].dtype != np.float32:
            errors.append(f"values_f32 has dtype {dense['values_f32'].dtype}")

        def compare(name, got, want):
            if got.shape != want.shape:
                errors.append(f"{name}: shape {got.shape}, expected {want.shape}")
                return
            same = got.view(np.uint32) == want.view(np.uint32)  # bitwise: -0.0 and inf too
            if not same.all():
                i = int(np.flatnonzero(~same)[0])
                errors.append(f"{name}: {int((~same).sum())} values differ, first at {i}: "
                              f"{got.flat[i]!r} vs {want.flat[i]!r}")

        compare("values_bf16", bf, ref)
        if ds.dtype.itemsize >= 4:  # h5py's own mapping holds bf16's range: plain reads work too
            compare("values_bf16 (plain read)", np.asarray(ds[()]).astype(np.float32), ref)
        compare("values_bf16_2d", read_as_f32(dense["values_bf16_2d"]), ref.reshape(-1, 4))
        grown = dense["appended_bf16"]
        if grown.maxshape[0] is not None:
            errors.append(f"appended_bf16 maxshape {grown.maxshape}, expected unlimited axis 0")
        compare("appended_bf16", read_as_f32(grown), ref.reshape(-1, 4))
        for probe in (3.0e38, -3.0e38, 1.0e-30, -1.0e-30):
            # The bf16 neighbour of probe must survive: within bf16's 2^-8 relative step.
            close = np.abs(bf.astype(np.float64) - probe) <= abs(probe) * 2.0 ** -8
            if not close.any():
                errors.append(f"no value near {probe} survived the bf16 read")
        if not np.isfinite(bf).all():
            errors.append("non-finite values after the bf16 read (read as float16?)")

    if errors:
        for e in errors:
            print(f"{path}: {e}")
        return 1
    print(f"OK: h5py {h5py.__version__} reads {path}: bf16 -> float32 exact ({bf.size} values; "
          f"h5py maps the bf16 type to {ds_dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
