// Flash attention for the CPU's prefill: a block of queries against a block of keys, fully visible or causal (query
// i sees keys 0..i + causal_offset: 0 is top-left, Lk - Lq a chunk's queries against its prefix and its own keys at
// once), with the query heads of a KV head sharing each key block (GQA / MQA)
// (cpinfer/attention/cpu_kernels.py builds and loads this file with cpu_decode.cpp; the op is
// torch.ops.cpinfer.flash_attention).
//
// q [Lq, H, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv]  float32 (rows and heads may be strided; channels contiguous),
//                                               Dv a multiple of 16
// causal_offset >= 0 (causal only)
// -> out [Lq, H, Dv] softmax(scale q k^T) v, lse [Lq, H] its log-sum-exp (natural log); query head h reads KV head
//    h / (H / Hkv). Without keys (Lk = 0) a row gets out 0 and lse -inf.
//
// Work items are (KV head, block of query positions): the rows of an item are its positions x the KV head's G query
// heads, so each key block is read once for all of them. Per block of 64 keys the item computes the scores
// S = Q K^T (register tiles of 6 rows x 64 keys against the block's keys transposed), the online softmax in base 2
// (log2(e) and the scale folded into Q), and O = alpha O + P V (tiles of 6 rows x 64 value channels); the keys are
// transposed once per call. Items, largest first, are taken by torch's intra-op threads from a shared counter
// (a causal item's cost grows with its position). Few query rows against many keys (a short suffix after a cached
// prefix) have each item's keys cut into pieces so that every thread has work, the pieces' partial sums merged at
// the end (split-KV; a causal piece past all of an item's rows adds nothing). Arithmetic is float32 throughout.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <vector>

#include "cpu_vec.h"

namespace {

using cpinfer_vec::exp2v;
using cpinfer_vec::kLog2e;
using cpinfer_vec::load16;
using cpinfer_vec::tree_max;
using cpinfer_vec::tree_sum;
using cpinfer_vec::v16;
using cpinfer_vec::vmax;

constexpr int64_t kKeys = 64;     // keys per block (four vectors)
constexpr int64_t kTile = 6;      // query rows per register tile
constexpr int64_t kRows = 144;    // rows (positions x G) per work item, about (96: 1-4% slower here)
constexpr int64_t kItemsPerThread = 8;  // a full block with fewer items than this per thread has its keys split
constexpr int64_t kMinPieceBlocks = 4;  // key blocks per piece at least (256 keys)
constexpr int64_t kMaxPieces = 16;

struct Block {  // a block of keys, as the rows' softmax needs it
  int64_t j0, n;  // its first key, its keys
  int64_t p0, g;  // the key index of the item's first query, query heads per KV head (row r sees keys <= p0 + r / g)
  bool causal, masked;  // masked: n < 64 or some row sees only part of the block
};

struct Rows {  // the item's running softmax per row: max m and sum l (base 2), alpha: the factor for earlier sums
  float* m;
  float* l;
  float* alpha;
};

// One row's online-softmax step over its scores x[4] (base 2), the keys past lim masked: p = 2^(x - m_new) into
// s[0:64], m, l and alpha updated.
inline void softmax_row(v16* x, int64_t lim, bool masked, float* s, float& m, float& l, float& alpha) {
  if (masked) {
    v16 iota;
    for (int c = 0; c < 16; ++c) iota[c] = static_cast<float>(c);
    const v16 none = v16{} - std::numeric_limits<float>::infinity();
    for (int c = 0; c < 4; ++c) x[c] = iota + static_cast<float>(16 * c) < static_cast<float>(lim) ? x[c] : none;
  }
  const float mx = tree_max(vmax(vmax(x[0], x[1]), vmax(x[2], x[3])));
  const float m_new = std::max(m, mx);
  if (m_new == -std::numeric_limits<float>::infinity()) {  // no key for this row yet
    std::memset(s, 0, kKeys * sizeof(float));
    alpha = 1.0f;
    return;
  }
  alpha = m == m_new ? 1.0f : std::exp2(m - m_new);
  v16 sum{};
  for (int c = 0; c < 4; ++c) {
    const v16 pc = exp2v(x[c] - m_new);
    sum += pc;
    std::memcpy(s + 16 * c, &pc, sizeof(pc));
  }
  l = l * alpha + tree_sum(sum);
  m = m_new;
}

// Rows r0 .. r0 + RT - 1 (d floats each at q) against a block of keys transposed, kt [D][64]: their scores in
// registers, then each row's softmax step (probabilities into s[r][0:64]).
template <int RT>
inline void score_tile(const float* __restrict__ q, int64_t d, const float* __restrict__ kt, float* __restrict__ s,
                       int64_t r0, const Block& b, Rows rows) {
  v16 acc[RT][4] = {};
  for (int64_t c = 0; c < d; ++c) {
    const float* kc = kt + c * kKeys;
    const v16 k0 = load16(kc), k1 = load16(kc + 16), k2 = load16(kc + 32), k3 = load16(kc + 48);
    for (int r = 0; r < RT; ++r) {
      const float qv = q[r * d + c];
      acc[r][0] += qv * k0;
      acc[r][1] += qv * k1;
      acc[r][2] += qv * k2;
      acc[r][3] += qv * k3;
    }
  }
  for (int r = 0; r < RT; ++r) {
    const int64_t row = r0 + r;
    const int64_t lim = b.causal ? std::min(b.n, std::max<int64_t>(b.p0 + row / b.g - b.j0 + 1, 0)) : b.n;
    softmax_row(acc[r], lim, b.masked, s + r * kKeys, rows.m[row], rows.l[row], rows.alpha[row]);
  }
}

// o[r][c0 : c0 + 16 CV] = alpha[r] o[r][...] + sum_j p[r][j] v_j[...] over the n value rows at v (v_row apart).
template <int RT, int CV>
inline void value_tile(const float* __restrict__ p, const float* __restrict__ alpha, const float* __restrict__ v,
                       int64_t v_row, int64_t n, float* __restrict__ o, int64_t dv) {
  v16 acc[RT][CV];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c] = load16(o + r * dv + 16 * c) * alpha[r];
  for (int64_t j = 0; j < n; ++j) {
    v16 vj[CV];
    for (int c = 0; c < CV; ++c) vj[c] = load16(v + j * v_row + 16 * c);
    for (int r = 0; r < RT; ++r) {
      const float pr = p[r * kKeys + j];
      for (int c = 0; c < CV; ++c) acc[r][c] += pr * vj[c];
    }
  }
  for (int r = 0; r < RT; ++r) std::memcpy(o + r * dv, acc[r], sizeof(acc[r]));
}

