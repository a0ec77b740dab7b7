"""The model families cpinfer runs, as a registry keyed by `model_type`: how each reads its `config.json` into
the options of the one shared decoder (`decoder.py`). A family writes only what differs from Llama, the way
transformers' `modular_*.py` files do; weights keep Hugging Face's names, so loading and TP slicing are shared.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import math

from cpinfer.model.config_parts import LAYER_TYPES, DSAConfig, MLAConfig, MoEConfig, RopeConfig
from cpinfer.model.quant import parse_quantization
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
    own_routing: bool = False  # the reader takes DeepSeek's router keys (n_group, topk_method, ...) itself
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # config.json -> the dict read (a
    # multimodal folder's text_config, keys the family leaves out)
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) on checkpoint tensor names, in order


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


def _rope_all_types(d: dict, theta: float = 10000.0) -> dict[str, RopeConfig]:
    rope = parse_rope(d, d.get("rope_parameters"), d.get("rope_theta", theta))
    return {t: rope for t in LAYER_TYPES}


def _sparse_layers(d: dict) -> tuple[int, ...]:
    """Qwen-MoE: layers not in `mlp_only_layers` whose (index + 1) is a multiple of `decoder_sparse_step`."""
    step, dense = int(d.get("decoder_sparse_step", 1)), set(d.get("mlp_only_layers") or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    if not _num_experts(d):
        return ()
    return tuple(i for i in range(d["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _num_experts(d: dict) -> int:
    """transformers 5 writes Qwen-MoE's `num_experts` as `num_local_experts`; the Hub's configs say num_experts."""
    return int(d.get("num_experts") or d.get("num_local_experts") or 0)


def _top_k(d: dict) -> int:
    return int(d.get("num_experts_per_tok") or d.get("experts_per_token") or 0)


def _read_qwen3_moe(d: dict, kw: dict) -> None:
    """Qwen3 attention; `use_sliding_window` makes every layer slide (as transformers' Qwen3MoeModel does)."""
    kw["qkv_bias"] = kw["o_bias"] = bool(d.get("attention_bias", False))
    kw["qk_norm"] = True
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    if window is not None:
        kw.update(sliding_window=int(window), layer_types=("sliding_attention",) * d["num_hidden_layers"])
    kw["rope"] = _rope_all_types(d)
    kw["moe_layers"] = _sparse_layers(d)
    kw["moe"] = MoEConfig(num_experts=_num_experts(d) or 1, top_k=_top_k(d) or 1,
                          intermediate_size=int(d["moe_intermediate_size"]),
                          norm_topk_prob=bool(d.get("norm_topk_prob", False)), hidden_act=kw["hidden_act"])


def _read_qwen2_moe(d: dict, kw: dict) -> None:
    """Qwen1.5/2-MoE: q/k/v biases (`qkv_bias`), a shared expert gated by sigmoid(x w) beside the routed ones;
    without `layer_types`, every even layer below `max_window_layers` slides when `use_sliding_window`."""
    kw["qkv_bias"] = bool(d.get("qkv_bias", True))
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 and i < d.get("max_window_layers", 28)
                                     and window else "full_attention" for i in range(n)]
    if not window:  # transformers: sliding_window 0, every layer full
        types = ["full_attention"] * n
    kw.update(layer_types=tuple(types), sliding_window=int(window) if window else None, rope=_rope_all_types(d))
    kw["moe_layers"] = _sparse_layers(d)
    kw["moe"] = MoEConfig(num_experts=_num_experts(d) or 1, top_k=_top_k(d) or 1,
                          intermediate_size=int(d["moe_intermediate_size"]),
                          norm_topk_prob=bool(d.get("norm_topk_prob", False)), hidden_act=kw["hidden_act"],
                          shared_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
                          shared_expert_gate=bool(d.get("shared_expert_intermediate_size")))


def _read_mixtral(d: dict, kw: dict) -> None:
    """Mistral's attention (optional window on every layer) over a sparse block `block_sparse_moe` of
    `num_local_experts` experts (w1 gate, w3 up, w2 down), softmax top-k renormalised."""
    _read_mistral(d, kw)
    kw.update(mlp_module="block_sparse_moe", moe_layers=tuple(range(d["num_hidden_layers"])))
    kw["moe"] = MoEConfig(num_experts=_num_experts(d), top_k=_top_k(d),
                          intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                          hidden_act=kw["hidden_act"], expert_proj_names=("w1", "w3", "w2"))


def _use_rope_flags(d: dict) -> list[bool]:
    """SmolLM3 / Llama 4 `no_rope_layers`: per layer 1 = RoPE, 0 = NoPE (default: every
    `no_rope_layer_interval`-th layer is NoPE)."""
    n = d["num_hidden_layers"]
    flags = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0) for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries but num_hidden_layers is {n}")
    return [bool(f) for f in flags]


