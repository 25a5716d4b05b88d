// The vectorised inner loops of the CPU sampled attention, one set per instruction set.
//
// Each set lives in its own translation unit compiled with its own flags
// (magicpig_isa_avx2.cpp: -mavx2 -mfma, magicpig_isa_avx512.cpp: -mavx512f), and the
// caller picks one at run time (resolve_isa, __builtin_cpu_supports), so the default build
// runs on any x86-64. Those units define everything in an anonymous namespace and use no
// inline function or template from another header: a weak symbol compiled with AVX-512
// there could otherwise be the copy the linker keeps for the whole program.
// The sets are constant tables of function pointers: selecting one runs no code.
#pragma once

#include <stdint.h>

namespace kvs::kernels::magicpig::isa {

struct Kernels {
  const char* name;
  // out[i] = q . rows[ids[i]] for i < n; rows are d bf16 values (their 16-bit words).
  void (*gather_dot)(const float* q, const uint16_t* rows, const int32_t* ids, int n, int d,
                     float* out);
  // acc[0..d) += sum over i < n of w[i] * rows[ids[i]].
  void (*gather_axpy)(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d,
                      float* acc);
  int lanes;  // d must be a multiple of this
};

extern const Kernels kPortable;
extern const Kernels kAvx2;    // defined only on x86-64
extern const Kernels kAvx512;  // defined only on x86-64

}  // namespace kvs::kernels::magicpig::isa
