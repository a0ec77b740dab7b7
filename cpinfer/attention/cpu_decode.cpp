// Batched decode attention on the CPU: every decode query of a step against its own keys, read in place from the
// paged KV store, in one call (cpinfer/attention/cpu_kernels.py builds and loads this file; the op is
// torch.ops.cpinfer.decode_attention).
//
// q     [N, H, D]        float32, one decode query per row
// k     [S, Hkv, D]      float32, the layer's key store (rows may be strided; the last dimension contiguous)
// v     [S, Hkv, Dv]     float32, the value store (may be a view of k's first channels)
// runs  [R, 2]           int64, slot runs [a, e) of the store
// first [N + 1]          int64, row n reads runs first[n] .. first[n + 1] - 1 (at least one key in all)
// -> out [N, H, Dv]      softmax(scale q k^T) v per query head; query head h reads KV head h / (H / Hkv)
//
// Work items are (row, piece of its keys): an item streams its keys' rows in store order, block by block, and for
// each KV head reads a key and value row once for the G = H / Hkv query heads that share it (online softmax over
// the blocks; the next block's rows prefetched meanwhile). Head sizes 64 and 128 run in register tiles: 16 keys'
// scores for up to 4 query heads at a time, and each value row loaded once into registers for up to 4 (128: 2)
// heads' accumulators (measured on a 2-core Zen 4: a batch-4 decode step's attention at ~550 tokens 9.6 -> 7 ms,
// the whole step ~2 ms less). Items are shared among torch's intra-op threads (at::parallel_for: the same OpenMP
// team as every other op). With fewer rows than twice the threads each row's keys are cut into pieces (split-KV,
// pieces of at least kMinPiece keys) so that every thread has work, and the pieces' partial softmax sums merged at
// the end.
// Arithmetic is float32 throughout; the softmax in base 2 (scores times log2(e): a vector exp2, cpu_vec.h).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace {

using cpinfer_vec::exp2v;
using cpinfer_vec::i16;
using cpinfer_vec::kLog2e;
using cpinfer_vec::load16;
using cpinfer_vec::sum4;
using cpinfer_vec::tree_max;
using cpinfer_vec::tree_sum;
using cpinfer_vec::v16;
using cpinfer_vec::vmax;

constexpr int64_t kBlock = 64;       // keys scored per pass of the online softmax
constexpr int64_t kMinPiece = 256;   // keys per split-KV piece at least
constexpr int64_t kMaxG = 16;        // query heads scored at a time (more per KV head: in groups of this many)

struct Partial {  // an item's unnormalised result: acc [H, Dv], running max m [H], sum l [H]
  float* acc;
  float* m;
  float* l;
};

// Any head size (attend<0, 0>): scores of the g query heads at q (rows d apart) against n key rows at k (k_row
// floats apart) into s[i * kBlock + j], then acc[i] += sum_j s[i * kBlock + j] v_j, one dot product / row at a time.
void scores_any(const float* __restrict__ q, int64_t g, int64_t d, const float* __restrict__ k, int64_t k_row,
                int64_t n, float scale, float* __restrict__ s) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict__ kj = k + j * k_row;
    for (int64_t i = 0; i < g; ++i) {
      const float* __restrict__ qi = q + i * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < d; ++c) dot += qi[c] * kj[c];
      s[i * kBlock + j] = dot * scale;
    }
  }
}

void accumulate_any(const float* __restrict__ s, int64_t g, int64_t dv, const float* __restrict__ v, int64_t v_row,
                    int64_t n, float* __restrict__ acc) {
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict__ vj = v + j * v_row;
    for (int64_t i = 0; i < g; ++i) {
      const float p = s[i * kBlock + j];
      float* __restrict__ ai = acc + i * dv;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) ai[c] += p * vj[c];
    }
  }
}

