#!/usr/bin/env bash
# The main job on the embedded default model (models/kvs-tiny-a), end to end:
#   capture (pre-RoPE q/k, v, attention maps)    training text   -> train4k.h5, train_ap.h5
#   train   (SAAP centroids + query MLPs; AttentionPredictor CNN) -> saap.h5, attnpred.h5
#   indexbuild (bundle: trained parts + MagicPIG projection)      -> bundle.h5
#   capture of held-out text, then eval: every method and the baselines against fp64 dense
#   attention -> table on stdout, eval.json / eval.csv / eval.png
#   the model decoding held-out text with each method in every layer: bits per byte against
#   dense (ppl.json) and pass key retrieval (needle.json)
#   scripts/results.py: the Markdown report of that JSON -> results.md and its PNG plots
# Installs dependencies if missing and builds first. Uses the GPU where there is one. The
# training knobs are sized for a CPU in minutes (the papers' defaults are in kvs-train --help).
#   scripts/main.sh        (KVS_OUT=out, KVS_CONTEXT=4096, KVS_SEQUENCES=2, KVS_STEPS=32,
#                           KVS_PPL_CONTEXTS=8192, KVS_PPL_STEPS=32, KVS_NEEDLE_CONTEXTS=4096)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
cmake -S . -B "$KVS_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVS_CMAKE_ARGS:-} >/dev/null
cmake --build "$KVS_BUILD_DIR" -j "$(nproc)" --target kvs-capture kvs-train kvs-indexbuild kvs-eval

out=${KVS_OUT:-out}
context=${KVS_CONTEXT:-4096}
sequences=${KVS_SEQUENCES:-2}
steps=${KVS_STEPS:-32}
mkdir -p "$out"
backend=cpu device=cpu
if nvidia-smi >/dev/null 2>&1; then backend=cuda device=cuda; fi
bin="$KVS_BUILD_DIR/tools"
model=models/kvs-tiny-a
train_text=data/corpus/docs.train.txt.gz
val_text=data/corpus/docs.val.txt.gz
t0=$SECONDS
step() { echo; echo "== main: $* ($((SECONDS - t0)) s)"; }

step "capture training text"
"$bin/kvs-capture" --model $model --text $train_text --context "$context" --sequences 2 \
  --decode-steps 16 --device $device --out "$out/train4k.h5"
# AttentionPredictor learns from attention rows of decode steps: a history of 64 rows needs
# longer runs of decode steps than the other methods do.
"$bin/kvs-capture" --model $model --text $train_text --offset 100000 --context 2048 \
  --sequences 4 --decode-steps 160 --device $device --out "$out/train_ap.h5"

step "train SAAP and AttentionPredictor"
"$bin/kvs-train" saap --capture "$out/train4k.h5" --clusters 128 --recent 256 --hidden 256 \
  --iterations 200 --batch 256 --lr 1e-3 --probes 8 --device $device -o "$out/saap.h5"
# One history per kv head (--group-history: the group's largest rows; the bundle tells the
# engine): on this GQA model it recovers more attention mass at equal KV read than a history per
# query head and its GPU step is 1.6-2x cheaper (docs/analysis.md, docs/gpu.md). Its samples are
# a group's fewer, so 12 epochs cost what 3 per query head did.
"$bin/kvs-train" attnpred --capture "$out/train_ap.h5" --epochs 12 --group-history -o "$out/attnpred.h5"

step "indexbuild"
"$bin/kvs-indexbuild" --model $model --trained "$out/saap.h5" "$out/attnpred.h5" --magicpig \
  -o "$out/bundle.h5"

step "capture held-out text"
"$bin/kvs-capture" --model $model --text $val_text --context "$context" --sequences "$sequences" \
  --decode-steps "$steps" --device $device --out "$out/capture.h5"

step "eval"
"$bin/kvs-eval" --capture "$out/capture.h5" --bundle "$out/bundle.h5" --backend $backend \
  --methods dense tactic mac magicpig saap:recent_tokens=256,probes=8 attnpred \
  attnpred:calibration_keys=e4m3 attnpred:calibration_keys=int4 \
  --budgets 0.05,0.1,0.2 --per-layer \
  --json "$out/eval.json" --csv "$out/eval.csv" --plot "$out/eval.png"
# The same methods inside the model's decode loop (prefill dense, then every layer through the
# method's engine); on a CPU the contexts are sized for minutes.
methods=(dense tactic mac magicpig saap:recent_tokens=256,probes=8 attnpred)
step "perplexity with each method in the decode loop"
"$bin/kvs-eval" ppl --model $model --text $val_text --bundle "$out/bundle.h5" --device $device \
  --contexts "${KVS_PPL_CONTEXTS:-8192}" --windows 1 --steps "${KVS_PPL_STEPS:-32}" \
  --offset 200000 --methods "${methods[@]}" --json "$out/ppl.json"
step "pass key retrieval with each method"
"$bin/kvs-eval" needle --model $model --text $val_text --bundle "$out/bundle.h5" --device $device \
  --contexts "${KVS_NEEDLE_CONTEXTS:-4096}" --depths 0.1,0.5,0.9 --trials 1 \
  --methods "${methods[@]}" --json "$out/needle.json"
step "report"
python3 scripts/results.py "$out"
echo "main: done in $((SECONDS - t0)) s; wrote $out/{capture,bundle,eval,ppl,needle}.* and" \
  "$out/results.md"
