// The gated MLP's SiLU(gate) * up on the CPU in float32, in one pass (cpinfer/attention/cpu_kernels.py builds and
// loads this file with the other kernels; the op is torch.ops.cpinfer.silu_mul; cpinfer/model/blocks.py calls it).
//
// gate, up [L, I] float32 (rows may be strided, e.g. column views of one fused gate / up GEMM; channels contiguous)
// -> out [L, I] contiguous: gate * sigmoid(gate) * up. sigmoid through e = 2^(-|x| log2(e)) (cpu_vec.h's exp2, in
// (0, 1], no overflow): 1 / (1 + e) for x >= 0, e / (1 + e) below. Where torch reads and writes the intermediate
// three times (silu, the product, and a copy of the strided result for the down projection), this reads each input
// once and writes once; values within float32 rounding of torch's (another exp).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>

#include "cpu_vec.h"

namespace {

using cpinfer_vec::exp2v;
using cpinfer_vec::kLog2e;
using cpinfer_vec::load16;
using cpinfer_vec::v16;

inline float silu_mul_one(float x, float u) {
  const float e = std::exp(-std::fabs(x));
  const float s = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return x * s * u;
}

void row(const float* __restrict__ g, const float* __restrict__ u, int64_t n, float* __restrict__ o) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 x = load16(g + i);
    const v16 neg = x < 0.0f ? -x : x;  // |x|
    const v16 e = exp2v(-neg * kLog2e);
    const v16 one = v16{} + 1.0f;
    const v16 s = (x >= 0.0f ? one : e) / (one + e);
    const v16 r = x * s * load16(u + i);
    std::memcpy(o + i, &r, sizeof(r));
  }
  for (; i < n; ++i) o[i] = silu_mul_one(g[i], u[i]);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat, "silu_mul: float32 gate and up");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "silu_mul: gate and up [L, I] of one shape");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1, "silu_mul: channels contiguous");
  const int64_t l = gate.size(0), n = gate.size(1);
  auto out = at::empty({l, n}, gate.options());
  const float* gp = gate.data_ptr<float>();
  const float* up_ = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g_row = gate.stride(0), u_row = up.stride(0);
  at::parallel_for(0, l, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) row(gp + t * g_row, up_ + t * u_row, n, op + t * n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpinfer, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