// Head sizes known at compile time (64, 128: attend<D, D>) in tiles of query heads that share a KV head.
// The 16 scores of keys j .. j + 15 for GG query heads: four keys at a time, one accumulator per (head, key), each
// four keys' sums reduced together (sum4 leaves key u's sum in lanes 4u .. 4u + 3), the four groups blended into one
// vector (lane L from group L % 4: key 4 (L % 4) + L / 4) and put back in key order by one permute.
template <int64_t D, int64_t GG>
inline void scores16(const float* __restrict__ q, const float* __restrict__ k, int64_t k_row, float scale,
                     float* __restrict__ s) {
  static_assert(D % 16 == 0);
  const i16 lane_mod4 = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  v16 r[GG];
  for (int64_t grp = 0; grp < 4; ++grp) {
    const float* __restrict__ kk = k + 4 * grp * k_row;
    v16 acc[GG][4] = {};
    for (int64_t c = 0; c < D; c += 16) {
      const v16 k0 = load16(kk + c), k1 = load16(kk + k_row + c);
      const v16 k2 = load16(kk + 2 * k_row + c), k3 = load16(kk + 3 * k_row + c);
      for (int64_t i = 0; i < GG; ++i) {
        const v16 qv = load16(q + i * D + c);
        acc[i][0] += qv * k0;
        acc[i][1] += qv * k1;
        acc[i][2] += qv * k2;
        acc[i][3] += qv * k3;
      }
    }
    for (int64_t i = 0; i < GG; ++i) {
      const v16 t = sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      r[i] = grp == 0 ? t : (lane_mod4 == static_cast<int32_t>(grp) ? t : r[i]);
    }
  }
  for (int64_t i = 0; i < GG; ++i) {
    const v16 x = CPINFER_PERMUTE(r[i], 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15) * scale;
    std::memcpy(s + i * kBlock, &x, sizeof(x));
  }
}

// Scores of GG query heads (q rows D apart) against n <= kBlock key rows into s[i * kBlock + j], times scale.
template <int64_t D, int64_t GG>
void scores_tile(const float* __restrict__ q, const float* __restrict__ k, int64_t k_row, int64_t n, float scale,
                 float* __restrict__ s) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) scores16<D, GG>(q, k + j * k_row, k_row, scale, s + j);
  for (; j < n; ++j) {
    const float* __restrict__ kj = k + j * k_row;
    for (int64_t i = 0; i < GG; ++i) {
      v16 a = {};
      for (int64_t c = 0; c < D; c += 16) a += load16(q + i * D + c) * load16(kj + c);
      s[i * kBlock + j] = tree_sum(a) * scale;
    }
  }
}

// acc[i] += sum_j s[i * kBlock + j] v_j for GG heads over n value rows: each row read once into registers for all
// GG heads, GG * DV / 16 independent accumulators in registers over the block.
template <int64_t DV, int64_t GG>
void accumulate_tile(const float* __restrict__ s, const float* __restrict__ v, int64_t v_row, int64_t n,
                     float* __restrict__ acc) {
  constexpr int64_t C = DV / 16;
  v16 a[GG][C];
  for (int64_t i = 0; i < GG; ++i)
    for (int64_t c = 0; c < C; ++c) a[i][c] = load16(acc + i * DV + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    v16 vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = load16(v + j * v_row + 16 * c);
    for (int64_t i = 0; i < GG; ++i) {
      const v16 p = v16{} + s[i * kBlock + j];
      for (int64_t c = 0; c < C; ++c) a[i][c] += p * vv[c];
    }
  }
  for (int64_t i = 0; i < GG; ++i) std::memcpy(acc + i * DV, a[i], sizeof(a[i]));
}

template <int64_t D>
void scores_heads(const float* q, int64_t gg, const float* k, int64_t k_row, int64_t n, float scale, float* s) {
  int64_t i = 0;
  for (; i + 4 <= gg; i += 4) scores_tile<D, 4>(q + i * D, k, k_row, n, scale, s + i * kBlock);
  switch (gg - i) {
    case 3: scores_tile<D, 3>(q + i * D, k, k_row, n, scale, s + i * kBlock); break;
    case 2: scores_tile<D, 2>(q + i * D, k, k_row, n, scale, s + i * kBlock); break;
    case 1: scores_tile<D, 1>(q + i * D, k, k_row, n, scale, s + i * kBlock); break;
    default: break;
  }
}

template <int64_t DV>
void accumulate_heads(const float* s, int64_t gg, const float* v, int64_t v_row, int64_t n, float* acc) {
  constexpr int64_t T = DV <= 64 ? 4 : 2;  // heads a tile: T * DV / 16 accumulators + DV / 16 value registers
  int64_t i = 0;
  for (; i + T <= gg; i += T) accumulate_tile<DV, T>(s + i * kBlock, v, v_row, n, acc + i * DV);
  switch (gg - i) {
    case 3: accumulate_tile<DV, 3>(s + i * kBlock, v, v_row, n, acc + i * DV); break;
    case 2: accumulate_tile<DV, 2>(s + i * kBlock, v, v_row, n, acc + i * DV); break;
    case 1: accumulate_tile<DV, 1>(s + i * kBlock, v, v_row, n, acc + i * DV); break;
    default: break;
  }
}

