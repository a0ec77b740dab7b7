"""The model families cpinfer runs, as a registry keyed by `model_type`: how each reads its `config.json` into
the options of the one shared decoder (`decoder.py`). A family writes only what differs from Llama, the way
transformers' `modular_*.py` files do; weights keep Hugging Face's names, so loading and TP slicing are shared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from cpinfer.model.config import LAYER_TYPES, RopeConfig
from cpinfer.utils import check_divisible

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class Family:
    """One supported architecture: its `model_type`, transformers' class, and what it adds to the Llama reading."""

    model_type: str
    hf_class: str  # the transformers class of the oracle (tests, docs)
    summary: str
    read: Callable[[dict[str, Any], dict[str, Any]], None]  # (config.json, kwargs so far) -> fills kwargs
    default_head_dim: int | None = None  # transformers' default when config.json has no head_dim


def _read_llama(d: dict, kw: dict) -> None:
    kw["qkv_bias"] = kw["o_bias"] = bool(d.get("attention_bias", False))
    kw["mlp_bias"] = bool(d.get("mlp_bias", False))
    kw["rope"] = {"full_attention": parse_rope(d, d.get("rope_parameters"), d.get("rope_theta", 10000.0))}


def _read_mistral(d: dict, kw: dict) -> None:
    kw["rope"] = {"full_attention": parse_rope(d, d.get("rope_parameters"), d.get("rope_theta", 10000.0))}
    window = d.get("sliding_window")
    if window is not None:  # every layer slides (Mistral 7B v0.1); Mistral-Small and Nemo set it to null
        kw["sliding_window"] = int(window)
        kw["layer_types"] = ("sliding_attention",) * d["num_hidden_layers"]
        kw["rope"]["sliding_attention"] = kw["rope"]["full_attention"]


def _qwen_windows(d: dict, kw: dict) -> None:
    """Qwen2/3: `use_sliding_window` enables `sliding_window` on layers >= `max_window_layers` (or `layer_types`)."""
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(d["num_hidden_layers"])]
    if window is None:  # transformers: a sliding layer without a window attends fully
        types = ["full_attention"] * len(types)
    kw["layer_types"], kw["sliding_window"] = tuple(types), None if window is None else int(window)
    rope = parse_rope(d, d.get("rope_parameters"), d.get("rope_theta", 10000.0))
    kw["rope"] = {t: rope for t in LAYER_TYPES}


def _read_qwen2(d: dict, kw: dict) -> None:
    kw["qkv_bias"] = True  # Qwen2 q/k/v projections always carry biases, o_proj none
    _qwen_windows(d, kw)


def _read_qwen3(d: dict, kw: dict) -> None:
    kw["qkv_bias"] = kw["o_bias"] = bool(d.get("attention_bias", False))
    kw["qk_norm"] = True
    _qwen_windows(d, kw)


def _read_gemma3(d: dict, kw: dict) -> None:
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it null)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: cpinfer serves causal decoders")
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:  # the 4.x layout: every `sliding_window_pattern`-th layer is global
        pattern = int(d.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    kw.update(layer_types=tuple(types), sliding_window=int(d.get("sliding_window", 4096)), qk_norm=True,
              qkv_bias=bool(d.get("attention_bias", False)), o_bias=bool(d.get("attention_bias", False)),
              norm_style="gemma", embed_scale=True, sandwich_norm=True,
              hidden_act=d.get("hidden_activation") or "gelu_pytorch_tanh",
              query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
              final_logit_softcapping=d.get("final_logit_softcapping"),
              tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
    params = d.get("rope_parameters")
    if params and any(t in params for t in LAYER_TYPES):  # 5.x: one RoPE dict per layer type
        theta = {"full_attention": d.get("rope_theta", 1e6), "sliding_attention": d.get("rope_local_base_freq", 1e4)}
        kw["rope"] = {t: parse_rope(d, params.get(t) or {}, theta[t], nested=True) for t in theta}
    else:  # 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq for sliding ones
        kw["rope"] = {"full_attention": parse_rope(d, params, d.get("rope_theta", 1e6)),
                      "sliding_attention": RopeConfig(theta=float(d.get("rope_local_base_freq", 1e4)))}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "Llama 2/3/3.1/3.2, SmolLM2: GQA, RoPE (llama3 scaling), SwiGLU",
           _read_llama),
    Family("mistral", "MistralForCausalLM", "Mistral 7B / Small / Nemo: Llama with an optional sliding window",
           _read_mistral),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5 (incl. 1M): q/k/v biases, optional sliding layers",
           _read_qwen2),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3 dense: per-head q/k RMSNorm, head_dim apart from hidden/heads",
           _read_qwen3, default_head_dim=128),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3 text: 5 local : 1 global layers, RoPE per layer type, "
           "q/k norm, GeGLU, (1 + w) RMSNorm, sandwich norms", _read_gemma3, default_head_dim=256),
)}


