"""Stand-ins for PyTorch's cuDNN attention ops on CPU, for tests only: the real ops' schemas (argument names, order,
defaults and keyword-only part), their argument checks (4-D BHSD dense tensors with a unit last stride and 16-byte
aligned base and strides; packed contiguous ragged tensors with int32 cumulative lengths and no GQA, as PyTorch's
varlen front end requires), and float64 results with cuDNN's semantics: a TOP-LEFT causal mask, natural-log
log-sum-exp [B, H, Lq] (dense) / [total_q, H, 1] (ragged). Faults a probe must catch: `lse_base2` (a base-2
log-sum-exp), `gqa_wrong` (query head h read KV head h % Hkv), `fail` (raises like an unsupported GPU),
`ragged_offset_bug` (each sequence's log-sum-exp written at offset cum_seq_q instead of cum_seq_q x H, as older
PyTorch builds did), `packed_only` (wrong results unless the BSHD views are of packed tensors). Every call is
recorded in `CALLS`.
"""
from __future__ import annotations

import math

import torch

CALLS: list[dict] = []


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1))


def _attend(q, k, v, scale, causal, gqa_wrong=False):
    """q [H, Lq, D], k/v [Hkv, Lk, D] → out [H, Lq, Dv] float64, lse [H, Lq] float64; causal: top-left."""
    h, hkv = q.shape[0], k.shape[0]
    heads = torch.arange(h) % hkv if gqa_wrong else torch.arange(h) // (h // hkv)
    kk, vv = k.double()[heads], v.double()[heads]
    s = torch.einsum("hqd,hkd->hqk", q.double(), kk) * scale
    if causal:
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(~(j <= i)[None], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("hqk,hkd->hqd", p, vv), lse


def make_ops(lse_base2: bool = False, gqa_wrong: bool = False, fail: bool = False, ragged_offset_bug: bool = False,
             packed_only: bool = False):
    """(dense, ragged) fakes with the options above."""

    def _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, return_debug_mask=False, *, scale=None):
        if fail:
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0 and return_debug_mask is False
        assert isinstance(is_causal, bool) and scale is not None and scale > 0
        assert query.dim() == key.dim() == value.dim() == 4, (query.shape, key.shape)
        assert query.dtype in (torch.float16, torch.bfloat16) and query.dtype == key.dtype == value.dtype
        b, h, lq, d = query.shape
        assert key.shape[0] == b and key.shape[:3] == value.shape[:3] and key.shape[3] == d and h % key.shape[1] == 0
        assert all(_aligned(t) for t in (query, key, value)), "cuDNN needs 16-byte aligned bases and strides"
        assert key.shape[2] > 1, "cudnn SDPA does not support key/value sequence length 1"
        CALLS.append({"op": "dense", "causal": is_causal, "batch": b, "heads": h, "kv_heads": key.shape[1],
                      "rows": lq, "keys": key.shape[2]})
        out = torch.empty(b, h, lq, value.shape[-1], dtype=torch.float64)
        lse = torch.empty(b, h, lq, dtype=torch.float64)
        for i in range(b):
            out[i], lse[i] = _attend(query[i], key[i], value[i], scale, is_causal, gqa_wrong)
        if lse_base2:
            lse = lse / math.log(2)
        if packed_only and not all(t.transpose(1, 2).is_contiguous() for t in (query, key, value)):
            out = out * 0.5  # a kernel that misreads a token stride
        empty = torch.empty(0)
        return (out.to(query.dtype), lse.float(), empty, empty, lq, key.shape[2], torch.zeros((), dtype=torch.long),
                torch.zeros((), dtype=torch.long), empty)

    def _cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                 compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                                 scale=None):
        if fail:
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0 and return_debug_mask is False
        assert is_causal is False, "cpinfer sends only FULL blocks to the ragged op"
        assert scale is not None and scale > 0
        assert query.dim() == key.dim() == value.dim() == 3 and query.dtype in (torch.float16, torch.bfloat16)
        assert query.shape[1] == key.shape[1] == value.shape[1], "the ragged op takes no GQA"
        assert all(t.is_contiguous() for t in (query, key, value)), "offsets are cum_seq x H x D: packed tensors"
        for cu, total, mx in ((cum_seq_q, query.shape[0], max_q), (cum_seq_k, key.shape[0], max_k)):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == query.device
            assert int(cu[0]) == 0 and bool((cu[1:] >= cu[:-1]).all()) and int(cu[-1]) == total
            assert isinstance(mx, int) and mx >= int((cu[1:] - cu[:-1]).max())
        assert len(cum_seq_q) == len(cum_seq_k)
        assert bool((cum_seq_k[1:] - cum_seq_k[:-1] > 1).all()), "cpinfer sends no one-key sequence"
        CALLS.append({"op": "ragged", "causal": False, "batch": len(cum_seq_q) - 1, "heads": query.shape[1],
                      "kv_heads": key.shape[1], "rows": query.shape[0], "keys": key.shape[0]})
        h = query.shape[1]
        out = torch.empty(query.shape[0], h, value.shape[-1], dtype=torch.float64)
        flat = torch.full((query.shape[0] * h,), 7.0, dtype=torch.float64)
        for s in range(len(cum_seq_q) - 1):
            qa, qb, ka, kb = (int(x) for x in (cum_seq_q[s], cum_seq_q[s + 1], cum_seq_k[s], cum_seq_k[s + 1]))
            o, lse = _attend(query[qa:qb].transpose(0, 1), key[ka:kb].transpose(0, 1), value[ka:kb].transpose(0, 1),
                             scale, False)
            out[qa:qb] = o.transpose(0, 1)
            at = qa if ragged_offset_bug else qa * h
            flat[at:at + (qb - qa) * h] = lse.transpose(0, 1).reshape(-1)
        empty = torch.empty(0)
        return (out.to(query.dtype), flat.float().view(query.shape[0], h, 1), cum_seq_q, cum_seq_k, max_q, max_k,
                torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), empty)

    return _scaled_dot_product_cudnn_attention, _cudnn_attention_forward


def install(monkeypatch, ragged: bool = True, **kwargs) -> None:
    """The fakes as the ops (allowed on CPU), probes and the shared backend object forgotten; monkeypatch undoes
    it. `ragged=False`: this torch has no ragged op."""
    from cpinfer.attention import autoselect, backends, torch_cudnn

    CALLS.clear()
    dense, ragged_op = make_ops(**kwargs)
    monkeypatch.setattr(torch_cudnn, "aten_ops", lambda: (dense, ragged_op if ragged else None))
    monkeypatch.setattr(torch_cudnn, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch_cudnn, "_PROBED", {})
    monkeypatch.setattr(backends, "_BACKENDS", {k: v for k, v in backends._BACKENDS.items() if k != "torch-cudnn"})
    monkeypatch.setattr(autoselect, "_CHOICES", {})


def install_plain(**kwargs) -> None:
    """The same for a worker process (no monkeypatch; the process keeps it)."""
    from cpinfer.attention import backends, torch_cudnn

    CALLS.clear()
    dense, ragged_op = make_ops(**kwargs)
    torch_cudnn.aten_ops = lambda: (dense, ragged_op)
    torch_cudnn.DEVICES = ("cuda", "cpu")
    torch_cudnn.forget_probes()
    backends._BACKENDS.pop("torch-cudnn", None)
