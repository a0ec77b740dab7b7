"""The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2, GLM-5), with Hugging Face's parameter names.

Per token it makes one indexer key k = LayerNorm(x W_k) [index_head_dim] (cached beside MLA's latent), and per query
`index_n_heads` indexer queries q_h = (q_latent W_qb)_h and weights w_h = (x W_w)_h / sqrt(heads); the first
qk_rope_head_dim channels of q_h and k carry RoPE (half-split pairs for V3.2, interleaved for GLM). A query's score
for key t is sum_h w_h relu(q_h · k_t / sqrt(index_head_dim)); attention reads its `index_topk` best keys
(`engine/sparse_attention.py`). No distributed code, no cache: `forward` returns this forward's rows.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from cpinfer.model.config import ModelConfig
from cpinfer.model.rope import apply_rope, apply_rope_interleaved


@dataclasses.dataclass
class IndexerRows:
    """One forward's indexer rows: q [L, Hi, Di] (RoPE applied), w [L, Hi] fp32 (times 1/sqrt(Hi)), k [L, Di]
    (RoPE applied: the cached indexer key), and the score scale 1/sqrt(Di)."""

    q: Tensor
    w: Tensor
    k: Tensor
    scale: float


class Indexer(nn.Module):
    """`self_attn.indexer`: wq_b [Hi * Di, q_lora_rank], wk [Di, hidden], k_norm (LayerNorm with bias),
    weights_proj [Hi, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        dsa, hidden = config.dsa, config.hidden_size
        self.dsa = dsa
        self.wq_b = nn.Linear(config.mla.q_lora_rank, dsa.index_n_heads * dsa.index_head_dim, bias=False)
        self.wk = nn.Linear(hidden, dsa.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(dsa.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, dsa.index_n_heads, bias=False)
        self.rope = apply_rope_interleaved if dsa.rope_interleaved else apply_rope

    def forward(self, x: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor) -> IndexerRows:
        """x [L, hidden] (the attention's input), q_latent [L, q_lora_rank] (q_a_layernorm(q_a_proj(x))),
        cos/sin [L, rope/2] -> this forward's `IndexerRows`."""
        d, n = self.dsa, x.shape[0]
        r = d.rope_dim
        q = self.wq_b(q_latent).view(n, d.index_n_heads, d.index_head_dim)  # [L, Hi, Di]
        k = self.k_norm(self.wk(x)).view(n, 1, d.index_head_dim)  # [L, 1, Di]
        q = torch.cat((self.rope(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((self.rope(k[..., :r], cos, sin), k[..., r:]), dim=-1)[:, 0]  # [L, Di]
        w = self.weights_proj(x).float() * d.index_n_heads ** -0.5  # [L, Hi]
        return IndexerRows(q, w, k, d.index_head_dim ** -0.5)


def index_key_fp8(config: ModelConfig) -> bool:
    """Whether the checkpoint's indexer is FP8 (its `quantization_config` quantizes `indexer.wk`, as DeepSeek-V3.2's
    and GLM-5's FP8 releases do): then an FP8 KV cache keeps the indexer key in FP8 too (`kv/store.py`)."""
    q = config.quantization
    return config.dsa is not None and q is not None and not q.leaves("model.layers.0.self_attn.indexer.wk")


def index_scores(q: Tensor, w: Tensor, k: Tensor, scale: float) -> Tensor:
    """q [Q, Hi, Di], w [Q, Hi] fp32, k [K, Di] -> scores [Q, K] fp32: sum_h w_h relu(scale q_h · k)."""
    s = torch.relu(torch.matmul(q.float(), k.float().t()) * scale)  # [Q, Hi, K]
    return torch.matmul(w.unsqueeze(1), s).squeeze(1)  # [Q, K]


__all__ = ["Indexer", "IndexerRows", "index_key_fp8", "index_scores"]
