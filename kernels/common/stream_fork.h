// A branch of work off a caller's stream, for steps whose parts do not depend on each other
// (SAAP's index step beside its router, AttentionPredictor's calibration row and predictor
// beside the later layers). Both ends are an event record plus a wait, so eager calls overlap the
// branches and stream capture records them as two branches of the graph.
#pragma once

#include <cuda_runtime_api.h>

namespace kvs::kernels {

// A side stream and the two events that fork it from, and join it back into, another stream.
// Owned by the caller (runtime: OwnedStreamFork); created once, reused every step.
struct StreamFork {
  cudaStream_t side = nullptr;
  cudaEvent_t forked = nullptr, joined = nullptr;
};

// Work queued on f.side from now on runs after everything queued on `from` so far.
inline cudaError_t fork_from(const StreamFork& f, cudaStream_t from) {
  const cudaError_t e = cudaEventRecord(f.forked, from);
  return e != cudaSuccess ? e : cudaStreamWaitEvent(f.side, f.forked, 0);
}

// Work queued on `into` from now on runs after everything queued on f.side so far.
inline cudaError_t join_into(const StreamFork& f, cudaStream_t into) {
  const cudaError_t e = cudaEventRecord(f.joined, f.side);
  return e != cudaSuccess ? e : cudaStreamWaitEvent(into, f.joined, 0);
}

}  // namespace kvs::kernels
