"""Per-item attention kernels: one FULL / CAUSAL / MASK block of queries against keys → `(out, lse)`.

`cpu-flash` is cpinfer's CPU flash kernel for float32 prefill blocks (`cpu_prefill.cpp`), else aten's CPU flash
attention (for a few queries, decode, with a KV head's query heads as its rows);
`math` is explicit fp32 matmul / softmax on any device, for small blocks. Neither reads anything from the host
while it runs (no `.item()`, no data-dependent shapes), so both can sit inside a layer loop that must not sync.
"""
from __future__ import annotations

import torch

from cpinfer.attention.cpu_kernels import flash_attention_op
from cpinfer.attention.items import AttentionBackend
from cpinfer.attention.kv_pack import same_head_size

_FEW_Q_MAX_ROWS = 64  # decode path: query rows x heads per KV head at most
_SPLIT_MIN_KEYS = 4096  # decode path: from this many keys on, split them so that every thread has a share (3 KV heads,
# 2 threads, one query: the split and its merge cost 139 vs 80 us at 1K keys, break even at 3K, 767 vs 799 us at 8K)
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _few_queries_full(q, k, v, scale: float):
    """(out [Lq, H, D], lse [Lq, H] fp32) of a handful of queries against keys they all see in full (decode): one
    flash call with a KV head's G query heads (and Lq rows) as the query rows of that KV head, so each key is read
    once per KV head — not once per query head, as the general path's G-batch over expanded K/V does. The kernel
    shares its (batch, head) problems among the threads: when the KV heads do not divide among them evenly (3 KV
    heads on 2 threads), long key ranges are cut into one piece per thread, as a batch, and merged (split-KV)."""
    lq, h, d = q.shape
    lk, hkv = k.shape[:2]
    g = h // hkv
    qr = q.view(1, hkv, g, d) if lq == 1 else q.view(lq, hkv, g, d).transpose(0, 1).reshape(1, hkv, lq * g, d)
    threads = torch.get_num_threads()  # qr: [1, Hkv, Lq*G, D], a view for one query
    if lk >= _SPLIT_MIN_KEYS and hkv % threads:
        out, lse = _split_keys(qr, k, v, threads, scale)
    else:  # K/V as [1, Hkv, Lk, D] views
        out, lse = _FLASH(qr, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0.0, False, scale=scale)
    if lq == 1:  # [1, Hkv, G, D] is [1, H, D] in head order
        return out.reshape(1, h, d), lse.reshape(1, h).float()
    out = out[0].unflatten(1, (lq, g)).transpose(0, 1).reshape(lq, h, d)  # [Lq, H, D]
    return out, lse[0].unflatten(1, (lq, g)).transpose(0, 1).reshape(lq, h).float()  # [Lq, H], finite


def _split_keys(qr, k, v, pieces: int, scale: float):
    """qr [1, Hkv, R, D] against k/v [Lk, Hkv, D] cut into `pieces` equal key ranges run as one batch (the last
    Lk % pieces keys as one more call), merged → (out [1, Hkv, R, D], lse [1, Hkv, R])."""
    m = k.shape[0] // pieces
    kr = k[:pieces * m].unflatten(0, (pieces, m)).transpose(1, 2)  # [P, Hkv, m, D], no copy
    vr = v[:pieces * m].unflatten(0, (pieces, m)).transpose(1, 2)
    out, lse = _FLASH(qr.expand(pieces, -1, -1, -1), kr, vr, 0.0, False, scale=scale)  # [P, Hkv, R, D], [P, Hkv, R]
    if k.shape[0] > pieces * m:
        o, s = _FLASH(qr, k[pieces * m:].permute(1, 0, 2)[None], v[pieces * m:].permute(1, 0, 2)[None], 0.0, False,
                      scale=scale)
        out, lse = torch.cat((out, o)), torch.cat((lse, s))
    total = torch.logsumexp(lse, dim=0, keepdim=True)  # [1, Hkv, R]: every piece sees keys, all finite
    return (out * torch.exp(lse - total).unsqueeze(-1)).sum(0, keepdim=True).to(qr.dtype), total


