"""Tiny checkpoints of every supported family for tests: named config variants, a `transformers`-based writer
(the oracle; both config.json layouts), and tiny GGUF writers (the converter's input, laid out as llama.cpp
writes it: from scratch for Llama, or from a Hugging Face folder of any family). Tests only: what demos and
benchmarks need, the torch-only writer, is in the package (`cpinfer/model/random_checkpoint.py`).

`transformers` is imported lazily, so importing this module does not need it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Shared base: 2 layers, fp32-friendly sizes; each variant overrides a few keys.
TINY_BASE: dict[str, Any] = {
    "model_type": "llama",
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

_LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 64,  # 8 factors for head_dim 16
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
             "long_factor": [1.0, 1.4, 2.0, 3.0, 4.5, 6.0, 8.0, 10.0]}

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
    # RoPE scalings on Llama (head_dim 16, a short original context so that test positions lie past it)
    "linear": {"hidden_size": 128, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "dynamic": {"hidden_size": 128, "max_position_embeddings": 64,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {"hidden_size": 128, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64}},
    "yarn_mscale": {"hidden_size": 128, "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                                         "mscale": 0.8, "mscale_all_dim": 0.5,
                                                         "original_max_position_embeddings": 64}},
    "longrope": {"hidden_size": 128, "max_position_embeddings": 256, "rope_scaling": _LONGROPE},
    "llama_bias": {"attention_bias": True, "mlp_bias": True},
    # the other families
    "mistral": {"model_type": "mistral", "sliding_window": 24, "head_dim": 16},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
    "qwen2_full": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "attention_bias": True,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen3_swa": {"model_type": "qwen3", "head_dim": 16, "use_sliding_window": True, "sliding_window": 16,
                  "max_window_layers": 0},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 16, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
               "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
               "tie_word_embeddings": True, "rope_theta": None,
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # NoPE and mixtures of experts (4 experts of 32, top 2; few layers)
    "smollm3": {"model_type": "smollm3", "head_dim": 16, "no_rope_layer_interval": 2, "use_sliding_window": True,
                "sliding_window": 16, "attention_bias": True, "pad_token_id": 0, "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_hidden_layers": 3, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "mlp_only_layers": [1], "attention_bias": True},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "use_sliding_window": True,
                  "sliding_window": 20, "max_window_layers": 2},
    "mixtral": {"model_type": "mixtral", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 32, "sliding_window": 24},
    "gpt_oss": {"model_type": "gpt_oss", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 32, "sliding_window": 16, "swiglu_limit": 1.0,  # a limit the tests reach
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}},
    "llama4": {"model_type": "llama4_text", "head_dim": 16, "num_hidden_layers": 4, "no_rope_layer_interval": 2,
               "attention_chunk_size": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
               "intermediate_size": 32, "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2,
               "floor_scale": 8, "attn_scale": 0.1, "pad_token_id": 0},
    # MLA (latent 16 + rotary 8 per token; per head nope 8, value 12) over DeepSeek's MoE: 8 experts of 32 in 4
    # groups, 2 groups eligible, top 3, one or two shared experts, layer 0 dense. V3: low-rank queries, attention
    # biases, YaRN with mscale != mscale_all_dim (the softmax correction shows); V2: full-rank queries, softmax
    # group_limited_greedy
    "deepseek_v3": {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 8,
                    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "attention_bias": True,
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                        "mscale": 0.9, "mscale_all_dim": 0.7, "rope_theta": 10000.0}},
    "deepseek_v2": {"model_type": "deepseek_v2", "num_hidden_layers": 3, "num_key_value_heads": 8,
                    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                    "topk_method": "group_limited_greedy", "moe_intermediate_size": 32, "n_shared_experts": 2,
                    "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": False},
    # MiniMax-M2: q/k norms over all heads, partial RoPE (rotary_dim 8 of head_dim 16), 4 experts of 32, top 2,
    # sigmoid routing with the block's correction bias
    "minimax_m2": {"model_type": "minimax_m2", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "intermediate_size": 32, "rotary_dim": 8, "rope_theta": 10000.0},
    # Gemma 4 text, every option on: 6 layers (sliding 16 / global), global heads 32 wide with 1 KV head (keys as
    # values), sliding heads 16 with 2; layers 4-5 reuse the K/V of layers 2-3 (double-wide MLPs); per-layer inputs
    # of 8; 4 experts of 16, top 2, beside each dense MLP; final soft-capping
    "gemma4": {"model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 16,
               "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
               "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 3,
               "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
               "vocab_size_per_layer_input": 256, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
               "moe_intermediate_size": 16, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
               "hidden_activation": "gelu_pytorch_tanh", "rope_theta": None, "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1e6}}},
    # linear-attention hybrids (Gated DeltaNet): 4 layers, linear / full alternating (full_attention_interval 2),
    # partial RoPE (half of head_dim 16), GQA 4:2 in attention and 2 key : 4 value heads in the recurrence
    "qwen3_next": {"model_type": "qwen3_next", "head_dim": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "full_attention_interval": 2, "partial_rotary_factor": 0.5,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                   "mlp_only_layers": [1], "norm_topk_prob": True},
    "qwen3_5": {"model_type": "qwen3_5_text", "head_dim": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
                "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 3},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe_text", "head_dim": 16, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "full_attention_interval": 2,
                    "partial_rotary_factor": 0.5, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    # Kimi Linear: KDA (2 heads of 16, conv kernel 4) / NoPE MLA (low-rank queries, biases) alternating; layer 0
    # dense, then DeepSeek-V3 experts (8 of 32 in 2 groups, 1 group eligible, top 2, one shared expert)
    "kimi_linear": {"model_type": "kimi_linear", "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "attention_bias": True, "linear_num_heads": 2,
                    "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
                    "n_shared_experts": 1, "routed_scaling_factor": 1.5, "pad_token_id": 0, "rope_theta": None,
                    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
    # Nemotron-H: Mamba-2 (4 heads of 8 in 2 groups, state 12, chunks of 32), MoE (4 un-gated experts, top 2, 2
    # groups, a shared expert), NoPE GQA attention, relu^2 MLP; biases on the Mamba projections and the MLPs
    "nemotron_h": {"model_type": "nemotron_h", "num_hidden_layers": None, "rope_theta": None, "rms_norm_eps": None,
                   "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                         "moe"],
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4,
                   "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 12, "conv_kernel": 4, "chunk_size": 32,
                   "use_bias": True, "mlp_bias": True, "layer_norm_epsilon": 1e-5, "n_routed_experts": 4,
                   "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 1.5},
}
# Gemma 4 as released: the multimodal folder (Gemma4ForConditionalGeneration, no vision / audio tower here) whose
# text_config is the "gemma4" variant; its text model's weights under model.language_model.
TINY_VARIANTS["gemma4_folder"] = {**dict.fromkeys(TINY_BASE), "model_type": "gemma4", "tie_word_embeddings": True,
                                  "text_config": {k: v for k, v in {**TINY_BASE, **TINY_VARIANTS["gemma4"]}.items()
                                                  if v is not None}}
# Parameters that transformers initialises to zeros or ones (or leaves constant): tests randomise them.
_RANDOMISED_SUFFIXES = ("norm.weight", ".bias", "_bias", ".sinks", "router.scale", "per_expert_scale")


def tiny_config(variant: str = "gqa", **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for the family's `transformers` config class (also valid `config.json` content)."""
    if variant not in TINY_VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {sorted(TINY_VARIANTS)}")
    d = {**TINY_BASE, **TINY_VARIANTS[variant], **overrides}
    return {k: v for k, v in d.items() if v is not None or k == "q_lora_rank"}  # (None: full-rank MLA queries)


