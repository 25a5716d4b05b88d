#!/bin/sh
# CTest wrapper: a short kvs-capture run on the embedded model, then h5py reads the file.
# Exits 77 (skipped) when no python3 with h5py is found.
# Usage: run_capture_check.sh <kvs-capture> <check_capture.py> <model dir> <text> <out.h5>
set -u
capture="$1" check="$2" model="$3" text="$4" out="$5"
python=""
for p in ${KVS_PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import h5py, numpy' >/dev/null 2>&1; then
    python="$p"
    break
  fi
done
[ -n "$python" ] || { echo "skipped: no python3 with h5py and numpy"; exit 77; }
rm -f "$out"
"$capture" --model "$model" --text "$text" --context 300 --sequences 2 --decode-steps 20 \
  --device cpu --out "$out" || exit 1
"$python" "$check" "$out" || exit 1
# A subset: one KV head (with its query heads) of two layers.
"$capture" --model "$model" --text "$text" --context 200 --decode-steps 10 --layers 1,3 \
  --kv-heads 1 --device cpu --out "$out" || exit 1
"$python" "$check" "$out"
status=$?
rm -f "$out"
exit $status
