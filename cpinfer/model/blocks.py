"""The decoder's building blocks, one per layer: GQA attention with RoPE (and every family's options: biases, q/k
norms, Gemma's norms and scales, NoPE layers with Llama 4's temperature tuning, the hybrids' output gate, MiniMax-M2's
all-head q/k norms, Gemma 4's per-layer head sizes, KV sharing and value norm), the gated and plain MLPs, the sparse
MLP layers (`moe.py`), multi-head latent attention (`mla.py`) in place of GQA, the hybrids' recurrent mixers
(`recurrent/`), and the two layer shapes: `DecoderLayer` (pre-norm attention or recurrence, then the MLP) and
`BlockLayer` (Nemotron-H: one module per layer). `decoder.py` stacks them into the model; Gemma 4's layer
(`gemma4.py`) extends `DecoderLayer`.

No distributed code: attention is an injected `AttentionFn` and the recurrence a `RecurrentFn`, and each layer
derives its head counts from its projection weights, so tensor parallelism can slice the linears from outside.
Parameter names are Hugging Face's, for every family.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.attention.cpu_kernels import silu_mul_op
from cpinfer.model.config import ModelConfig
from cpinfer.model.fused import FusedLinears
from cpinfer.model.mla import MLAttention
from cpinfer.model.moe import SparseMoE, relu2
from cpinfer.model.norms import RMSNorm, l2_norm
from cpinfer.model.rope import apply_rope, apply_rope_interleaved


class AttentionFn(Protocol):
    """(layer_idx, q [L, H, D], k [L, Hkv, D], v [L, Hkv, D]) -> out [L, H, D]; q and k already carry RoPE.

    The layer's visibility and softmax scale are `config.layer_window(layer_idx)`, `config.layer_chunk(layer_idx)`
    and `config.attention_scale`. `sinks` [H] (this rank's heads; passed only by layers that have them): a learned
    logit per head that joins every query's softmax denominator once (exp(sink)), with no value."""

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, *, sinks: Tensor | None = None) -> Tensor:
        ...


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "relu2": relu2}


def attn_temperature(positions: Tensor, attn_scale: float, floor_scale: float) -> Tensor:
    """Llama 4's query scale on NoPE layers from each token's global position: [L] int64 -> [L] fp32
    (1 + attn_scale * log(1 + floor((pos + 1) / floor_scale))), the same on every CP rank."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) — SwiGLU (silu) or GeGLU (tanh GELU)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    fused_gate_up: FusedLinears | None = None  # `fuse_projections`: gate / up as one GEMM

    def fuse_projections(self) -> bool:
        """Run gate / up as one GEMM from now on (`fused.py`); False when they cannot be fused."""
        if self.fused_gate_up is None and FusedLinears.fusable([self.gate_proj, self.up_proj]):
            self.fused_gate_up = FusedLinears(self, ["gate_proj", "up_proj"])
        return self.fused_gate_up is not None

    def forward(self, x: Tensor) -> Tensor:  # [L, hidden] -> [L, hidden]
        fused = self.fused_gate_up
        if fused is not None and fused.valid():
            g, u = fused(x)  # [L, intermediate] each, column views of one [L, 2 * intermediate] result
        else:
            g, u = self.gate_proj(x), None  # [L, intermediate]
        if self.act is F.silu and g.dtype == torch.float32 and g.device.type == "cpu" and g.dim() == 2 \
                and not (torch.is_grad_enabled() and g.requires_grad):  # (the op has no backward)
            op = silu_mul_op()  # float32 on the CPU: one pass, a contiguous result (`cpu_activation.cpp`)
            u = self.up_proj(x) if u is None else u
            if op is not None and g.stride(1) == 1 and u.stride(1) == 1:
                return self.down_proj(op(g, u))
        g = F.silu(g, inplace=True) if self.act is F.silu else self.act(g)  # activated and gated in place
        return self.down_proj(g.mul_(self.up_proj(x) if u is None else u))


class PlainMLP(nn.Module):
    """Un-gated MLP: down(act(up(x))) (Nemotron-H, relu^2)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:  # [L, hidden] -> [L, hidden]
        return self.down_proj(self.act(self.up_proj(x)))


