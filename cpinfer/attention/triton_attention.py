"""Triton kernel for one ring step of `cp_attention`: queries against one K/V block, merged into the running result.

One launch per ring step (paper §3.5.2 / §3.5.3 inner loop). Program (t, kv head) owns query rows
[row0[t], row1[t]) of a tile table (`tiles.py`) for all G query heads sharing that KV head (GQA/MQA packed into
the M dimension), visits only the key ranges the plan found visible, decides visibility per (query, key) inside the
kernel from the metadata vectors — `q_seq >= 0, 0 <= kv_seq <= q_seq < kv_seq_end, kv_pos <= q_pos` and
`q_pos - kv_pos < window` (a sliding window; 2^30 without one), no dense mask — runs an fp32 online softmax, and
merges its partial into the running fp32 (out, lse) it owns (App. B), so no separate merge pass is needed. The same source compiles for NVIDIA and AMD GPUs; on CPU it runs only in
Triton's interpreter (TRITON_INTERPRET=1), which is how the tests verify it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NO_WINDOW = 2 ** 30  # positions stay below this (int32 metadata), so q_pos - kv_pos < it always


@triton.jit
def _step_kernel(Q, K, V, OUT, LSE, QSEQ, QPOS, KSEQ, KEND, KPOS, ROW0, ROW1, OFF, KLO, KHI, RLO, RHI, DIAG,
                 SLOT, SCR, sq0, sq1, sk0, sk1, sv0, sv1, so0, so1, sl0, sl1, ss0, ss1, ss2, qk_scale, WINDOW,
                 D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_VECTORS: tl.constexpr,
                 SPLIT: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
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
    if USE_VECTORS:
        qs = tl.load(QSEQ + row, mask=m_ok, other=-1)
        qp = tl.load(QPOS + row, mask=m_ok, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of log2-scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for r in range(tl.load(OFF + t), tl.load(OFF + t + 1)):
        k_lo = tl.load(KLO + r)
        k_hi = tl.load(KHI + r)
        r_ok = m_ok & (row >= tl.load(RLO + r)) & (row < tl.load(RHI + r))  # rows this range is for
        diag = tl.load(DIAG + r)
        for kb in range(k_lo, k_hi, BLOCK_N):
            n = kb + tl.arange(0, BLOCK_N)
            n_ok = n < k_hi
            n_a = n.to(tl.int64)
            kt = tl.load(K + n_a[None, :] * sk0 + kvh * sk1 + d[:, None],
                         mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            if UPCAST:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
            vis = n_ok[None, :] & r_ok[:, None] & ((n[None, :] - row[:, None]) <= diag)
            if USE_VECTORS:
                ks = tl.load(KSEQ + n, mask=n_ok, other=0)
                ke = tl.load(KEND + n, mask=n_ok, other=0)
                kp = tl.load(KPOS + n, mask=n_ok, other=0)
                vis = (vis & (qs[:, None] >= 0) & (ks[None, :] >= 0) & (ks[None, :] <= qs[:, None])
                       & (qs[:, None] < ke[None, :]) & (kp[None, :] <= qp[:, None])
                       & ((qp[:, None] - kp[None, :]) < WINDOW))
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays empty
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(V + n_a[:, None] * sv0 + kvh * sv1 + d[None, :],
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            pv = p.to(vb.dtype)  # P rounded to the activation dtype for the second matmul, as flash kernels do
            if UPCAST:
                pv = pv.to(tl.float32)
                vb = vb.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, vb, input_precision=PRECISION)
            m_i = m_new
    nonempty = l_i > 0
    lse_new = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_new = acc / tl.where(nonempty, l_i, 1.0)[:, None]
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
                num_warps: int = 8, slots=None, n_slots: int = 0, window: int | None = None) -> None:
    """Accumulate q [Lq, H, D] against k/v [Lk, Hkv, D] into acc_out [Lq, H, D] fp32 / acc_lse [Lq, H] fp32.

    vectors: (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos) int32 device tensors, or None in item mode (the table
    alone is exact); table: the step's int32 device tile table (row0, row1, off, k_lo, k_hi, r_lo, r_hi, diag) for
    rows_per_prog = block_m // G. Strided acc views are fine (last dim contiguous). Always merges: acc must hold a
    valid partial (zeros / -inf where empty). slots [T] int32 (split-KV): programs with slot s >= 0 write their
    partial to scratch slot s instead, and one merge launch folds the n_slots scratch partials into acc.
    window: a sliding window applied with the vectors (item-mode tables are exact by themselves).
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
    use_vectors = vectors is not None
    q_seq, q_pos, kv_seq, kv_end, kv_pos = vectors if use_vectors else (row0,) * 5  # unread in item mode
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 applies to fp32 only; 16-bit dots are exact
    split = slots is not None and n_slots > 0
    scratch = split_scratch(n_slots, rows, h, d, q.device) if split else None
    scr = scratch if split else acc_out
    _step_kernel[(row0.numel(), hkv)](
        q, k, v, acc_out, acc_lse, q_seq, q_pos, kv_seq, kv_end, kv_pos, row0, row1, off, k_lo, k_hi, r_lo, r_hi, diag,
        slots if split else row0, scr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
        scr.stride(0), scr.stride(1), scr.stride(2), scale * _LOG2E, _NO_WINDOW if window is None else int(window),
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION=precision, UPCAST=interpreting() and q.dtype == torch.bfloat16, USE_VECTORS=use_vectors,
        SPLIT=split, num_warps=num_warps)
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