// Keys [lo, hi) of a row's runs (indices into the runs' concatenation) for all H = hkv * g query heads at q: block
// by block of keys, every KV head in turn, so a thread streams the store's rows [slot][Hkv][D] in order.
template <int64_t D, int64_t DV>
void attend(const float* __restrict__ q, int64_t hkv, int64_t g, int64_t d_rt, int64_t dv_rt,
            const float* __restrict__ k, const float* __restrict__ v, int64_t k_row, int64_t k_head, int64_t v_row,
            int64_t v_head, const int64_t* runs, int64_t r0, int64_t r1, int64_t lo, int64_t hi, float scale,
            Partial part) {
  const int64_t d = D > 0 ? D : d_rt, dv = DV > 0 ? DV : dv_rt, h = hkv * g;
  float* __restrict__ acc = part.acc;  // [H, Dv]
  float* __restrict__ m = part.m;      // [H]
  float* __restrict__ l = part.l;
  for (int64_t i = 0; i < h; ++i) {
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::fill(acc, acc + h * dv, 0.0f);
  alignas(64) float s[kMaxG * kBlock];
  const int64_t kspan = (hkv - 1) * k_head + d, vspan = (hkv - 1) * v_head + dv;  // a slot's floats in use
  int64_t base = 0;  // index of run r's first key in the concatenation
  for (int64_t r = r0; r < r1 && base < hi; ++r) {
    const int64_t a = runs[2 * r], e = runs[2 * r + 1], len = e - a;
    const int64_t from = std::max<int64_t>(lo - base, 0), to = std::min<int64_t>(hi - base, len);
    base += len;
    for (int64_t j0 = a + from; j0 < a + to; j0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, a + to - j0);
      for (int64_t j = j0 + n, j1 = std::min<int64_t>(a + to, j0 + n + kBlock); j < j1; ++j) {  // the next block
        for (int64_t c = 0; c < kspan; c += 16) __builtin_prefetch(k + j * k_row + c);
        for (int64_t c = 0; c < vspan; c += 16) __builtin_prefetch(v + j * v_row + c);
      }
      for (int64_t kh = 0; kh < hkv; ++kh)
      for (int64_t g0 = 0; g0 < g; g0 += kMaxG) {  // a KV head's query heads, kMaxG at a time
        const int64_t gg = std::min<int64_t>(kMaxG, g - g0), h0 = kh * g + g0;
        float* __restrict__ mh = m + h0;
        float* __restrict__ lh = l + h0;
        float* __restrict__ ah = acc + h0 * dv;
        if constexpr (D > 0)
          scores_heads<D>(q + h0 * d, gg, k + j0 * k_row + kh * k_head, k_row, n, scale, s);
        else
          scores_any(q + h0 * d, gg, d, k + j0 * k_row + kh * k_head, k_row, n, scale, s);
        for (int64_t i = 0; i < gg; ++i) {  // base 2 (log2(e) is in the scale): vector exp2 and tree reductions
          float* __restrict__ si = s + i * kBlock;
          for (int64_t j = n; j < kBlock; ++j) si[j] = -std::numeric_limits<float>::infinity();  // 2^-inf = 0
          v16 x0 = load16(si), x1 = load16(si + 16), x2 = load16(si + 32), x3 = load16(si + 48);
          const float mx = std::max(mh[i], tree_max(vmax(vmax(x0, x1), vmax(x2, x3))));
          const float alpha = std::exp2(mh[i] - mx);  // rescales what was summed before this block (0 at first)
          x0 = exp2v(x0 - mx);
          x1 = exp2v(x1 - mx);
          x2 = exp2v(x2 - mx);
          x3 = exp2v(x3 - mx);
          std::memcpy(si, &x0, sizeof(v16));
          std::memcpy(si + 16, &x1, sizeof(v16));
          std::memcpy(si + 32, &x2, sizeof(v16));
          std::memcpy(si + 48, &x3, sizeof(v16));
          lh[i] = lh[i] * alpha + tree_sum((x0 + x1) + (x2 + x3));
          mh[i] = mx;
          float* __restrict__ ai = ah + i * dv;
#pragma omp simd
          for (int64_t c = 0; c < dv; ++c) ai[c] *= alpha;
        }
        if constexpr (DV > 0)
          accumulate_heads<DV>(s, gg, v + j0 * v_row + kh * v_head, v_row, n, ah);
        else
          accumulate_any(s, gg, dv, v + j0 * v_row + kh * v_head, v_row, n, ah);
      }
    }
  }
}

