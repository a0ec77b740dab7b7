"""A stand-in for flash-attn on CPU, for tests only: `flash_attn_varlen_func` checks its arguments the way the real
kernels require them and computes the result in float64 with flash-attn's documented semantics — bottom-right
causal alignment, window (left, right) around that diagonal, out in q's dtype, log-sum-exp [heads, total_q] in
fp32, +inf (FA2) for a row that sees no key — so cpinfer's packing (cu_seqlens, gathers, LSE layout) is checked
exactly without a GPU. Every call is recorded in `CALLS`.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

CALLS: list[dict] = []


def _check(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    assert q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype)
    assert q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2] <= 256
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "flash-attn needs a contiguous last dimension"
    for cu, total in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device, (cu.dtype, cu.device)
        assert int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()) and int(cu[-1]) == total, (cu, total)
    assert len(cu_q) == len(cu_k)
    assert isinstance(max_q, int) and isinstance(max_k, int)
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    assert scale is not None and scale > 0


def varlen_reference(q, k, v, cu_q, cu_k, scale, causal, window=(-1, -1)):
    """(out [total_q, H, D] in q's dtype, lse [H, total_q] fp32) with flash-attn's masks, in float64."""
    h, g = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((h, q.shape[0]), torch.inf, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        lq, lk = qb - qa, kb - ka
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        vis = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            vis &= j <= i + lk - lq
        if window[0] >= 0:
            vis &= j >= i + lk - lq - window[0]
        if window[1] >= 0:
            vis &= j <= i + lk - lq + window[1]
        kk = k[ka:kb].double().repeat_interleave(g, dim=1)  # [lk, H, D]
        vv = v[ka:kb].double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[qa:qb].double(), kk) * scale
        s = s.masked_fill(~vis[None], -torch.inf)
        m = torch.logsumexp(s, dim=-1)  # [H, lq]
        p = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m)[..., None])
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p, vv)
        lse[:, qa:qb] = torch.where(torch.isneginf(m), torch.inf, m)  # FA2: +inf for a row with no key
    return out.to(q.dtype), lse.float()


def make_module(fa3: bool = False, version: str = "2.7.4") -> types.ModuleType:
    """A module named like flash-attn 3's `flash_attn_interface` or flash-attn 2's `flash_attn`."""
    name = "flash_attn_interface" if fa3 else "flash_attn"
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # libraries probe it with find_spec
    mod.__version__ = "3.0.0" if fa3 else version

    def fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and block_table is None
        assert return_attn_probs, "cpinfer needs the log-sum-exp"
        _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
        CALLS.append({"api": 2, "causal": causal, "window": window_size, "seqs": len(cu_seqlens_q) - 1,
                      "rows": q.shape[0], "keys": k.shape[0]})
        out, lse = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size)
        return out, lse, None

    def fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                   seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                   v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                   deterministic=False, sm_margin=0, return_attn_probs=False):
        assert seqused_q is None and seqused_k is None and qv is None and softcap == 0.0
        assert return_attn_probs, "cpinfer needs the log-sum-exp"
        _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
        CALLS.append({"api": 3, "causal": causal, "window": window_size, "seqs": len(cu_seqlens_q) - 1,
                      "rows": q.shape[0], "keys": k.shape[0]})
        out, lse = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size)
        return out, lse

    mod.flash_attn_varlen_func = fa3_varlen if fa3 else fa2_varlen
    return mod


def install(fa3: bool = False, version: str = "2.7.4") -> None:
    """Make `import flash_attn` (or `flash_attn_interface`) give the fake, allow it on CPU, forget earlier
    detections. Undo with `uninstall()`."""
    from cpinfer.attention import backends, flash_backend

    uninstall()
    sys.modules["flash_attn_interface" if fa3 else "flash_attn"] = make_module(fa3, version)
    flash_backend.DEVICES = ("cuda", "cpu")
    flash_backend.detect.cache_clear()
    backends._BACKENDS.pop("flash-attn", None)


def uninstall() -> None:
    from cpinfer.attention import backends, flash_backend

    for name in ("flash_attn", "flash_attn_interface"):
        if isinstance(sys.modules.get(name), types.ModuleType) and not hasattr(sys.modules[name], "__file__"):
            del sys.modules[name]
    flash_backend.DEVICES = ("cuda",)
    flash_backend.detect.cache_clear()
    backends._BACKENDS.pop("flash-attn", None)