def supported() -> str:
    return ", ".join(f"{name!r} ({f.summary})" for name, f in FAMILIES.items())


def family_of(d: dict[str, Any]) -> Family:
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        hint = ""
        if model_type == "gemma3":
            hint = " (a multimodal Gemma 3 folder: cpinfer runs the text model, model_type 'gemma3_text')"
        raise ValueError(f"unsupported model_type {model_type!r}{hint}: cpinfer supports {supported()}")
    return FAMILIES[model_type]


def config_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments from a Hugging Face config dict (ValueError naming what is unsupported)."""
    family = family_of(d)
    missing = [k for k in _REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}")
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or family.default_head_dim or check_divisible(
        d["hidden_size"], heads, "hidden_size", "num_attention_heads")
    eos = d.get("eos_token_id")
    kw: dict[str, Any] = dict(
        model_type=family.model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
        hidden_act=d.get("hidden_act", "silu"),
    )
    family.read(d, kw)
    return kw


def parse_rope(d: dict[str, Any], params: dict | None, theta: float, nested: bool = False) -> RopeConfig:
    """One `RopeConfig` from a rope dict (5.x `rope_parameters` or 4.x `rope_scaling`, which wins when both are
    given, as in transformers) with `theta` as the fallback `rope_theta`. `nested`: a per-layer-type dict."""
    if not nested:
        params = d.get("rope_scaling") or params
    params = dict(params or {})
    if params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "dynamic", "yarn", "longrope", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r}: cpinfer supports default, linear, dynamic, yarn, "
                         "longrope, llama3")
    kw: dict[str, Any] = {"rope_type": rope_type, "theta": float(params.get("rope_theta", theta))}
    if rope_type == "default":
        return RopeConfig(**kw)
    if params.get("factor") is not None:
        kw["factor"] = float(params["factor"])
    if rope_type in ("llama3", "yarn", "longrope"):
        # As in transformers: a top-level original_max_position_embeddings wins, then the rope dict, then max_pos.
        kw["original_max_position_embeddings"] = int(d.get("original_max_position_embeddings")
                                                      or params.get("original_max_position_embeddings")
                                                      or d.get("max_position_embeddings", 2048))
    if rope_type in ("yarn", "longrope") and "factor" not in kw:
        kw["factor"] = d.get("max_position_embeddings", 2048) / kw["original_max_position_embeddings"]
    try:
        if rope_type == "llama3":
            kw.update(low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]))
        elif rope_type == "yarn":
            kw.update(beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      # transformers reads `truncate` from the top-level dict, so a per-layer-type one is ignored
                      truncate=True if nested else bool(params.get("truncate", True)),
                      mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                      attention_factor=params.get("attention_factor"))
        elif rope_type == "longrope":
            kw.update(short_factor=tuple(float(x) for x in params["short_factor"]),
                      long_factor=tuple(float(x) for x in params["long_factor"]),
                      attention_factor=params.get("attention_factor"))
    except KeyError as e:
        raise ValueError(f"{rope_type} rope scaling is missing key {e.args[0]!r}") from None
    return RopeConfig(**kw)