template <int RT>
void scores(const float* q, int64_t d, const float* kt, float* s, int64_t r0, const Block& b, Rows rows, int rt) {
  if constexpr (RT > 1) {
    if (rt < RT) return scores<RT - 1>(q, d, kt, s, r0, b, rows, rt);
  }
  score_tile<RT>(q, d, kt, s, r0, b, rows);
}

template <int RT>
void values(const float* p, const float* alpha, const float* v, int64_t v_row, int64_t n, float* o, int64_t dv,
            int rt) {
  if constexpr (RT > 1) {
    if (rt < RT) return values<RT - 1>(p, alpha, v, v_row, n, o, dv, rt);
  }
  int64_t c0 = 0;
  for (; c0 + 64 <= dv; c0 += 64) value_tile<RT, 4>(p, alpha, v + c0, v_row, n, o + c0, dv);
  switch ((dv - c0) / 16) {
    case 3: value_tile<RT, 3>(p, alpha, v + c0, v_row, n, o + c0, dv); break;
    case 2: value_tile<RT, 2>(p, alpha, v + c0, v_row, n, o + c0, dv); break;
    case 1: value_tile<RT, 1>(p, alpha, v + c0, v_row, n, o + c0, dv); break;
    default: break;
  }
}

struct Shapes {
  int64_t lq, lk, h, hkv, g, d, dv, positions;  // positions: query positions per item
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
  int64_t off;  // causal: query i sees keys up to i + off
  bool causal;
  float scale;
};

struct Scratch {  // one thread's buffers for an item
  std::vector<float> q, s, o, m, l, alpha;
};

struct Dest {  // where an item's rows go: normalised into out / lse, or (split keys) unnormalised into a piece's sums
  float* out;    // [Lq, H, Dv]
  float* lse;    // [Lq, H]
  float* acc;    // a piece's [Lq, H, Dv], m and l [Lq, H] (base 2); null: no split
  float* m;
  float* l;
};

