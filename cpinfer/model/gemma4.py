"""Gemma 4's text decoder layer, an option of the shared decoder (`decoder.py`): sandwich norms around attention and
the dense MLP, as Gemma 3; beside the dense MLP (26B-A4B) a routed mixture of experts whose router RMS-normalises
its input, scales it per channel and per expert; per-layer input embeddings (E2B / E4B: a per-token vector per layer,
gated into the residual after the MLP); a learned scalar on the layer's output. Attention's own options (per-layer
head sizes, KV sharing, value norm, keys as values) are in `blocks.Attention`.

Every piece is per token, so context parallelism needs nothing of its own here: only attention crosses ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import MoEConfig
from cpinfer.model.blocks import _ACTIVATIONS, AttentionFn, DecoderLayer
from cpinfer.model.moe import Experts
from cpinfer.model.norms import RMSNorm


def plain_rms(x: Tensor, eps: float) -> Tensor:
    """A weightless RMSNorm over the last dim in fp32, back to x's dtype (Gemma 4's value and router norms)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Gemma4Router(nn.Module):
    """scores = softmax(proj(rms(x) * scale / sqrt(hidden))); the top k renormalised to sum 1, each times its
    expert's `per_expert_scale`."""

    def __init__(self, hidden: int, cfg: MoEConfig, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.eps, self.top_k, self.root = eps, cfg.top_k, hidden ** -0.5

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [L, hidden] (the layer's residual stream) -> (weights [L, k] fp32, experts [L, k] int64)."""
        scores = self.proj(plain_rms(x, self.eps) * self.scale * self.root).float().softmax(-1)  # [L, E]
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts].float(), experts


class Gemma4DecoderLayer(DecoderLayer):
    """DecoderLayer (sandwich norms) plus Gemma 4's parallel experts, per-layer input and output scalar."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        eps, style, hidden = config.rms_norm_eps, config.norm_style, config.hidden_size
        self.has_moe = config.moe_beside_mlp
        if self.has_moe:
            self.router = Gemma4Router(hidden, config.moe, eps)
            self.experts = Experts(hidden, config.moe)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, style)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, style)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, style)
        p = config.per_layer_input_size
        if p:
            self.act = _ACTIVATIONS[config.hidden_act]
            self.per_layer_input_gate = nn.Linear(hidden, p, bias=False)
            self.per_layer_projection = nn.Linear(p, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps, style)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalar else None

    def forward(self, h: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn,
                q_scale: Tensor | None = None, kv_share: dict | None = None,
                per_layer_input: Tensor | None = None) -> Tensor:  # [L, hidden]; per_layer_input [L, P]
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, attn, q_scale,
                                                             kv_share))
        x = self.ffn(self.pre_feedforward_layernorm(h))
        if self.has_moe:  # the experts read the residual stream (their own norm), not the dense MLP's input
            weights, experts = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), weights, experts)
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(x)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h if self.layer_scalar is None else h * self.layer_scalar


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer input embeddings: per token and layer, (norm(proj(embedding) / sqrt(hidden)) + a token
    embedding times sqrt(P)) / sqrt(2), P channels each. Parameters under the checkpoint's names (on the model)."""

    @staticmethod
    def add_to(model: nn.Module, config: ModelConfig) -> None:
        n, p = config.num_hidden_layers, config.per_layer_input_size
        model.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size, n * p)
        model.per_layer_model_projection = nn.Linear(config.hidden_size, n * p, bias=False)
        model.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps, config.norm_style)

    @staticmethod
    def compute(model: nn.Module, config: ModelConfig, input_ids: Tensor, embeds: Tensor) -> Tensor:
        """input_ids [L], embeds [L, hidden] (scaled) -> [L, layers, P]."""
        n, p = config.num_hidden_layers, config.per_layer_input_size
        tokens = model.embed_tokens_per_layer(input_ids)
        tokens = (tokens * torch.tensor(p ** 0.5, dtype=tokens.dtype)).view(-1, n, p)
        proj = model.per_layer_model_projection(embeds) * config.hidden_size ** -0.5
        proj = model.per_layer_projection_norm(proj.view(-1, n, p))
        return (proj + tokens) * 2.0 ** -0.5
