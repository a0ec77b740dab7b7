"""A stand-in for `torch.ops.aten._flash_attention_forward` on CPU, for tests only: the op's schema (same argument
names, order and keyword-only part), its argument checks, and the result in float64 with FA2's semantics (the
reference of `fake_flash_attn.py`: bottom-right causal alignment, out in q's dtype, fp32 log-sum-exp). `layout`
chooses how the log-sum-exp comes back ("hp": [H, total_q] as torch 2.13; "1hp": [1, H, total_q]; "padded":
[sequences, H, max_q]; "bad": a shape cpinfer must refuse); `top_left` aligns causal masks top-left (what a wrong
alignment would do); `fail` raises like an unsupported GPU. Every call is recorded in `CALLS`.
"""
from __future__ import annotations

import torch

from fake_flash_attn import _check, varlen_reference

CALLS: list[dict] = []


def make_op(layout: str = "hp", top_left: bool = False, fail: bool = False):
    def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
        if fail:
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        assert dropout_p == 0.0 and return_debug_mask is False and isinstance(is_causal, bool)
        assert window_size_left is None and window_size_right is None and seqused_k is None
        assert alibi_slopes is None and block_table is None and num_splits is None
        _check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale)
        CALLS.append({"causal": is_causal, "seqs": len(cum_seq_q) - 1, "rows": query.shape[0],
                      "keys": key.shape[0]})
        if top_left and is_causal:  # a top-left mask: pad every sequence's keys so that its diagonal starts at 0
            out, lse = _top_left(query, key, value, cum_seq_q, cum_seq_k, scale)
        else:
            out, lse = varlen_reference(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal)
        lse = _layout(lse, cum_seq_q, max_q, layout)
        empty = torch.empty(0)
        return out, lse, torch.zeros(2, dtype=torch.int64), empty, empty

    return _flash_attention_forward


def _top_left(q, k, v, cu_q, cu_k, scale):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qa, qb, ka, kb = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        one_q = torch.tensor([0, qb - qa], dtype=torch.int32)
        one_k = torch.tensor([0, min(kb - ka, qb - qa)], dtype=torch.int32)  # keys [0, Lq): the square at the top
        o, lse = varlen_reference(q[qa:qb], k[ka:ka + int(one_k[1])], v[ka:ka + int(one_k[1])], one_q, one_k, scale,
                                  True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _layout(lse, cu_q, max_q: int, layout: str):
    """lse [H, total_q] → the layout asked for."""
    if layout == "hp":
        return lse
    if layout == "1hp":
        return lse[None]
    if layout == "padded":
        out = torch.full((len(cu_q) - 1, lse.shape[0], max_q), 7.0)  # padding a reader must never take
        for b in range(len(cu_q) - 1):
            a, e = int(cu_q[b]), int(cu_q[b + 1])
            out[b, :, :e - a] = lse[:, a:e]
        return out
    if layout == "bad":
        return lse.reshape(-1)
    raise ValueError(layout)


def install(monkeypatch, **kwargs) -> None:
    """The fake as the op (allowed on CPU), probes and the shared backend object forgotten; monkeypatch undoes it."""
    from cpinfer.attention import backends, torch_flash

    CALLS.clear()
    op = make_op(**kwargs)
    monkeypatch.setattr(torch_flash, "aten_op", lambda: op)
    monkeypatch.setattr(torch_flash, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch_flash, "_PROBED", {})  # fresh probes, dropped with the fake
    monkeypatch.setattr(backends, "_BACKENDS", {k: v for k, v in backends._BACKENDS.items() if k != "torch-flash"})
