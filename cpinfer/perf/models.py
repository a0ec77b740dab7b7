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

    @property
    def has_fp8(self) -> bool:
        return self.attn_fp8 or self.ffn_fp8


@dataclass(frozen=True)
class HeldWeights:
    """Bytes per element of each kind of weight as the engine holds it once loaded, and which GEMMs run FP8.
    `expert_*`: the routed experts of a mixture; `other_bytes`: embeddings, LM head, norms, routers and MLA's
    kv_b_proj (which the model reads as a tensor). `notes` say what differs from the checkpoint's format."""
    attn_bytes: int
    attn_fp8: bool
    ffn_bytes: int          # dense MLPs and shared experts
    ffn_fp8: bool
    expert_bytes: int
    expert_fp8: bool
    other_bytes: int
    notes: tuple[str, ...] = ()
    fp8_any_shape: bool = True  # the Triton FP8 GEMM takes what _scaled_mm cannot (a GPU with Triton); else a
    #                             linear whose dims are not multiples of 16 is dequantized (CPU: _scaled_mm only)


def held_weights(fmt: WeightFormat, model: ModelSpec, compute_bytes: int, fp8_gemms: bool,
                 fp8_experts: bool, fp8_any_shape: bool = True) -> HeldWeights:
    """What the engine keeps of a checkpoint in format `fmt`: a weight that is not FP8 is held in the compute dtype
    (`compute_bytes`); an FP8 linear stays FP8 (with one fp32 scale per output row) only on a device with FP8 GEMMs
    (`fp8_gemms`; elsewhere, as on CPU, every FP8 weight is dequantized at load); routed experts stay FP8 only when
    `fp8_experts` (cpinfer dequantizes them at load)."""
    attn, ffn = fmt.attn_fp8 and fp8_gemms, fmt.ffn_fp8 and fp8_gemms
    experts = ffn and fp8_experts
    notes = []
    if fmt.has_fp8 and not fp8_gemms:
        notes.append("no FP8 GEMMs on this hardware: every FP8 weight is dequantized at load")
    if fmt.ffn_fp8 and fp8_gemms and model.moe_layers and not fp8_experts:
        notes.append(f"the routed experts are dequantized to {compute_bytes}-byte elements at load; dense MLPs and "
                     "shared experts stay FP8")
    if attn and model.mla:
        notes.append("MLA's kv_b_proj is dequantized at load (folded into the queries and the output)")
    c = compute_bytes
    return HeldWeights(1 if attn else c, attn, 1 if ffn else c, ffn, 1 if experts else c, experts, c, tuple(notes),
                       fp8_any_shape)


