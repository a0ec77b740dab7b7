"""Triton kernel for one ring step of `cp_attention`: queries against one K/V block, merged into the running result.

One launch per ring step (paper §3.5.2 / §3.5.3 inner loop). Program (t, kv head) owns query rows
[row0[t], row1[t]) of a tile table (`tiles.py`) for all G query heads sharing that KV head (GQA/MQA packed into
the M dimension) and visits only the key ranges the plan found visible. Per range, the key blocks every row of the
program sees (FULL items, and a causal square's blocks left of the diagonal) run without any mask; the diagonal,
the range's last partial block and MASK tiles run masked — by the range's diagonal, and in vector mode by the
metadata vectors (`q_seq >= 0, 0 <= kv_seq <= q_seq < kv_seq_end, kv_pos <= q_pos`, `q_pos - kv_pos < window`;
no dense mask). An fp32 online softmax in the log2 domain (scale x log2(e) fused into exp2's argument, O
accumulated in place by the second dot) gives a partial that the program merges into the running fp32 (out, lse)
it owns (App. B; lse in the natural log), so no separate merge pass is needed. Tiles, warps and pipeline depth per
shape class: `triton_tuning.py`. The same source compiles for NVIDIA and AMD GPUs; on CPU it runs only in
Triton's interpreter (TRITON_INTERPRET=1), which is how the tests verify it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cpinfer.attention.tiles import NO_DIAG

_LOG2E = 1.4426950408889634
_NO_WINDOW = 2 ** 30  # positions stay below this (int32 metadata), so q_pos - kv_pos < it always
_NO_DIAG = tl.constexpr(NO_DIAG)  # diag <= this: the range is exact by itself (FULL / CAUSAL); above: vectors


@triton.jit
def _step_kernel(Q, K, V, OUT, LSE, QSEQ, QPOS, KSEQ, KEND, KPOS, ROW0, ROW1, OFF, KLO, KHI, RLO, RHI, DIAG,
                 SLOT, SCR, sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sl0, sl1, ss0, ss1, ss2, qk_scale, WINDOW, n_kvh,
                 D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_VECTORS: tl.constexpr,
                 SPLIT: tl.constexpr):
    # one flat grid, KV head fastest: programs start in table order for every head at once (the table puts the
    # longest rows first), and the program count is not bounded by a grid axis of 65535
    pid = tl.program_id(0)
    kvh = pid % n_kvh
    t = pid // n_kvh
    row0 = tl.load(ROW0 + t)
    row1 = tl.load(ROW1 + t)
    m = tl.arange(0, BLOCK_M)
    row = row0 + m // G  # [BLOCK_M]: lane m is query row `row`, head kvh * G + m % G
    head = kvh * G + m % G
    m_ok = row < row1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    row_a = row.to(tl.int64)  # metadata is int32; addresses are int64 (1M rows x H x D overflows int32)
    q = tl.load(Q + row_a[:, None] * sq0 + head[:, None] * sq1 + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:  # the interpreter's dot reads bf16 as raw integers; bf16 products are exact in fp32 anyway
        q = q.to(tl.float32)
    qs = row  # unread without vectors
    qp = row
    if USE_VECTORS:
        qs = tl.load(QSEQ + row, mask=m_ok, other=-1)
        qp = tl.load(QPOS + row, mask=m_ok, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of log2-scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = K + kvh.to(tl.int64) * sk1
    v_head = V + kvh.to(tl.int64) * sv1
    for r in range(tl.load(OFF + t), tl.load(OFF + t + 1)):
        k_lo = tl.load(KLO + r)
        k_hi = tl.load(KHI + r)
        r_lo = tl.load(RLO + r)
        r_hi = tl.load(RHI + r)
        diag = tl.load(DIAG + r)
        # keys [k_lo, k_free) are visible to every row of the program (a FULL range, or a causal range's keys left
        # of the program's first row's diagonal, in whole blocks): no mask there. The rest — the diagonal, the
        # range's last partial block, MASK tiles (vectors) — runs masked.
        clean = (r_lo <= row0) & (r_hi >= row1) & (diag <= _NO_DIAG)
        reach = tl.minimum((k_hi - k_lo).to(tl.int64), (row0 - k_lo).to(tl.int64) + diag + 1)
        n_free = tl.where(clean, tl.maximum(reach, 0) // BLOCK_N * BLOCK_N, 0).to(tl.int32)
        k_free = k_lo + n_free
        for kb in range(k_lo, k_free, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_head, v_head, kb, k_hi, sk0, sv0, d, d_ok, row, m_ok,
                                          r_lo, r_hi, diag, qs, qp, KSEQ, KEND, KPOS, WINDOW, qk_scale,
                                          BLOCK_N, D == BLOCK_D, PRECISION, UPCAST, False, False)
        for kb in range(k_free, k_hi, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_head, v_head, kb, k_hi, sk0, sv0, d, d_ok, row, m_ok,
                                          r_lo, r_hi, diag, qs, qp, KSEQ, KEND, KPOS, WINDOW, qk_scale,
                                          BLOCK_N, D == BLOCK_D, PRECISION, UPCAST, True, USE_VECTORS)
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    lse_new = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # natural log
    o_new = acc / l_safe[:, None]
    slot = -1
    if SPLIT:  # split-KV: one of several programs over these rows; its partial goes to scratch slot `slot`
        slot = tl.load(SLOT + t)
    if slot >= 0:
        s_ptr = SCR + slot.to(tl.int64) * ss0 + row_a * ss1 + head * ss2  # slot x [Lq, H, D+1] passes 2^31
        tl.store(s_ptr[:, None] + d[None, :], o_new, mask=m_ok[:, None] & d_ok[None, :])
        tl.store(s_ptr + D, lse_new, mask=m_ok)
    else:
        _merge_into_running(OUT, LSE, row_a, head, d, m_ok, d_ok, so0, so1, sl0, sl1, o_new, lse_new)


@triton.jit
def _load_keys(ptrs, n_ok, d_ok, MASK_N: tl.constexpr, EVEN_D: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of K or V: masked on keys only on a range's edge, on channels only when D is
    not a power of two."""
    if MASK_N:
        x = tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_head, v_head, kb, k_hi, sk0, sv0, d, d_ok, row, m_ok, r_lo, r_hi, diag, qs, qp,
                  KSEQ, KEND, KPOS, WINDOW, qk_scale, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, USE_VECTORS: tl.constexpr):
    """One key block into the running (acc, l_i, m_i) of the online softmax, in the log2 domain: the scale and
    log2(e) are one factor (qk_scale) fused into the exponent's argument; acc is rescaled and accumulated in place
    by the second dot. MASKED: visibility per (row, key) from the range (and the vectors when USE_VECTORS)."""
    n = kb + tl.arange(0, BLOCK_N)
    n_ok = n < k_hi
    n_a = n.to(tl.int64)
    k = _load_keys(k_head + n_a[:, None] * sk0 + d[None, :], n_ok, d_ok, MASKED, EVEN_D)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32, unscaled
    if MASKED:
        vis = (n_ok[None, :] & (m_ok & (row >= r_lo) & (row < r_hi))[:, None]
               & ((n[None, :] - row[:, None]) <= diag))
        if USE_VECTORS:
            ks = tl.load(KSEQ + n, mask=n_ok, other=0)
            ke = tl.load(KEND + n, mask=n_ok, other=0)
            kp = tl.load(KPOS + n, mask=n_ok, other=0)
            vis = (vis & (qs[:, None] >= 0) & (ks[None, :] >= 0) & (ks[None, :] <= qs[:, None])
                   & (qs[:, None] < ke[None, :]) & (kp[None, :] <= qp[:, None])
                   & ((qp[:, None] - kp[None, :]) < WINDOW))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
    else:  # every score is finite: so is the new max
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    p = tl.math.exp2(s * qk_scale - m_use[:, None])  # one FMA per score before the exp2
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_keys(v_head + n_a[:, None] * sv0 + d[None, :], n_ok, d_ok, MASKED, EVEN_D)  # [BLOCK_N, BLOCK_D]
    pv = p.to(v.dtype)  # P rounded to the activation dtype for the second matmul, as flash kernels do
    if UPCAST:
        pv = pv.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None]
    acc = tl.dot(pv, v, acc, input_precision=PRECISION)  # accumulates into acc's registers
    return acc, l_i, m_new