def _read_smollm3(d: dict, kw: dict) -> None:
    """Llama with NoPE layers; an optional window on the NoPE layers (`use_sliding_window`)."""
    _read_llama(d, kw)
    kw["o_bias"] = kw["qkv_bias"]
    use_rope = _use_rope_flags(d)
    kw["nope_layers"] = tuple(i for i, r in enumerate(use_rope) if not r)
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    types = d.get("layer_types") or ["sliding_attention" if window and not r else "full_attention" for r in use_rope]
    if not window:
        types = ["full_attention"] * len(types)
    kw.update(layer_types=tuple(types), sliding_window=int(window) if window else None,
              tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
    kw["rope"] = _rope_all_types(d)


def _read_gpt_oss(d: dict, kw: dict) -> None:
    """Attention with biases and a learned sink per head, sliding / full layers alternating, YaRN; every MLP a
    sparse block of experts with biases and the clamped SwiGLU, stored fused [E, in, out] with gate / up
    interleaved."""
    n = d["num_hidden_layers"]
    kw["qkv_bias"] = kw["o_bias"] = bool(d.get("attention_bias", True))
    kw["layer_types"] = tuple(d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                       for i in range(n)])
    kw["sliding_window"] = int(d.get("sliding_window") or 128)
    params = d.get("rope_parameters") or {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 4096}
    rope = parse_rope(d, params, d.get("rope_theta", 150000.0))
    kw["rope"] = {t: rope for t in LAYER_TYPES}
    kw["attention_sinks"] = True
    kw["norm_style"] = "fp32"  # GptOssRMSNorm: (weight * x̂).to(dtype)
    kw["hidden_act"] = "silu"  # gpt-oss's experts ignore hidden_act: their activation is the clamped SwiGLU
    kw["moe_layers"] = tuple(range(n))
    kw["moe"] = MoEConfig(num_experts=_num_experts(d), top_k=_top_k(d),
                          intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True, router_bias=True,
                          router_name="router", expert_bias=True, hidden_act="swiglu_clamped",
                          swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                          swiglu_limit=float(d.get("swiglu_limit", 7.0)), gate_up_interleaved=True, transposed=True)


def _read_llama4_text(d: dict, kw: dict) -> None:
    """Llama 4 text: chunked local attention with RoPE (pairs interleaved, then a weightless q/k norm) on most
    layers, NoPE global layers with temperature tuning; `feed_forward` is a sparse block (sigmoid top-k over
    `num_local_experts`, input scaled by its weight, plus a shared expert) every `interleave_moe_layer_step`-th
    layer (or on `moe_layers`), a dense MLP of `intermediate_size_mlp` elsewhere."""
    n = d["num_hidden_layers"]
    kw["qkv_bias"] = kw["o_bias"] = bool(d.get("attention_bias", False))
    use_rope = _use_rope_flags(d)
    chunk = d.get("attention_chunk_size")
    kw["layer_types"] = tuple(d.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention"
                                                       for r in use_rope])
    if chunk:
        kw["attention_chunk_size"] = int(chunk)
    kw["rope"] = _rope_all_types(d, 500000.0)
    kw["rope"]["chunked_attention"] = kw["rope"]["full_attention"]
    kw.update(nope_layers=tuple(i for i, r in enumerate(use_rope) if not r), rope_interleaved=True,
              qk_l2_norm=bool(d.get("use_qk_norm", True)), mlp_module="feed_forward",
              intermediate_size=int(d.get("intermediate_size_mlp") or d["intermediate_size"]))
    if d.get("attn_temperature_tuning", True):
        kw["attn_temperature"] = (float(d.get("attn_scale", 0.1)), float(d.get("floor_scale", 8192)))
    step = int(d.get("interleave_moe_layer_step", 1))
    layers = d.get("moe_layers")
    kw["moe_layers"] = tuple(layers if layers is not None else range(step - 1, n, step))
    kw["moe"] = MoEConfig(num_experts=_num_experts(d), top_k=_top_k(d) or 1,
                          intermediate_size=int(d["intermediate_size"]), scoring="sigmoid", router_name="router",
                          weight_input=True, hidden_act=kw["hidden_act"], transposed=True,
                          shared_intermediate_size=int(d["intermediate_size"]))


