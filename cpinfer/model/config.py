"""Frozen, self-validating model configuration read from a Hugging Face `config.json` of a supported family.

One `ModelConfig` describes every family (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, SmolLM3 and the mixtures of
experts) as options of one decoder: biases, q/k norms, norm style, activation, embedding scale, sandwich norms,
attention scale, attention sinks, per layer its type (full, sliding-window or chunked attention), its RoPE (or
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

from cpinfer.model.config_parts import ACTIVATIONS, LAYER_TYPES, DSAConfig, MLAConfig, MoEConfig, RopeConfig
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
        missing = sorted(set(self.layer_types) - set(self.rope))
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
        if self.attn_temperature is not None:
            attn_scale, floor_scale = self.attn_temperature
            if not (attn_scale >= 0 and floor_scale > 0):
                raise ValueError(f"attn_temperature needs attn_scale >= 0 and floor_scale > 0, got "
                                 f"{self.attn_temperature}")

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
        """The RoPE of a layer, None on a NoPE layer."""
        return None if layer in self.nope_layers else self.rope[self.layer_types[layer]]

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
