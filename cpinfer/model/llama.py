"""Llama-3 decoder (RMSNorm, GQA attention with RoPE, SwiGLU) over packed, token-major inputs.

No distributed code: attention is an injected `AttentionFn`, and each layer derives its head counts from its
projection weights, so tensor parallelism can slice the linears from outside. Parameter names match HF's.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.config import ModelConfig
from cpinfer.model.rope import RotaryEmbedding, apply_rope

# (layer_idx, q [L, H, D], k [L, Hkv, D], v [L, Hkv, D]) -> out [L, H, D]; q and k already carry RoPE.
AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> same shape and dtype; the statistics are taken in fp32."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [L, hidden] -> [L, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=False)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)

    @property
    def num_heads(self) -> int:  # from the weights, so a TP-sliced q_proj means fewer local heads
        return self.q_proj.weight.shape[0] // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.k_proj.weight.shape[0] // self.head_dim

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        """x [L, hidden], cos/sin [L, D/2] -> [L, hidden] (a partial sum when o_proj is TP-sliced)."""
        n = x.shape[0]
        d = self.head_dim  # head counts follow from the (possibly TP-sliced) weights; L may be 0 on a rank
        h, hkv = self.q_proj.weight.shape[0] // d, self.k_proj.weight.shape[0] // d
        q = self.q_proj(x).view(n, h, d)  # [L, H, D]
        k = self.k_proj(x).view(n, hkv, d)  # [L, Hkv, D]
        v = self.v_proj(x).view(n, hkv, d)  # [L, Hkv, D]
        out = attn(self.layer_idx, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [L, H, D]
        return self.o_proj(out.reshape(n, h * d))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:  # [L, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-3 causal LM over packed tokens: `forward` gives final-norm hidden states, `compute_logits` logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share the input embedding with the output projection (call again after replacing either)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """input_ids, positions [L] int64 (any sequences, any order) -> hidden [L, hidden] after the final norm."""
        cos, sin = self.rotary.cos_sin(positions)       # [L, D/2] fp32, shared by all layers
        h = self.model.embed_tokens(input_ids)          # [L, hidden]
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, hidden] -> logits [M, vocab] fp32."""
        return self.lm_head(hidden).float()