def write_hf_checkpoint(directory: str | Path, variant: str = "gqa", *, seed: int = 0,
                        max_shard_size: str | int | None = None, layout: str = "hf5", **overrides: Any) -> Path:
    """Save a random `transformers` causal LM of the variant's family (fp32) with `save_pretrained`.

    Norm weights and biases get noise on top of HF's init (ones / zeros) so that a mis-mapped or ignored norm or
    bias is caught. layout "hf4" rewrites config.json in the transformers 4.x layout (rope_theta + rope_scaling,
    Gemma's rope_local_base_freq and sliding_window_pattern), which transformers 5 also reads.
    """
    import transformers

    torch.manual_seed(seed)
    kwargs = tiny_config(variant, **overrides)
    model_type = kwargs.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_RANDOMISED_SUFFIXES):
                p.add_(0.1 * torch.randn_like(p))
            elif ".experts." in name or name.endswith(("router.weight", "gate.weight")):  # routers, experts
                p.normal_(0.0, 0.1)
            elif name.endswith("A_log"):  # Gated DeltaNet decays: slow enough that states carry far
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.5).log())
            elif name.endswith(".D"):  # Mamba-2's skip (ones at init)
                p.normal_(1.0, 0.5)
        for name, b in model.named_buffers():  # DeepSeek-V3's selection-only router bias (a buffer there)
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (ones at init)
                b.add_(0.1 * torch.randn_like(b))
    save = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **save)
    if layout == "hf4":
        file = Path(directory) / "config.json"
        file.write_text(json.dumps(legacy_layout(json.loads(file.read_text())), indent=2))
    elif layout != "hf5":
        raise ValueError(f"layout must be 'hf5' or 'hf4', got {layout!r}")
    return Path(directory)