def _deepseek_scale(d: dict, qk_head_dim: int) -> float:
    """MLA's softmax scale as transformers computes it: 1/sqrt(qk_nope + qk_rope), times mscale^2 with
    mscale = 0.1 mscale_all_dim ln(factor) + 1 when a RoPE scaling (not default) sets mscale_all_dim."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    scale = qk_head_dim ** -0.5
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _deepseek_choice(d: dict, key: str, allowed: tuple, default):
    """A DeepSeek routing option (key in config.json) that must be one of `allowed` (None: absent → default)."""
    value = d.get(key)
    if value not in allowed:
        raise ValueError(f"unsupported {key}={value!r} for model_type {d.get('model_type')!r}: cpinfer supports "
                         f"{[a for a in allowed if a is not None]}")
    return default if value is None else value


def _read_deepseek(d: dict, kw: dict, v3: bool) -> None:
    """DeepSeek-V2/V3 (Kimi K2, Moonlight): MLA on every layer; dense MLPs on the first `first_k_dense_replace`
    layers, then a sparse block of `n_routed_experts` plus `n_shared_experts` shared ones. V3 routes by sigmoid
    scores with a selection-only `e_score_correction_bias` over the best `topk_group` of `n_group` groups (a group's
    top-2 sum), renormalised when `norm_topk_prob`; V2 by softmax scores, `topk_method` greedy or
    group_limited_greedy (a group's best score); both scale the weights by `routed_scaling_factor`.
    `ep_size` (expert parallelism of the reference code) does not change the math and is ignored."""
    n, heads = d["num_hidden_layers"], d["num_attention_heads"]
    bias = bool(d.get("attention_bias", False))
    nope, rope_dim = int(d.get("qk_nope_head_dim", 128)), int(d.get("qk_rope_head_dim", 64))
    kw.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False)) and not v3,
              head_dim=rope_dim, num_key_value_heads=heads, rope=_rope_all_types(d))
    kw["mla"] = MLAConfig(kv_lora_rank=int(d.get("kv_lora_rank", 512)), qk_nope_head_dim=nope,
                          qk_rope_head_dim=rope_dim, v_head_dim=int(d.get("v_head_dim") or 128),
                          q_lora_rank=d.get("q_lora_rank"), softmax_scale=_deepseek_scale(d, nope + rope_dim),
                          rope_interleaved=bool(d.get("rope_interleave", True)) if v3 else True)
    if int(d.get("moe_layer_freq", 1)) != 1:
        raise ValueError(f"moe_layer_freq={d['moe_layer_freq']} is not supported: cpinfer (like transformers) makes "
                         "every layer from first_k_dense_replace on sparse (moe_layer_freq 1)")
    experts = int(d.get("n_routed_experts") or 0)
    if not experts:
        return
    if v3:
        _deepseek_choice(d, "scoring_func", (None, "sigmoid"), "sigmoid")
        _deepseek_choice(d, "topk_method", (None, "noaux_tc"), "noaux_tc")
        groups, top_groups = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    else:
        _deepseek_choice(d, "scoring_func", (None, "softmax"), "softmax")
        method = _deepseek_choice(d, "topk_method", (None, "greedy", "group_limited_greedy"), "greedy")
        if d.get("norm_topk_prob"):
            raise ValueError("norm_topk_prob=true is not supported for model_type 'deepseek_v2': transformers' "
                             "DeepseekV2 ignores it while DeepSeek's reference code renormalises; set it false")
        grouped = method == "group_limited_greedy"
        groups, top_groups = (int(d.get("n_group") or 1), int(d.get("topk_group") or 1)) if grouped else (1, 1)
    kw["moe_layers"] = tuple(range(int(d.get("first_k_dense_replace") or 0), n))
    inter = int(d["moe_intermediate_size"])
    kw["moe"] = MoEConfig(num_experts=experts, top_k=_top_k(d) or 1, intermediate_size=inter,
                          scoring="sigmoid" if v3 else "softmax", norm_topk_prob=bool(d.get("norm_topk_prob")),
                          hidden_act=kw["hidden_act"], shared_intermediate_size=inter * int(d.get("n_shared_experts")
                                                                                              or 0),
                          shared_name="shared_experts", n_group=groups, topk_group=top_groups,
                          group_score="top2_sum" if v3 else "max", score_correction_bias=v3,
                          routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0))


def _read_deepseek_v3(d: dict, kw: dict) -> None:
    _read_deepseek(d, kw, v3=True)


def _read_deepseek_v2(d: dict, kw: dict) -> None:
    _read_deepseek(d, kw, v3=False)


def _read_minimax_m2(d: dict, kw: dict) -> None:
    """MiniMax-M2 / M2.1 / M2.5: full attention on every layer, q and k each RMS-normed over all their heads' channels
    at once (`qk_norm_type` "per_layer", before the head split), partial RoPE (`rotary_dim`, else
    `partial_rotary_factor`); every MLP a sparse block `block_sparse_moe` (w1 gate, w3 up, w2 down) routed by sigmoid
    scores, top-k chosen with the block's selection-only `e_score_correction_bias`, weights renormalised.
    Multi-token-prediction modules (`num_mtp_modules`) are a draft head, not part of the model, and are ignored."""
    for key, allowed in (("qk_norm_type", (None, "per_layer")), ("use_qk_norm", (None, True)),
                         ("scoring_func", (None, "sigmoid")), ("use_routing_bias", (None, True)),
                         ("routed_scaling_factor", (None, 1, 1.0))):
        if d.get(key) not in allowed:
            raise ValueError(f"unsupported {key}={d[key]!r} for model_type 'minimax_m2': cpinfer (as transformers) "
                             f"supports {[a for a in allowed if a is not None]}")
    n, head_dim = d["num_hidden_layers"], int(d.get("head_dim") or 128)
    kinds = d.get("attn_type_list")
    if kinds is not None and any(k != 1 for k in kinds):  # 0: MiniMax-01's lightning attention, not this family's
        raise ValueError(f"attn_type_list={kinds!r} is not supported for model_type 'minimax_m2': cpinfer supports "
                         "full softmax attention (1) on every layer")
    params = dict(d.get("rope_parameters") or {})
    if d.get("rotary_dim"):  # the released checkpoints' key, as transformers converts it
        params.setdefault("partial_rotary_factor", int(d["rotary_dim"]) / head_dim)
    rope = parse_rope(d, params, d.get("rope_theta", 5000000.0), partial=True)
    kw.update(qk_norm=True, qk_norm_all_heads=True, rope={t: rope for t in LAYER_TYPES},
              mlp_module="block_sparse_moe", moe_layers=tuple(range(n)))
    kw["moe"] = MoEConfig(num_experts=_num_experts(d), top_k=_top_k(d) or 1,
                          intermediate_size=int(d["intermediate_size"]), scoring="sigmoid", norm_topk_prob=True,
                          hidden_act=kw["hidden_act"], expert_proj_names=("w1", "w3", "w2"),
                          score_correction_bias=True, correction_bias_on_block=True)


_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}


def _gemma4_shapes(d: dict, types: list[str]) -> tuple[list[int], list[int]]:
    """Each layer's (head size, KV heads): `per_layer_config` (what transformers saves: layer -> overrides), else
    global layers take `global_head_dim` (default 512) and, with attention_k_eq_v, `num_global_key_value_heads`."""
    n, head_dim = d["num_hidden_layers"], int(d.get("head_dim") or 256)
    kv = int(d.get("num_key_value_heads") or d["num_attention_heads"])
    per_layer = d.get("per_layer_config")
    if per_layer is None:
        over: dict = {"head_dim": d.get("global_head_dim", 512)}
        if d.get("attention_k_eq_v") and d.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = d["num_global_key_value_heads"]
        per_layer = {i: over for i, t in enumerate(types) if t == "full_attention"}
    dims, heads = [head_dim] * n, [kv] * n
    for key, over in per_layer.items():
        if not str(key).isdigit() or not 0 <= int(key) < n:
            raise ValueError(f"per_layer_config key {key!r}: cpinfer supports layer indices 0..{n - 1}")
        bad = sorted(set(over) - {"head_dim", "num_key_value_heads"})
        if bad:
            raise ValueError(f"per_layer_config[{key!r}] overrides {bad}: cpinfer supports head_dim and "
                             "num_key_value_heads per layer")
        dims[int(key)] = int(over.get("head_dim", head_dim))
        heads[int(key)] = int(over.get("num_key_value_heads", kv))
    return dims, heads


def _gemma4_kv_sources(d: dict, types: list[str]) -> list[int]:
    """transformers' KV sharing: the last `num_kv_shared_layers` layers each attend the K/V of the last earlier
    layer of their own type that computes its own."""
    n, shared = d["num_hidden_layers"], int(d.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers={shared}: cpinfer supports 0 to num_hidden_layers - 1 ({n - 1}) "
                         "(some earlier layer must compute the K/V the shared layers reuse)")
    first = n - shared
    producers = {t: max(i for i in range(first) if types[i] == t) for t in set(types[:first])}
    missing = sorted(set(types[first:]) - set(producers))
    if missing:
        raise ValueError(f"num_kv_shared_layers={shared}: no earlier layer of type {missing} computes the K/V its "
                         "shared layers would reuse")
    return [i if i < first else producers[types[i]] for i in range(n)]


def _read_gemma4(d: dict, kw: dict) -> None:
    """Gemma 4 text (E2B, E4B, 26B-A4B, 31B): sliding and global layers (the last one global), per-head q/k RMSNorm
    and a weightless value norm, softmax scale 1, RoPE per layer type (global: "proportional", on a quarter of a
    wider head, `global_head_dim`, with its own KV heads; values = keys' projection when `attention_k_eq_v`), the
    last `num_kv_shared_layers` layers reusing an earlier layer's K/V (their MLP double-wide with
    `use_double_wide_mlp`), per-layer input embeddings (`hidden_size_per_layer_input`), routed experts beside the
    dense MLP (`enable_moe_block`), a learned scalar per layer, weight * x̂ RMSNorms, final logit soft-capping."""
    if d.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(f"use_bidirectional_attention={d['use_bidirectional_attention']!r} is not supported: "
                         "cpinfer serves causal decoders (None or 'vision', which leaves text causal)")
    for key in ("attn_logit_softcapping",):
        if d.get(key) is not None:
            raise ValueError(f"{key}={d[key]!r} is not supported for model_type {d.get('model_type')!r}")
    n = d["num_hidden_layers"]
    types = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(n)])
    types[-1] = "full_attention"  # as transformers forces it
    dims, heads = _gemma4_shapes(d, types)
    sources = _gemma4_kv_sources(d, types)
    params = d.get("rope_parameters") or _GEMMA4_ROPE
    rope = {t: parse_rope(d, params.get(t) or _GEMMA4_ROPE[t], _GEMMA4_ROPE[t]["rope_theta"], nested=True,
                          partial=True) for t in ("full_attention", "sliding_attention")}
    bias = bool(d.get("attention_bias", False))
    kw.update(layer_types=tuple(types), sliding_window=int(d.get("sliding_window") or 512), qk_norm=True,
              qkv_bias=bias, o_bias=bias, norm_style="fp32", embed_scale=True, sandwich_norm=True,
              hidden_act=d.get("hidden_activation") or "gelu_pytorch_tanh", query_pre_attn_scalar=1.0,
              final_logit_softcapping=d.get("final_logit_softcapping"), rope=rope,
              tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), head_dim=max(dims),
              num_key_value_heads=max(heads), layer_head_dims=tuple(dims), layer_kv_heads=tuple(heads),
              value_norm=True, layer_scalar=True,
              k_eq_v_layers=tuple(i for i, t in enumerate(types) if t == "full_attention")
              if d.get("attention_k_eq_v") else ())
    if any(s != i for i, s in enumerate(sources)):
        kw["kv_source_layers"] = tuple(sources)
        if d.get("use_double_wide_mlp"):
            kw["layer_intermediate_sizes"] = tuple(kw["intermediate_size"] * (2 if s != i else 1)
                                                   for i, s in enumerate(sources))
    per_layer = d.get("hidden_size_per_layer_input", 256)  # transformers' default: on
    if per_layer:
        kw.update(per_layer_input_size=int(per_layer),
                  per_layer_vocab_size=int(d.get("vocab_size_per_layer_input") or 262144))
    if d.get("enable_moe_block"):
        kw["moe_beside_mlp"] = True
        kw["moe"] = MoEConfig(num_experts=int(d.get("num_experts") or 0), top_k=int(d.get("top_k_experts") or 0),
                              intermediate_size=int(d.get("moe_intermediate_size") or 0), norm_topk_prob=True,
                              hidden_act=kw["hidden_act"])
def _hybrid_layer_types(d: dict) -> tuple[str, ...]:
    """Qwen3-Next / Qwen3.5: `layer_types` (linear_attention / full_attention), else every
    `full_attention_interval`-th layer full attention (default 4), the others Gated DeltaNet."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        interval = int(d.get("full_attention_interval", 4))
        if interval < 1:
            raise ValueError(f"full_attention_interval must be >= 1, got {interval}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    bad = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"unsupported layer_types {bad} for model_type {d.get('model_type')!r}: cpinfer supports "
                         "'full_attention' and 'linear_attention' here")
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n}")
    return tuple(types)


