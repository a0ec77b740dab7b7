"""Tiny Llama checkpoints for tests: named config variants, a `transformers`-based writer (the oracle) and a
tiny GGUF writer (the converter's input, laid out as llama.cpp writes it).

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


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte → printable-character table (printable bytes map to themselves, the rest above U+0100)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


TINY_GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2 as in SmolLM2
TINY_GGUF_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                           "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                           "{% endif %}")


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", seed: int = 0, num_layers: int = 2,
                    hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                    tied: bool = True, quantize: bool = True, metadata: dict[str, Any] | None = None) -> Path:
    """A small GGUF file laid out as llama.cpp writes Llama models: Q/K rows permuted for its RoPE, linears in
    Q8_0 when `quantize`, a byte-level BPE tokenizer with ChatML specials and a chat template. `arch` other than
    "llama" writes only the header (for the unsupported-architecture path); `metadata` adds raw keys.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    path = Path(path)
    tokens = [*TINY_GGUF_SPECIALS, *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_block_count(num_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(TINY_GGUF_SPECIALS) + [1] * (len(tokens) - len(TINY_GGUF_SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_GGUF_CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value, _gguf_value_type(value))
    if arch == "llama":
        rng = np.random.default_rng(seed)
        head_dim = hidden // heads

        def rand(*shape: int) -> np.ndarray:
            return (rng.standard_normal(shape) * 0.1).astype(np.float32)

        def permute(x: np.ndarray, n: int) -> np.ndarray:  # HF rotate-half rows -> llama.cpp's interleaved rows
            return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

        def add(name: str, x: np.ndarray, quantized: bool) -> None:
            if quantized and quantize:
                w.add_tensor(name, quants.quantize(x, GGMLQuantizationType.Q8_0),
                             raw_dtype=GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(name, x)

        add("token_embd.weight", rand(len(tokens), hidden), True)
        for i in range(num_layers):
            b = f"blk.{i}."
            add(b + "attn_norm.weight", 1 + rand(hidden), False)
            add(b + "attn_q.weight", permute(rand(heads * head_dim, hidden), heads), True)
            add(b + "attn_k.weight", permute(rand(kv_heads * head_dim, hidden), kv_heads), True)
            add(b + "attn_v.weight", rand(kv_heads * head_dim, hidden), True)
            add(b + "attn_output.weight", rand(hidden, heads * head_dim), True)
            add(b + "ffn_norm.weight", 1 + rand(hidden), False)
            add(b + "ffn_gate.weight", rand(intermediate, hidden), True)
            add(b + "ffn_up.weight", rand(intermediate, hidden), True)
            add(b + "ffn_down.weight", rand(hidden, intermediate), True)
        add("output_norm.weight", 1 + rand(hidden), False)
        if not tied:
            add("output.weight", rand(len(tokens), hidden), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_value_type(value: Any):
    from gguf import GGUFValueType

    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    return GGUFValueType.FLOAT32
