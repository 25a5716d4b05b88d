#!/usr/bin/env bash
# Installs kvsparse's build and test dependencies from Debian 12 packages. Idempotent: does
# nothing when everything is present. The CUDA Toolkit (nvcc) is not a Debian main package:
# it must already be installed (this machine kind ships CUDA 13 in /usr/local/cuda).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libhdf5-dev hdf5-tools
  libeigen3-dev
  libboost-program-options-dev
  libgtest-dev libgmock-dev
  libopenblas-dev liblapack-dev
  libfaiss-dev
  libtorch-dev
  gnuplot-nox
  python3-h5py python3-numpy
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Faiss and libtorch link the generic libblas/liblapack names: point them at OpenBLAS so
# neither runs on the reference BLAS.
arch_dir=/usr/lib/x86_64-linux-gnu
if [ -e "$arch_dir/openblas-pthread/libblas.so.3" ] && [ "$(id -u)" -eq 0 ]; then
  update-alternatives --quiet --set libblas.so.3-x86_64-linux-gnu "$arch_dir/openblas-pthread/libblas.so.3" || true
  update-alternatives --quiet --set liblapack.so.3-x86_64-linux-gnu "$arch_dir/openblas-pthread/liblapack.so.3" || true
fi

if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "install_deps: nvcc (CUDA Toolkit 12.4 or newer) not found; install it and put it on PATH" >&2
  exit 1
fi