def _read_gated_deltanet_hybrid(d: dict, kw: dict, layout: str) -> None:
    """The Qwen3-Next / Qwen3.5 decoder: Gated DeltaNet layers (`linear_attn`) between gated full-attention
    layers (q_proj doubled into a sigmoid output gate, (1 + w) q/k norms, partial RoPE), (1 + w) RMSNorms."""
    from cpinfer.model.recurrent.gdn import GDNConfig  # late: the recurrent package imports torch modules

    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    for key in ("mrope_section", "mrope_interleaved"):  # Qwen3.5's multimodal RoPE: text positions are 1-D
        params.pop(key, None)
    rotary = int(kw["head_dim"] * partial)
    if not 0 < rotary <= kw["head_dim"] or rotary % 2:
        raise ValueError(f"partial_rotary_factor={partial} gives {rotary} rotary channels of head_dim "
                         f"{kw['head_dim']}: need an even number in (0, head_dim]")
    flat = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
    rope = parse_rope(flat, params, params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kw["rope"] = {"full_attention": rope}
    bias = bool(d.get("attention_bias", False))
    kw.update(qkv_bias=bias, o_bias=bias, qk_norm=True, norm_style="gemma", attn_output_gate=True,
              rotary_dim=None if rotary == kw["head_dim"] else rotary, layer_types=_hybrid_layer_types(d))
    act = d.get("hidden_act", "silu")
    kw["recurrent"] = GDNConfig(num_key_heads=int(d.get("linear_num_key_heads", 16)),
                                num_value_heads=int(d.get("linear_num_value_heads", 32)),
                                key_head_dim=int(d.get("linear_key_head_dim", 128)),
                                value_head_dim=int(d.get("linear_value_head_dim", 128)),
                                conv_kernel=int(d.get("linear_conv_kernel_dim", 4)), layout=layout, activation=act)


def _hybrid_moe(d: dict, kw: dict, layers: tuple[int, ...], normalise: bool) -> None:
    """The Qwen-Next / Qwen3.5 sparse block: softmax top-k experts plus a shared expert gated by sigmoid(x w)."""
    if not layers:
        return
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    kw["moe_layers"] = layers
    kw["moe"] = MoEConfig(num_experts=_num_experts(d), top_k=_top_k(d) or 1,
                          intermediate_size=int(d["moe_intermediate_size"]), norm_topk_prob=normalise,
                          hidden_act=kw["hidden_act"], shared_intermediate_size=shared,
                          shared_expert_gate=bool(shared))


def _read_qwen3_next(d: dict, kw: dict) -> None:
    """Qwen3-Next: in_proj_qkvz / in_proj_ba (interleaved per key head); sparse layers as Qwen3-MoE's
    (decoder_sparse_step, mlp_only_layers), top-k renormalised when norm_topk_prob (default true)."""
    _read_gated_deltanet_hybrid(d, kw, "qkvz")
    _hybrid_moe(d, kw, _sparse_layers(d), bool(d.get("norm_topk_prob", True)))


def _read_qwen3_5(d: dict, kw: dict) -> None:
    """Qwen3.5 dense (text): in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; dense MLPs."""
    _read_gated_deltanet_hybrid(d, kw, "split")


def _read_qwen3_5_moe(d: dict, kw: dict) -> None:
    """Qwen3.5-MoE (text): every layer's MLP is the sparse block, top-k always renormalised."""
    _read_gated_deltanet_hybrid(d, kw, "split")
    _hybrid_moe(d, kw, tuple(range(d["num_hidden_layers"])), True)


# ---------------------------------------------------------------- Kimi Linear, Nemotron-H

# Kimi Linear's config.json spells some keys its own way (transformers' attribute_map): the usual name <- its alias
_KIMI_ALIASES = {"norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group", "num_local_experts": "num_experts",
                 "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
                 "max_position_embeddings": "model_max_length"}


def _kimi_keys(d: dict) -> dict:
    """A kimi_linear config.json with its aliased keys under the usual names."""
    d = dict(d)
    for key, alias in _KIMI_ALIASES.items():
        if key not in d and alias in d:
            d[key] = d[alias]
    # transformers' KimiLinearConfig defaults where DeepSeek's reader would assume others
    for key, value in (("num_local_experts", 256), ("num_experts_per_tok", 8), ("n_shared_experts", 1),
                       ("norm_topk_prob", True), ("routed_scaling_factor", 2.446), ("first_k_dense_replace", 1)):
        d.setdefault(key, value)
    d.setdefault("n_routed_experts", d["num_local_experts"])
    return d


def _kimi_layer_types(d: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(layer types, sparse layers) as transformers reads them: `layer_types`, else linear_attn_config's 1-indexed
    full_attn_layers / kda_layers, else every 4th layer from 4 full attention; `mlp_layer_types` (dense / sparse),
    else dense below first_k_dense_replace (default 1)."""
    n, lin = d["num_hidden_layers"], d.get("linear_attn_config") or {}
    types = d.get("layer_types")
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for i in lin[key]:
                if not 1 <= int(i) <= n:
                    raise ValueError(f"linear_attn_config.{key} names layer {i}: layers are 1..{n}")
                types[int(i) - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or sorted(set(types) - {"full_attention", "linear_attention"}):
        raise ValueError(f"kimi_linear layer_types must give each of the {n} layers 'full_attention' or "
                         f"'linear_attention', got {types}")
    mlp = d.get("mlp_layer_types") or ["dense" if i < int(d.get("first_k_dense_replace", 1)) else "sparse"
                                       for i in range(n)]
    if len(mlp) != n or sorted(set(mlp) - {"dense", "sparse"}):
        raise ValueError(f"kimi_linear mlp_layer_types must give each of the {n} layers 'dense' or 'sparse', got {mlp}")
    return tuple(types), tuple(i for i, t in enumerate(mlp) if t == "sparse")


def _read_kimi_linear(d: dict, kw: dict) -> None:
    """Kimi Linear: KDA layers (`model/recurrent/kda.py`, under `self_attn`) between NoPE multi-head latent attention
    layers; dense MLPs below first_k_dense_replace, then DeepSeek-V3's sparse block (sigmoid scores, a selection-only
    correction bias, groups, shared experts; `block_sparse_moe` in the checkpoint, w1 / w3 / w2 per expert)."""
    from cpinfer.model.recurrent.kda import KDAShape

    if d.get("mla_use_nope") is False:
        raise ValueError("mla_use_nope=false is not supported for model_type 'kimi_linear': cpinfer (like "
                         "transformers) runs Kimi Linear's MLA layers without RoPE (mla_use_nope true)")
    _deepseek_choice(d, "moe_router_activation_func", (None, "sigmoid"), "sigmoid")
    _read_deepseek(d, kw, v3=True)
    n = d["num_hidden_layers"]
    types, sparse = _kimi_layer_types(d)
    kw.update(layer_types=types, nope_layers=tuple(range(n)), rope={"full_attention": RopeConfig()},
              recurrent=KDAShape.from_hf(d))
    kw["mla"] = MLAConfig(kv_lora_rank=kw["mla"].kv_lora_rank, qk_nope_head_dim=kw["mla"].qk_nope_head_dim,
                          qk_rope_head_dim=kw["mla"].qk_rope_head_dim, v_head_dim=kw["mla"].v_head_dim,
                          q_lora_rank=kw["mla"].q_lora_rank)  # softmax scale 1/sqrt(nope + rope), no mscale
    if "moe" in kw:
        kw["moe_layers"] = sparse
        kw["moe"] = dataclasses.replace(kw["moe"], expert_proj_names=("w1", "w3", "w2"))
    elif sparse:
        raise ValueError("kimi_linear has sparse layers (mlp_layer_types / first_k_dense_replace) but no "
                         "num_experts")


_NEMOTRON_BLOCKS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NEMOTRON_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _nemotron_blocks(d: dict) -> list[str]:
    """Nemotron-H's per-layer block types: `layers_block_type` (or `layer_types`), else the legacy
    `hybrid_override_pattern` (M Mamba-2, * attention, - MLP, E MoE)."""
    blocks = d.get("layers_block_type") or d.get("layer_types")
    if blocks is None:
        pattern = d.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("nemotron_h config needs layers_block_type (or hybrid_override_pattern)")
        bad = sorted(set(pattern) - set(_NEMOTRON_BLOCKS))
        if bad:
            raise ValueError(f"hybrid_override_pattern has unknown block(s) {bad}: allowed {sorted(_NEMOTRON_BLOCKS)}")
        blocks = [_NEMOTRON_BLOCKS[c] for c in pattern]
    blocks = [_NEMOTRON_LEGACY.get(b, b) for b in blocks]
    bad = sorted(set(blocks) - set(_NEMOTRON_BLOCKS.values()))
    if bad:
        raise ValueError(f"layers_block_type has unknown block type(s) {bad}: allowed "
                         f"{sorted(_NEMOTRON_BLOCKS.values())}")
    return blocks


def _nemotron_keys(d: dict) -> dict:
    """A nemotron_h config.json with num_hidden_layers from its blocks (transformers derives it; the saved config has
    none), hidden_act from mlp_hidden_act and dense intermediate_size when absent (a MoE-only model)."""
    d = dict(d)
    d["num_hidden_layers"] = len(_nemotron_blocks(d))
    d["hidden_act"] = d.get("mlp_hidden_act", "relu2")
    for key, value in (("vocab_size", 131072), ("hidden_size", 4096), ("intermediate_size", 21504),
                       ("num_attention_heads", 32), ("num_key_value_heads", 8)):  # transformers' defaults
        d.setdefault(key, value)
    return d


def _read_nemotron_h(d: dict, kw: dict) -> None:
    """Nemotron-H / Nemotron 3: one module per layer (norm -> module -> residual): Mamba-2 (`mamba2.py`), NoPE GQA
    attention without biases, an un-gated relu^2 MLP, or a sparse block (DeepSeek-V3 routing, un-gated experts, on
    the hidden size or in `moe_latent_size`, an un-gated shared expert); fp32-weighted RMSNorms of
    layer_norm_epsilon."""
    from cpinfer.model.recurrent.mamba2 import Mamba2Shape

    blocks = _nemotron_blocks(d)
    n = len(blocks)
    kw.update(layer_types=tuple("ffn" if b in ("mlp", "moe") else b for b in blocks), mixer_blocks=True,
              mlp_gated=False, nope_layers=tuple(range(n)), rope={"full_attention": RopeConfig()},
              norm_style="fp32", rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
              mlp_bias=bool(d.get("mlp_bias", False)), recurrent=Mamba2Shape.from_hf(d))
    moe = tuple(i for i, b in enumerate(blocks) if b == "moe")
    if moe:
        _deepseek_choice(d, "scoring_func", (None, "sigmoid"), "sigmoid")
        groups, top_groups = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
        kw["moe_layers"] = moe
        kw["moe"] = MoEConfig(num_experts=int(d.get("n_routed_experts", 8)), top_k=_top_k(d) or 2,
                              intermediate_size=int(d.get("moe_intermediate_size", 7688)), scoring="sigmoid",
                              norm_topk_prob=bool(d.get("norm_topk_prob", True)), hidden_act=kw["hidden_act"],
                              shared_intermediate_size=int(d.get("moe_shared_expert_intermediate_size", 7688)),
                              shared_name="shared_experts", n_group=groups, topk_group=top_groups,
                              score_correction_bias=True, gated=False,
                              latent_size=int(d.get("moe_latent_size") or 0), latent_bias=kw["mlp_bias"],
                              routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0))


def _text_of(d: dict) -> dict:
    """A multimodal Qwen3.5 folder (model_type qwen3_5 / qwen3_5_moe): its text_config, read as the text model
    (the loader maps model.language_model.* to model.* and skips the vision tower); the MoE text config has no
    dense intermediate_size (no layer is dense): the experts' size stands in."""
    text = dict(d.get("text_config") or d)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "quantization_config"):
        if key not in text and key in d:
            text[key] = d[key]
    text["model_type"] = d["model_type"]
    if "intermediate_size" not in text and "moe_intermediate_size" in text:
        text["intermediate_size"] = text["moe_intermediate_size"]
    return text