class RecurrentFn(Protocol):
    """(layer_idx, mixer, u [L, C], side) -> o [L, H, Dv] fp32: a recurrent layer's stages 2-4 (conv with each
    sequence's tail, recurrence inputs, run from each sequence's state; `model/recurrent/__init__.py`) over the
    packed tokens, the caller keeping tails and states. `side`: the mixer's per-token side inputs ([L, ...] each)."""

    def __call__(self, layer_idx: int, mixer: nn.Module, u: Tensor, side: tuple) -> Tensor:
        ...


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        d, hkv = config.layer_head_dim(layer_idx), config.layer_kv_head_count(layer_idx)  # Gemma 4: per layer
        self.head_dim = d
        # Gemma 4: the cache's (KV heads, head size) when this layer's are smaller (padded exactly on the way in)
        self.cache_shape = (config.num_key_value_heads, config.head_dim) if config.padded_heads else None
        self.kv_source = config.kv_source(layer_idx)  # != layer_idx: attends an earlier layer's K/V (no k/v here)
        self._kv_heads = hkv
        self.keeps_kv = any(config.kv_source(j) == layer_idx != j for j in range(config.num_hidden_layers))
        own_kv = self.kv_source == layer_idx
        # Qwen3-Next / Qwen3.5: q_proj also yields a per-channel output gate (each head's [q ; gate] side by side)
        self.q_per_head = 2 if config.attn_output_gate else 1
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * d * self.q_per_head,
                                bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=config.qkv_bias) if own_kv else None
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=config.qkv_bias) \
            if own_kv and layer_idx not in config.k_eq_v_layers else None  # k_eq_v: values from the key projection
        self.o_proj = nn.Linear(config.num_attention_heads * d, config.hidden_size, bias=config.o_bias)
        self.qk_norm_all_heads = config.qk_norm_all_heads  # MiniMax-M2: over every head's channels at once
        if config.qk_norm:  # per head, over head_dim (or over all heads), before RoPE
            q_dim, k_dim = (config.q_size, config.kv_size) if config.qk_norm_all_heads else (d, d)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, config.norm_style)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, config.norm_style) if own_kv else None
        else:
            self.q_norm = self.k_norm = None
        self.v_norm_eps = config.rms_norm_eps if config.value_norm else None  # Gemma 4: weightless, per head
        self.rope = apply_rope_interleaved if config.rope_interleaved else apply_rope
        use_rope = layer_idx not in config.nope_layers
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm and use_rope else None  # after RoPE, RoPE layers
        # gpt-oss: one sink logit per query head (TP slices it with the heads)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads)) if config.attention_sinks else None

    fused_qkv: FusedLinears | None = None  # `fuse_projections`: q / k / v as one GEMM

    def fuse_projections(self) -> bool:
        """Run q / k / v as one GEMM from now on (`fused.py`; the modules keep their parameters, as views); False
        when they cannot be fused (a layer without its own k / v, TP-sliced or quantized Linears)."""
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if self.fused_qkv is None and None not in linears and self.cache_shape is None and not self.v_norm_eps \
                and FusedLinears.fusable(linears):
            self.fused_qkv = FusedLinears(self, ["q_proj", "k_proj", "v_proj"])
        return self.fused_qkv is not None

    @property
    def num_heads(self) -> int:  # from the weights, so a TP-sliced q_proj means fewer local heads
        return self.q_proj.weight.shape[0] // (self.head_dim * self.q_per_head)

    @property
    def num_kv_heads(self) -> int:  # the KV heads the cache holds for this layer
        if self.cache_shape is not None:
            return self.cache_shape[0]
        if self.k_proj is None:  # a KV-sharing layer: its source's (TP refuses such models)
            return self._kv_heads
        return self.k_proj.weight.shape[0] // self.head_dim

    @property
    def key_width(self) -> int:  # channels per KV head of a key (and of a value): head_dim (the cache's, padded)
        return self.head_dim if self.cache_shape is None else self.cache_shape[1]

    value_width = key_width

    def forward(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn,
                q_scale: Tensor | None = None, kv_share: dict | None = None) -> Tensor:
        """x [L, hidden], cos/sin [L, D/2] (None: a NoPE layer), q_scale [L] fp32 or None -> [L, hidden] (a
        partial sum when o_proj is TP-sliced). `kv_share` (Gemma 4's KV sharing): layer -> this forward's (k, v) as
        given to attention; a layer with its own K/V leaves its pair there, a sharing layer attends its source's
        (and so writes the same rows into its own cache: every tier and transfer sees an ordinary layer)."""
        if self.k_proj is None or self.cache_shape is not None or self.v_proj is None or self.v_norm_eps:
            return self._forward_per_layer_shape(x, cos, sin, attn, q_scale, kv_share)
        n = x.shape[0]
        d = self.head_dim  # head counts follow from the (possibly TP-sliced) weights; L may be 0 on a rank
        h, hkv = self.q_proj.weight.shape[0] // (d * self.q_per_head), self.k_proj.weight.shape[0] // d
        gate = None
        fused = self.fused_qkv
        if fused is not None and fused.valid():  # one GEMM, q / k / v as column views of its result
            q, k, v = fused(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [L, H * D (x2)], [L, Hkv * D] x2
        if self.q_per_head == 2:  # (partial RoPE: the tables are narrower than D/2, `apply_rope` rotates the first)
            q, gate = q.reshape(n, h, 2 * d).chunk(2, dim=-1)  # [L, H, D] each
            q, gate = q.reshape(n, h * d), gate.reshape(n, h * d)
        if self.qk_norm_all_heads:  # (TP refuses this family: the statistic spans every rank's heads)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(n, h, d), k.view(n, hkv, d)  # [L, H, D], [L, Hkv, D]
        v = v.view(n, hkv, d)  # [L, Hkv, D]
        if self.q_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # (partial RoPE: tables of rotary_dim / 2 columns; `apply_rope` rotates the first channels)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if q_scale is not None:
            q = (q * q_scale[:, None, None]).to(q.dtype)
        if kv_share is not None and self.keeps_kv:
            kv_share[self.layer_idx] = (k, v)
        if self.sinks is None:
            out = attn(self.layer_idx, q, k, v)  # [L, H, D]
        else:
            out = attn(self.layer_idx, q, k, v, sinks=self.sinks)
        out = out.reshape(n, h * d)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _forward_per_layer_shape(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn,
                                 q_scale: Tensor | None, kv_share: dict | None) -> Tensor:
        """Gemma 4's attention: per-head q / k norms then RoPE, values from v_proj (or the key projection, before
        its norm) through a weightless RMSNorm; K/V of an earlier layer on a sharing layer; a layer smaller than
        the cache pads q / k / v with zero channels (no change to q.k or to the first D output channels) and
        repeats its KV heads (each query head still reads its own group's K/V), then keeps the first D channels."""
        n, d = x.shape[0], self.head_dim
        h = self.q_proj.weight.shape[0] // d
        q = self.q_proj(x).view(n, h, d)  # [L, H, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        if cos is not None:
            q = self.rope(q, cos, sin)
        if q_scale is not None:
            q = (q * q_scale[:, None, None]).to(q.dtype)
        if self.k_proj is None:  # KV sharing: the source layer's keys and values of these tokens
            k, v = kv_share[self.kv_source]
        else:
            hkv = self.k_proj.weight.shape[0] // d
            raw_k = self.k_proj(x).view(n, hkv, d)  # [L, Hkv, D]
            v = raw_k if self.v_proj is None else self.v_proj(x).view(n, hkv, d)
            k = self.k_norm(raw_k) if self.k_norm is not None else raw_k
            if cos is not None:
                k = self.rope(k, cos, sin)
            if self.v_norm_eps is not None:
                v = F.rms_norm(v.float(), (d,), eps=self.v_norm_eps).to(v.dtype)
            if self.cache_shape is not None:
                k, v = self._pad_kv(k), self._pad_kv(v)  # [L, Hkv_cache, D_cache]
            if kv_share is not None and self.keeps_kv:
                kv_share[self.layer_idx] = (k, v)
        if self.cache_shape is not None and d < self.cache_shape[1]:
            q = F.pad(q, (0, self.cache_shape[1] - d))  # [L, H, D_cache]
        out = attn(self.layer_idx, q, k, v) if self.sinks is None else attn(self.layer_idx, q, k, v, sinks=self.sinks)
        return self.o_proj(out[..., :d].reshape(n, h * d))

    def _pad_kv(self, t: Tensor) -> Tensor:
        """[L, Hkv, D] -> [L, Hkv_cache, D_cache]: each KV head repeated for Hkv_cache / Hkv consecutive heads, zero
        channels after D."""
        heads, width = self.cache_shape
        if t.shape[1] != heads:
            t = t.repeat_interleave(heads // t.shape[1], dim=1)
        return F.pad(t, (0, width - t.shape[2])) if t.shape[2] != width else t


def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """A layer's MLP: the sparse block on MoE layers (with its shared expert a dense MLP), else the dense MLP."""
    def dense(size: int) -> nn.Module:
        if not config.mlp_gated:
            return PlainMLP(config.hidden_size, size, config.hidden_act, config.mlp_bias)
        return MLP(config.hidden_size, size, config.hidden_act, config.mlp_bias)

    if config.layer_is_moe(layer_idx):
        return SparseMoE(config.hidden_size, config.moe, dense)
    return dense(config.layer_intermediate(layer_idx))  # (Gemma 4: double-wide on its KV-sharing layers)


def make_mixer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """A recurrent layer's mixer from the config's recurrent mixer config (Gated DeltaNet, KDA, Mamba-2)."""
    from cpinfer.model.recurrent.gdn import GDNConfig, GatedDeltaNet
    from cpinfer.model.recurrent.kda import KDAShape
    from cpinfer.model.recurrent.layers import KDALayer, Mamba2Layer
    from cpinfer.model.recurrent.mamba2 import Mamba2Shape

    if isinstance(config.recurrent, GDNConfig):
        return GatedDeltaNet(config.recurrent, config.hidden_size, config.rms_norm_eps, layer_idx)
    if isinstance(config.recurrent, KDAShape):
        return KDALayer(config.recurrent, layer_idx)
    if isinstance(config.recurrent, Mamba2Shape):
        return Mamba2Layer(config.recurrent, layer_idx)
    raise ValueError(f"unsupported recurrent mixer config {type(config.recurrent).__name__}")


class DecoderLayer(nn.Module):
    """Pre-norm block; with `sandwich_norm` (Gemma 3) the attention and MLP outputs are normed too. The MLP sits
    under the checkpoint's name (`mlp`, Mixtral's `block_sparse_moe`, Llama 4's `feed_forward`)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        eps, style = config.rms_norm_eps, config.norm_style
        self.input_layernorm = RMSNorm(config.hidden_size, eps, style)
        self.recurrent = config.layer_is_recurrent(layer_idx)
        if self.recurrent:  # a linear-attention mixer in place of attention, under the checkpoint's name
            mixer = make_mixer(config, layer_idx)
            self.mixer_name = getattr(mixer, "checkpoint_name", "linear_attn")
            setattr(self, self.mixer_name, mixer)
        else:
            self.self_attn = MLAttention(config, layer_idx) if config.mla is not None else Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, style)  # Llama: before the MLP
        self.mlp_name = config.mlp_module
        setattr(self, self.mlp_name, make_mlp(config, layer_idx))
        self.sandwich = config.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, style)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, style)

    @property
    def ffn(self) -> nn.Module:
        """The layer's MLP, whatever the checkpoint calls it (replace it with `setattr(layer, layer.mlp_name, m)`)."""
        return self._modules[self.mlp_name]

    @property
    def linear_attn(self) -> nn.Module:
        """A recurrent layer's mixer, whatever the checkpoint calls it (Kimi Linear: `self_attn`)."""
        return self._modules[self.mixer_name]

    def mix(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn, q_scale: Tensor | None,
            recurrent: RecurrentFn | None, extra: tuple = ()) -> Tensor:
        """The token mixer: attention (`extra`: Gemma 4's KV-sharing dict), or the layer's recurrence through
        `recurrent`."""
        if self.recurrent:
            if recurrent is None:
                raise ValueError(f"layer {self.linear_attn.layer_idx} is a recurrent (linear attention) layer: the "
                                 "forward needs a recurrent callback (RecurrentFn)")
            return self.linear_attn(x, recurrent)
        return self.self_attn(x, cos, sin, attn, q_scale, *extra)

    def forward(self, h: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn,
                q_scale: Tensor | None = None, kv_share: dict | None = None,
                recurrent: RecurrentFn | None = None) -> Tensor:  # [L, hidden]
        extra = () if kv_share is None else (kv_share,)  # (KV sharing: Gemma 4's attention only)
        if self.sandwich:
            h = h + self.post_attention_layernorm(self.mix(self.input_layernorm(h), cos, sin, attn, q_scale,
                                                           recurrent, extra))
            return h + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(h)))
        h = h + self.mix(self.input_layernorm(h), cos, sin, attn, q_scale, recurrent, extra)
        return h + self.ffn(self.post_attention_layernorm(h))