def weight_bytes_per_gpu(model: ModelSpec, held: HeldWeights, tp: int, vocab_parallel: bool = False) -> float:
    """Weights, FP8 row scales and norms one TP rank holds: column-parallel linears (q, k, v, gate, up) keep 1/tp
    of their rows, row-parallel ones (o, down) 1/tp of their columns, KV heads replicated when tp > N_KV, MLA's
    latent projections and the routers whole on every rank; the embedding and LM head split only when
    `vocab_parallel`."""
    per_layer = _attn_bytes(model, held, tp)
    dense = _mlp_bytes(model.hidden, model.ffn_dim // tp, held.ffn_bytes, held.ffn_fp8, held)
    total = model.attn_layers * per_layer + (model.n_layers - model.moe_layers) * dense
    if model.linear_layers:
        total += model.linear_layers * _linear_layer_bytes(model, held, tp)
    if model.moe_layers:
        experts = model.n_experts * _mlp_bytes(model.hidden, model.expert_ffn_dim // tp, held.expert_bytes,
                                               held.expert_fp8, held)
        shared = _mlp_bytes(model.hidden, model.shared_ffn_dim // tp, held.ffn_bytes, held.ffn_fp8, held)
        router = model.n_experts * model.hidden * held.other_bytes
        total += model.moe_layers * (experts + shared + router)
    embed = model.embed_params * held.other_bytes
    return total + (embed / tp if vocab_parallel else embed) + model.norm_params * held.other_bytes


FP8_ALIGN = 16  # torch._scaled_mm needs both dimensions of a row-wise FP8 weight (its TP slice) multiples of 16


def _linear_bytes(rows: int, cols: int, elem: int, fp8: bool, compute: int, any_shape: bool = True) -> int:
    """An [rows, cols] linear, with one fp32 scale per output row when it stays FP8; without the Triton GEMM
    (`any_shape` False) a shape _scaled_mm cannot take is dequantized to the `compute` element size at load."""
    if fp8 and not any_shape and (rows % FP8_ALIGN or cols % FP8_ALIGN):
        return rows * cols * compute
    return rows * cols * elem + (4 * rows if fp8 else 0)


def _mlp_bytes(hidden: int, ffn: int, elem: int, fp8: bool, held: HeldWeights) -> int:
    """A gated MLP slice of intermediate `ffn`: gate and up [ffn, hidden], down [hidden, ffn]."""
    if not ffn:
        return 0
    c, any_shape = held.other_bytes, held.fp8_any_shape
    return 2 * _linear_bytes(ffn, hidden, elem, fp8, c, any_shape) + _linear_bytes(hidden, ffn, elem, fp8, c,
                                                                                    any_shape)


def _linear_layer_bytes(model: ModelSpec, held: HeldWeights, tp: int) -> int:
    """A recurrent layer's weights on one TP rank: its projections held like attention's (heads split over the TP
    ranks), the conv, decay and norm parameters in the compute dtype."""
    into, second, vd = model.linear_proj_dims
    linear = _linear_bytes(into // tp, model.hidden, held.attn_bytes, held.attn_fp8, held.other_bytes,
                           held.fp8_any_shape) + _linear_bytes(model.hidden, vd // tp, held.attn_bytes,
                                                              held.attn_fp8, held.other_bytes, held.fp8_any_shape)
    low_rank = second * model.linear_k_dim // tp * held.other_bytes
    rest = model.linear_params - model.hidden * (into + vd) - second * model.linear_k_dim
    return linear + low_rank + rest // tp * held.other_bytes


def _attn_bytes(model: ModelSpec, held: HeldWeights, tp: int) -> int:
    def linear(rows: int, cols: int) -> int:
        return _linear_bytes(rows, cols, held.attn_bytes, held.attn_fp8, held.other_bytes, held.fp8_any_shape)

    heads, hidden = model.n_heads // tp, model.hidden
    if not model.mla:
        kv_rows = model.kv_heads_per_gpu(tp) * model.head_dim
        q_rows = heads * model.head_dim * (2 if model.attn_output_gate else 1)  # + the output gate's rows
        return linear(q_rows, hidden) + 2 * linear(kv_rows, hidden) + \
            linear(hidden, heads * model.head_dim)
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    if model.q_lora_rank:  # q_a_proj (whole on every rank), then q_b_proj
        q = linear(model.q_lora_rank, hidden) + linear(heads * qk, model.q_lora_rank)
    else:
        q = linear(heads * qk, hidden)
    kv_a = linear(model.kv_lora_rank + model.qk_rope_head_dim, hidden)
    kv_b = heads * (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank * held.other_bytes
    indexer = 0
    if model.dsa:  # the lightning indexer, whole on every TP rank: wq_b, wk, weights_proj
        indexer = linear(model.index_heads * model.index_dim, model.q_lora_rank or hidden) + \
            linear(model.index_dim, hidden) + linear(model.index_heads, hidden)
    return q + kv_a + kv_b + linear(hidden, heads * model.v_head_dim) + indexer


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
        cfg = _hybrid_layer_types(cfg, layers)
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
            **_experts(cfg, layers), **mla, **_linear(cfg, source))
    except KeyError as exc:
        raise ValueError(f"{source}: config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: config.json has a malformed field ({exc})") from None


GDN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LINEAR_TYPES = GDN_TYPES + ("kimi_linear",)


def _hybrid_layer_types(cfg: dict, layers: int) -> dict:
    """A hybrid config without `layer_types`: Kimi Linear's `linear_attn_config.kda_layers`; Qwen3-Next / Qwen3.5
    as transformers lays them out, every `full_attention_interval`-th layer (default 4) full attention."""
    if cfg.get("layer_types") is not None:
        return cfg
    lin = cfg.get("linear_attn_config") or {}
    if cfg.get("model_type") == "kimi_linear" and "kda_layers" in lin:  # 1-based layer numbers of the KDA layers
        kda = {int(i) - 1 for i in lin["kda_layers"]}
        return {**cfg, "layer_types": ["linear_attention" if i in kda else "full_attention" for i in range(layers)]}
    if cfg.get("model_type") not in GDN_TYPES:
        return cfg
    every = int(cfg.get("full_attention_interval") or 4)
    return {**cfg, "layer_types": ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                   for i in range(layers)]}


def _linear(cfg: dict, source: str) -> dict:
    """The recurrent-layer fields of a ModelSpec from a hybrid's config (the `linear_attention` entries of
    `layer_types`): Gated DeltaNet's `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
    `linear_value_head_dim`, `linear_conv_kernel_dim`; KDA's `linear_attn_config` (or transformers' flat keys);
    transformers' defaults where a key is missing. {} for a model with no recurrent layer."""
    count = sum(t == "linear_attention" for t in cfg.get("layer_types") or ())
    if not count:
        return {}
    kind = cfg.get("model_type")
    if kind not in LINEAR_TYPES:
        raise ValueError(f"{source}: linear_attention layers in a {kind!r} config; the planner knows the linear "
                         f"layers of {', '.join(LINEAR_TYPES)}")
    gate = kind in GDN_TYPES
    if kind == "kimi_linear":
        lin = cfg.get("linear_attn_config") or {}
        heads = int(lin.get("num_heads", cfg.get("linear_num_heads", 32)))
        dim = int(lin.get("head_dim", cfg.get("linear_head_dim", 128)))
        conv = int(lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)))
        return dict(linear_layers=count, linear_kind="kda", linear_k_heads=heads, linear_v_heads=heads,
                    linear_k_dim=dim, linear_v_dim=dim, linear_conv=conv)
    return dict(linear_layers=count, linear_kind="gdn", linear_k_heads=int(cfg.get("linear_num_key_heads", 16)),
                linear_v_heads=int(cfg.get("linear_num_value_heads", 32)),
                linear_k_dim=int(cfg.get("linear_key_head_dim", 128)),
                linear_v_dim=int(cfg.get("linear_value_head_dim", 128)),
                linear_conv=int(cfg.get("linear_conv_kernel_dim", 4)), attn_output_gate=gate)


