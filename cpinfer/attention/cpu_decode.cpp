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
// Work items are (row, KV head, piece): each reads its keys and values once for the G = H / Hkv query heads that
// share them, with an online softmax over blocks of keys, and items are shared among torch's intra-op threads
// (at::parallel_for: the same OpenMP team as every other op). When there are fewer (row, KV head) pairs than twice
// the threads, each pair's keys are cut into pieces (split-KV) so that every thread has work, and the pieces'
// partial softmax sums are merged at the end. Arithmetic is float32 throughout.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;       // keys scored per pass of the online softmax
constexpr int64_t kMinPiece = 256;   // keys per split-KV piece at least
constexpr int64_t kMaxG = 16;        // query heads per KV head handled on the stack

struct Partial {  // an item's unnormalised result: acc [G, Dv], running max m [G], sum l [G]
  float* acc;
  float* m;
  float* l;
};

// Scores of the G query heads at q against n key rows at k (k_row floats apart) into s[i * kBlock + j]. With a head
// size that is a multiple of 16 known at compile time, four keys at a time with one vector accumulator per (head,
// key): independent chains instead of one dot product (and its horizontal sum) after another.
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

template <int64_t D>
void scores(const float* __restrict__ q, int64_t g, int64_t d_rt, const float* __restrict__ k, int64_t k_row,
            int64_t n, float scale, float* __restrict__ s) {
  int64_t j = 0;
  if constexpr (D > 0 && D % 16 == 0) {
    if (g <= 4) {
      for (; j + 4 <= n; j += 4) {
        v16 acc[4][4] = {};
        for (int64_t c = 0; c < D; c += 16) {
          const v16 k0 = load16(k + j * k_row + c), k1 = load16(k + (j + 1) * k_row + c);
          const v16 k2 = load16(k + (j + 2) * k_row + c), k3 = load16(k + (j + 3) * k_row + c);
          for (int64_t i = 0; i < g; ++i) {
            const v16 qv = load16(q + i * D + c);
            acc[i][0] += qv * k0;
            acc[i][1] += qv * k1;
            acc[i][2] += qv * k2;
            acc[i][3] += qv * k3;
          }
        }
        for (int64_t i = 0; i < g; ++i)
          for (int64_t u = 0; u < 4; ++u) s[i * kBlock + j + u] = hsum(acc[i][u]) * scale;
      }
    }
  }
  const int64_t d = D > 0 ? D : d_rt;
  for (; j < n; ++j) {
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

// acc[i] += sum_j s[i * kBlock + j] v_j over the n value rows at v (v_row floats apart), for the G heads. With a
// value size that is a multiple of 16 (at most 128) known at compile time, each head's accumulator stays in
// registers over the block (the block's rows, read again per head, are in the L1 cache).
template <int64_t DV>
void accumulate(const float* __restrict__ s, int64_t g, int64_t dv_rt, const float* __restrict__ v, int64_t v_row,
                int64_t n, float* __restrict__ acc) {
  if constexpr (DV > 0 && DV % 16 == 0 && DV <= 128) {
    constexpr int64_t C = DV / 16;
    for (int64_t i = 0; i < g; ++i) {
      v16 a[C];
      for (int64_t c = 0; c < C; ++c) a[c] = load16(acc + i * DV + 16 * c);
      const float* __restrict__ si = s + i * kBlock;
      for (int64_t j = 0; j < n; ++j) {
        const float p = si[j];
        for (int64_t c = 0; c < C; ++c) a[c] += p * load16(v + j * v_row + 16 * c);
      }
      std::memcpy(acc + i * DV, a, sizeof(a));
    }
    return;
  }
  const int64_t dv = DV > 0 ? DV : dv_rt;
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

// Keys [lo, hi) of a row's runs (indices into the runs' concatenation) for the G query heads at q.
template <int64_t D, int64_t DV>
void attend(const float* __restrict__ q, int64_t g, int64_t d_rt, int64_t dv_rt, const float* __restrict__ k,
            const float* __restrict__ v, int64_t k_row, int64_t v_row, const int64_t* runs, int64_t r0, int64_t r1,
            int64_t lo, int64_t hi, float scale, Partial part) {
  const int64_t d = D > 0 ? D : d_rt, dv = DV > 0 ? DV : dv_rt;
  float* __restrict__ acc = part.acc;
  float* __restrict__ m = part.m;
  float* __restrict__ l = part.l;
  for (int64_t i = 0; i < g; ++i) {
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::fill(acc, acc + g * dv, 0.0f);
  alignas(64) float s[kMaxG * kBlock];
  int64_t base = 0;  // index of run r's first key in the concatenation
  for (int64_t r = r0; r < r1 && base < hi; ++r) {
    const int64_t a = runs[2 * r], e = runs[2 * r + 1], len = e - a;
    const int64_t from = std::max<int64_t>(lo - base, 0), to = std::min<int64_t>(hi - base, len);
    base += len;
    for (int64_t j0 = a + from; j0 < a + to; j0 += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, a + to - j0);
      scores<D>(q, g, d, k + j0 * k_row, k_row, n, scale, s);
      for (int64_t i = 0; i < g; ++i) {
        float* __restrict__ si = s + i * kBlock;
        float mx = m[i];
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, si[j]);
        const float alpha = std::exp(m[i] - mx);  // rescales what was summed before this block (0 at the start)
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          si[j] = std::exp(si[j] - mx);
          sum += si[j];
        }
        l[i] = l[i] * alpha + sum;
        m[i] = mx;
        float* __restrict__ ai = acc + i * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) ai[c] *= alpha;
      }
      accumulate<DV>(s, g, dv, v + j0 * v_row, v_row, n, acc);
    }
  }
}

