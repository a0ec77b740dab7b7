"""Write a random, HF-compatible checkpoint (config.json + model.safetensors) with torch only: Llama by default,
any supported family by `model_type`.

For demos and tests on machines without `transformers`: deterministic from a seed, weights ~N(0, 0.02).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cpinfer.model.config import ModelConfig

# A small Llama-3-shaped default (GQA 4:1); every key can be overridden.
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def random_config_dict(**overrides: Any) -> dict[str, Any]:
    """DEFAULT_CONFIG with overrides and an explicit head_dim, validated by `ModelConfig`."""
    d = {**DEFAULT_CONFIG, **overrides}
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    ModelConfig.from_dict(d)  # fail here, with a clear message, rather than at load time
    return d


def random_state_dict(config: ModelConfig, seed: int = 0, std: float = 0.02,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named tensors of every parameter of `config`'s family; norms are their identity plus small noise and
    biases are random, so that a mis-mapped norm or bias is caught by tests; attention sinks are ~N(0, 1) logits
    (the size of attention scores), so that a sink merged twice or not at all shows."""
    from cpinfer.model.loader import UNIT_SCALES, build_model  # late: the loader imports this package

    gen = torch.Generator().manual_seed(seed)
    identity = 0.0 if config.norm_style == "gemma" else 1.0  # gemma norms scale by (1 + weight)
    sd = {}
    for name, p in build_model(config).named_parameters():  # meta model: names and shapes only
        noise = torch.randn(*p.shape, generator=gen)
        if name.endswith("norm.weight"):  # a Gated DeltaNet's gated norm scales by its weight, whatever the style
            one = 1.0 if name.endswith("linear_attn.norm.weight") else identity
            sd[name] = (one + 0.1 * noise).to(dtype)
        elif name.endswith(UNIT_SCALES):
            sd[name] = (1.0 + 0.1 * noise).to(dtype)
        elif name.endswith("self_attn.sinks"):
            sd[name] = noise.to(dtype)
        else:
            sd[name] = (noise * std).to(dtype)
    return sd


def write_random_checkpoint(directory: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                            **config_overrides: Any) -> Path:
    """Write config.json + model.safetensors to `directory` (created if needed); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    d = random_config_dict(**config_overrides)
    d["torch_dtype"] = str(dtype).removeprefix("torch.")
    sd = random_state_dict(ModelConfig.from_dict(d), seed=seed, dtype=dtype)
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with open(directory / "config.json", "w") as f:
        json.dump(d, f, indent=2)
    return directory
