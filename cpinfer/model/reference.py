"""Single-device reference attention for packed, token-major batches (tests and the model run alone).

Query i sees key j iff they belong to the same sequence and pos[j] <= pos[i] — the `cp_attention` contract
with all keys local. Builds a dense [L, L] mask, so it is for short inputs only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class ReferenceAttention:
    """An `AttentionFn` over one packed batch whose new tokens are all the keys (no KV cache)."""

    def __init__(self, seq_ids: Tensor, positions: Tensor, scale: float | None = None):
        # seq_ids, positions: [L] int64
        same_seq = seq_ids[:, None] == seq_ids[None, :]
        self.mask = same_seq & (positions[None, :] <= positions[:, None])   # [Lq, Lk] bool
        self.any_visible = self.mask.any(dim=1)[:, None, None]              # [Lq, 1, 1]
        self.scale = scale

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [L, H, D], k/v [L, Hkv, D] -> out [L, H, D]; a query with no visible key gets zeros."""
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                                # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),          # [H, L, D]
            attn_mask=self.mask, scale=self.scale,
        ).transpose(0, 1)                                                    # [L, H, D]
        return torch.where(self.any_visible, out, torch.zeros((), dtype=out.dtype))
