"""Single-device reference attention for packed, token-major batches (tests and the model run alone).

Query i sees key j iff they belong to the same sequence, pos[j] <= pos[i], on a sliding-window layer
pos[i] - pos[j] < window, and on a chunked layer pos[i] // C == pos[j] // C — the `cp_attention` contract with all
keys local; a layer's sinks add one logit per head to every softmax denominator. Builds a dense [L, L] mask, so it
is for short inputs only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class ReferenceAttention:
    """An `AttentionFn` over one packed batch whose new tokens are all the keys (no KV cache).

    `config` (a `ModelConfig`) supplies each layer's sliding window, attention chunk and the softmax scale; without
    it every layer is full causal attention scaled by `scale` (default 1/sqrt(head_dim))."""

    def __init__(self, seq_ids: Tensor, positions: Tensor, scale: float | None = None, config=None):
        # seq_ids, positions: [L] int64
        same_seq = seq_ids[:, None] == seq_ids[None, :]
        self.positions = positions
        self.dist = positions[:, None] - positions[None, :]                 # [Lq, Lk] q_pos - kv_pos
        self.mask = same_seq & (self.dist >= 0)                             # [Lq, Lk] bool
        self.config = config
        self.scale = config.attention_scale if config is not None and scale is None else scale
        self._masks: dict[tuple, Tensor] = {(None, None): self.mask}

    def layer_mask(self, layer_idx: int) -> Tensor:
        c = self.config
        kind = (None, None) if c is None else (c.layer_window(layer_idx), c.layer_chunk(layer_idx))
        if kind not in self._masks:
            window, chunk = kind
            mask = self.mask if window is None else self.mask & (self.dist < window)
            if chunk is not None:
                blocks = self.positions // chunk
                mask = mask & (blocks[:, None] == blocks[None, :])
            self._masks[kind] = mask
        return self._masks[kind]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None = None) -> Tensor:
        """q [L, H, D], k/v [L, Hkv, D] -> out [L, H, D]; a query with no visible key gets zeros. sinks [H]."""
        mask = self.layer_mask(layer_idx)
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                                # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        if sinks is not None:
            return _with_sinks(q, k, v, mask, sinks, self.scale)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),          # [H, L, D]
            attn_mask=mask, scale=self.scale,
        ).transpose(0, 1)                                                    # [L, H, D]
        return torch.where(mask.any(dim=1)[:, None, None], out, torch.zeros((), dtype=out.dtype))


def _with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor, scale: float | None) -> Tensor:
    """Explicit softmax with one more column per head holding its sink logit (value 0). q/k/v [L, H, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale           # [H, Lq, Lk] fp32
    s = s.masked_fill(~mask[None], -torch.inf)
    s = torch.cat((s, sinks.float().reshape(-1, 1, 1).expand(-1, s.shape[1], 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]                                   # the sink's share has no value
    return torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)