class BlockLayer(nn.Module):
    """Nemotron-H's block: h + mixer(norm(h)), the one module a Mamba-2 mixer, attention, or (on "ffn" layers) the
    MLP / MoE. Offers the engine what a `DecoderLayer` does: `recurrent`, `linear_attn`, `self_attn`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)
        self.recurrent = config.layer_is_recurrent(layer_idx)
        self.kind = "recurrent" if self.recurrent else "ffn" if config.layer_is_ffn(layer_idx) else "attention"
        if self.recurrent:
            self.mixer = make_mixer(config, layer_idx)
        elif self.kind == "ffn":
            self.mixer = make_mlp(config, layer_idx)
        else:
            self.mixer = Attention(config, layer_idx)
        self.mlp_name = "mixer"

    @property
    def linear_attn(self) -> nn.Module:
        if not self.recurrent:
            raise AttributeError(f"layer {self.layer_idx} is not a recurrent layer")
        return self.mixer

    @property
    def self_attn(self) -> nn.Module:
        if self.kind != "attention":
            raise AttributeError(f"layer {self.layer_idx} is not an attention layer")
        return self.mixer

    def forward(self, h: Tensor, cos: Tensor | None, sin: Tensor | None, attn: AttentionFn,
                q_scale: Tensor | None = None, recurrent: RecurrentFn | None = None) -> Tensor:  # [L, hidden]
        x = self.norm(h)
        if self.kind == "ffn":
            return h + self.mixer(x)
        if self.recurrent:
            if recurrent is None:
                raise ValueError(f"layer {self.layer_idx} is a recurrent layer: the forward needs a recurrent "
                                 "callback (RecurrentFn)")
            return h + self.mixer(x, recurrent)
        return h + self.mixer(x, cos, sin, attn, q_scale)
