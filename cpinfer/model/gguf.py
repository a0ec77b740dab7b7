"""Convert a GGUF file of a supported family (llama — incl. Mistral, which llama.cpp writes as llama —, qwen2,
qwen3, gemma3) into a Hugging Face checkpoint folder (fp32 safetensors, config.json, generation_config.json,
tokenizer files with the chat template) that `loader.load_model` reads.

Weights are dequantized with the `gguf` package and brought back to Hugging Face's layout: llama.cpp stores the
Q/K rows of Llama-style models interleaved for its RoPE (un-permuted here; Qwen and Gemma use NEOX-style RoPE and
are stored as is) and Gemma's norm weights as 1 + w. The tokenizer and chat template are built by
`transformers`' GGUF reader, the same one its models use.
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


@dataclass(frozen=True)
class GGUFFamily:
    """How one GGUF architecture maps back to a Hugging Face family."""

    model_type: str
    hf_class: str
    permuted_qk: bool  # Q/K rows interleaved by llama.cpp's converter (Llama-style RoPE)
    norm_plus_one: bool  # norm weights stored as 1 + w (Gemma)


GGUF_FAMILIES = {
    "llama": GGUFFamily("llama", "LlamaForCausalLM", True, False),
    "qwen2": GGUFFamily("qwen2", "Qwen2ForCausalLM", False, False),
    "qwen3": GGUFFamily("qwen3", "Qwen3ForCausalLM", False, False),
    "gemma3": GGUFFamily("gemma3_text", "Gemma3ForCausalLM", False, True),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_FAMILIES)
WEIGHTS_FILE = "model.safetensors"
_NUM_TOKENS = "tokenizer.ggml.tokens.count"  # our own key: the vocabulary's length, not its contents

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."); weights and biases alike.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",  # Llama / Qwen: the norm before the MLP
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_TENSORS = {  # Gemma 3's four norms per layer
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_SCALINGS = ("none", "linear", "yarn")


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
                         f"{SUPPORTED_GGUF_ARCHITECTURES} (Llama and Mistral files are 'llama')")
    a, m = info.architecture, info.metadata
    if m.get(f"{a}.expert_count"):
        raise ValueError(f"{path}: a mixture-of-experts {a!r} model ({m[f'{a}.expert_count']} experts) is not "
                         "supported; cpinfer runs dense models")
    scaling = m.get(f"{a}.rope.scaling.type", "none")
    freqs = "rope_freqs.weight" in info.tensor_names
    if scaling not in _ROPE_SCALINGS or (freqs and (a != "llama" or scaling != "none")):
        raise ValueError(f"{path}: RoPE scaling in a GGUF file ({scaling!r}{', rope_freqs tensor' if freqs else ''}) "
                         f"is not supported (GGUF scalings read: {_ROPE_SCALINGS}, and a Llama 3.1 rope_freqs "
                         "tensor); convert from the Hugging Face folder instead (its config.json carries it)")
    if m.get(f"{a}.attention.sliding_window") and a not in ("gemma3",):
        raise ValueError(f"{path}: a sliding window in a {a!r} GGUF file is not supported; use the Hugging Face "
                         "folder (its config.json says which layers slide)")


def _rope_scaling(a: str, m: dict[str, Any]) -> dict[str, Any] | None:
    """The HF rope_scaling dict of a GGUF's `rope.scaling.*` keys (linear or yarn), or None."""
    kind = m.get(f"{a}.rope.scaling.type", "none")
    if kind == "none":
        return None
    d: dict[str, Any] = {"rope_type": kind, "factor": float(m.get(f"{a}.rope.scaling.factor", 1.0))}
    if kind == "yarn":
        orig = m.get(f"{a}.rope.scaling.original_context_length")
        if orig:
            d["original_max_position_embeddings"] = int(orig)
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if f"{a}.rope.scaling.{theirs}" in m:
                d[ours] = float(m[f"{a}.rope.scaling.{theirs}"])
    return d


def llama3_scaling_from_rope_freqs(freqs, theta: float, head_dim: int,
                                   original: int | None = None) -> dict[str, Any]:
    """The `llama3` rope_scaling dict behind llama.cpp's `rope_freqs` tensor (each frequency divided by its entry).

    Llama 3.1's factor is 1 for short wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s) in between,
    with s linear in 1 / wavelength: the two coefficients give low / high_freq_factor for an original context
    (the file's `rope.scaling.original_context_length`, else Llama 3's 8192 — the frequencies depend only on the
    ratios, so any choice reproduces them). The recovered parameters must reproduce the tensor, else ValueError.
    """
    from cpinfer.model.config_parts import RopeConfig
    from cpinfer.model.rope import rope_inv_freq

    f = np.asarray(freqs, dtype=np.float64).reshape(-1)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(f) != len(inv):
        raise ValueError(f"GGUF rope_freqs has {len(f)} entries, expected head_dim / 2 = {len(inv)}")
    factor = float(f.max())
    medium = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if factor <= 1 or medium.sum() < 2:
        raise ValueError("GGUF rope_freqs does not have Llama 3.1's shape (two or more interpolated dimensions); "
                         "convert from the Hugging Face folder instead")
    smooth = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
    slope, offset = np.polyfit(inv[medium] / (2 * np.pi), smooth, 1)  # smooth = slope / wavelength + offset
    old = int(original or 8192)
    width = old / slope  # high_freq_factor - low_freq_factor
    d = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(-offset * width),
         "high_freq_factor": float((1 - offset) * width), "original_max_position_embeddings": old}
    got, _ = rope_inv_freq(head_dim, RopeConfig(theta=theta, **d))
    if not np.allclose(got.double().numpy(), inv / f, rtol=1e-4, atol=0):
        raise ValueError("GGUF rope_freqs is not a Llama 3.1 scaling; convert from the Hugging Face folder instead")
    return d


