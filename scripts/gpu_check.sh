#!/usr/bin/env bash
# The one script to run on the GPU machine as it is (see /work/shared/DEVICE.md): builds
# with the staged deps (.deps, made by scripts/stage_gpu_deps.sh), runs the CPU and CUDA
# tests, compute-sanitizer memcheck and racecheck on a subset of the CUDA tests, kvs-bench
# and scripts/bench_sdpa.py, every method's benchmark, and prints a short summary and the
# joined benchmark table last. Every benchmark writes its JSON; scripts/results.py makes
# results.md of them, and the JSON goes back in json.tgz (docs/gpu.md: into docs/data/).
#   scripts/gpu_check.sh            (summary.txt, results.md, json.tgz, logs.tgz in ${OUT:-out}/)
# Environment: KVS_GPU_BUILD (build folder, default build-gpu), KVS_BENCH_ARGS (extra
# arguments for both benchmarks, e.g. "--contexts 8K,128K --batches 1"). Steps switched off
# by =0: KVS_GPU_TORCH (the libtorch build), KVS_GPU_TESTS (every test run), KVS_GPU_SANITIZE
# (the sanitizers), KVS_GPU_DENSE_EXTRA, KVS_GPU_METHODS, KVS_GPU_CAPTURE, KVS_GPU_MODEL_EVAL.
# The benchmarks alone on the main job's kernels:
#   KVS_GPU_TORCH=0 KVS_GPU_TESTS=0 KVS_GPU_CAPTURE=0 scripts/gpu_check.sh
# Each step has a time cap so that the whole stays under about 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}
BUILD=${KVS_GPU_BUILD:-build-gpu}
BENCH_ARGS=${KVS_BENCH_ARGS:-}
mkdir -p "$OUT"
summary=()
note() { summary+=("$1"); echo "== $1"; }
t0=$SECONDS
# At most 8 files come back from the GPU machine: summary.txt and results.md stay, the JSON
# goes in json.tgz and the logs in logs.tgz. (A *.tmp.* file is JSON a timeout cut off.) Also
# when a caller's timeout stops the check (SIGTERM): the JSON written so far still comes back.
pack_outputs() {
  (
    cd "$OUT" || exit 1
    shopt -s nullglob
    json=(./*.json)
    if [ ${#json[@]} -gt 0 ]; then tar czf json.tgz "${json[@]}" && rm -f "${json[@]}"; fi
    rm -f ./*.tmp.*
    logs=(./*.log)
    if [ ${#logs[@]} -gt 0 ]; then tar czf logs.tgz "${logs[@]}" && rm -f "${logs[@]}"; fi
  )
}
step_pid=  # run_step's step under way
trap 'echo "== stopped after $((SECONDS - t0)) s"; [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null;
      pack_outputs; exit 124' TERM INT

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader \
  > "$OUT/build.log" 2>&1
# libtorch comes from the machine's PyTorch (capture, trainers and their tests need it);
# KVS_GPU_TORCH=0 builds without it (faster: kernels, runtime, benchmarks only).
torch_args=(-DKVS_WITH_TORCH=OFF)
if [ "${KVS_GPU_TORCH:-1}" = 1 ] && torch_prefix=$(python3 -c \
    'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  torch_args=(-DKVS_WITH_TORCH=ON "-DCMAKE_PREFIX_PATH=$torch_prefix")
fi
if ! cmake -S . -B "$BUILD" -G Ninja "${torch_args[@]}" -DKVS_DEPS_PREFIX="$PWD/.deps" \
    -DCMAKE_CUDA_ARCHITECTURES=90 >> "$OUT/build.log" 2>&1; then
  note "configure FAILED (see build.log)"; tail -30 "$OUT/build.log"; exit 1
fi
# -k 0: a broken target elsewhere must not stop the ones this check needs.
if ninja -C "$BUILD" -k 0 >> "$OUT/build.log" 2>&1; then
  note "build ok ($((SECONDS - t0)) s)"
else
  note "build had failures (see build.log): $(grep -c FAILED "$OUT/build.log") targets"
  grep -A5 FAILED "$OUT/build.log" | head -40
fi

run_step() {  # name, seconds, log, command...
  local name=$1 secs=$2 log=$3; shift 3
  local t=$SECONDS
  echo "== $name: $*" >> "$OUT/$log"
  # In the background and waited for, so that a SIGTERM to the check interrupts the wait and
  # the trap above stops the step (timeout passes the signal on) instead of waiting it out.
  timeout "$secs" "$@" >> "$OUT/$log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  local rc=$?
  step_pid=
  if [ $rc -eq 0 ]; then note "$name ok ($((SECONDS - t)) s)";
  elif [ $rc -eq 124 ]; then note "$name TIMED OUT after $secs s (see $log)";
  else note "$name FAILED rc=$rc (see $log)"; fi
  return $rc
}

tests_cpu=$BUILD/tests/kvs_tests_cpu
tests_cuda=$BUILD/tests/kvs_tests_cuda
if [ "${KVS_GPU_TESTS:-1}" != 1 ]; then
  note "tests skipped (KVS_GPU_TESTS=0)"
else
if [ -x "$tests_cpu" ]; then run_step "kvs_tests_cpu" 120 tests.log "$tests_cpu"; else note "kvs_tests_cpu missing"; fi
tests_torch=$BUILD/tests/kvs_tests_torch
if [ -x "$tests_torch" ]; then run_step "kvs_tests_torch" 150 tests.log "$tests_torch"; fi
if [ -x "$tests_cuda" ]; then
  run_step "kvs_tests_cuda" 240 tests.log "$tests_cuda"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/tests.log" | sort | uniq -c | sed 's/^/   /'
  grep -E "^\[  FAILED  \]" "$OUT/tests.log" | sort -u | head -20
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  # A subset covering every kernel (paged and contiguous, both head dims, splits and the
  # merge kernel, the graph replay); the full grid is slow under the tools.
  memcheck_filter='Grid/DenseCuda.*b3_*:Grid/DenseCuda.*b17_ragged_p64_g4_d64:Grid/DenseCuda.*b1_len17_*:DenseCudaGraph.*:DenseCudaArgs.*:*MergeState*:*Rope*'
  racecheck_filter='Grid/DenseCuda.*b3_with_empty_p16_g2_d128:Grid/DenseCuda.*b1_len4097_p16_g8_d64:Shapes/MergeStatesCuda.*states7*:HeadDims/RopeCuda.*'
  if [ "${KVS_GPU_SANITIZE:-1}" = 1 ]; then
  run_step "memcheck" 120 sanitizer.log "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$tests_cuda" --gtest_filter="$memcheck_filter"
  run_step "racecheck" 90 sanitizer.log "$sanitizer" --tool racecheck --error-exitcode 3 \
    "$tests_cuda" --gtest_filter="$racecheck_filter"
  fi
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$OUT/sanitizer.log" | sort | uniq -c | head -10
else
  note "kvs_tests_cuda missing"
fi
fi

if [ -x "$BUILD/tools/kvs-bench" ]; then
  # shellcheck disable=SC2086
  run_step "kvs-bench" 120 bench.log "$BUILD/tools/kvs-bench" --json "$OUT/kvs_bench.json" $BENCH_ARGS
  if [ "${KVS_GPU_DENSE_EXTRA:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  run_step "kvs-bench shuffled pages" 120 bench.log "$BUILD/tools/kvs-bench" --page-order shuffled \
    --json "$OUT/kvs_bench_shuffled.json" $BENCH_ARGS
  # One kv head: token rows are contiguous, as in SDPA's layout (bench.log only).
  run_step "kvs-bench one kv head" 60 bench.log "$BUILD/tools/kvs-bench" --hq 8 --hkv 1 \
    --contexts 128K,512K --batches 1,8
  fi
else
  note "kvs-bench missing"
fi
# The sparse methods: their CUDA tests ran in kvs_tests_cuda; racecheck on a subset of
# each, then each method's benchmark against the dense kernel in the same process.
if [ "${KVS_GPU_METHODS:-1}" = 1 ]; then
  # One small test per method (SAAP: its router shapes and the fold, not the 2300-step
  # generation; racecheck took 23 s on the fold test here and did not finish FoldKeeps* in
  # 150 s): the tools slow kernels down by orders of magnitude.
  methods_filter='TacticCuda.SelectionAndAttentionMatchCpuGqa4:MacCuda.MissesMatchTheDenseEngine:MagicPigCuda.NoCandidate*:SaapCuda.MlpRouter*:SaapCuda.FoldOfManyClustersInTwoRounds:AttnPredCuda.TopBlocksEqualCpu:AttnPredCuda.CnnEquals*-*LongGeneration'
  if [ "${KVS_GPU_SANITIZE:-1}" = 1 ] && [ "${KVS_GPU_TESTS:-1}" = 1 ] && [ -x "$tests_cuda" ]; then
  run_step "memcheck methods" 150 sanitizer.log "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$tests_cuda" --gtest_filter="$methods_filter"
  run_step "racecheck methods" 240 sanitizer.log "$sanitizer" --tool racecheck --error-exitcode 3 \
    "$tests_cuda" --gtest_filter="$methods_filter"
  fi
  # Each line: the JSON's name (scripts/results.py reads it by that name), program, arguments.
  # SAAP: its 32 layers index on their own steps (index_every 32), so the timed step is the
  # average one: one layer assigns the 32 tokens that left the window since its last. Then
  # the step that only indexes and the one that folds (fold_every 1024), every layer on the
  # timed step: results.py adds the fold's share to the average.
  # AttentionPredictor with a history per kv head: 32 layers, so that the calibration rows and
  # predictions of a layer run beside the later layers' steps as in a model, not at the join
  # of a 4-layer graph; last, its calibration rows from the e4m3 and the int4 copies of K.
  for b in "kvs_bench_tactic kvs-bench --method tactic --contexts 128K --batches 1,8" \
           "kvs_bench_mac kvs-bench-mac" "kvs_bench_magicpig kvs-bench-magicpig ${KVS_MAGICPIG_ARGS:-}" \
           "kvs_bench_saap kvs-bench-saap --generated 31 --layers 32" \
           "kvs_bench_saap_index kvs-bench-saap --contexts 131072 --restore-index --timed-step index --iters 20 --generated 991" \
           "kvs_bench_saap_fold kvs-bench-saap --contexts 131072 --restore-index --timed-step index --iters 20 --generated 1023" \
           "kvs_bench_attnpred kvs-bench-attnpred" \
           "kvs_bench_attnpred_p4 kvs-bench-attnpred --predict-interval 4 --steps 20" \
           "kvs_bench_attnpred_grouped kvs-bench-attnpred --group-history --steps 20 --layers 32" \
           "kvs_bench_attnpred_grouped_p4 kvs-bench-attnpred --group-history --predict-interval 4 --steps 20 --layers 32" \
           "kvs_bench_attnpred_grouped_p4_e4m3 kvs-bench-attnpred --group-history --predict-interval 4 --steps 20 --layers 32 --calibration-keys e4m3" \
           "kvs_bench_attnpred_grouped_p4_int4 kvs-bench-attnpred --group-history --predict-interval 4 --steps 20 --layers 32 --calibration-keys int4"; do
    read -r name exe args <<< "$b"
    # shellcheck disable=SC2086
    [ -x "$BUILD/tools/$exe" ] && run_step "$exe $args" 120 methods.log "$BUILD/tools/$exe" $args \
      --json "$OUT/$name.json"
  done
fi
# A capture of the embedded model at 16K context on the GPU, read back with h5py.
if [ "${KVS_GPU_CAPTURE:-1}" = 1 ] && [ -x "$BUILD/tools/kvs-capture" ]; then
  cap=$(mktemp -d)/capture16k.h5
  run_step "kvs-capture 16K" 240 capture.log "$BUILD/tools/kvs-capture" --model models/kvs-tiny-a \
    --text data/corpus/docs.val.txt.gz --context 16384 --decode-steps 128 --out "$cap"
  [ -f "$cap" ] && run_step "h5py reads the capture" 60 capture.log python3 tests/python/check_capture.py "$cap"
  grep "kvs-capture:" "$OUT/capture.log" | tail -1 | sed 's/^/   /'
  # Tactic's step on the keys, values and queries the model made (every head of layers 0-3,
  # 8 KV sets a replay so that the L2 does not hold the next).
  [ -f "$cap" ] && [ -x "$BUILD/tools/kvs-bench" ] && run_step "kvs-bench tactic on the capture" 120 \
    methods.log "$BUILD/tools/kvs-bench" --method tactic --capture "$cap" --layers 8 \
    --json "$OUT/kvs_bench_tactic_capture.json"
fi

# The methods inside the model's decode loop on the GPU: kvs-eval ppl and needle at 16K and
# 32K context (32500 and 32000: the model has 32768 positions and the decode steps need
# room) with the bundle of a scripts/main.sh run (carry it: KVS_GPU_BUNDLE, default
# out/bundle.h5). KVS_GPU_MODEL_EVAL=0 skips this.
bundle=${KVS_GPU_BUNDLE:-out/bundle.h5}
if [ "${KVS_GPU_MODEL_EVAL:-1}" = 1 ] && [ -x "$BUILD/tools/kvs-eval" ] && [ -f "$bundle" ]; then
  methods=(dense tactic mac magicpig saap:recent_tokens=256,probes=8 attnpred)
  # 4 windows x 256 steps: 1,024 scored bytes per row (64 was too few to tell +-3 % from
  # noise); 32500 + 256 + 1 stays within the model's 32768 positions.
  run_step "kvs-eval ppl 16K,32K" 300 model_eval.log "$BUILD/tools/kvs-eval" ppl \
    --text data/corpus/docs.val.txt.gz --bundle "$bundle" --contexts 16384,32500 --windows 4 \
    --steps 256 --offset 200000 --methods "${methods[@]}" --json "$OUT/ppl.json"
  run_step "kvs-eval needle 16K,32K" 300 model_eval.log "$BUILD/tools/kvs-eval" needle \
    --text data/corpus/docs.val.txt.gz --bundle "$bundle" --contexts 16384,32000 \
    --depths 0.1,0.5,0.9 --trials 3 --methods "${methods[@]}" --json "$OUT/needle.json"
fi

# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 run_step "bench_sdpa.py" 150 bench.log python3 scripts/bench_sdpa.py \
  --json "$OUT/sdpa_bench.json" $BENCH_ARGS
# The dense reference for Tactic's clustering at prefill: causal prefill attention over the
# shapes of its benchmark above (results.py joins them).
PYTHONUNBUFFERED=1 run_step "bench_sdpa.py --prefill" 120 bench.log python3 scripts/bench_sdpa.py \
  --prefill --contexts 128K --batches 1,8 --json "$OUT/sdpa_prefill.json"
# The Markdown report of this visit's JSON, for a first look; plots are drawn where the JSON
# becomes docs/results.md (docs/gpu.md).
run_step "results.py" 60 results.log python3 scripts/results.py "$OUT" --no-plots

{
  echo "gpu_check summary ($((SECONDS - t0)) s):"
  for s in "${summary[@]}"; do echo "  $s"; done
  if [ -f "$OUT/kvs_bench.json" ] && [ -f "$OUT/sdpa_bench.json" ]; then
    shuffled_json=()
    [ -f "$OUT/kvs_bench_shuffled.json" ] && shuffled_json=("$OUT/kvs_bench_shuffled.json")
    python3 scripts/bench_table.py "$OUT/kvs_bench.json" "$OUT/sdpa_bench.json" "${shuffled_json[@]}"
  elif [ -f "$OUT/kvs_bench.json" ]; then
    grep -A30 "us/call" "$OUT/bench.log" | head -20
  fi
} | tee "$OUT/summary.txt"
# The methods' tables (they are short) after the summary, so the reply's tail has them.
if [ -f "$OUT/model_eval.log" ]; then
  echo; echo "== model decode loop (model_eval.log)"; grep -v '^== \|^kvs-eval: ' "$OUT/model_eval.log" | tail -80
fi
if [ -f "$OUT/methods.log" ]; then
  echo; echo "== method benchmarks (methods.log)"; grep -v '^== ' "$OUT/methods.log" | tail -120
fi
pack_outputs