def _glm_indexer_types(d: dict) -> list:
    """GLM-5's per-layer indexer modes: `indexer_types`, else `index_topk_pattern` ("F" full, "S" shared), else
    full where max(i - index_skip_topk_offset + 1, 0) is a multiple of index_topk_freq (transformers' rule)."""
    if d.get("indexer_types") is not None:
        return list(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(d.get("index_topk_freq", 1)), 1), int(d.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(d["num_hidden_layers"])]


def _read_dsa(d: dict, kw: dict, glm: bool) -> None:
    """DeepSeek-V3.2 / GLM-5 (DeepSeek sparse attention): DeepSeek-V3's MLA (RoPE pairs always interleaved) and
    routing, `mlp_layer_types` ("dense" / "sparse") naming the MoE layers, and a lightning indexer per layer
    (`indexer.py`): its RoPE half-split (V3.2) or interleaved (GLM), GLM's "shared" layers reusing the previous
    layer's top-k."""
    if d.get("q_lora_rank") is None:
        raise ValueError(f"q_lora_rank is required for model_type {d.get('model_type')!r}: the lightning indexer's "
                         "queries are made from the low-rank query latent")
    _read_deepseek(d, kw, v3=True)
    kw["mla"] = MLAConfig(**{**kw["mla"].__dict__, "rope_interleaved": True})
    n = d["num_hidden_layers"]
    types = d.get("mlp_layer_types")
    if types is not None:
        bad = sorted(set(types) - {"dense", "sparse"})
        if bad or len(types) != n:
            raise ValueError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, got {types}")
        if kw.get("moe") is not None:
            kw["moe_layers"] = tuple(i for i, t in enumerate(types) if t == "sparse")
    bad = sorted(set(d.get("layer_types") or ()) - {"indexed_attention"})
    if bad:
        raise ValueError(f"unsupported layer_types {bad} for model_type {d.get('model_type')!r}: cpinfer supports "
                         "'indexed_attention' on every layer")
    kw["layer_types"] = ()
    kw["dsa"] = DSAConfig(index_topk=int(d.get("index_topk", 2048)),
                          index_n_heads=int(d.get("index_n_heads", 32 if glm else 64)),
                          index_head_dim=int(d.get("index_head_dim", 128)), rope_dim=kw["mla"].qk_rope_head_dim,
                          rope_interleaved=glm, indexer_types=tuple(_glm_indexer_types(d) if glm else ["full"] * n))


