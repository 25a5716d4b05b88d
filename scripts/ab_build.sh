#!/usr/bin/env bash
# Builds two versions side by side for an A/B measured in one call of the GPU machine: the
# working tree in build-gpu and a base revision in build-base (docs/gpu.md, "Working on the
# GPU machine").
#   here:  scripts/ab_build.sh pack [REV]       git archive of REV (default HEAD) into
#                                               build-carry/base.tgz; carry that file
#   there: scripts/ab_build.sh build TARGET...  configures (once) and builds TARGET... in both
#                                               (e.g. tools/kvs-bench tests/kvs_tests_cuda)
# Both use the staged deps in .deps and no libtorch; each build takes 50-60 s on the machine's
# 16 cores for the benchmarks and the CUDA tests. A newer base.tgz replaces build-base.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
cmd=${1:-}
shift || true
configure() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DKVS_WITH_TORCH=OFF -DKVS_DEPS_PREFIX="$PWD/.deps" \
    -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/configure_$(basename "$2").log" 2>&1 ||
    { tail -20 "$OUT/configure_$(basename "$2").log"; exit 1; }
}
case "$cmd" in
  pack)
    mkdir -p build-carry
    git archive -o build-carry/base.tgz "${1:-HEAD}" CMakeLists.txt cmake kernels runtime \
      artifacts capture train indexbuild tools tests
    echo "build-carry/base.tgz: $(git rev-parse --short "${1:-HEAD}")"
    ;;
  build)
    [ $# -gt 0 ] || { echo "ab_build.sh build: name the targets" >&2; exit 2; }
    [ -f build-carry/base.tgz ] || { echo "ab_build.sh: build-carry/base.tgz missing (pack it here, carry it)" >&2; exit 2; }
    t0=$SECONDS
    [ -f build-gpu/build.ninja ] || configure . build-gpu
    # A call that carries build-carry again replaces it, base-src with it: then too.
    if [ ! -f build-base/build.ninja ] || [ ! -d build-carry/base-src ] ||
      [ build-carry/base.tgz -nt build-base/build.ninja ]; then
      rm -rf build-carry/base-src build-base
      mkdir -p build-carry/base-src
      tar xzf build-carry/base.tgz -C build-carry/base-src
      configure build-carry/base-src build-base
    fi
    ninja -C build-base -j6 "$@" > "$OUT/build_base.log" 2>&1 &
    base=$!
    ok=1
    ninja -C build-gpu -j12 "$@" > "$OUT/build.log" 2>&1 || { ok=0; grep -A20 FAILED "$OUT/build.log" | head -40; }
    wait $base || { ok=0; echo "base build FAILED"; grep -A20 FAILED "$OUT/build_base.log" | head -40; }
    [ $ok = 1 ] || exit 1
    echo "built build-gpu and build-base in $((SECONDS - t0)) s"
    ;;
  *)
    sed -n '2,10p' "$0" >&2
    exit 2
    ;;
esac
