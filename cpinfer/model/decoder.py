"""The one decoder every family runs (RMSNorm, GQA attention with RoPE, gated MLP) over packed, token-major
inputs; the family's options (`ModelConfig`) switch biases, q/k norms, Gemma's norms and scales on or off.

No distributed code: attention is an injected `AttentionFn` (it reads each layer's window and scale from the
config), and each layer derives its head counts from its projection weights, so tensor parallelism can slice
the linears from outside. Parameter names are Hugging Face's, for every family.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.config import ModelConfig, RopeConfig
from cpinfer.model.rope import RotaryEmbedding, apply_rope


class AttentionFn(Protocol):
    """(layer_idx, q [L, H, D], k [L, Hkv, D], v [L, Hkv, D]) -> out [L, H, D]; q and k already carry RoPE.

    The layer's visibility and softmax scale are `config.layer_window(layer_idx)`, `config.layer_chunk(layer_idx)`
    and `config.attention_scale`. `sinks` [H] (this rank's heads; passed only by layers that have them): a learned
    logit per head that joins every query's softmax denominator once (exp(sink)), with no value."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None = None) -> Tensor:
        ...


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `style` "llama": weight * x̂ cast first, "gemma": (x̂ * (1 + weight)) in fp32."""

    def __init__(self, dim: int, eps: float, style: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if style == "llama" else torch.zeros(dim))
        self.eps, self.style = eps, style

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> same shape and dtype; the statistics are taken in fp32."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "gemma":
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) — SwiGLU (silu) or GeGLU (tanh GELU)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:  # [L, hidden] -> [L, hidden]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:  # per head, over head_dim, before RoPE
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_style)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_style)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: one sink logit per query head (TP slices it with the heads)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads)) if config.attention_sinks else None

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
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.sinks is None:
            out = attn(self.layer_idx, q, k, v)  # [L, H, D]
        else:
            out = attn(self.layer_idx, q, k, v, sinks=self.sinks)
        return self.o_proj(out.reshape(n, h * d))


class DecoderLayer(nn.Module):
    """Pre-norm block; with `sandwich_norm` (Gemma 3) the attention and MLP outputs are normed too."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        eps, style = config.rms_norm_eps, config.norm_style
        self.input_layernorm = RMSNorm(config.hidden_size, eps, style)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, style)  # Llama: before the MLP
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        self.sandwich = config.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, style)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, style)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:  # [L, hidden]
        if self.sandwich:
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, attn))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)


class CausalLM(nn.Module):
    """A causal LM of any supported family over packed tokens: `forward` gives final-norm hidden states,
    `compute_logits` the logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        ropes: dict[RopeConfig, RotaryEmbedding] = {}
        for rope in config.rope.values():  # one table of frequencies per distinct RoPE (Gemma 3: two)
            if rope not in ropes:
                ropes[rope] = RotaryEmbedding(config.head_dim, rope, config.max_position_embeddings)
        self.layer_rotary = [ropes[config.layer_rope(i)] for i in range(config.num_hidden_layers)]
        self.embed_scale = config.hidden_size ** 0.5 if config.embed_scale else None
        if config.tie_word_embeddings:
            self.tie_weights()

    @property
    def rotary(self) -> RotaryEmbedding:
        """The RoPE of layer 0 (every layer of a single-RoPE family)."""
        return self.layer_rotary[0]

    def tie_weights(self) -> None:
        """Share the input embedding with the output projection (call again after replacing either)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [L] -> [L, hidden]; Gemma scales by sqrt(hidden) rounded to the weights' dtype, as HF does."""
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """input_ids, positions [L] int64 (any sequences, any order) -> hidden [L, hidden] after the final norm."""
        tables = {id(r): r for r in self.layer_rotary}
        tables = {k: r.cos_sin(positions) for k, r in tables.items()}  # [L, D/2] fp32 each, shared by layers
        h = self.embed(input_ids)                                        # [L, hidden]
        for layer, rotary in zip(self.model.layers, self.layer_rotary):
            h = layer(h, *tables[id(rotary)], attn)
        return self.model.norm(h)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, hidden] -> logits [M, vocab] fp32 (tanh soft-capped when the config says so)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# The names the Llama-only model had; kept so that callers written against them keep working.
LlamaForCausalLM = CausalLM
LlamaDecoderLayer = DecoderLayer
LlamaAttention = Attention
LlamaMLP = MLP
LlamaModel = DecoderModel