def _mla(cfg: dict) -> dict:
    """MLA fields of a ModelSpec from a DeepSeek-V2/V3 or Kimi K2 config (`kv_lora_rank` set), else {}."""
    if not cfg.get("kv_lora_rank"):
        return {}
    dsa = {}
    if cfg.get("index_topk"):  # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5)
        dsa = dict(index_heads=int(cfg.get("index_n_heads") or 64), index_dim=int(cfg.get("index_head_dim") or 128),
                   index_topk=int(cfg["index_topk"]))
    return dict(kv_lora_rank=int(cfg["kv_lora_rank"]), qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
                qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)), v_head_dim=int(cfg.get("v_head_dim") or 128),
                q_lora_rank=int(cfg.get("q_lora_rank") or 0), **dsa)


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
                    moe_layers=layers - int(cfg.get("first_k_dense_replace") or 0),
                    router_bias=cfg.get("model_type") in ("deepseek_v3", "kimi_k2"))
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
        # DeepSeek sparse attention's layers (V3.2, GLM-5) cost as full MLA here: an upper bound on their top-k's
        types = ["full_attention" if t == "indexed_attention" else t for t in types]
        if len(types) != layers:
            raise ValueError(f"{source}: layer_types has {len(types)} entries for {layers} layers")
        types = [t for t in types if t != "linear_attention"]  # a hybrid's recurrent layers (`_linear`)
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
