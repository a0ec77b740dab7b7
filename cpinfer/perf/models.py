"""Where the performance model's model shapes come from, and its weight formats (paper §4.1, App. A).

`load_model_spec` takes a catalog name (`model_catalog.py`) or reads any other model's `config.json` (the layouts
of every family cpinfer runs) into a `ModelSpec` (`model_spec.py`); `WEIGHT_FORMATS` give bytes per weight.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cpinfer.perf.model_catalog import MODELS
from cpinfer.perf.model_spec import ModelSpec

# Element sizes in bytes of the dtypes the planner knows (activations, KV cache, weights).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per weight element by layer kind; `*_fp8` says whether that GEMM runs at the FP8 rate."""
    name: str
    attn_bytes: int
    ffn_bytes: int
    embed_bytes: int
    attn_fp8: bool
    ffn_fp8: bool
    source: str

    def __post_init__(self) -> None:
        for what in ("attn_bytes", "ffn_bytes", "embed_bytes"):
            if getattr(self, what) not in (1, 2, 4):
                raise ValueError(f"weight format {self.name!r}: {what} must be 1, 2 or 4")

    def weight_bytes_per_gpu(self, model: ModelSpec, tp: int) -> float:
        """Weights + row-wise FP8 scales (one fp32 per output row) on one TP rank, in bytes."""
        kv_rep = model.kv_heads_per_gpu(tp) * tp / model.n_kv_heads  # > 1 when KV heads are replicated
        kv_part = 0 if model.mla else 2 * model.hidden * model.n_kv_heads * model.head_dim * (kv_rep - 1)
        kv_part += model.attn_replicated_params * (tp - 1)  # MLA's latent path: whole on every rank
        attn = (model.attn_params + kv_part) * self.attn_bytes
        ffn = model.ffn_params_total * self.ffn_bytes  # every expert: each rank holds its slice of all of them
        scales = 4 * (_ffn_rows(model) * self.ffn_fp8 + model.n_layers *
                      ((model.n_heads + 2 * model.n_kv_heads) * model.head_dim + model.hidden) * self.attn_fp8)
        norms = 4 * (2 * model.n_layers + 1) * model.hidden  # replicated, fp32
        return (model.n_layers * attn + ffn + scales + model.embed_params * self.embed_bytes) / tp + norms


def _ffn_rows(model: ModelSpec) -> int:
    """Output rows of every MLP GEMM of the model (one row-wise FP8 scale each)."""
    def dense(f: int) -> int:
        return 2 * f + model.hidden if f else 0

    sparse = model.n_experts * dense(model.expert_ffn_dim) + dense(model.shared_ffn_dim)
    return (model.n_layers - model.moe_layers) * dense(model.ffn_dim) + model.moe_layers * sparse


WEIGHT_FORMATS = {
    "bf16": WeightFormat("bf16", 2, 2, 2, False, False, "all weights bf16"),
    "fp16": WeightFormat("fp16", 2, 2, 2, False, False, "all weights fp16"),
    "fp32": WeightFormat("fp32", 4, 4, 4, False, False, "all weights fp32 (the CPU path)"),
    "fp8-ffn": WeightFormat("fp8-ffn", 2, 1, 2, False, True,
                            "paper §4.1: row-wise FP8 FFN weights (FBGEMM), attention and embeddings bf16"),
    "fp8": WeightFormat("fp8", 1, 1, 2, True, True, "row-wise FP8 attention and FFN weights, embeddings bf16"),
}


def _known(catalog: dict) -> str:
    return ", ".join(sorted(catalog))


def load_model_spec(name_or_config_path) -> ModelSpec:
    """A ModelSpec, a catalog name (case-insensitive), or a path to a HF `config.json` (or the folder holding it)."""
    if isinstance(name_or_config_path, ModelSpec):
        return name_or_config_path
    key = str(name_or_config_path).strip().lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(name_or_config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_config_path!r}: known models are {_known(MODELS)}, "
                         f"or give the path of a Hugging Face config.json (or of the folder holding it)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return model_spec_from_hf_config(cfg, name=path.parent.name or str(path), source=str(path))


# model_type -> tie_word_embeddings when config.json omits it (the transformers config class default)
TIED_BY_DEFAULT = {"gemma": True, "gemma2": True, "gemma3": True, "gemma3_text": True}
GEMMA3 = ("gemma3", "gemma3_text")


