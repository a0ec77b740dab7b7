"""The one decoder every family runs over packed, token-major inputs: the embedding, the layers (`blocks.py`:
`DecoderLayer`, Nemotron-H's `BlockLayer`, Gemma 4's layer in `gemma4.py`) with their RoPE tables (one per
distinct RoPE and head size), the final norm and the LM head. The family's options (`ModelConfig`) decide every
layer's pieces.

No distributed code: attention is an injected `AttentionFn`, the hybrids' recurrence a `RecurrentFn`. Parameter
names are Hugging Face's, for every family.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from cpinfer.model.blocks import (MLP, Attention, AttentionFn, BlockLayer, DecoderLayer, RecurrentFn,
                                  attn_temperature)
from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import RopeConfig
from cpinfer.model.cpu_gemm import pack_linear
from cpinfer.model.gemma4 import Gemma4DecoderLayer, PerLayerInputs
from cpinfer.model.norms import RMSNorm
from cpinfer.model.rope import RotaryEmbedding

__all__ = ["MLP", "Attention", "AttentionFn", "BlockLayer", "CausalLM", "DecoderLayer", "DecoderModel",
           "RecurrentFn"]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_cls = BlockLayer if config.mixer_blocks else DecoderLayer
        if config.layer_scalar or config.per_layer_input_size or config.moe_beside_mlp:  # Gemma 4
            layer_cls = Gemma4DecoderLayer
            if config.per_layer_input_size:
                PerLayerInputs.add_to(self, config)
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)


class CausalLM(nn.Module):
    """A causal LM of any supported family over packed tokens: `forward` gives final-norm hidden states,
    `compute_logits` the logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        ropes: dict[tuple[RopeConfig, int], RotaryEmbedding] = {}
        for i in range(config.num_hidden_layers):  # one table of frequencies per distinct RoPE and head size
            rope, dim = config.layer_rope(i), config.layer_rope_dim(i)  # (Gemma 3: two; Gemma 4: two head sizes)
            if rope is not None and (rope, dim) not in ropes:
                ropes[(rope, dim)] = RotaryEmbedding(dim, rope, config.max_position_embeddings)
        self.layer_rotary = [None if config.layer_rope(i) is None else ropes[(config.layer_rope(i),
                                                                               config.layer_rope_dim(i))]
                             for i in range(config.num_hidden_layers)]  # None: a NoPE layer
        self.embed_scale = config.hidden_size ** 0.5 if config.embed_scale else None
        if config.tie_word_embeddings:
            self.tie_weights()

    @property
    def rotary(self) -> RotaryEmbedding:
        """The RoPE of the first RoPE layer (every RoPE layer of a single-RoPE family)."""
        return next(r for r in self.layer_rotary if r is not None)

    def tie_weights(self) -> None:
        """Share the input embedding with the output projection (call again after replacing either)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [L] -> [L, hidden]; Gemma scales by sqrt(hidden) rounded to the weights' dtype, as HF does."""
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn,
                recurrent: RecurrentFn | None = None) -> Tensor:
        """input_ids, positions [L] int64 (any sequences, any order; a hybrid's tokens of one sequence in order)
        -> hidden [L, hidden] after the final norm. `recurrent` runs the recurrent layers (hybrid families)."""
        tables = {id(r): r for r in self.layer_rotary if r is not None}
        tables = {k: r.cos_sin(positions) for k, r in tables.items()}  # [L, D/2] fp32 each, shared by layers
        tables[id(None)] = (None, None)                                   # NoPE layers
        temp = self.config.attn_temperature  # Llama 4: NoPE layers scale queries by their global position
        q_scale = None if temp is None else attn_temperature(positions, *temp)  # [L] fp32
        h = self.embed(input_ids)                                        # [L, hidden]
        c = self.config
        if c.per_layer_input_size or c.kv_source_layers:  # Gemma 4's per-layer inputs and shared K/V
            per_layer = PerLayerInputs.compute(self.model, c, input_ids, h) if c.per_layer_input_size else None
            kv_share: dict | None = {} if c.kv_source_layers else None
            for i, (layer, rotary) in enumerate(zip(self.model.layers, self.layer_rotary)):
                extra = {} if per_layer is None else {"per_layer_input": per_layer[:, i]}
                h = layer(h, *tables[id(rotary)], attn, q_scale if rotary is None else None, kv_share, **extra)
            return self.model.norm(h)
        for layer, rotary in zip(self.model.layers, self.layer_rotary):
            scale = q_scale if rotary is None else None
            h = layer(h, *tables[id(rotary)], attn, scale, recurrent=recurrent)
        return self.model.norm(h)

    def fuse_projections(self) -> int:
        """Each attention layer's q / k / v and each gated MLP's gate / up as one GEMM from now on (`fused.py`; the
        parameters stay where they are, as views): how many modules were fused. Layers that cannot be fused (TP-sliced
        or quantized Linears, KV-sharing layers, MoE) keep their separate Linears."""
        return sum(bool(m.fuse_projections()) for m in self.modules() if hasattr(m, "fuse_projections")
                   and m is not self)

    def pack_linears(self) -> int:
        """CPU: every plain nn.Linear multiplies its rows through `cpu_gemm.PackedWeight` from now on (cpinfer's
        kernel for a decode step's 1-4 rows over an interleaved copy of the weight, oneDNN over a packed copy from 5
        rows on; the fused q / k / v and gate / up GEMMs already do); the LM head up to 16 rows (more: the
        weight-first product below). How many modules."""
        linears = [m for m in self.modules() if type(m) is nn.Linear]
        for m in linears:
            pack_linear(m, 16 if m is self.lm_head else None)
        return len(linears)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [M, hidden] -> logits [M, vocab] fp32 (tanh soft-capped when the config says so)."""
        head = self.lm_head
        packed = getattr(head, "_packed", None)
        if packed is not None and hidden.dtype == torch.float32 and packed.takes(hidden.shape[0]):
            logits = head(hidden).float()
        elif hidden.device.type == "cpu" and 1 < hidden.shape[0] <= _FEW_ROWS and type(head) is nn.Linear \
                and head.bias is None:
            # a few rows (a verification's k+1, a small decode batch) on the CPU: BLAS runs weight @ hidden^T several
            # times faster than the short-M GEMM `linear` picks for the vocabulary-wide head (same products)
            logits = (head.weight @ hidden.t()).t().float()  # [M, vocab]
        else:
            logits = head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


_FEW_ROWS = 32  # compute_logits: up to this many rows take the weight-first product on the CPU


# The names the Llama-only model had; kept so that callers written against them keep working.
LlamaForCausalLM = CausalLM
LlamaDecoderLayer = DecoderLayer
LlamaAttention = Attention
LlamaMLP = MLP
LlamaModel = DecoderModel
