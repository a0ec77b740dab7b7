"""Triton merge of S partial attention results (paper App. B) — pass-Q's partials after the All2All (§3.5.3).

Program b merges a block of (query row, head) pairs over the S partials with an online log-sum-exp in fp32:
out = Σ_s exp(lse_s - lse) out_s, lse = log Σ_s exp(lse_s); empty partials (lse = -inf) weigh nothing and rows
empty in every partial give zeros and -inf. The output is written once, in the activation dtype.

A program holds BLOCK_R x D fp32 twice (the running sum and the partial read) plus their 64-bit addresses: at 64
pairs of D = 128 that is past the 255 registers a thread may have, and the sm_90 binary spilled 2.6 KB a thread to
local memory in the loop (on an H200, the split-KV decode of a 32-layer, D = 128 model at 32K context spent 0.58 ms
a layer in this kernel, 69% of its device time). `block_rows` keeps the tile at 512 elements: 64-72 registers, no
spill in either variant (1,024 still spilled 8 bytes; read from the binary in tests/test_triton_compile.py), and a
decode batch's few pairs spread over more programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(P_OUT, P_LSE, OUT, LSE, n_src, n_pairs, heads,
                  po0, po1, po2, pl0, pl1, pl2, oo0, oo1, ol0, ol1,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACCUMULATE: tl.constexpr):
    # flat (row, head) pair index, int64: row * po1 etc. pass 2^31 elements (CP8, 128K rows per rank)
    e = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    e_ok = e < n_pairs
    row = e // heads
    head = e % heads
    d = tl.arange(0, BLOCK_D)
    ok2 = e_ok[:, None] & (d < D)[None, :]
    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if ACCUMULATE:  # the fp32 running (out, lse) in OUT / LSE is one more partial (split-KV)
        mx = tl.load(LSE + row * ol0 + head * ol1, mask=e_ok, other=float("-inf"))
        den = tl.where(mx == float("-inf"), 0.0, 1.0)
        acc = tl.load(OUT + row[:, None] * oo0 + head[:, None] * oo1 + d[None, :], mask=ok2, other=0.0)
    lse_ptr = P_LSE + row * pl1 + head * pl2  # source 0; each source advances the 64-bit pointers by its stride,
    out_ptr = P_OUT + row[:, None] * po1 + head[:, None] * po2 + d[None, :]  # so s * po0 is never an int32 product
    for _ in range(0, n_src):
        lse_s = tl.load(lse_ptr, mask=e_ok, other=float("-inf")).to(tl.float32)
        out_s = tl.load(out_ptr, mask=ok2, other=0.0).to(tl.float32)
        lse_ptr += pl0
        out_ptr += po0
        new_mx = tl.maximum(mx, lse_s)
        safe = tl.where(new_mx == float("-inf"), 0.0, new_mx)
        a = tl.exp(mx - safe)
        w = tl.exp(lse_s - safe)
        den = den * a + w
        acc = acc * a[:, None] + out_s * w[:, None]
        mx = new_mx
    has = den > 0
    den_safe = tl.where(has, den, 1.0)
    out = acc / den_safe[:, None]
    lse = tl.where(has, tl.where(mx == float("-inf"), 0.0, mx) + tl.log(den_safe), float("-inf"))
    tl.store(OUT + row[:, None] * oo0 + head[:, None] * oo1 + d[None, :], out.to(OUT.dtype.element_ty), mask=ok2)
    tl.store(LSE + row * ol0 + head * ol1, lse, mask=e_ok)


TILE = 512  # (pair, channel) elements a program holds


def block_rows(head_dim: int) -> int:
    """The (row, head) pairs one merge program takes for heads of `head_dim` channels: 64 for D <= 8, 4 for D = 128,
    1 from D = 512 on."""
    return max(1, min(64, TILE // triton.next_power_of_2(head_dim)))


def triton_merge(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype | None = None,
                 block_r: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [S, L, H, D] and lses [S, L, H] (any strides with a contiguous last dim of outs) →
    (out [L, H, D] in out_dtype (default outs' dtype), lse [L, H] fp32). block_r: pairs a program (default
    `block_rows(D)`)."""
    if outs.dim() != 4 or lses.shape != outs.shape[:3]:
        raise ValueError(f"need outs [S, L, H, D] and lses [S, L, H], got {tuple(outs.shape)} and {tuple(lses.shape)}")
    if outs.stride(-1) != 1:
        raise ValueError(f"outs must have a contiguous last dimension, got strides {outs.stride()}")
    n_src, rows, heads, d = outs.shape
    block_r = block_r or block_rows(d)
    out = torch.empty(rows, heads, d, dtype=out_dtype or outs.dtype, device=outs.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=outs.device)
    n_pairs = rows * heads
    if n_pairs == 0:
        return out, lse
    _merge_kernel[(triton.cdiv(n_pairs, block_r),)](
        outs, lses, out, lse, n_src, n_pairs, heads,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), ACCUMULATE=False)
    return out, lse


def triton_merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor,
                      block_r: int | None = None) -> None:
    """In place: (acc_out [L, H, D] fp32, acc_lse [L, H] fp32) ← merge of themselves with outs [S, L, H, D] /
    lses [S, L, H] (split-KV partials of one ring step)."""
    if outs.dim() != 4 or lses.shape != outs.shape[:3] or acc_out.shape != outs.shape[1:]:
        raise ValueError(f"need acc [L, H, D], outs [S, L, H, D], lses [S, L, H]; got {tuple(acc_out.shape)}, "
                         f"{tuple(outs.shape)}, {tuple(lses.shape)}")
    n_src, rows, heads, d = outs.shape
    block_r = block_r or block_rows(d)
    n_pairs = rows * heads
    if n_pairs == 0:
        return
    _merge_kernel[(triton.cdiv(n_pairs, block_r),)](
        outs, lses, acc_out, acc_lse, n_src, n_pairs, heads,
        outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1), lses.stride(2),
        acc_out.stride(0), acc_out.stride(1), acc_lse.stride(0), acc_lse.stride(1),
        D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), ACCUMULATE=True)
