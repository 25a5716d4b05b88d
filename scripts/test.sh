#!/usr/bin/env bash
# The test command: installs dependencies if missing, builds everything, runs every test.
# GPU tests skip where there is no GPU; CPU tests always run.
#   scripts/test.sh            (build folder: build/, or $KVS_BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
source scripts/env.sh
cmake -S . -B "$KVS_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVS_CMAKE_ARGS:-}
cmake --build "$KVS_BUILD_DIR" -j "$(nproc)"
cd "$KVS_BUILD_DIR"
ctest --output-on-failure -j "$(nproc)"
