// RMSNorm on the CPU in float32, one read and one write per row (cpinfer/attention/cpu_kernels.py builds and loads
// this file with the other kernels; the op is torch.ops.cpinfer.rms_norm; cpinfer/model/norms.py calls it).
//
// x [R, C] or [R, H, C] float32 (rows and heads may be strided; channels contiguous), weight [C] float32
// -> out of x's shape, contiguous: out = weight * (x * 1 / sqrt(mean(x^2) + eps)), each row alone.
// The sum of squares runs in float32 over 16 lanes, then the lanes' tree: an order fixed by C alone, so a row's bits
// do not depend on how many rows come with it (a decode step and a prefill agree). torch's rms_norm sums in
// another order: the two agree within float32 rounding, not to the bit.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>

#include "cpu_vec.h"

namespace {

using cpinfer_vec::v16;

void norm_row(const float* __restrict__ x, const float* __restrict__ w, int64_t c, float eps,
              float* __restrict__ o) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= c; i += 16) {
    const v16 a = cpinfer_vec::load16(x + i);
    acc += a * a;
  }
  for (int64_t j = 0; i < c; ++i, ++j) acc[j] += x[i] * x[i];  // a ragged tail (C % 16) into the first lanes
  const float ss = cpinfer_vec::tree_sum(acc);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(c) + eps);
#pragma omp simd
  for (int64_t k = 0; k < c; ++k) o[k] = w[k] * (x[k] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 x and weight");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && weight.dim() == 1, "rms_norm: x [R, C] or [R, H, C], weight [C]");
  const int64_t c = x.size(-1);
  TORCH_CHECK(weight.size(0) == c, "rms_norm: weight has ", weight.size(0), " channels, x ", c);
  TORCH_CHECK(x.stride(-1) == 1 && weight.stride(0) == 1, "rms_norm: channels contiguous");
  const int64_t r = x.size(0), h = x.dim() == 3 ? x.size(1) : 1;
  const int64_t x_row = x.stride(0), x_head = x.dim() == 3 ? x.stride(1) : 0;
  auto out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, r * h, std::max<int64_t>(1, 16384 / std::max<int64_t>(c, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(xp + (i / h) * x_row + (i % h) * x_head, wp, c, e, op + i * c);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpinfer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