def model_spec_from_hf_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """The shape of a decoder from a Hugging Face config dict, a multimodal wrapper's `text_config` included.
    Sliding-window layers come from `layer_types`, else Gemma 3's `sliding_window_pattern`, else Qwen's
    `use_sliding_window` + `max_window_layers`, else Mistral's `sliding_window` on every layer; chunked layers
    (Llama 4) from `layer_types` or the RoPE layers when `attention_chunk_size` is set; experts from
    `num_experts` / `num_local_experts` (see `_experts`)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: config.json must hold a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
    try:
        hidden, heads, layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        tied = cfg.get("tie_word_embeddings", TIED_BY_DEFAULT.get(cfg.get("model_type", ""), False))
        window, window_layers, local = _windows(cfg, layers, source)
        mla = _mla(cfg)
        return ModelSpec(
            name=name, n_layers=layers, hidden=hidden, n_heads=heads,
            n_kv_heads=1 if mla else int(cfg.get("num_key_value_heads") or heads),
            head_dim=mla["kv_lora_rank"] + mla["qk_rope_head_dim"] if mla else int(cfg.get("head_dim")
                                                                                  or hidden // heads),
            ffn_dim=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tie_embeddings=bool(tied), source=source, window=window,
            window_layers=window_layers, max_context=int(cfg.get("max_position_embeddings") or 0), local=local,
            **_experts(cfg, layers), **mla)
    except KeyError as exc:
        raise ValueError(f"{source}: config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: config.json has a malformed field ({exc})") from None


def _mla(cfg: dict) -> dict:
    """MLA fields of a ModelSpec from a DeepSeek-V2/V3 or Kimi K2 config (`kv_lora_rank` set), else {}."""
    if not cfg.get("kv_lora_rank"):
        return {}
    return dict(kv_lora_rank=int(cfg["kv_lora_rank"]), qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
                qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)), v_head_dim=int(cfg.get("v_head_dim") or 128),
                q_lora_rank=int(cfg.get("q_lora_rank") or 0))


def _experts(cfg: dict, layers: int) -> dict:
    """The sparse-MLP fields of a ModelSpec: experts `num_experts` (Qwen-MoE) or `num_local_experts`, each of
    `moe_intermediate_size` (else `intermediate_size`), a shared expert of `shared_expert_intermediate_size` (Llama
    4: `intermediate_size`); sparse layers from `moe_layers`, `interleave_moe_layer_step`, or Qwen's
    `decoder_sparse_step` / `mlp_only_layers` (default: every layer)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    if cfg.get("n_routed_experts"):  # DeepSeek: sparse from first_k_dense_replace on, n_shared_experts beside
        inter = int(cfg["moe_intermediate_size"])
        return dict(n_experts=experts, experts_per_tok=int(cfg.get("num_experts_per_tok") or 1), expert_ffn_dim=inter,
                    shared_ffn_dim=inter * int(cfg.get("n_shared_experts") or 0),
                    moe_layers=layers - int(cfg.get("first_k_dense_replace") or 0))
    llama4 = str(cfg.get("model_type", "")).startswith("llama4")
    if cfg.get("moe_layers") is not None:
        sparse = len(cfg["moe_layers"])
    elif cfg.get("interleave_moe_layer_step"):
        sparse = len(range(int(cfg["interleave_moe_layer_step"]) - 1, layers, int(cfg["interleave_moe_layer_step"])))
    else:
        step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
        sparse = sum(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(n_experts=experts, experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
                                                       or 1),
                expert_ffn_dim=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size")
                                   or (cfg["intermediate_size"] if llama4 else 0)), moe_layers=sparse)


def _windows(cfg: dict, layers: int, source: str) -> tuple[int, int, str]:
    """(window, number of windowed layers, "sliding" | "chunked") as transformers lays the layer types out."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    chunk = int(cfg.get("attention_chunk_size") or 0)
    if types is None and chunk and str(cfg.get("model_type", "")).startswith("llama4"):  # chunks on RoPE layers
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        types = ["chunked_attention" if r else "full_attention" for r in rope]
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"{source}: layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention", "chunked_attention"}
        if unknown:
            raise ValueError(f"{source}: layer_types holds {sorted(unknown)}; the planner knows "
                             f"'sliding_attention', 'chunked_attention' and 'full_attention'")
        if "chunked_attention" in types:
            if "sliding_attention" in types:
                raise ValueError(f"{source}: both sliding and chunked layers; the planner knows one local kind")
            if not chunk:
                raise ValueError(f"{source}: chunked_attention layers but no attention_chunk_size")
            return chunk, sum(t == "chunked_attention" for t in types), "chunked"
        count = sum(t == "sliding_attention" for t in types)
    elif cfg.get("sliding_window_pattern") or cfg.get("model_type") in GEMMA3:  # every pattern-th layer global
        pattern = int(cfg.get("sliding_window_pattern") or 6)  # transformers' Gemma3TextConfig default
        count = sum(bool((i + 1) % pattern) for i in range(layers))
    elif "use_sliding_window" in cfg:  # Qwen2 / Qwen3: layers from max_window_layers on, when switched on
        first = int(cfg.get("max_window_layers", 28))  # transformers' Qwen2Config default
        count = max(0, layers - first) if cfg["use_sliding_window"] else 0
    else:  # Mistral / Llama: one window for every layer when set
        count = layers if window else 0
    if count and not window:
        raise ValueError(f"{source}: {count} sliding-window layers but no sliding_window length")
    return (window, count, "sliding") if count else (0, 0, "sliding")


def load_weight_format(name) -> WeightFormat:
    if isinstance(name, WeightFormat):
        return name
    key = str(name).strip().lower()
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: known formats are {_known(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


def dtype_bytes(name: str) -> int:
    key = str(name).strip().lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}: known dtypes are {_known(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]