def legacy_layout(d: dict[str, Any]) -> dict[str, Any]:
    """A 5.x config dict in the 4.x layout: `rope_parameters` → `rope_theta` + `rope_scaling` (Gemma 3:
    the global RoPE there, the local theta as `rope_local_base_freq`, and `layer_types` as a window pattern)."""
    d = dict(d)
    params = d.pop("rope_parameters", None) or {}
    if d.get("model_type") == "gemma3_text":
        types = d.pop("layer_types")
        pattern = types.index("full_attention") + 1
        if types != ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(len(types))]:
            raise ValueError("this Gemma 3 layer_types has no 4.x sliding_window_pattern equivalent")
        d["sliding_window_pattern"] = pattern
        d["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    params = dict(params)
    d["rope_theta"] = params.pop("rope_theta", 10000.0)
    type_key = "rope_type" if d.get("model_type") == "gemma3_text" else "type"  # the older alias, where it worked
    d["rope_scaling"] = None if params.get("rope_type", "default") == "default" else {
        (type_key if k == "rope_type" else k): v for k, v in params.items()}
    return d


def load_hf_model(directory: str | Path):
    """The oracle: the family's `transformers` causal LM from `directory`, fp32, eager attention, eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
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


# A SentencePiece ("llama"-type) vocabulary in Gemma's style: specials, the 256 byte-fallback tokens, a few pieces.
TINY_SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
TINY_SPM_PIECES = ("\u2581", "t", "h", "e", "\u2581t", "he", "\u2581the")
TINY_GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + "
                            "m['content'] + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                            "{{ '<start_of_turn>model\\n' }}{% endif %}")
GGUF_TEST_VOCAB = {"bpe": len(TINY_GGUF_SPECIALS) + 256 + 3, "spm": len(TINY_SPM_SPECIALS) + 256 + len(TINY_SPM_PIECES)}


def write_gguf_from_hf(hf_dir: str | Path, path: str | Path, *, quantize: bool = False) -> Path:
    """Write the Hugging Face checkpoint in `hf_dir` (llama, mistral, qwen2, qwen3, gemma3_text) as a GGUF file laid
    out the way llama.cpp's converter writes it: its architecture and metadata keys, Q/K rows permuted for
    Llama-style models, Gemma's norms stored as 1 + w, linears in Q8_0 when `quantize` (else F32), and a tokenizer
    with a chat template — byte-level BPE (ChatML) for Llama / Qwen, SentencePiece for Gemma — whose vocabulary
    size must equal the checkpoint's (`GGUF_TEST_VOCAB`). Gemma's query scale is written as `attention.scale`
    only when it is not llama.cpp's default (1/sqrt(head_dim))."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
    from safetensors.numpy import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}[
        model_type]
    from cpinfer.model.config import ModelConfig

    c = ModelConfig.from_dict(cfg)
    sd = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(str(file)))
    w = GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    full = c.rope["full_attention"]
    w.add_rope_freq_base(full.theta)
    if full.rope_type in ("linear", "yarn"):
        w.add_rope_scaling_type(RopeScalingType(full.rope_type))
        w.add_rope_scaling_factor(full.factor)
        if full.rope_type == "yarn":
            w.add_rope_scaling_orig_ctx_len(full.original_max_position_embeddings)
    elif full.rope_type not in ("default", "llama3"):
        raise ValueError(f"no GGUF layout for {full.rope_type} RoPE here")
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        w.add_rope_freq_base_swa(c.rope["sliding_attention"].theta)
        if c.query_pre_attn_scalar != c.head_dim:
            w.add_attention_scale(c.query_pre_attn_scalar ** -0.5)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    spm = arch == "gemma3"
    if spm:
        specials = list(TINY_SPM_SPECIALS)
        tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *TINY_SPM_PIECES]
        types = [3] * len(specials) + [6] * 256 + [1] * len(TINY_SPM_PIECES)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * (len(specials) + 256) + [-float(i) for i in range(len(TINY_SPM_PIECES))])
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_chat_template(TINY_GEMMA_CHAT_TEMPLATE)
    else:
        tokens = [*TINY_GGUF_SPECIALS, *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(TINY_GGUF_SPECIALS) + [1] * (len(tokens) - len(TINY_GGUF_SPECIALS)))
        w.add_token_merges(["Ġ t", "h e", "Ġt he"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(TINY_GGUF_CHAT_TEMPLATE)
    if len(tokens) != c.vocab_size:
        raise ValueError(f"the test tokenizer has {len(tokens)} tokens but the checkpoint's vocab_size is "
                         f"{c.vocab_size}; write the checkpoint with vocab_size={len(tokens)}")
    w.add_vocab_size(len(tokens))

    def permute(x: np.ndarray, n: int) -> np.ndarray:  # HF rotate-half rows -> llama.cpp's interleaved rows
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "post_attention_layernorm": "post_attention_norm" if spm else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if full.rope_type == "llama3":  # as llama.cpp's converter: each frequency's divisor in a rope_freqs tensor
        import math

        inv = 1.0 / full.theta ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim)
        old = full.original_max_position_embeddings
        lo, hi = old / full.low_freq_factor, old / full.high_freq_factor
        factors = []
        for freq in inv:
            wavelen = 2 * math.pi / freq
            smooth = (old / wavelen - full.low_freq_factor) / (full.high_freq_factor - full.low_freq_factor)
            factors.append(1.0 if wavelen < hi else full.factor if wavelen > lo
                           else 1 / ((1 - smooth) / full.factor + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    for name, x in sd.items():
        x = np.ascontiguousarray(x, dtype=np.float32)
        if name in top:
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            out = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                x = permute(x, c.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                x = permute(x, c.num_key_value_heads)
        if spm and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if quantize and x.ndim == 2 and "norm" not in name:
            w.add_tensor(out, quants.quantize(x, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(out, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
