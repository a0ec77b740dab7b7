"""Write a random, HF-compatible Llama checkpoint (config.json + model.safetensors) with torch only.

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
    """HF-named tensors; norms are 1 + small noise so that a mis-mapped norm weight is caught by tests."""
    gen = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=gen)).to(dtype)

    sd = {"model.embed_tokens.weight": normal(config.vocab_size, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = normal(config.q_size, h)
        sd[p + "self_attn.k_proj.weight"] = normal(config.kv_size, h)
        sd[p + "self_attn.v_proj.weight"] = normal(config.kv_size, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, config.q_size)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = normal(i, h)
        sd[p + "mlp.up_proj.weight"] = normal(i, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, i)
    sd["model.norm.weight"] = norm()
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = normal(config.vocab_size, h)
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
