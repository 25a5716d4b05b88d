#!/usr/bin/env bash
# Stages what the GPU machine lacks (see docs/gpu.md): Debian's static Faiss and static
# Boost.ProgramOptions, with their headers, into one folder that travels with a device run.
#   scripts/stage_gpu_deps.sh [DEST=.deps]
# Then build there with -DKVS_DEPS_PREFIX=$PWD/.deps (scripts/gpu_check.sh does).
set -euo pipefail
dest=${1:-.deps}
for f in /usr/lib/x86_64-linux-gnu/libfaiss.a /usr/lib/x86_64-linux-gnu/libboost_program_options.a \
         /usr/include/faiss/IndexFlat.h /usr/include/boost/program_options.hpp; do
  [ -e "$f" ] || { echo "stage_gpu_deps: $f is missing; run scripts/install_deps.sh first" >&2; exit 1; }
done
rm -rf "$dest"
mkdir -p "$dest/lib" "$dest/include/boost"
cp /usr/lib/x86_64-linux-gnu/libfaiss.a /usr/lib/x86_64-linux-gnu/libboost_program_options.a "$dest/lib/"
cp -r /usr/include/faiss "$dest/include/"
# Only program_options' own headers: the rest of Boost comes from the GPU machine, and these
# must win over its newer copy so that they match the staged library.
cp -r /usr/include/boost/program_options /usr/include/boost/program_options.hpp "$dest/include/boost/"
du -sh "$dest"
