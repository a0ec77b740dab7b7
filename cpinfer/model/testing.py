"""Tiny Llama checkpoints for tests: named config variants and a `transformers`-based writer (the oracle).

`transformers` is imported lazily, so importing this module does not need it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Shared base: 2 layers, fp32-friendly sizes; each variant overrides a few keys.
TINY_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.1,  # larger than HF's 0.02 so attention is far from uniform: RoPE bugs show
}

TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},                                                   # 8 query heads : 2 KV heads (4:1)
    "mqa": {"num_attention_heads": 4, "num_key_value_heads": 1},
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "llama3": {                                                  # short original context: all 3 bands in use
        "vocab_size": 320, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
}


def tiny_config(variant: str = "gqa", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `transformers.LlamaConfig` (also valid `config.json` content)."""
    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {sorted(TINY_VARIANTS)}")
    return {**TINY_BASE, **TINY_VARIANTS[variant], **overrides}


def write_hf_checkpoint(directory: str | Path, variant: str = "gqa", *, seed: int = 0,
                        max_shard_size: str | int | None = None, **overrides: Any) -> Path:
    """Save a random `transformers.LlamaForCausalLM` (fp32) with `save_pretrained`; returns the directory.

    Norm weights get small noise on top of HF's ones-init so that a mis-mapped norm is caught.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_config(variant, **overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **kwargs)
    return Path(directory)


def load_hf_model(directory: str | Path):
    """The oracle: `transformers.LlamaForCausalLM` from `directory`, fp32, eager attention, eval mode."""
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager").eval()
