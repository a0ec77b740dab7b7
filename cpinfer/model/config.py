"""Frozen, self-validating model configuration read from a Hugging Face Llama `config.json`.

Accepts both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x one (`rope_parameters`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpinfer.utils import check_divisible, check_positive

SUPPORTED_MODEL_TYPES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (`rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"llama3 rope scaling: factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "llama3 rope scaling: need 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        check_positive(self.original_max_position_embeddings, "llama3 rope scaling: original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-3 family hyper-parameters cpinfer needs. Build with `from_dict` / `from_pretrained`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            check_positive(getattr(self, name), name)
        check_divisible(self.num_attention_heads, self.num_key_value_heads,
                        "num_attention_heads", "num_key_value_heads")
        check_divisible(self.head_dim, 2, "head_dim", "2 (RoPE rotates pairs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive finite number, got {self.rope_theta}")
        if self.attention_bias or self.mlp_bias:
            raise ValueError("attention_bias / mlp_bias are not supported: Llama-3 linears have no bias")

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
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}: cpinfer supports {SUPPORTED_MODEL_TYPES} "
                             "(Llama-3 family: GQA, RoPE with optional llama3 scaling, RMSNorm, SwiGLU)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise ValueError(f"config is missing required key(s) {missing}")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or check_divisible(d["hidden_size"], heads, "hidden_size", "num_attention_heads")
        theta, scaling = _parse_rope(d)
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
        )


def _parse_rope(d: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5.x) or `rope_theta` + `rope_scaling` (4.x)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}: cpinfer supports {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    # As in transformers: a top-level original_max_position_embeddings wins, then the rope dict, then max_pos.
    orig = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=orig or d.get("max_position_embeddings", 2048),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing key {e.args[0]!r}") from None
    return theta, scaling
