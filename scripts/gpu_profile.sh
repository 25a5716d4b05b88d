#!/usr/bin/env bash
# Per-kernel time breakdown of the decode benchmarks, for the GPU machine: builds the
# benchmarks without libtorch (staged deps in .deps), runs each one under Nsight Compute
# (ncu, clocks left alone, caches flushed before every kernel, so a kernel's time is its
# cold-cache time alone, without launch gaps) and prints, per program, every kernel's
# median duration and launch count (scripts/ncu_table.py). The benchmark's own table
# (CUDA-graph replays, launch gaps included) is printed beside it from a plain run.
#   scripts/gpu_profile.sh                          (the default list below)
#   PROFILE_RUNS="kvs-bench-saap --contexts 131072" scripts/gpu_profile.sh
# Environment: KVS_GPU_BUILD (default build-gpu), PROFILE_RUNS (one "program args" per line).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}
BUILD=${KVS_GPU_BUILD:-build-gpu}
RUNS=${PROFILE_RUNS:-"kvs-bench --contexts 8K,32K,128K --batches 1 --iters 5
kvs-bench-saap --contexts 131072 --layers 1 --iters 5
kvs-bench-mac --contexts 128K --batches 1 --hit-rates 0,1 --layers 1 --iters 5
kvs-bench --method tactic --contexts 128K --batches 1 --layers 1 --iters 5"}
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
targets="kvs-bench $(echo "$RUNS" | awk '{print $1}' | sort -u | tr '\n' ' ')"
# shellcheck disable=SC2086
if ! cmake -S . -B "$BUILD" -G Ninja -DKVS_WITH_TORCH=OFF -DKVS_DEPS_PREFIX="$PWD/.deps" \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/profile_build.log" 2>&1 ||
   ! ninja -C "$BUILD" $targets >> "$OUT/profile_build.log" 2>&1; then
  tail -40 "$OUT/profile_build.log"; exit 1
fi
echo "build ok ($((SECONDS - t0)) s)"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
i=0
while read -r exe args; do
  [ -z "$exe" ] && continue
  i=$((i + 1))
  echo; echo "== $exe $args"
  # shellcheck disable=SC2086
  timeout 120 "$BUILD/tools/$exe" $args 2>&1 | tail -12
  # shellcheck disable=SC2086
  timeout 240 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --print-units base "$BUILD/tools/$exe" $args > "$OUT/ncu_$i.csv" 2> "$OUT/ncu_$i.err"
  python3 scripts/ncu_table.py "$OUT/ncu_$i.csv" || tail -5 "$OUT/ncu_$i.err"
done <<< "$RUNS"
# Dense against torch SDPA, both timed as CUDA-graph replays in this call (PROFILE_SDPA=0: skip).
if [ "${PROFILE_SDPA:-1}" = 1 ]; then
  shapes=(--contexts "${PROFILE_CONTEXTS:-8K,32K,128K}" --batches "${PROFILE_BATCHES:-1,8}")
  echo; echo "== dense against torch SDPA: ${shapes[*]}"
  timeout 120 "$BUILD/tools/kvs-bench" "${shapes[@]}" --json "$OUT/kvs_bench.json" > "$OUT/bench.log" 2>&1
  timeout 150 python3 scripts/bench_sdpa.py "${shapes[@]}" --json "$OUT/sdpa_bench.json" >> "$OUT/bench.log" 2>&1
  python3 scripts/bench_table.py "$OUT/kvs_bench.json" "$OUT/sdpa_bench.json" || tail -20 "$OUT/bench.log"
fi
echo; echo "gpu_profile: $((SECONDS - t0)) s"
