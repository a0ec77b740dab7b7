"""Frozen, self-validating model configuration read from a Hugging Face `config.json` of a supported family.

One `ModelConfig` describes every family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3 / 4, SmolLM3, MiniMax-M2 and the
mixtures of experts) as options of one decoder: biases, q/k norms, norm style, activation, embedding scale, sandwich
norms, attention scale, attention sinks, per layer its type (full, sliding-window or chunked attention), its RoPE (or
none: NoPE) and its MLP (dense, or the sparse block a `MoEConfig` describes). The family-specific reading lives in
`families.py`; both the transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`, per layer
type) layouts are accepted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpinfer.model.config_parts import (ACTIVATIONS, FFN_LAYER_TYPES, LAYER_TYPES, RECURRENT_LAYER_TYPES, DSAConfig,
                                        MLAConfig, MoEConfig, RopeConfig)
from cpinfer.model.families import config_kwargs
from cpinfer.model.quant import QuantMethod
from cpinfer.utils import check_divisible, check_positive

# weight * x.to(dtype)  |  (x * (1 + weight)).to(dtype)  |  (weight * x).to(dtype) (gpt-oss)
NORM_STYLES = ("llama", "gemma", "fp32")
MLP_MODULES = ("mlp", "block_sparse_moe", "feed_forward")  # the checkpoint's name of a layer's MLP


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters of a decoder of any supported family. Build with `from_dict` / `from_pretrained`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope: dict[str, RopeConfig] = field(default_factory=lambda: {"full_attention": RopeConfig()})  # by layer type
    layer_types: tuple[str, ...] = ()  # per layer; () means every layer is full attention
    sliding_window: int | None = None  # keys with q_pos - kv_pos >= window are invisible to sliding layers
    attention_chunk_size: int | None = None  # chunked layers: keys with kv_pos // C != q_pos // C are invisible
    attention_sinks: bool = False  # every layer has a learned per-head sink logit (gpt-oss `self_attn.sinks`)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_all_heads: bool = False  # with qk_norm: one RMSNorm over all heads' channels of q (of k) (MiniMax-M2)
    norm_style: str = "llama"
    hidden_act: str = "silu"
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norm: bool = False  # norms after attention and MLP too (Gemma 3)
    query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    final_logit_softcapping: float | None = None
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3, Llama 4's global layers)
    rope_interleaved: bool = False  # RoPE rotates pairs (2i, 2i + 1) (Llama 4) instead of (i, i + D/2)
    qk_l2_norm: bool = False  # weightless RMS norm of q and k after RoPE, on RoPE layers (Llama 4 use_qk_norm)
    attn_temperature: tuple[float, float] | None = None  # Llama 4 NoPE layers: (attn_scale, floor_scale)
    moe: MoEConfig | None = None  # the sparse MLP of the layers in `moe_layers`
    moe_layers: tuple[int, ...] = ()
    mlp_module: str = "mlp"  # the checkpoint's name of each layer's MLP (MLP_MODULES)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2) instead of GQA
    quantization: QuantMethod | None = None  # FP8 checkpoints: the linear method of `quantization_config`
    # Gemma 4 (each empty / off for the other families). Per layer: its head size and KV heads (the cache holds
    # head_dim x num_key_value_heads, the largest; a smaller layer is padded exactly: zero channels, repeated KV
    # heads), the layer whose K/V it attends (itself, or an earlier one of its type: KV sharing) and its dense MLP
    # width; layers whose values are their key projection (attention_k_eq_v); a weightless RMSNorm of the values;
    # a learned scalar on each layer's output; per-layer input embeddings of per_layer_input_size channels per layer
    # over per_layer_vocab_size tokens; routed experts beside each layer's dense MLP (`moe` then describes them).
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_source_layers: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()
    k_eq_v_layers: tuple[int, ...] = ()
    value_norm: bool = False
    layer_scalar: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    moe_beside_mlp: bool = False
    weights_prefix: str = ""  # a multimodal folder: its text model's weights are "<prefix>..." (read as "model...")
    # hybrid families (Qwen3-Next, Qwen3.5): the recurrent mixer of the "linear_attention" layers (a
    # `recurrent.gdn.GDNConfig`), attention's sigmoid output gate (q_proj doubled), partial RoPE (the first
    # rotary_dim channels of each head rotate; None: all)
    recurrent: Any = None
    attn_output_gate: bool = False
    rotary_dim: int | None = None
    # Nemotron-H: each layer is one block, norm -> one module (`mixer`: Mamba-2, attention, or on "ffn" layers the
    # MLP / MoE) -> residual; dense MLPs (and experts, `MoEConfig.gated`) un-gated: down(act(up(x)))
    mixer_blocks: bool = False
    mlp_gated: bool = True
    dsa: DSAConfig | None = None  # DeepSeek sparse attention: MLA reading each query's top-k keys (`indexer.py`)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            check_positive(getattr(self, name), name)
        check_divisible(self.num_attention_heads, self.num_key_value_heads,
                        "num_attention_heads", "num_key_value_heads")
        check_divisible(self.head_dim, 2, "head_dim", "2 (RoPE rotates pairs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                             f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unsupported layer type(s) {bad}: cpinfer supports {LAYER_TYPES}")
        if self.sliding_window is not None:
            check_positive(self.sliding_window, "sliding_window")
        elif "sliding_attention" in self.layer_types:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.attention_chunk_size is not None:
            check_positive(self.attention_chunk_size, "attention_chunk_size")
        elif "chunked_attention" in self.layer_types:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set")
        if "chunked_attention" in self.layer_types and "chunked_attention" not in self.rope and \
                "full_attention" in self.rope:  # chunked layers rotate like the global ones unless told otherwise
            object.__setattr__(self, "rope", {**self.rope, "chunked_attention": self.rope["full_attention"]})
        if any(t in RECURRENT_LAYER_TYPES for t in self.layer_types) and self.recurrent is None:
            raise ValueError(f"layer_types has linear_attention layers but model_type {self.model_type!r} defines no "
                             "recurrent mixer for them (the hybrid families qwen3_next, qwen3_5, qwen3_5_moe, "
                             "kimi_linear, nemotron_h do)")
        if not any(t not in RECURRENT_LAYER_TYPES and t not in FFN_LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types {list(self.layer_types)} has no attention layer: cpinfer needs at least "
                             "one (the engine keeps its KV cache and ring beside the recurrent states)")
        if any(t in FFN_LAYER_TYPES for t in self.layer_types) and not self.mixer_blocks:
            raise ValueError("layer_types has 'ffn' (feed-forward only) layers, which only a family of one-module "
                             "blocks (nemotron_h) has")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in (0, head_dim = {self.head_dim}], got {self.rotary_dim}")
        missing = sorted(set(self.layer_types) - set(self.rope) - set(RECURRENT_LAYER_TYPES) - set(FFN_LAYER_TYPES))
        if missing:
            raise ValueError(f"no RoPE parameters for layer type(s) {missing}")
        for name, allowed in (("norm_style", NORM_STYLES), ("hidden_act", ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unsupported {name} {getattr(self, name)!r}: cpinfer supports {allowed}")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        self._check_layers()
        if self.dsa is not None and (self.mla is None or len(self.dsa.indexer_types) != self.num_hidden_layers):
            raise ValueError("DeepSeek sparse attention needs MLA and one indexer_types entry per layer, got "
                             f"{len(self.dsa.indexer_types)} for {self.num_hidden_layers} layers")

    def _check_layers(self) -> None:
        """The per-layer options (NoPE layers, MoE layers) name existing layers; their companions are set."""
        n = self.num_hidden_layers
        for name in ("nope_layers", "moe_layers"):
            object.__setattr__(self, name, tuple(sorted(set(getattr(self, name)))))
            bad = [i for i in getattr(self, name) if not 0 <= i < n]
            if bad:
                raise ValueError(f"{name} {bad} out of range for {n} layers")
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers are given but no MoEConfig (moe)")
        if self.mlp_module not in MLP_MODULES:
            raise ValueError(f"unsupported mlp_module {self.mlp_module!r}: cpinfer supports {MLP_MODULES}")
        self._check_gemma4_layers()
        if self.attn_temperature is not None:
            attn_scale, floor_scale = self.attn_temperature
            if not (attn_scale >= 0 and floor_scale > 0):
                raise ValueError(f"attn_temperature needs attn_scale >= 0 and floor_scale > 0, got "
                                 f"{self.attn_temperature}")

    def _check_gemma4_layers(self) -> None:
        """Per-layer head sizes and KV heads fit the cache; a shared layer reads an earlier, unshared layer of its
        own type and shape."""
        n = self.num_hidden_layers
        for name in ("layer_head_dims", "layer_kv_heads", "kv_source_layers", "layer_intermediate_sizes"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if value and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries but num_hidden_layers is {n}")
        for i in range(n):
            d, kv = self.layer_head_dim(i), self.layer_kv_head_count(i)
            if d % 2 or not 0 < d <= self.head_dim:
                raise ValueError(f"layer {i}: head size {d} must be even and at most head_dim {self.head_dim}")
            if kv < 1 or self.num_key_value_heads % kv or self.num_attention_heads % kv:
                raise ValueError(f"layer {i}: {kv} KV heads must divide num_key_value_heads "
                                 f"({self.num_key_value_heads}) and num_attention_heads ({self.num_attention_heads})")
            src = self.kv_source(i)
            if src != i and not (0 <= src < i and self.kv_source(src) == src and
                                 self.layer_types[src] == self.layer_types[i] and
                                 (self.layer_head_dim(src), self.layer_kv_head_count(src)) == (d, kv)):
                raise ValueError(f"layer {i} cannot reuse the K/V of layer {src}: it must be an earlier layer with "
                                 "its own K/V, of the same type and shape")
        bad = [i for i in self.k_eq_v_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"k_eq_v_layers {bad} out of range for {n} layers")
        if self.per_layer_input_size < 0 or (self.per_layer_input_size and self.per_layer_vocab_size < 1):
            raise ValueError("per-layer input embeddings need per_layer_input_size >= 0 and a vocabulary >= 1, got "
                             f"{self.per_layer_input_size} and {self.per_layer_vocab_size}")
        if self.moe_beside_mlp and self.moe is None:
            raise ValueError("moe_beside_mlp needs a MoEConfig (moe)")

    def layer_head_dim(self, layer: int) -> int:
        """The head size of a layer's queries, keys and values (Gemma 4's global layers: wider)."""
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_rope_dim(self, layer: int) -> int:
        """The channels of a layer's head its RoPE tables are built for (partial RoPE of the hybrids: rotary_dim)."""
        return self.rotary_dim or self.layer_head_dim(layer)

    def layer_kv_head_count(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V this layer attends: itself, or (KV sharing) an earlier layer's."""
        return self.kv_source_layers[layer] if self.kv_source_layers else layer

    def layer_intermediate(self, layer: int) -> int:
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    @property
    def padded_heads(self) -> bool:
        """Whether layers differ in head size or KV heads (each then pads to the cache's shape)."""
        return any((self.layer_head_dim(i), self.layer_kv_head_count(i)) != (self.head_dim, self.num_key_value_heads)
                   for i in range(self.num_hidden_layers))

    # Derived sizes (unsharded).
    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer: 1/sqrt(query_pre_attn_scalar) (Gemma) or 1/sqrt(head_dim); MLA's own
        (the original head's, with YaRN's mscale^2)."""
        if self.mla is not None:
            return self.mla.softmax_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_key_width(self) -> int:
        """Channels per cached KV head and token of the keys (MLA: latent + rotary key, one head)."""
        return self.mla.key_width if self.mla is not None else self.head_dim

    @property
    def kv_value_width(self) -> int:
        """Channels per KV head of the values; with MLA they are the keys' first channels (no storage of their own)."""
        return self.mla.value_width if self.mla is not None else self.head_dim

    @property
    def values_in_keys(self) -> bool:
        """Whether the values are the keys' first kv_value_width channels (MLA): the cache stores keys only."""
        return self.mla is not None

    @property
    def kv_row(self) -> str:
        """What a cached row is, for tier keys: "" (a key and a value of head_dim per KV head) or MLA's latent."""
        if self.mla is None:
            return ""
        index = "" if self.dsa is None else f"+index{self.dsa.index_head_dim}"  # DSA: its indexer key after it
        return f"latent{self.mla.kv_lora_rank}+rope{self.mla.qk_rope_head_dim}{index}"

    @property
    def cached_kv_heads(self) -> int:
        """KV heads the cache holds per token (unsharded): MLA's one latent head, else num_key_value_heads."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def tensor_parallel_refusal(self) -> str | None:
        """Why tensor parallelism cannot split this model (None: it can); the engine refuses TP > 1 with it."""
        if self.qk_norm_all_heads:
            return "its q/k RMSNorm spans every attention head (MiniMax-M2's qk_norm_type 'per_layer')"
        if self.padded_heads or self.kv_source_layers or self.per_layer_input_size or self.moe_beside_mlp \
                or self.layer_intermediate_sizes:
            return ("Gemma 4's per-layer head sizes, shared KV, per-layer inputs, double-wide or parallel expert MLPs "
                    "are not split by tensor parallelism here")
        return None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of a layer (None: not chunked): a query sees only keys of its own chunk of C
        positions, `kv_pos // C == q_pos // C` (Llama 4's local layers)."""
        return self.attention_chunk_size if self.layer_types[layer] == "chunked_attention" else None

    @property
    def chunks(self) -> tuple[int | None, ...]:
        return tuple(self.layer_chunk(i) for i in range(self.num_hidden_layers))

    @property
    def local_attention(self) -> bool:
        """Whether some layer sees only part of the context (a window or a chunk): the engine then mirrors the
        positions of every rank's KV slots to gather only the keys such a layer can see."""
        return any(w is not None for w in self.windows) or any(c is not None for c in self.chunks)

    def layer_rope(self, layer: int) -> RopeConfig | None:
        """The RoPE of a layer, None on a NoPE layer (and on a recurrent or feed-forward-only one)."""
        if layer in self.nope_layers or self.layer_is_recurrent(layer) or self.layer_is_ffn(layer):
            return None
        return self.rope[self.layer_types[layer]]

    def layer_is_recurrent(self, layer: int) -> bool:
        """Whether a layer is a recurrent mixer (linear attention: a state, no KV cache)."""
        return self.layer_types[layer] in RECURRENT_LAYER_TYPES

    def layer_is_ffn(self, layer: int) -> bool:
        """Whether a layer has no token mixer, only its MLP / MoE (Nemotron-H's "mlp" / "moe" blocks)."""
        return self.layer_types[layer] in FFN_LAYER_TYPES

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_is_recurrent(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers)
                     if not self.layer_is_recurrent(i) and not self.layer_is_ffn(i))

    @property
    def num_kv_layers(self) -> int:
        """Layers that hold a KV cache (the attention layers: every layer but a hybrid's recurrent ones)."""
        return len(self.attention_layers)

    @property
    def hybrid(self) -> bool:
        """Whether some layer is recurrent (the engine then keeps per-request states beside the KV cache)."""
        return bool(self.recurrent_layers)

    def layer_is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def rope_theta(self) -> float:
        """The RoPE base of the global (full-attention) layers, or of the sliding ones when every layer slides."""
        return self.rope.get("full_attention", next(iter(self.rope.values()))).theta

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `<path>/config.json` (or `path` itself when it is a JSON file)."""
        path = Path(path)
        file = path if path.is_file() else path / "config.json"
        if not file.is_file():
            raise ValueError(f"no config.json found in {path}")
        with open(file) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict; reject architectures and options cpinfer does not implement."""
        return cls(**config_kwargs(d))
