// A few rows times a weight on the CPU in float32: x [M, K] @ w[N, K]^T (+ bias) for a decode step's M rows
// (cpinfer/attention/cpu_kernels.py builds and loads this file with the other kernels; the ops are
// torch.ops.cpinfer.small_linear, small_linear_tiles and small_linear_tiled; cpinfer/model/cpu_gemm.py calls them for
// a decode step's 1-4 rows, and up to 16 for a weight left without oneDNN's packed copy).
//
// A decode step reads every weight once for a few rows: the product is a stream of the weight from memory, and the
// BLAS' matrix-vector and short-M kernels stream it at a fraction of the memory's rate on some CPUs (7-10 GB/s of
// ~26 on the AMD EPYC of docs/benchmarks.md). Here each thread takes a contiguous range of the weight's rows and
// reads it once, four rows at a time, against up to four of x's rows: 4 x 4 accumulators of 16 lanes in registers,
// sixteen FMAs for eight loads. More rows of x re-read the same four weight rows from L1.
//
// Four rows of the weight read side by side are four streams from memory, which one core pulls at about half the
// rate of one stream (one thread, 1 row: 9-13 GB/s against 16-22). `small_linear_tiles` copies the weight once into
// an interleaved layout, [N / 4, K / 16, 4, 16] (rounded up, zeros past N and K): each tile of four rows is then one
// stream, 16 values of each row in turn, and `small_linear_tiled` reads it with the same loop (the SmolLM2-135M
// layers and LM head, 2 threads: 1 row 28-36 -> 23-31 ms; the engine's batch-4 decode step 40-50 -> 37-40 ms).
//
// Every output is the same sum whatever M, the tile, the thread or the layout: lane l of an accumulator adds k = l,
// l + 16, ... in order, a K % 16 tail is zero-padded into one last step, and the 16 lanes are summed by one tree
// (cpu_vec.h's sum4), then the bias added. So a row's result does not depend on the batch it is in
// (batch-invariant) nor on the copy, and it differs from the BLAS' by float32 rounding only (another order of the
// same products).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_vec.h"

namespace {

using cpinfer_vec::load16;
using cpinfer_vec::sum4;
using cpinfer_vec::v16;

// A loaded vector kept in a register for its four FMAs: GCC otherwise folds the load into every FMA (20 loads for
// 16 FMAs, where 8 do; 16 rows x the embedded model's weights: ~50 -> ~44 ms). One AVX-512 register per vector.
#if defined(__AVX512F__)
#define CPINFER_IN_REGISTER(x) asm("" : "+v"(x))
#else
#define CPINFER_IN_REGISTER(x) ((void)0)
#endif

constexpr int kRows = 4;     // weight rows per tile (four streams from memory)
constexpr int kMaxM = 16;    // rows of x the op takes (a decode step's few sequences)
#if defined(__AVX512F__)
constexpr int kGroup = 4;    // rows of x per tile: 16 accumulators of the 32 vector registers
constexpr int kBest = kMaxM;  // the rows up to which this beats MKL (measured on an AMD EPYC: all 16)
#else
constexpr int kGroup = 1;    // 16 registers of 8 lanes (AVX2): four accumulators (8 registers) and four weights
constexpr int kBest = 1;     // (built without AVX-512 on the same EPYC: 1 row 37 ms, 4 rows 90: MKL's from 2 rows)
#endif

// out[m, n + r] for m < MR, r < 4: x rows x[m] (stride xs), weight row r's k-th value at w[r][CS * k] for k in
// steps of 16 (CS 1: the weight's own rows; CS 4: a tile of the interleaved copy, w[r] = the tile + 16 r)
template <int MR, int CS>
inline void tile(const float* const* w, const float* x, int64_t xs, int64_t k, const float* bias, float* out,
                 int64_t os, int64_t n, int nr, const float* next) {
  v16 acc[MR][kRows];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = v16{};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    v16 w0 = load16(w[0] + CS * i), w1 = load16(w[1] + CS * i), w2 = load16(w[2] + CS * i),
        w3 = load16(w[3] + CS * i);
    if (next)  // the same line of the next tile's rows (a hint, never a fault): memory kept busy during the FMAs
      for (int r = 0; r < kRows; ++r) __builtin_prefetch(next + r * k + i);
    CPINFER_IN_REGISTER(w0);
    CPINFER_IN_REGISTER(w1);
    CPINFER_IN_REGISTER(w2);
    CPINFER_IN_REGISTER(w3);
    for (int m = 0; m < MR; ++m) {
      v16 xv = load16(x + m * xs + i);
      CPINFER_IN_REGISTER(xv);
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
      acc[m][3] += xv * w3;
    }
  }
  if (i < k) {  // the tail, zero-padded: one more step of the same sums
    const int64_t t = k - i;
    v16 wt[kRows];
    for (int r = 0; r < kRows; ++r) {
      wt[r] = v16{};
      std::memcpy(&wt[r], w[r] + CS * i, t * sizeof(float));
    }
    for (int m = 0; m < MR; ++m) {
      v16 xv{};
      std::memcpy(&xv, x + m * xs + i, t * sizeof(float));
      for (int r = 0; r < kRows; ++r) acc[m][r] += xv * wt[r];
    }
  }
  for (int m = 0; m < MR; ++m) {
    const v16 s = sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    for (int r = 0; r < nr; ++r) out[m * os + n + r] = s[4 * r] + (bias ? bias[n + r] : 0.0f);
  }
}

