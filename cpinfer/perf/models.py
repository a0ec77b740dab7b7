"""Model catalog for the performance model: Llama-3 shapes, parameter counts, weight formats (paper §4.1, App. A).

A `ModelSpec` is only the shape of a dense GQA transformer; it knows nothing about hardware. Catalog entries come
from the published Hugging Face `config.json` files; any other model is read from its own `config.json`.
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
    head_dim: int        # D_H
    ffn_dim: int         # SwiGLU intermediate size
    vocab: int
    tie_embeddings: bool = False
    source: str = ""     # where the numbers come from

    def __post_init__(self) -> None:
        for what in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab"):
            check_positive(getattr(self, what), f"model {self.name!r}: {what}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads}) for grouped-query attention")

    # Parameter counts (elements), per layer unless stated.
    @property
    def attn_params(self) -> int:  # Wq, Wk, Wv, Wo
        return self.hidden * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + \
            self.n_heads * self.head_dim * self.hidden

    @property
    def ffn_params(self) -> int:  # SwiGLU: gate, up, down
        return 3 * self.hidden * self.ffn_dim

    @property
    def embed_params(self) -> int:  # input embedding + LM head (once if tied)
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        """W of the paper: every weight, norms included."""
        norms = (2 * self.n_layers + 1) * self.hidden
        return self.n_layers * (self.attn_params + self.ffn_params) + self.embed_params + norms

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads a TP rank holds; with tp > N_KV each KV head is replicated (paper §4.2.2)."""
        check_positive(tp, "tp")
        if self.n_heads % tp:
            raise ValueError(f"model {self.name!r}: n_heads ({self.n_heads}) must be divisible by tp ({tp})")
        if self.n_kv_heads % tp == 0:
            return self.n_kv_heads // tp
        if tp % self.n_kv_heads == 0:
            return 1
        raise ValueError(f"model {self.name!r}: tp ({tp}) must divide n_kv_heads ({self.n_kv_heads}) "
                         f"or be a multiple of it")

    def kv_bytes_per_token(self, tp: int, kv_bytes: int) -> int:
        """KV cache bytes per token per GPU over all layers (K and V)."""
        return 2 * self.n_layers * self.kv_heads_per_gpu(tp) * self.head_dim * kv_bytes


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
        kv_part = 2 * model.hidden * model.n_kv_heads * model.head_dim * (kv_rep - 1)
        attn = (model.attn_params + kv_part) * self.attn_bytes
        ffn = model.ffn_params * self.ffn_bytes
        scales = 4 * ((2 * model.ffn_dim + model.hidden) * self.ffn_fp8 +
                      ((model.n_heads + 2 * model.n_kv_heads) * model.head_dim + model.hidden) * self.attn_fp8)
        per_layer = attn + ffn + scales
        norms = 4 * (2 * model.n_layers + 1) * model.hidden  # replicated, fp32
        return (model.n_layers * per_layer + model.embed_params * self.embed_bytes) / tp + norms


_HF = "published Hugging Face config.json of meta-llama/Llama-3.1-{}"
MODELS = {
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, source=_HF.format("8B")),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256, source=_HF.format("70B")),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256,
                             source=_HF.format("405B") + "; paper App. A Table 6"),
}

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


def load_model_spec(name_or_config_path: str) -> ModelSpec:
    """A catalog name (case-insensitive) or a path to a HF `config.json` (or the folder holding it)."""
    key = str(name_or_config_path).strip().lower()
    if key in MODELS:
        return MODELS[key]
    path = Path(name_or_config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_config_path!r}: known models are {_known(MODELS)}, "
                         f"or give the path of a Hugging Face config.json")
    return model_spec_from_hf_config(json.loads(path.read_text()), name=path.parent.name or str(path),
                                     source=str(path))


def model_spec_from_hf_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """Read the shape of a Llama-style model from a Hugging Face config dict."""
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return ModelSpec(
            name=name, n_layers=int(cfg["num_hidden_layers"]), hidden=hidden, n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), ffn_dim=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            source=source)
    except KeyError as exc:
        raise ValueError(f"{source}: config.json lacks {exc.args[0]!r}") from None


def load_weight_format(name: str) -> WeightFormat:
    key = str(name).strip().lower()
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: known formats are {_known(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


def dtype_bytes(name: str) -> int:
    key = str(name).strip().lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}: known dtypes are {_known(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]