def _read_deepseek_v32(d: dict, kw: dict) -> None:
    _read_dsa(d, kw, glm=False)


def _read_glm_moe_dsa(d: dict, kw: dict) -> None:
    _read_dsa(d, kw, glm=True)


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
    Family("smollm3", "SmolLM3ForCausalLM", "SmolLM3: Llama with no RoPE on every 4th layer (NoPE)", _read_smollm3),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3 attention, softmax top-k "
           "experts; decoder_sparse_step / mlp_only_layers", _read_qwen3_moe, default_head_dim=128),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen1.5/2-MoE: Qwen2 attention, top-k experts plus a shared "
           "expert gated by a sigmoid", _read_qwen2_moe),
    Family("mixtral", "MixtralForCausalLM", "Mixtral 8x7B / 8x22B: Mistral attention (optional window), top-2 of "
           "8 experts", _read_mixtral),
    Family("gpt_oss", "GptOssForCausalLM", "gpt-oss 20b / 120b (unquantized): attention sinks, alternating "
           "sliding / full layers, YaRN, experts with biases and a clamped SwiGLU", _read_gpt_oss,
           default_head_dim=64),
    Family("llama4_text", "Llama4ForCausalLM", "Llama 4 text (Scout, Maverick): chunked attention on RoPE layers, "
           "NoPE global layers with temperature tuning, L2 q/k norm, sigmoid top-1 experts plus a shared one",
           _read_llama4_text, default_head_dim=128),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3 / R1, Kimi K2, Moonlight: multi-head latent attention "
           "(latent KV cache), sigmoid group-limited routing with a correction bias, shared experts",
           _read_deepseek_v3, default_head_dim=64, own_routing=True),
    Family("kimi_k2", "DeepseekV3ForCausalLM", "Kimi K2 (its own model_type, DeepSeek-V3's architecture and keys)",
           _read_deepseek_v3, default_head_dim=64, own_routing=True),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2 / V2-Lite / V2.5: multi-head latent attention, "
           "softmax greedy or group-limited routing, shared experts", _read_deepseek_v2, default_head_dim=64,
           own_routing=True),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMax-M2 / M2.1 / M2.5: full attention with q/k RMSNorm over all "
           "heads, partial RoPE, sigmoid top-k experts chosen with a correction bias (MTP modules ignored)",
           _read_minimax_m2, default_head_dim=128, own_routing=True),
    Family("gemma4_text", "Gemma4ForCausalLM", "Gemma 4 text (E2B, E4B, 26B-A4B, 31B): sliding / global layers with "
           "wider global heads and proportional RoPE, KV shared across layers, per-layer input embeddings, experts "
           "beside the dense MLP, q/k/v norms (a released multimodal 'gemma4' folder: its text model)", _read_gemma4,
           default_head_dim=256),
    Family("qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next: Gated DeltaNet layers (a recurrent state) with one "
           "gated full-attention layer in 4 (partial RoPE, q/k norm), top-k experts plus a gated shared expert",
           _read_qwen3_next, default_head_dim=256),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3.5 / 3.6 dense, text: Gated DeltaNet + gated full "
           "attention (3:1), dense MLPs", _read_qwen3_5, default_head_dim=256, prepare=_text_of),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3.5 dense folder (its text model; the vision "
           "tower is not loaded)", _read_qwen3_5, default_head_dim=256, prepare=_text_of),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5-MoE, text: Gated DeltaNet + gated full "
           "attention, every MLP top-k experts plus a gated shared expert", _read_qwen3_5_moe,
           default_head_dim=256, prepare=_text_of),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3.5-MoE folder (e.g. 397B-A17B; its text "
           "model)", _read_qwen3_5_moe, default_head_dim=256, prepare=_text_of),
    Family("kimi_linear", "KimiLinearForCausalLM", "Kimi Linear: Kimi Delta Attention layers (a recurrent state, "
           "decay per channel) with NoPE latent attention (MLA) every 4th layer, DeepSeek-V3 experts",
           _read_kimi_linear, default_head_dim=64, own_routing=True, prepare=_kimi_keys,
           renames=((r"\.block_sparse_moe\.", ".mlp."),)),
    Family("nemotron_h", "NemotronHForCausalLM", "Nemotron-H / Nemotron 3: one module per layer from the block "
           "pattern: Mamba-2 (a recurrent state), NoPE attention, relu^2 MLP or sigmoid-routed experts",
           _read_nemotron_h, default_head_dim=128, own_routing=True, prepare=_nemotron_keys,
           renames=((r"^backbone\.embeddings\.", "model.embed_tokens."), (r"^backbone\.norm_f\.", "model.norm."),
                    (r"^backbone\.", "model."))),
    Family("deepseek_v32", "DeepseekV32ForCausalLM", "DeepSeek-V3.2: DeepSeek-V3's MLA and routing with DeepSeek "
           "sparse attention (a lightning indexer picks each query's top-k keys)", _read_deepseek_v32,
           default_head_dim=64, own_routing=True),
    Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", "GLM-5: MLA with DeepSeek sparse attention (interleaved indexer "
           "RoPE; 'shared' layers reuse the previous layer's top-k), sigmoid routing, shared experts",
           _read_glm_moe_dsa, default_head_dim=64, own_routing=True),
)}


