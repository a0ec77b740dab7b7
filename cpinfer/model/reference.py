"""Single-device reference attention for packed, token-major batches (tests and the model run alone).

Query i sees key j iff they belong to the same sequence, pos[j] <= pos[i] and, on a sliding-window layer,
pos[i] - pos[j] < window — the `cp_attention` contract with all keys local. Builds a dense [L, L] mask, so it
is for short inputs only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class ReferenceAttention:
    """An `AttentionFn` over one packed batch whose new tokens are all the keys (no KV cache).

    `config` (a `ModelConfig`) supplies each layer's sliding window and the softmax scale; without it every
    layer is full causal attention scaled by `scale` (default 1/sqrt(head_dim))."""

    def __init__(self, seq_ids: Tensor, positions: Tensor, scale: float | None = None, config=None):
        # seq_ids, positions: [L] int64
        same_seq = seq_ids[:, None] == seq_ids[None, :]
        self.dist = positions[:, None] - positions[None, :]                 # [Lq, Lk] q_pos - kv_pos
        self.mask = same_seq & (self.dist >= 0)                             # [Lq, Lk] bool
        self.config = config
        self.scale = config.attention_scale if config is not None and scale is None else scale
        self._masks: dict[int | None, Tensor] = {None: self.mask}

    def layer_mask(self, layer_idx: int) -> Tensor:
        window = None if self.config is None else self.config.layer_window(layer_idx)
        if window not in self._masks:
            self._masks[window] = self.mask & (self.dist < window)
        return self._masks[window]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [L, H, D], k/v [L, Hkv, D] -> out [L, H, D]; a query with no visible key gets zeros."""
        mask = self.layer_mask(layer_idx)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                                # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),          # [H, L, D]
            attn_mask=mask, scale=self.scale,
        ).transpose(0, 1)                                                    # [L, H, D]
        return torch.where(mask.any(dim=1)[:, None, None], out, torch.zeros((), dtype=out.dtype))