@triton.jit
def _merge_into_running(OUT, LSE, row_a, head, d, m_ok, d_ok, so0, so1, sl0, sl1, o_new, lse_new):
    """Merge a partial (o_new normalised, lse_new) into the running (out, lse) this program owns (App. B)."""
    o_ptr = OUT + row_a[:, None] * so0 + head[:, None] * so1 + d[None, :]
    l_ptr = LSE + row_a * sl0 + head * sl1
    lse_old = tl.load(l_ptr, mask=m_ok, other=float("-inf"))
    out_old = tl.load(o_ptr, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    mx = tl.maximum(lse_old, lse_new)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w_old = tl.exp(lse_old - mx_safe)
    w_new = tl.exp(lse_new - mx_safe)
    den = w_old + w_new
    has = den > 0
    den_safe = tl.where(has, den, 1.0)
    out = (out_old * w_old[:, None] + o_new * w_new[:, None]) / den_safe[:, None]
    lse = tl.where(has, mx_safe + tl.log(den_safe), float("-inf"))
    tl.store(o_ptr, out, mask=m_ok[:, None] & d_ok[None, :])
    tl.store(l_ptr, lse, mask=m_ok)


def launch_step(q, k, v, acc_out, acc_lse, vectors, table, scale: float, block_m: int, block_n: int,
                num_warps: int | None = None, slots=None, n_slots: int = 0, window: int | None = None,
                num_stages: int | None = None) -> None:
    """Accumulate q [Lq, H, D] against k/v [Lk, Hkv, D] into acc_out [Lq, H, D] fp32 / acc_lse [Lq, H] fp32.

    vectors: (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos) int32 device tensors, or None in item mode (the table
    alone is exact); table: the step's int32 device tile table (row0, row1, off, k_lo, k_hi, r_lo, r_hi, diag) for
    rows_per_prog = block_m // G; ranges with diag > NO_DIAG (`tiles.VEC_DIAG`) need the vectors. Strided acc views
    are fine (last dim contiguous). Always merges: acc must hold a valid partial (zeros / -inf where empty). slots
    [T] int32 (split-KV): programs with slot s >= 0 write their partial to scratch slot s instead, and one merge
    launch folds the n_slots scratch partials into acc. window: a sliding window applied with the vectors
    (item-mode tables are exact by themselves). num_warps: default 8 on 128-lane tiles, else 4; num_stages:
    default Triton's (`triton_tuning` gives both per shape class).
    """
    rows, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    row0, row1, off, k_lo, k_hi, r_lo, r_hi, diag = table
    if row0.numel() == 0 or rows == 0:
        return
    for name, x in (("q", q), ("k", k), ("v", v), ("acc_out", acc_out)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {x.stride()}")
    if not scale > 0:  # the running max is taken of unscaled scores times the scale
        raise ValueError(f"the softmax scale must be positive, got {scale}")
    if block_m < triton.next_power_of_2(g):
        raise ValueError(f"block_m={block_m} holds fewer lanes than one row's {g} heads")
    use_vectors = vectors is not None
    q_seq, q_pos, kv_seq, kv_end, kv_pos = vectors if use_vectors else (row0,) * 5  # unread in item mode
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 applies to fp32 only; 16-bit dots are exact
    split = slots is not None and n_slots > 0
    scratch = split_scratch(n_slots, rows, h, d, q.device) if split else None
    scr = scratch if split else acc_out
    extra = {} if num_stages is None or interpreting() else {"num_stages": num_stages}
    _step_kernel[(row0.numel() * hkv,)](
        q, k, v, acc_out, acc_lse, q_seq, q_pos, kv_seq, kv_end, kv_pos, row0, row1, off, k_lo, k_hi, r_lo, r_hi, diag,
        slots if split else row0, scr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
        scr.stride(0), scr.stride(1), scr.stride(2), scale * _LOG2E, _NO_WINDOW if window is None else int(window),
        hkv, D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION=precision, UPCAST=interpreting() and q.dtype == torch.bfloat16, USE_VECTORS=use_vectors,
        SPLIT=split, num_warps=num_warps or (8 if block_m >= 128 else 4), **extra)
    if split:
        from cpinfer.attention.triton_merge import triton_merge_into

        triton_merge_into(acc_out, acc_lse, scratch[..., :d], scratch[..., d])


def split_scratch(n_slots: int, rows: int, h: int, d: int, device) -> torch.Tensor:
    """[S, Lq, H, D+1] fp32: out | lse per split-KV slot; slots a row block does not use stay empty (0, -inf)."""
    scratch = torch.zeros(n_slots, rows, h, d + 1, dtype=torch.float32, device=device)
    scratch[..., d].fill_(-torch.inf)
    return scratch


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1) instead of being compiled."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; before, `triton.jit` read the variable itself
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_m_for(g: int, block_m: int) -> int:
    """The M block (query rows x G heads) as a power of two that holds at least one row's G heads."""
    return max(block_m, triton.next_power_of_2(g))


def rows_per_program(g: int, block_m: int) -> int:
    return block_m_for(g, block_m) // g


__all__ = ["launch_step", "block_m_for", "rows_per_program"]
