#!/usr/bin/env bash
# The main job on the embedded default model (models/kvs-tiny-a):
#   capture (pre-RoPE q/k, v, attention maps of held-out text) -> eval (every method and the
#   baselines against fp64 dense attention) -> table on stdout, JSON/CSV/PNG under out/.
# Installs dependencies if missing and builds first. Uses the GPU where there is one.
#   scripts/main.sh                  (KVS_OUT=out, KVS_CONTEXT=4096, KVS_SEQUENCES=2, KVS_STEPS=32)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
cmake -S . -B "$KVS_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVS_CMAKE_ARGS:-} >/dev/null
cmake --build "$KVS_BUILD_DIR" -j "$(nproc)" --target kvs-capture kvs-eval

out=${KVS_OUT:-out}
context=${KVS_CONTEXT:-4096}
sequences=${KVS_SEQUENCES:-2}
steps=${KVS_STEPS:-32}
methods=${KVS_METHODS:-dense,tactic}
mkdir -p "$out"
backend=cpu
if nvidia-smi >/dev/null 2>&1; then backend=cuda; fi

bin="$KVS_BUILD_DIR/tools"
"$bin/kvs-capture" --model models/kvs-tiny-a --text data/corpus/docs.val.txt.gz \
  --context "$context" --sequences "$sequences" --decode-steps "$steps" --out "$out/capture.h5"
"$bin/kvs-eval" --capture "$out/capture.h5" --methods "$methods" --backend "$backend" --per-layer \
  --json "$out/eval.json" --csv "$out/eval.csv" --plot "$out/eval.png"
echo "main: wrote $out/capture.h5, $out/eval.json, $out/eval.csv, $out/eval.png"