def _gemma3_layer_types(a: str, m: dict[str, Any], n_layers: int) -> list[str]:
    """Per layer: `sliding_window_pattern` as a bool array (true: sliding) or a period; llama.cpp's default 6."""
    pattern = m.get(f"{a}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layers:
            raise ValueError(f"GGUF sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        return ["sliding_attention" if bool(x) else "full_attention" for x in pattern]
    pattern = int(pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]


def hf_config(info: GGUFInfo, rope_freqs=None) -> dict[str, Any]:
    """The Hugging Face `config.json` of a GGUF of a supported family, validated by `ModelConfig`; `rope_freqs`:
    the values of the file's `rope_freqs` tensor (Llama 3.1's RoPE scaling), if it has one."""
    a, m = info.architecture, info.metadata
    family = GGUF_FAMILIES[a]

    def need(key: str):
        if f"{a}.{key}" not in m:
            raise ValueError(f"GGUF metadata lacks {a}.{key}")
        return m[f"{a}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    layers = int(need("block_count"))
    head_dim = int(m.get(f"{a}.attention.key_length", hidden // heads))
    rot = int(m.get(f"{a}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rot} != head_dim {head_dim}: partial RoPE is not supported")
    vocab = m.get(f"{a}.vocab_size") or m.get(_NUM_TOKENS)
    if not vocab:
        raise ValueError(f"GGUF metadata lacks {a}.vocab_size and tokenizer.ggml.tokens")
    has_bias = "blk.0.attn_q.bias" in info.tensor_names
    d: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(m.get(f"{a}.rope.freq_base", 1e6 if a == "gemma3" else 10000.0)),
        "rope_scaling": _rope_scaling(a, m) if rope_freqs is None else llama3_scaling_from_rope_freqs(
            rope_freqs, float(m.get(f"{a}.rope.freq_base", 10000.0)), head_dim,
            m.get(f"{a}.rope.scaling.original_context_length")),
        "tie_word_embeddings": "output.weight" not in info.tensor_names,
        "torch_dtype": "float32",
    }
    if a == "gemma3":
        # llama.cpp scales queries by 1/sqrt(hidden / heads) for the 62-layer 27B and 1/sqrt(head_dim) otherwise,
        # unless the file says `attention.scale`
        scale = m.get(f"{a}.attention.scale")
        d.update(hidden_activation="gelu_pytorch_tanh", attention_bias=has_bias,
                 sliding_window=int(need("attention.sliding_window")),
                 layer_types=_gemma3_layer_types(a, m, layers),
                 rope_local_base_freq=float(m.get(f"{a}.rope.freq_base_swa", 10000.0)),
                 query_pre_attn_scalar=(round(1.0 / float(scale) ** 2) if scale else  # an int in transformers
                                        hidden // heads if layers == 62 else head_dim),
                 final_logit_softcapping=m.get(f"{a}.final_logit_softcapping"))
    else:
        d.update(hidden_act="silu", attention_bias=has_bias, mlp_bias="blk.0.ffn_gate.bias" in info.tensor_names)
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{theirs}" in m:
            d[ours] = int(m[f"tokenizer.ggml.{theirs}"])
    ModelConfig.from_dict(d)  # fail here, naming the bad value, rather than at load time
    return d


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head it stores (half, pair) where HF stores (pair, half).

    w: [n_heads * head_dim, hidden] (or a bias [n_heads * head_dim]) -> same shape, in HF's rotate-half order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(reader, config: dict[str, Any], architecture: str = "llama") -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file dequantized to fp32, under its Hugging Face name and in its layout."""
    from gguf import quants

    family = GGUF_FAMILIES[architecture]
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # RoPE scaling, in config.json
            continue
        name = _hf_name(t.name, architecture)
        try:
            w = quants.dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's: [out, in]
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {t.name} has quantization {t.tensor_type.name}, which the gguf "
                             "package cannot dequantize") from None
        if family.permuted_qk and ".q_proj." in name:
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif family.permuted_qk and ".k_proj." in name:
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        if family.norm_plus_one and name.endswith("norm.weight"):
            w = w.astype(np.float32) - 1.0  # llama.cpp multiplies by the stored weight; Gemma's is (1 + w)
        w = np.ascontiguousarray(w, dtype=np.float32)
        sd[name] = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 tensors are read-only maps
    return sd


def _hf_name(gguf_name: str, architecture: str = "llama") -> str:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    table = _GEMMA3_LAYER_TENSORS if architecture == "gemma3" else _LAYER_TENSORS
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in table and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a {architecture!r} model")


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
    freqs = next((np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = hf_config(info, freqs)
    sd = hf_state_dict(reader, config, info.architecture)
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