using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*, int64_t,
                          int64_t, int64_t, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, float,
                          Partial);

AttendFn pick(int64_t d, int64_t dv) {  // compile-time head sizes for the common ones (register tiles)
  if (d == 64 && dv == 64) return attend<64, 64>;
  if (d == 128 && dv == 128) return attend<128, 128>;
  return attend<0, 0>;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& runs,
                            const at::Tensor& first, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "decode_attention: q [N, H, D], k [S, Hkv, D], v [S, Hkv, Dv]");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: contiguous q");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: a key / value row's channels contiguous");
  TORCH_CHECK(runs.scalar_type() == at::kLong && first.scalar_type() == at::kLong && runs.is_contiguous() &&
                  first.is_contiguous(), "decode_attention: int64 contiguous runs and first");
  const int64_t nq = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(1), dv = v.size(2);
  TORCH_CHECK(k.size(2) == d && v.size(1) == hkv && h % hkv == 0 && first.numel() == nq + 1,
              "decode_attention: shapes do not match");
  const int64_t g = h / hkv;
  auto out = at::empty({nq, h, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* rp = runs.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t k_row = k.stride(0), k_head = k.stride(1), v_row = v.stride(0), v_head = v.stride(1);
  const float sc = static_cast<float>(scale) * kLog2e;  // scores in base 2
  std::vector<int64_t> keys(nq);  // keys per row
  int64_t longest = 0;
  for (int64_t n = 0; n < nq; ++n) {
    int64_t t = 0;
    for (int64_t r = fp[n]; r < fp[n + 1]; ++r) t += rp[2 * r + 1] - rp[2 * r];
    TORCH_CHECK(t > 0, "decode_attention: a row without keys");
    keys[n] = t;
    longest = std::max(longest, t);
  }
  const int64_t threads = at::get_num_threads();
  int64_t pieces = 1;  // split-KV: enough items for every thread, no piece under kMinPiece keys
  if (nq < 2 * threads) pieces = std::max<int64_t>(1, std::min((2 * threads + nq - 1) / nq, longest / kMinPiece));
  const AttendFn fn = pick(d, dv);
  // partials per (row, piece) (one piece: the row whole), then per row and head their merge, normalised
  std::vector<float> acc(nq * pieces * h * dv), ms(nq * pieces * h), ls(nq * pieces * h);
  at::parallel_for(0, nq * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / pieces, p = item % pieces;
      const int64_t lo = keys[n] * p / pieces, hi = keys[n] * (p + 1) / pieces;
      Partial part{acc.data() + item * h * dv, ms.data() + item * h, ls.data() + item * h};
      if (lo >= hi) {  // a row shorter than the pieces: this one is empty
        std::fill(part.m, part.m + h, -std::numeric_limits<float>::infinity());
        std::fill(part.l, part.l + h, 0.0f);
        std::fill(part.acc, part.acc + h * dv, 0.0f);
        continue;
      }
      fn(qp + n * h * d, hkv, g, d, dv, kp, vp, k_row, k_head, v_row, v_head, rp, fp[n], fp[n + 1], lo, hi, sc, part);
    }
  });
  at::parallel_for(0, nq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < h; ++i) {
        float* o = op + (n * h + i) * dv;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < pieces; ++p) mx = std::max(mx, ms[(n * pieces + p) * h + i]);
        float total = 0.0f;
        for (int64_t c = 0; c < dv; ++c) o[c] = 0.0f;
        for (int64_t p = 0; p < pieces; ++p) {
          const int64_t at = (n * pieces + p) * h + i;
          if (ls[at] == 0.0f) continue;
          const float w = std::exp2(ms[at] - mx);  // 1 for a row's only piece: its sums as they are
          total += ls[at] * w;
          const float* a = acc.data() + at * dv;
          for (int64_t c = 0; c < dv; ++c) o[c] += a[c] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < dv; ++c) o[c] *= inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(cpinfer, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor runs, Tensor first, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
