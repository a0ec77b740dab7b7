// The vector type of cpinfer's CPU kernels (cpu_decode.cpp, cpu_prefill.cpp, cpu_rmsnorm.cpp): 16 floats as one
// value through GCC / Clang vector extensions (an AVX-512 register where the CPU has them, else pairs or quadruples of
// narrower ones); loads through memcpy, so no alignment is assumed.
#pragma once

#include <cstdint>
#include <cstring>

namespace cpinfer_vec {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr float kLog2e = 1.4426950408889634f;  // scores times this: softmax in base 2

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// x's lanes permuted (Clang's builtin, and GCC's own, which GCC had long before it took Clang's in version 12)
// and two vectors' lanes picked (indices 0-15: a's, 16-31: b's)
#if defined(__clang__)
#define CPINFER_PERMUTE(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#define CPINFER_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CPINFER_PERMUTE(x, ...) __builtin_shuffle(x, i16{__VA_ARGS__})
#define CPINFER_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, i16{__VA_ARGS__})
#endif

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

// 2^x for x <= 0 (masked lanes: -inf or below -126 give 0): x = n + f, f in [-1/2, 1/2], 2^f by its Taylor series
// to degree 7 (truncation error under 1e-8, below float32's rounding), n added to the exponent.
inline v16 exp2v(v16 x) {
  const v16 lo = x < -126.0f ? v16{} + 1.0f : v16{};  // lanes that underflow
  x = x < -126.0f ? v16{} - 126.0f : x;
  const v16 magic = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = x + magic;
  const v16 n = t - magic;
  const v16 f = x - n;
  v16 p = v16{} + 1.5252733804059841e-05f;  // ln2^7 / 7!
  p = p * f + 1.5403530393381610e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  i16 bits;
  std::memcpy(&bits, &p, sizeof(bits));
  i16 tn;
  std::memcpy(&tn, &t, sizeof(tn));
  bits += (tn - 0x4B400000) << 23;  // t's low mantissa bits hold n
  v16 r;
  std::memcpy(&r, &bits, sizeof(r));
  return lo > 0.0f ? v16{} : r;
}

// The lanes' maximum and sum by a tree of shuffles (four steps, not a chain of fifteen; the sum: another rounding
// order than hsum's)
inline float tree_max(v16 x) {
  x = vmax(x, CPINFER_PERMUTE(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = vmax(x, CPINFER_PERMUTE(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = vmax(x, CPINFER_PERMUTE(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = vmax(x, CPINFER_PERMUTE(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return x[0];
}

inline float tree_sum(v16 x) {
  x += CPINFER_PERMUTE(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += CPINFER_PERMUTE(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += CPINFER_PERMUTE(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += CPINFER_PERMUTE(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

// Four vectors' sums at once: lane 4u of the result is the sum of a_u's lanes (the other lanes: partial sums). Halves
// of pairs are added (lanes of a0 and a1 side by side, then of all four by quarters), then within each quarter: 13
// operations where four tree_sum would take 16 and four hsum 60.
inline v16 sum4(v16 a0, v16 a1, v16 a2, v16 a3) {
  const v16 s01 = CPINFER_SHUFFLE2(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  CPINFER_SHUFFLE2(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 s23 = CPINFER_SHUFFLE2(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  CPINFER_SHUFFLE2(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16 t = CPINFER_SHUFFLE2(s01, s23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
          CPINFER_SHUFFLE2(s01, s23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  t += CPINFER_PERMUTE(t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  t += CPINFER_PERMUTE(t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return t;
}

}  // namespace cpinfer_vec
