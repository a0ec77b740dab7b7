// The vector type of cpinfer's CPU kernels (cpu_decode.cpp, cpu_prefill.cpp): 16 floats as one value through GCC /
// Clang vector extensions (an AVX-512 register where the CPU has them, else pairs or quadruples of narrower ones);
// loads through memcpy, so no alignment is assumed.
#pragma once

#include <cstring>

namespace cpinfer_vec {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline float hsum(v16 x) {
  float t = 0.0f;
  for (int c = 0; c < 16; ++c) t += x[c];
  return t;
}

}  // namespace cpinfer_vec
