"""A test-only family: Llama as read from config.json, plus the per-layer attention options of the shared decoder
that the gpt-oss and Llama 4 readers set (`layer_types` with sliding / chunked layers, `sliding_window`,
`attention_chunk_size`, `attention_sinks`), so the attention core is tested end to end without a MoE checkpoint.

`register()` adds the family to this process's registry and `unregister()` takes it out again (so other tests'
lists of supported model types stay as they are); `pool.run(register)` registers it on every rank (rank processes
import this module to run it).
"""
from __future__ import annotations

from cpinfer.model.families import FAMILIES, Family, parse_rope

MODEL_TYPE = "cpinfer_test_local_attention"


def _read(d: dict, kw: dict) -> None:
    rope = parse_rope(d, d.get("rope_parameters"), d.get("rope_theta", 10000.0))
    kw["rope"] = {"full_attention": rope, "sliding_attention": rope}  # chunked layers: the global RoPE
    kw["layer_types"] = tuple(d["layer_types"])
    kw["sliding_window"] = d.get("sliding_window")
    kw["attention_chunk_size"] = d.get("attention_chunk_size")
    kw["attention_sinks"] = bool(d.get("attention_sinks", False))


def register(ctx=None) -> None:
    """Register the family in this process (`pool.run(register)` does it on every rank)."""
    FAMILIES.setdefault(MODEL_TYPE, Family(MODEL_TYPE, "none (tests only)", "Llama + per-layer attention options",
                                           _read))


def unregister(ctx=None) -> None:
    FAMILIES.pop(MODEL_TYPE, None)


def write_checkpoint(directory, seed: int = 0, std: float = 0.1, **overrides):
    """A random checkpoint of this family (weights ~N(0, std), sinks ~N(0, 1)) in `directory`; returns it."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from cpinfer.model import ModelConfig
    from cpinfer.model.random_checkpoint import random_config_dict, random_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    d = random_config_dict(model_type=MODEL_TYPE, **overrides)
    save_file(random_state_dict(ModelConfig.from_dict(d), seed=seed, std=std), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(d, indent=2))
    return directory
