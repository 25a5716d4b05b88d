#!/usr/bin/env bash
# Variant sweep of the dense decode kernel, for the GPU machine (docs/gpu.md, section "Dense
# decode kernel"): builds kvs_tests_cuda and kvs-bench with the staged deps (.deps), checks
# each kernel variant against the CPU reference (KVS_DENSE_VARIANT selects it), runs the
# sanitizers on the bulk-copy kernel, times every variant with kvs-bench and torch SDPA once
# with scripts/bench_sdpa.py at the same shapes, and prints one table last.
#   scripts/dense_sweep.sh      (logs and JSON in ${OUT:-out}/sweep.tgz, table in table.txt)
# Environment: KVS_GPU_BUILD (default build-gpu), SWEEP_TEST_VARIANTS, SWEEP_SAN_VARIANTS,
# SWEEP_BENCH (lines of "variant contexts batches", - for the defaults), SWEEP_CONTEXTS /
# SWEEP_BATCHES (the default shapes), SWEEP_SDPA_JSON (reuse bench_sdpa.py JSON of the same
# run, e.g. gpu_check.sh's, instead of timing SDPA again).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}
BUILD=${KVS_GPU_BUILD:-build-gpu}
LOGS=$(mktemp -d)
CONTEXTS=${SWEEP_CONTEXTS:-8K,32K,128K,512K}
BATCHES=${SWEEP_BATCHES:-1,8,32}
# "default" runs with KVS_DENSE_VARIANT unset (w4.s3); w4.s3 is timed twice for the spread.
TEST_VARIANTS=${SWEEP_TEST_VARIANTS:-"default w8.s3"}
SAN_VARIANTS=${SWEEP_SAN_VARIANTS:-"default w8.s3"}
BENCH=${SWEEP_BENCH:-"w4.s3 - -
w8.s3 - -
w4.s3 - -"}
mkdir -p "$OUT"
t0=$SECONDS
status=()

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader \
  > "$LOGS/build.log" 2>&1
if ! cmake -S . -B "$BUILD" -G Ninja -DKVS_WITH_TORCH=OFF -DKVS_DEPS_PREFIX="$PWD/.deps" \
    -DCMAKE_CUDA_ARCHITECTURES=90 >> "$LOGS/build.log" 2>&1 ||
   ! ninja -C "$BUILD" kvs_tests_cuda kvs-bench >> "$LOGS/build.log" 2>&1; then
  tail -40 "$LOGS/build.log"; tar -C "$LOGS" -czf "$OUT/sweep.tgz" .; exit 1
fi
echo "build ok ($((SECONDS - t0)) s)"

for v in $TEST_VARIANTS; do
  KVS_DENSE_VARIANT=${v#default} timeout 90 "$BUILD/tests/kvs_tests_cuda" --gtest_filter='*Dense*' \
    > "$LOGS/tests_$v.log" 2>&1
  rc=$?
  line="tests $v: rc=$rc $(grep -E '^\[  PASSED  \]' "$LOGS/tests_$v.log" | head -1) $(grep -c '^\[  FAILED  \]' "$LOGS/tests_$v.log") failed lines"
  status+=("$line"); echo "$line"
  grep -E '^\[  FAILED  \]|Failure|error' "$LOGS/tests_$v.log" | head -8
done
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for v in $SAN_VARIANTS; do
  for tool in memcheck racecheck; do
    KVS_DENSE_VARIANT=${v#default} timeout 90 "$san" --tool $tool --error-exitcode 3 "$BUILD/tests/kvs_tests_cuda" \
      --gtest_filter='Grid/DenseCuda.*b3_*:Grid/DenseCuda.*b1_len4097_p16_g8_d64:Grid/DenseCuda.*b17_ragged_p64_g4_d64:DenseCudaGraph.*:DenseCudaStream.*' \
      > "$LOGS/san_${tool}_$v.log" 2>&1
    line="$tool $v: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/san_${tool}_$v.log" | tail -1)"
    status+=("$line"); echo "$line"
  done
done

n=0
while read -r v ctx bat; do
  [ -z "$v" ] && continue
  [ "$ctx" = "-" ] && ctx=$CONTEXTS
  [ "$bat" = "-" ] && bat=$BATCHES
  n=$((n + 1))
  KVS_DENSE_VARIANT=${v#default} timeout 90 "$BUILD/tools/kvs-bench" --contexts "$ctx" --batches "$bat" \
    --json "$LOGS/bench_$(printf %02d $n)_$v.json" > "$LOGS/bench_$(printf %02d $n)_$v.log" 2>&1 ||
    { status+=("bench $v FAILED"); tail -5 "$LOGS/bench_$(printf %02d $n)_$v.log"; }
done <<< "$BENCH"
if [ -n "${SWEEP_SDPA_JSON:-}" ]; then
  cp "$SWEEP_SDPA_JSON" "$LOGS/sdpa.json"
else
  PYTHONUNBUFFERED=1 timeout 150 python3 scripts/bench_sdpa.py --contexts "$CONTEXTS" \
    --batches "$BATCHES" --json "$LOGS/sdpa.json" > "$LOGS/sdpa.log" 2>&1 || status+=("sdpa FAILED")
fi

python3 - "$LOGS" > "$LOGS/table.txt" <<'EOF'
import glob, json, os, sys
d = sys.argv[1]
sdpa = json.load(open(os.path.join(d, "sdpa.json")))
runs = [(os.path.basename(p)[9:-5], json.load(open(p))) for p in sorted(glob.glob(os.path.join(d, "bench_*.json")))]
shapes = [(r["context"], r["batch"]) for r in runs[0][1]["rows"]]
name = lambda c, b: f"{c // 1024}K/{b}"
print(f"dense decode sweep on {sdpa['meta']['device']}: us per call "
      f"(ratio to SDPA in brackets); copy GB/s: SDPA run {sdpa['meta']['copy_gbps']:.0f}, "
      f"ours {min(r['meta']['copy_gbps'] for _, r in runs):.0f}..{max(r['meta']['copy_gbps'] for _, r in runs):.0f}")
print(f"{'variant':30s}" + "".join(f"{name(c, b):>15s}" for c, b in shapes))
s = {(r["context"], r["batch"]): r for r in sdpa["rows"]}
print(f"{'torch SDPA':30s}" + "".join(f"{s[k]['us']:>9.1f} ({s[k]['frac_copy']:.2f})" if k in s else f"{'-':>15s}" for k in shapes))
for label, run in runs:
    rows = {(r["context"], r["batch"]): r for r in run["rows"]}
    cells = []
    for k in shapes:
        r = rows.get(k)
        cells.append(f"{r['us']:>8.1f} [{r['us'] / s[k]['us']:.3f}]" if r and k in s else f"{'-':>15s}")
    print(f"{label:30s}" + "".join(f"{c:>15s}" for c in cells))
print("frac of copy bandwidth (ours' run) per variant:")
for label, run in runs:
    rows = {(r["context"], r["batch"]): r for r in run["rows"]}
    print(f"{label:30s}" + "".join(f"{rows[k]['frac_copy']:>15.3f}" if k in rows else f"{'-':>15s}" for k in shapes))
EOF
cp "$LOGS/table.txt" "$OUT/table.txt"
tar -C "$LOGS" -czf "$OUT/sweep.tgz" .
echo "sweep ($((SECONDS - t0)) s):"
for s in "${status[@]}"; do echo "  $s"; done
cat "$OUT/table.txt"
