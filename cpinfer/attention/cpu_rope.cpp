// Rotary position embedding on the CPU in float32, in one pass (cpinfer/attention/cpu_kernels.py builds and loads
// this file with the attention kernels; the op is torch.ops.cpinfer.rope; cpinfer/model/rope.py calls it).
//
// x [L, H, D] float32 (rows and heads may be strided; channels contiguous), cos / sin [L, D/2] float32
// -> out [L, H, D] contiguous: the pairs (i, i + D/2) rotated, out_i = x_i c - x_{i+D/2} s and
//    out_{i+D/2} = x_{i+D/2} c + x_i s, each product rounded before the sum (no fused multiply-add): the same bits as
//    torch's element-wise ops in model/rope.py, so a model's results do not move by a rounding.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>

namespace {

#if defined(__clang__)
#define CPINFER_NO_CONTRACT
#elif defined(__GNUC__)
#define CPINFER_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define CPINFER_NO_CONTRACT
#endif

CPINFER_NO_CONTRACT void rotate(const float* __restrict__ x, const float* __restrict__ c, const float* __restrict__ s,
                                int64_t half, float* __restrict__ o) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const float* __restrict__ x2 = x + half;
  float* __restrict__ o2 = o + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i], b = x2[i] * s[i];
    o[i] = a - b;
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x2[i] * c[i], b = x[i] * s[i];
    o2[i] = a + b;
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: float32 x, cos, sin");
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.dim() == 2, "rope: x [L, H, D], cos / sin [L, D/2]");
  const int64_t l = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == l && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rope: shapes do not match (cos / sin [L, D/2] for x [L, H, D], D even)");
  TORCH_CHECK(x.stride(2) == 1 && cos.stride(1) == 1 && sin.stride(1) == 1, "rope: channels contiguous");
  auto out = at::empty({l, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_row = x.stride(0), x_head = x.stride(1), c_row = cos.stride(0), s_row = sin.stride(0);
  at::parallel_for(0, l * h, std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / h, hd = i % h;
      rotate(xp + t * x_row + hd * x_head, cp + t * c_row, sp + t * s_row, half, op + i * d);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpinfer, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
}