// bias float32 [n] contiguous, or nullptr
const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
              "small_linear: bias float32 [N], contiguous");
  return bias->data_ptr<float>();
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "small_linear: float32 x [M, K]");
  TORCH_CHECK(x.size(0) <= kMaxM, "small_linear: at most ", kMaxM, " rows of x, got ", x.size(0));
  TORCH_CHECK(x.stride(1) == 1, "small_linear: x's columns contiguous");
}

// x [M, K] times n weight rows read from wp: CS 1, the weight itself [n, K]; CS 4, its interleaved copy (tile t of
// four rows at wp + t * 4 * K16, K16 = K rounded up to 16)
template <int CS>
at::Tensor product(const at::Tensor& x, const float* wp, int64_t n, const float* bp) {
  const int64_t m = x.size(0), k = x.size(1), k16 = (k + 15) / 16 * 16;
  auto out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = std::max<int64_t>(x.stride(0), 1), tiles = (n + kRows - 1) / kRows;
  // ~64 KB of weight a task at least: a small weight stays on one thread (a fork costs more than its stream)
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k * kRows, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      const int nr = static_cast<int>(std::min<int64_t>(kRows, n - n0));
      const float* rows[kRows];
      const float* next = nullptr;  // the weight's own rows: this thread's next tile, prefetched during the first pass
      if (CS == 1) {
        for (int r = 0; r < kRows; ++r) rows[r] = wp + (n0 + std::min(r, nr - 1)) * k;  // past N: a repeat, dropped
        next = t + 1 < end ? wp + (n0 + kRows) * k : nullptr;
      } else {  // (the copy: one stream, which the hardware prefetches by itself; rows past N are zeros, dropped)
        for (int r = 0; r < kRows; ++r) rows[r] = wp + t * kRows * k16 + 16 * r;
      }
      int64_t i = 0;
      for (; i + kGroup <= m; i += kGroup) {
        tile<kGroup, CS>(rows, xp + i * xs, xs, k, bp, op + i * n, n, n0, nr, next);
        next = nullptr;
      }
      switch (m - i) {  // (AVX-512: a remainder of 1-3 rows)
        case 3: tile<3, CS>(rows, xp + i * xs, xs, k, bp, op + i * n, n, n0, nr, next); break;
        case 2: tile<2, CS>(rows, xp + i * xs, xs, k, bp, op + i * n, n, n0, nr, next); break;
        case 1: tile<1, CS>(rows, xp + i * xs, xs, k, bp, op + i * n, n, n0, nr, next); break;
        default: break;
      }
    }
  });
  return out;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "small_linear: float32 weight [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "small_linear: x has ", x.size(1), " columns, the weight ", w.size(1));
  TORCH_CHECK(w.is_contiguous(), "small_linear: the weight contiguous");
  return product<1>(x, w.data_ptr<float>(), w.size(0), bias_of(bias, w.size(0)));
}

// The same product from the weight's interleaved copy (`small_linear_tiles`): the same sums, the same bits.
at::Tensor small_linear_tiled(const at::Tensor& x, const at::Tensor& tiles, int64_t n,
                              const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const int64_t k = x.size(1);
  TORCH_CHECK(tiles.scalar_type() == at::kFloat && tiles.dim() == 4 && tiles.size(2) == kRows && tiles.size(3) == 16
                  && tiles.is_contiguous(), "small_linear_tiled: tiles float32 [N / 4, K / 16, 4, 16] (rounded up), "
              "contiguous");
  TORCH_CHECK(n >= 0 && tiles.size(0) == (n + kRows - 1) / kRows && tiles.size(1) == (k + 15) / 16,
              "small_linear_tiled: tiles ", tiles.sizes(), " do not hold ", n, " rows of ", k, " columns");
  return product<4>(x, tiles.data_ptr<float>(), n, bias_of(bias, n));
}

// weight [N, K] -> its interleaved copy [ceil(N / 4), ceil(K / 16), 4, 16]: each tile of four rows as one stream,
// 16 values of each row in turn, zeros past N and K
at::Tensor small_linear_tiles(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2, "small_linear_tiles: float32 weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1), n4 = (n + kRows - 1) / kRows * kRows, k16 = (k + 15) / 16 * 16;
  auto padded = at::zeros({n4, k16}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  auto tiles = at::empty({n4 / kRows, k16 / 16, kRows, 16}, w.options());
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // 2 MB pages where the kernel allows them (THP "madvise" or "always"), asked for before the copy touches the pages:
  // a stream of fewer TLB misses (the embedded model's 1-4 row products 6-20% faster); a hint, refusals ignored
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(tiles.data_ptr()) + 4095) & ~uintptr_t(4095);
  const uintptr_t end = reinterpret_cast<uintptr_t>(tiles.data_ptr()) + tiles.numel() * sizeof(float);
  if (end > begin + (uintptr_t(2) << 20)) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
  return tiles.copy_(padded.view({n4 / kRows, kRows, k16 / 16, 16}).transpose(1, 2));
}

int64_t small_linear_rows() { return kBest; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpinfer, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear));
  m.def("small_linear_tiled(Tensor x, Tensor tiles, int n, Tensor? bias=None) -> Tensor");
  m.impl("small_linear_tiled", c10::DispatchKey::CPU, TORCH_FN(small_linear_tiled));
  m.def("small_linear_tiles(Tensor weight) -> Tensor");
  m.impl("small_linear_tiles", c10::DispatchKey::CPU, TORCH_FN(small_linear_tiles));
  // the rows up to which the callers should prefer small_linear on this build (16 with AVX-512, else 1)
  m.def("small_linear_rows() -> int", TORCH_FN(small_linear_rows));
}
