# Sourced by the scripts: puts nvcc on PATH where the toolkit lives in /usr/local/cuda.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
export KVS_BUILD_DIR=${KVS_BUILD_DIR:-build}