def cpu_flash_backend(q, k, v, causal, mask, scale):
    """CPU kernel. float32 FULL and CAUSAL blocks of more than a few query rows (prefill) run cpinfer's own flash
    kernel (`cpu_prefill.cpp`: a KV head's query heads share each key block; any Dv that is a multiple of 16) when
    it is compiled; the rest `aten_flash_backend`."""
    own = None
    if (mask is None and not _few_queries(q, k, causal) and q.dtype == k.dtype == v.dtype == torch.float32
            and v.shape[-1] % 16 == 0 and q.device.type == "cpu"):
        own = flash_attention_op()  # None without a compiled library
    if own is not None:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return own(q, k, v, causal, scale)
    return aten_flash_backend(q, k, v, causal, mask, scale)


def _few_queries(q, k, causal: bool) -> bool:
    """A fully visible block of at most `_FEW_Q_MAX_ROWS` query rows x heads per KV head (decode)."""
    return not causal and q.shape[0] * (q.shape[1] // k.shape[1]) <= _FEW_Q_MAX_ROWS


def aten_flash_backend(q, k, v, causal, mask, scale):
    """aten's flash attention for CPU; GQA as a batch of G groups over stride-0 expanded K/V. A fully visible block
    of a few queries (decode) takes `_few_queries_full`. aten's kernel takes one head size for q, k and v: a value
    head size Dv != Dk runs padded (`kv_pack.same_head_size`, exact; the padded call through `cpu_flash_backend`)
    and returns out [Lq, H, Dv]."""
    if v.shape[-1] != k.shape[-1]:
        dv = v.shape[-1]
        out, lse = cpu_flash_backend(*same_head_size(q, k, v), causal, mask, scale)
        return out[..., :dv], lse
    if mask is None and _few_queries(q, k, causal):
        return _few_queries_full(q, k, v, scale)
    lq, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qb = q.view(lq, hkv, g, d).permute(2, 1, 0, 3)  # [G, Hkv, Lq, D], no copy
    kb = k.permute(1, 0, 2).unsqueeze(0).expand(g, -1, -1, -1)  # [G, Hkv, Lk, D], stride 0 over G
    vb = v.permute(1, 0, 2).unsqueeze(0).expand(g, -1, -1, -1)
    attn_mask = None
    if mask is not None:
        attn_mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -torch.inf)[None, None]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb, kb, vb, 0.0, causal, attn_mask=attn_mask, scale=scale)
    out = out.permute(2, 1, 0, 3).reshape(lq, h, d)  # [Lq, H, D]
    lse = lse.permute(2, 1, 0).reshape(lq, h)  # [Lq, H]
    if mask is not None:  # the kernel returns lse 0 (not -inf) for a fully masked row; fixed without a host check
        empty = ~mask.any(dim=1)  # [Lq]
        lse = lse.masked_fill(empty[:, None], -torch.inf)
        out = out.masked_fill(empty[:, None, None], 0.0)
    return out, lse.float()


def sdpa_math_backend(q, k, v, causal, mask, scale):
    """Portable fallback on any device: explicit matmul/softmax in fp32 (small blocks only: it builds the
    [H, Lq, Lk] scores)."""
    lq, h, d = q.shape
    g = h // k.shape[1]
    kk = k.float().repeat_interleave(g, dim=1)  # [Lk, H, D]
    vv = v.float().repeat_interleave(g, dim=1)  # [Lk, H, Dv]
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale  # [H, Lq, Lk]
    if causal:
        mask = torch.ones(lq, k.shape[0], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask[None], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


KERNELS: dict[str, AttentionBackend] = {"cpu-flash": cpu_flash_backend, "math": sdpa_math_backend}


def kernel_by_name(name: str | None, device) -> AttentionBackend:
    """A per-item kernel of this module: None → cpu-flash on CPU, math elsewhere; else one of `KERNELS`.
    (The names of whole-step backends, "auto" / "triton" / "flash-attn", resolve in `backends.item_kernel`.)"""
    if name is None:
        name = "cpu-flash" if torch.device(device).type == "cpu" else "math"
    if name not in KERNELS:
        raise ValueError(f"{name!r} is not a per-item kernel ({', '.join(KERNELS)}); use "
                         "cpinfer.attention.backends.item_kernel or attend_local for the whole-step backends")
    return KERNELS[name]


def register_backend(name: str, fn: AttentionBackend) -> None:
    """Let a device-specific per-item kernel slot in under a name."""
    KERNELS[name] = fn


__all__ = ["cpu_flash_backend", "aten_flash_backend", "sdpa_math_backend", "kernel_by_name", "register_backend", "KERNELS"]