using AttendFn = void (*)(const float*, int64_t, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, float, Partial);

AttendFn pick(int64_t d, int64_t dv) {  // compile-time head sizes for the common ones (unrolled channel loops)
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
  TORCH_CHECK(g <= kMaxG, "decode_attention: at most ", kMaxG, " query heads per KV head");
  auto out = at::empty({nq, h, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* rp = runs.data_ptr<int64_t>();
  const int64_t* fp = first.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t k_row = k.stride(0), k_head = k.stride(1), v_row = v.stride(0), v_head = v.stride(1);
  const float sc = static_cast<float>(scale);
  std::vector<int64_t> keys(nq);  // keys per row
  int64_t longest = 0;
  for (int64_t n = 0; n < nq; ++n) {
    int64_t t = 0;
    for (int64_t r = fp[n]; r < fp[n + 1]; ++r) t += rp[2 * r + 1] - rp[2 * r];
    TORCH_CHECK(t > 0, "decode_attention: a row without keys");
    keys[n] = t;
    longest = std::max(longest, t);
  }
  const int64_t pairs = nq * hkv, threads = at::get_num_threads();
  int64_t pieces = 1;  // split-KV: enough items for every thread, no piece under kMinPiece keys
  if (pairs < 2 * threads) pieces = std::max<int64_t>(1, std::min((2 * threads + pairs - 1) / pairs, longest / kMinPiece));
  const AttendFn fn = pick(d, dv);
  if (pieces == 1) {
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      float m[kMaxG], l[kMaxG];
      std::vector<float> acc(g * dv);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / hkv, kh = item % hkv;
        fn(qp + (n * h + kh * g) * d, g, d, dv, kp + kh * k_head, vp + kh * v_head, k_row, v_row, rp, fp[n],
           fp[n + 1], 0, keys[n], sc, Partial{acc.data(), m, l});
        float* o = op + (n * h + kh * g) * dv;
        for (int64_t i = 0; i < g; ++i) {
          const float inv = 1.0f / l[i];
          for (int64_t c = 0; c < dv; ++c) o[i * dv + c] = acc[i * dv + c] * inv;
        }
      }
    });
    return out;
  }
  // split-KV: partials per (pair, piece), then one merge per pair
  std::vector<float> acc(pairs * pieces * g * dv), ms(pairs * pieces * g), ls(pairs * pieces * g);
  at::parallel_for(0, pairs * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / pieces, p = item % pieces, n = pair / hkv, kh = pair % hkv;
      const int64_t lo = keys[n] * p / pieces, hi = keys[n] * (p + 1) / pieces;
      Partial part{acc.data() + item * g * dv, ms.data() + item * g, ls.data() + item * g};
      if (lo >= hi) {  // a row shorter than the pieces: this one is empty
        for (int64_t i = 0; i < g; ++i) part.m[i] = -std::numeric_limits<float>::infinity(), part.l[i] = 0.0f;
        std::fill(part.acc, part.acc + g * dv, 0.0f);
        continue;
      }
      fn(qp + (n * h + kh * g) * d, g, d, dv, kp + kh * k_head, vp + kh * v_head, k_row, v_row, rp, fp[n],
         fp[n + 1], lo, hi, sc, part);
    }
  });
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t n = pair / hkv, kh = pair % hkv;
    float* o = op + (n * h + kh * g) * dv;
    for (int64_t i = 0; i < g; ++i) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < pieces; ++p) mx = std::max(mx, ms[(pair * pieces + p) * g + i]);
      float total = 0.0f;
      for (int64_t c = 0; c < dv; ++c) o[i * dv + c] = 0.0f;
      for (int64_t p = 0; p < pieces; ++p) {
        const int64_t at = (pair * pieces + p) * g + i;
        if (ls[at] == 0.0f) continue;
        const float w = std::exp(ms[at] - mx);
        total += ls[at] * w;
        const float* a = acc.data() + at * dv;
        for (int64_t c = 0; c < dv; ++c) o[i * dv + c] += a[c] * w;
      }
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < dv; ++c) o[i * dv + c] *= inv;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(cpinfer, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor runs, Tensor first, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