// One item: KV head kh, query positions [p0, p1), against keys [j_lo, j_hi) (j_lo a multiple of 64; a causal row
// sees no key past its position + off) of the keys transposed kt [Hkv][blocks][D][64].
void attend_item(const Shapes& sh, const float* qp, const float* ktp, const float* vp, int64_t kh, int64_t p0,
                 int64_t p1, int64_t j_lo, int64_t j_hi, const Dest& dest, Scratch& w) {
  const int64_t g = sh.g, d = sh.d, dv = sh.dv, rows = (p1 - p0) * g;
  const float qscale = sh.scale * kLog2e;  // scores in base 2
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t i = 0; i < g; ++i) {
      const float* src = qp + p * sh.q_row + (kh * g + i) * sh.q_head;
      float* dst = w.q.data() + ((p - p0) * g + i) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * qscale;
    }
  std::fill(w.o.begin(), w.o.begin() + rows * dv, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  const int64_t kend = sh.causal ? std::min(j_hi, p1 + sh.off) : j_hi;  // keys any row of the item sees
  const int64_t k0 = p0 + sh.off;  // the key index of the item's first position (causal)
  const float* vhead = vp + kh * sh.v_head;
  const Rows state{w.m.data(), w.l.data(), w.alpha.data()};
  for (int64_t j0 = j_lo; j0 < kend; j0 += kKeys) {
    const int64_t n = std::min(kKeys, kend - j0);
    const float* kt = ktp + ((kh * ((sh.lk + kKeys - 1) / kKeys)) + j0 / kKeys) * d * kKeys;
    const Block blk{j0, n, k0, g, sh.causal, n < kKeys || (sh.causal && j0 + kKeys - 1 > k0)};
    for (int64_t r0 = 0; r0 < rows; r0 += kTile) {  // a tile's scores and its values while the block is in L1
      const int rt = static_cast<int>(std::min(kTile, rows - r0));
      if (sh.causal && k0 + (r0 + rt - 1) / g < j0) continue;  // the tile's rows see no key of this block
      scores<kTile>(w.q.data() + r0 * d, d, kt, w.s.data(), r0, blk, state, rt);
      values<kTile>(w.s.data(), w.alpha.data() + r0, vhead + j0 * sh.v_row, sh.v_row, n, w.o.data() + r0 * dv, dv, rt);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (p0 + r / g) * sh.h + kh * g + r % g;  // (position, head)
    const float* a = w.o.data() + r * dv;
    const float l = w.l[r];
    if (dest.acc != nullptr) {
      std::copy(a, a + dv, dest.acc + at * dv);
      dest.m[at] = w.m[r];
      dest.l[at] = l;
      continue;
    }
    float* o = dest.out + at * dv;
    if (l == 0.0f) {  // no key at all
      std::fill(o, o + dv, 0.0f);
      dest.lse[at] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float inv = 1.0f / l;
    for (int64_t c = 0; c < dv; ++c) o[c] = a[c] * inv;
    dest.lse[at] = (w.m[r] + std::log2(l)) / kLog2e;
  }
}

// The pieces' sums of each (position, head) merged and normalised into out / lse.
void merge_pieces(const Shapes& sh, int64_t pieces, const std::vector<float>& acc, const std::vector<float>& ms,
                  const std::vector<float>& ls, float* outp, float* lsep) {
  const int64_t n = sh.lq * sh.h, dv = sh.dv;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t at = begin; at < end; ++at) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < pieces; ++p)
        if (ls[p * n + at] > 0.0f) mx = std::max(mx, ms[p * n + at]);
      float* o = outp + at * dv;
      std::fill(o, o + dv, 0.0f);
      float total = 0.0f;
      for (int64_t p = 0; p < pieces; ++p) {
        if (ls[p * n + at] == 0.0f) continue;
        const float wgt = std::exp2(ms[p * n + at] - mx);
        total += ls[p * n + at] * wgt;
        const float* a = acc.data() + (p * n + at) * dv;
        for (int64_t c = 0; c < dv; ++c) o[c] += a[c] * wgt;
      }
      if (total == 0.0f) {
        lsep[at] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = 1.0f / total;
      for (int64_t c = 0; c < dv; ++c) o[c] *= inv;
      lsep[at] = (mx + std::log2(total)) / kLog2e;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   bool causal, double scale, int64_t causal_offset) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "flash_attention: float32 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "flash_attention: q [Lq, H, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "flash_attention: each row's channels contiguous");
  Shapes sh{};
  sh.lq = q.size(0), sh.h = q.size(1), sh.d = q.size(2), sh.lk = k.size(0), sh.hkv = k.size(1), sh.dv = v.size(2);
  TORCH_CHECK(k.size(2) == sh.d && v.size(0) == sh.lk && v.size(1) == sh.hkv && sh.hkv > 0 && sh.h % sh.hkv == 0,
              "flash_attention: shapes do not match");
  TORCH_CHECK(sh.dv % 16 == 0, "flash_attention: a value head size that is a multiple of 16");
  TORCH_CHECK(causal_offset == 0 || (causal && causal_offset > 0), "flash_attention: causal_offset >= 0, causal only");
  sh.g = sh.h / sh.hkv;
  sh.q_row = q.stride(0), sh.q_head = q.stride(1), sh.k_row = k.stride(0), sh.k_head = k.stride(1);
  sh.v_row = v.stride(0), sh.v_head = v.stride(1);
  sh.causal = causal;
  sh.off = causal_offset;
  sh.scale = static_cast<float>(scale);
  sh.positions = std::max<int64_t>(1, kRows / sh.g);
  auto out = at::empty({sh.lq, sh.h, sh.dv}, q.options());
  auto lse = at::empty({sh.lq, sh.h}, q.options());
  if (sh.lq == 0) return {out, lse};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  // the keys transposed, per KV head and block of 64: kt [Hkv][blocks][D][64], zeros past Lk
  const int64_t blocks = (sh.lk + kKeys - 1) / kKeys;
  std::unique_ptr<float[]> kt_buf(new float[sh.hkv * blocks * sh.d * kKeys]);  // (not zeroed: every block written)
  float* const kt = kt_buf.get();
  at::parallel_for(0, sh.hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t hb = begin; hb < end; ++hb) {
      const int64_t kh = hb / blocks, j0 = (hb % blocks) * kKeys, n = std::min(kKeys, sh.lk - j0);
      float* dst = kt + hb * sh.d * kKeys;
      if (n < kKeys) std::fill(dst, dst + sh.d * kKeys, 0.0f);
      const float* src = kp + j0 * sh.k_row + kh * sh.k_head;
      const int64_t k_row = sh.k_row;
      for (int64_t c = 0; c < sh.d; ++c) {  // each row of the destination written in order
        float* __restrict__ dc = dst + c * kKeys;
        for (int64_t j = 0; j < n; ++j) dc[j] = src[j * k_row + c];
      }
    }
  });
  // items (KV head, position block, piece of the keys): a block with too few items for the threads to share evenly
  // (a short suffix against a long prefix) has its keys cut into pieces of at least kMinPieceBlocks blocks
  const int64_t pblocks = (sh.lq + sh.positions - 1) / sh.positions, threads = at::get_num_threads();
  int64_t pieces = 1;
  if (sh.hkv * pblocks < kItemsPerThread * threads)
    pieces = std::clamp<int64_t>(std::min((kItemsPerThread * threads + sh.hkv * pblocks - 1) / (sh.hkv * pblocks),
                                          blocks / kMinPieceBlocks), 1, kMaxPieces);
  std::vector<int64_t> order(sh.hkv * pblocks * pieces);  // item = (kh * pblocks + pb) * pieces + piece
  std::iota(order.begin(), order.end(), 0);
  if (causal)  // the most keys first
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return a / pieces % pblocks > b / pieces % pblocks;
    });
  std::vector<float> acc, ms, ls;  // the pieces' sums [pieces][Lq, H](, Dv)
  if (pieces > 1) {
    acc.resize(pieces * sh.lq * sh.h * sh.dv);
    ms.resize(pieces * sh.lq * sh.h);
    ls.resize(pieces * sh.lq * sh.h);
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, static_cast<int64_t>(order.size())), 1, [&](int64_t begin,
                                                                                              int64_t end) {
    Scratch w;
    const int64_t rows = sh.positions * sh.g;
    w.q.resize(rows * sh.d);
    w.s.resize(kTile * kKeys);
    w.o.resize(rows * sh.dv);
    w.m.resize(rows);
    w.l.resize(rows);
    w.alpha.resize(rows);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(order.size()); i = next.fetch_add(1)) {
        const int64_t piece = order[i] % pieces, kh = order[i] / pieces / pblocks, pb = order[i] / pieces % pblocks;
        const int64_t p0 = pb * sh.positions, p1 = std::min(sh.lq, p0 + sh.positions);
        const int64_t j_lo = blocks * piece / pieces * kKeys, j_hi = std::min(sh.lk, blocks * (piece + 1) / pieces * kKeys);
        const int64_t at = piece * sh.lq * sh.h;
        const Dest dest = pieces == 1 ? Dest{out.data_ptr<float>(), lse.data_ptr<float>(), nullptr, nullptr, nullptr}
                                      : Dest{nullptr, nullptr, acc.data() + at * sh.dv, ms.data() + at, ls.data() + at};
        attend_item(sh, qp, kt, vp, kh, p0, p1, j_lo, j_hi, dest, w);
      }
    }
  });
  if (pieces > 1) merge_pieces(sh, pieces, acc, ms, ls, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpinfer, m) {
  m.def("flash_attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, int causal_offset=0) -> (Tensor, "
        "Tensor)");
  m.impl("flash_attention", c10::DispatchKey::CPU, TORCH_FN(flash_attention));
}
