#!/bin/sh
# CTest wrapper: writes the h5py fixture with the C++ test binary, then reads it with h5py.
# Exits 77 (reported by CTest as skipped) when no python3 with h5py is found; the
# interpreter is $KVS_PYTHON if set, else the first python3 on PATH or /usr/bin/python3
# that imports h5py.
# Usage: run_h5py_check.sh <kvs_tests_cpu> <check_h5py.py> <fixture.h5>
set -u
tests="$1" check="$2" fixture="$3"
python=""
for p in ${KVS_PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import h5py, numpy' >/dev/null 2>&1; then
    python="$p"
    break
  fi
done
if [ -z "$python" ]; then
  echo "skipped: no python3 with h5py and numpy"
  exit 77
fi
rm -f "$fixture"
KVS_H5PY_FIXTURE="$fixture" "$tests" --gtest_filter=H5pyFixture.Write || exit 1
[ -f "$fixture" ] || { echo "the fixture $fixture was not written"; exit 1; }
"$python" "$check" "$fixture"
status=$?
rm -f "$fixture"
exit $status