def supported() -> str:
    return ", ".join(f"{name!r} ({f.summary})" for name, f in FAMILIES.items())


def family_of(d: dict[str, Any]) -> Family:
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        hint = ""
        if model_type == "gemma3":
            hint = " (a multimodal Gemma 3 folder: cpinfer runs the text model, model_type 'gemma3_text')"
        elif model_type == "llama4":
            hint = (" (a multimodal Llama 4 folder: cpinfer runs a text-only checkpoint, model_type 'llama4_text', "
                    "with its weights under model.layers)")
        raise ValueError(f"unsupported model_type {model_type!r}{hint}: cpinfer supports {supported()}")
    return FAMILIES[model_type]


# Multimodal folders whose text model cpinfer serves: model_type -> (the text family, the checkpoint's prefix of the
# text model's weights, read as "model."; the other towers' weights are not loaded)
NESTED_TEXT_MODELS = {"gemma4": ("gemma4_text", "model.language_model.")}


def config_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` keyword arguments from a Hugging Face config dict (ValueError naming what is unsupported)."""
    nested = NESTED_TEXT_MODELS.get(d.get("model_type"))
    if nested is not None:  # the text model of a multimodal folder: its `text_config`
        if not isinstance(d.get("text_config"), dict):
            raise ValueError(f"a {d['model_type']!r} config needs a text_config (the text model cpinfer serves)")
        text = {**d["text_config"], "model_type": nested[0]}
        if "tie_word_embeddings" in d:  # transformers ties by the outer config's flag
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        kw = config_kwargs(text)
        kw["weights_prefix"] = nested[1]
        return kw
    family = family_of(d)
    if family.prepare is not None:
        d = family.prepare(d)
    missing = [k for k in _REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"config is missing required key(s) {missing}")
    check_unsupported(d, routing=not family.own_routing)
    quantization = parse_quantization(d.get("quantization_config"))
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
        quantization=quantization,
    )
    family.read(d, kw)
    return kw


# Router options cpinfer does not implement (DeepSeek-style routing, issue 28): key -> the values it accepts.
_ROUTER_DEFAULTS = {"scoring_func": (None, "softmax"), "topk_method": (None, "greedy"), "n_group": (None, 1),
                    "topk_group": (None, 1), "routed_scaling_factor": (None, 1, 1.0),
                    "moe_router_activation_func": (None, "softmax")}


def check_unsupported(d: dict[str, Any], routing: bool = True) -> None:
    """Reject options cpinfer would otherwise ignore: (`routing`) router variants the family's reader does not
    implement. (Quantized weights are checked by `parse_quantization`: FP8 formats load, others are named and
    refused.)"""
    for key, allowed in _ROUTER_DEFAULTS.items() if routing else ():
        if d.get(key) not in allowed:
            raise ValueError(f"unsupported router option {key}={d[key]!r} for model_type {d.get('model_type')!r}: "
                             f"cpinfer supports {key} in {[a for a in allowed if a is not None]} here")


def parse_rope(d: dict[str, Any], params: dict | None, theta: float, nested: bool = False,
               partial: bool = False) -> RopeConfig:
    """One `RopeConfig` from a rope dict (5.x `rope_parameters` or 4.x `rope_scaling`, which wins when both are
    given, as in transformers) with `theta` as the fallback `rope_theta`. `nested`: a per-layer-type dict.
    `partial`: the family rotates part of each head as transformers does (`partial_rotary_factor`; Gemma 4's
    "proportional" type), else a factor other than 1 is refused."""
    if not nested:
        params = d.get("rope_scaling") or params
    params = dict(params or {})
    fraction = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if fraction != 1.0 and not partial:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    types = ("default", "linear", "dynamic", "yarn", "longrope", "llama3") + (("proportional",) if partial else ())
    if rope_type not in types:
        raise ValueError(f"unsupported rope type {rope_type!r}: cpinfer supports {', '.join(types)}")
    kw: dict[str, Any] = {"rope_type": rope_type, "theta": float(params.get("rope_theta", theta))}
    if fraction != 1.0:
        kw["partial_rotary_factor"] = fraction
    if rope_type == "default":
        return RopeConfig(**kw)
    if rope_type == "proportional":
        return RopeConfig(**kw, factor=None if params.get("factor") is None else float(params["factor"]))
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
