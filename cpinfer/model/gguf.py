"""Convert a GGUF file of a Llama-family model into a Hugging Face checkpoint folder (fp32 safetensors,
config.json, generation_config.json, tokenizer files with the chat template) that `loader.load_model` reads.

Weights are dequantized with the `gguf` package and un-permuted (llama.cpp stores Q/K rows interleaved for its
RoPE); the tokenizer and chat template are built by `transformers`' GGUF reader, the same one its models use.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from cpinfer.model.config import ModelConfig
from cpinfer.utils import get_logger

log = get_logger()

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
WEIGHTS_FILE = "model.safetensors"
_NUM_TOKENS = "tokenizer.ggml.tokens.count"  # our own key: the vocabulary's length, not its contents

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says: its architecture and metadata (arrays of tokens left out)."""

    architecture: str
    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]


def read_gguf_info(path: str | Path):
    """(GGUFInfo, the open GGUFReader) — header only; tensors stay memory-mapped until read."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: say which and why
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key == "tokenizer.ggml.tokens":
            meta[_NUM_TOKENS] = len(field.data)
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model" and not key.endswith("_id"):
            continue  # vocabularies and merges: large, and only transformers' tokenizer reader needs them
        try:
            meta[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we need
            continue
    arch = meta.get("general.architecture")
    return GGUFInfo(str(arch), meta, tuple(t.name for t in reader.tensors)), reader


def check_supported(info: GGUFInfo, path: str | Path) -> None:
    """ValueError naming what is unsupported (architecture, RoPE scaling, MoE) before any heavy work."""
    if info.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {info.architecture!r} is not supported; cpinfer converts "
                         f"{SUPPORTED_GGUF_ARCHITECTURES} (Llama family: GQA, RoPE, RMSNorm, SwiGLU)")
    a, m = info.architecture, info.metadata
    if m.get(f"{a}.expert_count"):
        raise ValueError(f"{path}: a mixture-of-experts {a!r} model ({m[f'{a}.expert_count']} experts) is not "
                         "supported; cpinfer runs dense Llama models")
    scaling = m.get(f"{a}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in info.tensor_names:
        raise ValueError(f"{path}: RoPE scaling in a GGUF file ({scaling!r}"
                         f"{', rope_freqs tensor' if 'rope_freqs.weight' in info.tensor_names else ''}) is not "
                         "supported; convert from the Hugging Face folder instead (its config.json carries it)")


def hf_config(info: GGUFInfo) -> dict[str, Any]:
    """The Hugging Face `config.json` of a Llama GGUF, validated by `ModelConfig`."""
    a, m = info.architecture, info.metadata

    def need(key: str):
        if f"{a}.{key}" not in m:
            raise ValueError(f"GGUF metadata lacks {a}.{key}")
        return m[f"{a}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(m.get(f"{a}.attention.key_length", hidden // heads))
    rot = int(m.get(f"{a}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rot} != head_dim {head_dim}: partial RoPE is not supported")
    vocab = m.get(f"{a}.vocab_size") or m.get(_NUM_TOKENS)
    if not vocab:
        raise ValueError(f"GGUF metadata lacks {a}.vocab_size and tokenizer.ggml.tokens")
    d = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(m.get(f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in info.tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{theirs}" in m:
            d[ours] = int(m[f"tokenizer.ggml.{theirs}"])
    ModelConfig.from_dict(d)  # fail here, naming the bad value, rather than at load time
    return d


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores (half, pair) where HF stores (pair, half).

    w: [n_heads * head_dim, hidden] -> same shape, rows in Hugging Face's rotate-half order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(reader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file dequantized to fp32, under its Hugging Face name."""
    from gguf import quants

    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        try:
            w = quants.dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's: [out, in]
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {t.name} has quantization {t.tensor_type.name}, which the gguf "
                             "package cannot dequantize") from None
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        w = np.ascontiguousarray(w, dtype=np.float32)
        sd[name] = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are read-only maps
    return sd


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama model")


def save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, as transformers reads them from the GGUF."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write the HF checkpoint of `gguf_path` into `out_dir` (which must exist); returns its config dict."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    t0 = time.perf_counter()
    info, reader = read_gguf_info(gguf_path)
    check_supported(info, gguf_path)
    config = hf_config(info)
    sd = hf_state_dict(reader, config)
    log.info("GGUF %s: %d tensors dequantized in %.1f s", gguf_path.name, len(sd), time.perf_counter() - t0)
    save_file(sd, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    del sd, reader
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump(gen, f, indent=2)
    save_tokenizer(gguf_path, out_dir)
    log.info("GGUF %s: converted in %.1f s", gguf_path.name, time.perf_counter() - t0)
    return config
