"""Model shapes for the performance model: `ModelSpec`, parameter counts, weight formats (paper §4.1, App. A).

A `ModelSpec` is only the shape of a GQA transformer (with the layers that see a sliding window or a chunk, and its
sparse MLP layers: total parameters for memory, active ones for FLOPs); it knows nothing about hardware. Catalog
entries (`model_catalog.py`) come from published Hugging Face `config.json` files; any other model is read from
its own `config.json` (the layouts of every family cpinfer runs).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cpinfer.utils import check_positive

# Element sizes in bytes of the dtypes the planner knows (activations, KV cache, weights).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    hidden: int          # D, model dimension
    n_heads: int         # N_H, query heads
    n_kv_heads: int      # N_KV, key/value heads
    head_dim: int        # D_H (need not be hidden / n_heads: Qwen3, Gemma 3)
    ffn_dim: int         # gated-MLP intermediate size (SwiGLU / GeGLU: gate, up, down)
    vocab: int
    tie_embeddings: bool = False
    source: str = ""     # where the numbers come from
    window: int = 0          # sliding window of the windowed layers (a key j visible to query i iff i - j < window)
    window_layers: int = 0   # how many of the n_layers use it (Gemma 3: 5 of every 6; Mistral v0.1: all)
    max_context: int = 0     # max_position_embeddings of the config (0: not stated)
    local: str = "sliding"   # what `window` is: a "sliding" window, or "chunked" attention (Llama 4: a query sees
    #                          only keys of its own chunk of `window` positions)
    n_experts: int = 0       # routed experts of each sparse MLP layer (0: a dense model)
    experts_per_tok: int = 0  # k: experts each token goes through
    expert_ffn_dim: int = 0   # gated-MLP intermediate size of one expert
    shared_ffn_dim: int = 0   # a shared expert every token goes through (Qwen2-MoE, Llama 4; 0: none)
    moe_layers: int = 0       # how many of the n_layers are sparse (the others are dense MLPs of ffn_dim)
    # multi-head latent attention (DeepSeek-V2/V3, Kimi K2; 0: GQA): one cached KV head of kv_lora_rank +
    # qk_rope_head_dim per token, the same on every TP rank; attention runs absorbed (head_dim is that width)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0      # 0: full-rank queries

    def __post_init__(self) -> None:
        for what in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab"):
            check_positive(getattr(self, what), f"model {self.name!r}: {what}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention")
        for what in ("window", "window_layers", "max_context"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {what} must be a non-negative integer, got {value!r}")
        if self.window_layers > self.n_layers:
            raise ValueError(f"model {self.name!r}: window_layers ({self.window_layers}) exceeds n_layers "
                             f"({self.n_layers})")
        if bool(self.window) != bool(self.window_layers):
            raise ValueError(f"model {self.name!r}: a sliding window needs both window ({self.window}) and "
                             f"window_layers ({self.window_layers}) positive, or neither")
        if self.local not in ("sliding", "chunked"):
            raise ValueError(f"model {self.name!r}: local must be 'sliding' or 'chunked', got {self.local!r}")
        self._check_experts()
        mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.kv_lora_rank and not all(getattr(self, w) > 0 for w in mla):
            raise ValueError(f"model {self.name!r}: MLA needs {', '.join(mla)} all positive")
        if self.kv_lora_rank and (self.n_kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim):
            raise ValueError(f"model {self.name!r}: MLA attends over one KV head of kv_lora_rank + qk_rope_head_dim "
                             f"(n_kv_heads 1, head_dim {self.kv_lora_rank + self.qk_rope_head_dim})")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attn_replicated_params(self) -> int:
        """Attention weights every TP rank holds whole: MLA's latent path (q_a_proj, kv_a_proj_with_mqa); else 0."""
        if not self.mla:
            return 0
        return self.hidden * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

    def _check_experts(self) -> None:
        names = ("n_experts", "experts_per_tok", "expert_ffn_dim", "shared_ffn_dim", "moe_layers")
        for what in names:
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name!r}: {what} must be a non-negative integer, got {value!r}")
        if not self.moe_layers:
            return
        if self.moe_layers > self.n_layers:
            raise ValueError(f"model {self.name!r}: moe_layers ({self.moe_layers}) exceeds n_layers ({self.n_layers})")
        if not (self.n_experts and self.expert_ffn_dim and 0 < self.experts_per_tok <= self.n_experts):
            raise ValueError(f"model {self.name!r}: sparse layers need n_experts, expert_ffn_dim and "
                             f"0 < experts_per_tok <= n_experts (got {self.n_experts}, {self.expert_ffn_dim}, "
                             f"{self.experts_per_tok})")

    @property
    def full_layers(self) -> int:  # layers that attend to the whole context
        return self.n_layers - self.window_layers

    # Parameter counts (elements), per layer unless stated.
    @property
    def attn_params(self) -> int:  # Wq, Wk, Wv, Wo (MLA: q_a / q_b or q_proj, kv_a, kv_b, o_proj)
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (self.q_lora_rank or self.hidden) * self.n_heads * qk
            kv_b = self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return self.attn_replicated_params + q + kv_b + self.n_heads * self.v_head_dim * self.hidden
        return self.hidden * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + \
            self.n_heads * self.head_dim * self.hidden

    @property
    def ffn_params(self) -> int:  # SwiGLU: gate, up, down (a dense layer)
        return 3 * self.hidden * self.ffn_dim

    def moe_layer_params(self, experts: int) -> int:
        """A sparse layer's weights through `experts` routed experts: theirs, the shared expert's and the router."""
        return 3 * self.hidden * (experts * self.expert_ffn_dim + self.shared_ffn_dim) + self.n_experts * self.hidden

    @property
    def ffn_params_total(self) -> int:
        """Every MLP weight of every layer (what memory holds)."""
        return (self.n_layers - self.moe_layers) * self.ffn_params + self.moe_layers * self.moe_layer_params(
            self.n_experts)

    @property
    def ffn_params_active(self) -> int:
        """The MLP weights one token goes through over all layers (what its FLOPs use)."""
        return (self.n_layers - self.moe_layers) * self.ffn_params + self.moe_layers * self.moe_layer_params(
            self.experts_per_tok)

    @property
    def active_ffn_dim(self) -> float:
        """The intermediate width one token sees per layer, averaged over layers (elementwise passes)."""
        sparse = self.experts_per_tok * self.expert_ffn_dim + self.shared_ffn_dim
        return ((self.n_layers - self.moe_layers) * self.ffn_dim + self.moe_layers * sparse) / self.n_layers

    @property
    def embed_params(self) -> int:  # input embedding + LM head (once if tied)
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        """W of the paper: every weight, norms included (a mixture of experts: all experts, for memory)."""
        norms = (2 * self.n_layers + 1) * self.hidden
        return self.n_layers * self.attn_params + self.ffn_params_total + self.embed_params + norms

    @property
    def active_params(self) -> int:
        """The weights one token goes through (= params for a dense model; for FLOPs)."""
        return self.params - self.ffn_params_total + self.ffn_params_active

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads a TP rank holds; with tp > N_KV each KV head is replicated (paper §4.2.2)."""
        check_positive(tp, "tp")
        if self.n_heads % tp:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be divisible by tp ({tp})")
        if self.mla:  # the one latent head, on every TP rank
            return 1
        if self.n_kv_heads % tp == 0:
            return self.n_kv_heads // tp
        if tp % self.n_kv_heads == 0:
            return 1
        raise ValueError(f"model {self.name!r}: tp ({tp}) must divide n_kv_heads ({self.n_kv_heads}) "
                         f"or be a multiple of it")

    def kv_bytes_per_token(self, tp: int, kv_bytes: int, scale_bytes: int = 0) -> int:
        """KV cache bytes per token per GPU over all layers (K and V; MLA: the latent and rotary key, once;
        `scale_bytes` per row: FP8 KV's scale)."""
        return self.kv_parts * self.n_layers * self.kv_heads_per_gpu(tp) * (self.head_dim * kv_bytes + scale_bytes)

    @property
    def kv_parts(self) -> int:
        """Tensors a cached token is per KV head: 2 (K and V of head_dim) or 1 (MLA: the values are in the keys)."""
        return 1 if self.mla else 2

    def kv_bytes_per_head_layout(self, kv_bytes: int) -> int:
        """What the same model's cache would hold per token with per-head K/V (MLA expanded: H x (nope + rope) keys
        and H x v values per layer); = kv_bytes_per_token(1, .) for GQA."""
        if not self.mla:
            return self.kv_bytes_per_token(1, kv_bytes)
        per_layer = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return self.n_layers * per_layer * kv_bytes


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
    from cpinfer.perf.model_catalog import MODELS  # the catalog imports this module

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
