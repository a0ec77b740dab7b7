"""The causal depthwise conv1d in front of KDA and Mamba-2 (FLA's "short convolution"), with an explicit tail.

Channel c of the output at token t is  act(bias_c + sum_{j<K} w[c, j] * x[t - K + 1 + j, c])  over the rows
x = [tail; u]: the `kernel - 1` pre-conv rows before the run come from the caller (zeros at a sequence start, the
halo from whoever holds the preceding tokens under CP, the cached conv state in decode), so a run cut anywhere gives
the same outputs as the uncut run (DESIGN.md "Hybrid and sparse models").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, None: lambda x: x}


def check_activation(act: str | None, field: str) -> str | None:
    if act not in ACTIVATIONS:
        raise ValueError(f"{field} {act!r} is not supported for the short convolution; allowed: "
                         f"{sorted(a for a in ACTIVATIONS if a)} (or none)")
    return act


def causal_conv(u: Tensor, tail: Tensor | None, weight: Tensor, bias: Tensor | None,
                activation: str | None) -> tuple[Tensor, Tensor]:
    """u [T, C] pre-conv rows, tail [K-1, C] (None: zeros), weight [C, K], bias [C] or None ->
    (act(conv) [T, C], the new tail [K-1, C]: the last K-1 rows of [tail; u])."""
    t, c = u.shape
    k = weight.shape[-1]
    if tail is None:
        tail = u.new_zeros(k - 1, c)
    if tuple(tail.shape) != (k - 1, c):
        raise ValueError(f"conv tail has shape {tuple(tail.shape)}, expected (kernel - 1, channels) = {(k - 1, c)}")
    rows = torch.cat([tail.to(u.dtype), u], dim=0)  # [K-1+T, C]
    if t == 0:  # a rank may hold no token of a sequence
        return u, rows
    out = F.conv1d(rows.T[None].to(weight.dtype), weight[:, None, :], bias, groups=c)[0].T  # [T, C]
    return ACTIVATIONS[activation](out).to(u.dtype), rows[rows.shape[0] - (k - 1):]


__all__ = ["causal_conv", "check_activation"]
