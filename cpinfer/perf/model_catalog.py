"""Built-in model shapes for `cpinfer plan`: the paper's Llama3-405B (§4.1, App. A Table 6) and the long-context
members of the families cpinfer serves (Llama 3.1, Qwen2.5 incl. 1M, Qwen3, Mistral Small 3.1, Gemma 3, and the
mixtures of experts Qwen3-MoE, gpt-oss, Llama 4 Scout, Mixtral: total parameters for memory, active for FLOPs;
DeepSeek-V3 and Kimi K2 with multi-head latent attention: a 576-value latent per token in the KV cache; DeepSeek-V3.2
with sparse attention on top: a 128-value indexer key more per token and layer; the linear-attention hybrids
Qwen3.5-397B-A17B, Qwen3-Next and Kimi Linear: K/V on their attention layers only, a fixed-size recurrent state per
request on the others).

Every number is the published Hugging Face `config.json` of the checkpoint named in its `source` (text part of the
multimodal ones); windows follow the config's layer layout (Gemma 3: 5 local layers of 1024 keys per global one).
"""
from __future__ import annotations

from cpinfer.perf.model_spec import ModelSpec


def _hf(repo: str, extra: str = "") -> str:
    return f"published config.json of huggingface.co/{repo}" + (f"; {extra}" if extra else "")


_LLAMA = "llama3 RoPE scaling to 131072 positions"
_QWEN25 = "use_sliding_window false (its sliding_window field is inactive)"
_QWEN3 = ("use_sliding_window false; max_position_embeddings 40960 (the model card: 32768 native, 131072 with "
          "YaRN factor 4 in rope_scaling)")


def _gemma3_windowed(layers: int) -> int:  # sliding_window_pattern 6: every 6th layer global, the rest local
    return sum(bool((i + 1) % 6) for i in range(layers))


_SPECS = (
    # name, layers, hidden, heads, kv heads, head_dim, ffn, vocab, tied, window, windowed layers, context, source
    ("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 0, 0, 131072,
     _hf("meta-llama/Llama-3.1-8B", _LLAMA)),
    ("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256, False, 0, 0, 131072,
     _hf("meta-llama/Llama-3.1-70B", _LLAMA)),
    ("llama3-405b", 126, 16384, 128, 8, 128, 53248, 128256, False, 0, 0, 131072,
     _hf("meta-llama/Llama-3.1-405B", "paper App. A Table 6")),
    ("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, 0, 0, 131072,
     _hf("Qwen/Qwen2.5-7B", _QWEN25)),
    ("qwen2.5-7b-1m", 28, 3584, 28, 4, 128, 18944, 152064, False, 0, 0, 1010000,
     _hf("Qwen/Qwen2.5-7B-Instruct-1M", _QWEN25 + "; rope_theta 1e7")),
    ("qwen2.5-14b-1m", 48, 5120, 40, 8, 128, 13824, 152064, False, 0, 0, 1010000,
     _hf("Qwen/Qwen2.5-14B-Instruct-1M", "the Qwen2.5-14B shapes; " + _QWEN25 + "; rope_theta 1e7")),
    ("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, False, 0, 0, 40960,
     _hf("Qwen/Qwen3-8B", _QWEN3)),
    ("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, False, 0, 0, 40960,
     _hf("Qwen/Qwen3-32B", "head_dim 128 x 64 heads = 8192 > hidden 5120; " + _QWEN3)),
    ("mistral-small-3.1-24b", 40, 5120, 32, 8, 128, 32768, 131072, False, 0, 0, 131072,
     _hf("mistralai/Mistral-Small-3.1-24B-Instruct-2503", "text_config; sliding_window null")),
    ("gemma-3-12b", 48, 3840, 16, 8, 256, 15360, 262208, True, 1024, _gemma3_windowed(48), 131072,
     _hf("google/gemma-3-12b-it", "text_config; sliding_window 1024, sliding_window_pattern 6 (40 local + 8 "
         "global layers); tied embeddings (Gemma3TextConfig default)")),
    ("gemma-3-27b", 62, 5376, 32, 16, 128, 21504, 262208, True, 1024, _gemma3_windowed(62), 131072,
     _hf("google/gemma-3-27b-it", "text_config; sliding_window 1024, sliding_window_pattern 6 (52 local + 10 "
         "global layers); tied embeddings (Gemma3TextConfig default)")),
)

MODELS = {name: ModelSpec(name, layers, hidden, heads, kv, hd, ffn, vocab, tied, source, window, windowed, ctx)
          for name, layers, hidden, heads, kv, hd, ffn, vocab, tied, window, windowed, ctx, source in _SPECS}


def _moe(name: str, layers: int, hidden: int, heads: int, kv: int, head_dim: int, ffn: int, vocab: int, ctx: int,
         experts: int, k: int, expert_ffn: int, source: str, **extra) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, kv, head_dim, ffn, vocab, max_context=ctx, n_experts=experts,
                     experts_per_tok=k, expert_ffn_dim=expert_ffn, moe_layers=extra.pop("moe_layers", layers),
                     source=source, **extra)


_GPT_OSS = ("layer_types alternate sliding_attention (window 128) / full_attention; YaRN factor 32 over 4096; "
            "attention sinks; unquantized weights (the published experts are MXFP4)")
MOE_MODELS = (
    _moe("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, 40960, 128, 8, 768,
         _hf("Qwen/Qwen3-30B-A3B", "moe_intermediate_size 768, 128 experts, top 8, decoder_sparse_step 1; " + _QWEN3)),
    _moe("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 151936, 40960, 128, 8, 1536,
         _hf("Qwen/Qwen3-235B-A22B", "moe_intermediate_size 1536, 128 experts, top 8; " + _QWEN3)),
    _moe("gpt-oss-20b", 24, 2880, 64, 8, 64, 2880, 201088, 131072, 32, 4, 2880,
         _hf("openai/gpt-oss-20b", "32 experts, top 4; " + _GPT_OSS), window=128, window_layers=12),
    _moe("gpt-oss-120b", 36, 2880, 64, 8, 64, 2880, 201088, 131072, 128, 4, 2880,
         _hf("openai/gpt-oss-120b", "128 experts, top 4; " + _GPT_OSS), window=128, window_layers=18),
    _moe("llama-4-scout", 48, 5120, 40, 8, 128, 16384, 202048, 10485760, 16, 1, 8192,
         _hf("meta-llama/Llama-4-Scout-17B-16E", "text_config: 16 experts, top 1, plus a shared expert of 8192; "
             "attention_chunk_size 8192 on the 36 RoPE layers, every 4th layer NoPE and global"),
         shared_ffn_dim=8192, window=8192, window_layers=36, local="chunked"),
    _moe("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768, 8, 2, 14336,
         _hf("mistralai/Mixtral-8x7B-v0.1", "8 experts, top 2; sliding_window null (every layer full)")),
)
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536,
            router_bias=True)
_MLA_NOTE = ("MLA: kv_lora_rank 512 + qk_rope_head_dim 64 cached once per token (one latent KV head), q_lora_rank "
             "1536, qk_nope_head_dim 128, v_head_dim 128")
MLA_MODELS = (  # head_dim 576: the absorbed attention's width (latent + rotary key); 1 KV head
    _moe("deepseek-v3", 61, 7168, 128, 1, 576, 18432, 129280, 163840, 256, 8, 2048,
         _hf("deepseek-ai/DeepSeek-V3", _MLA_NOTE + "; 256 routed experts of 2048, top 8, 1 shared, first 3 layers "
             "dense; YaRN factor 40 over 4096 (the MTP layer is not counted)"),
         moe_layers=58, shared_ffn_dim=2048, **_MLA),
    _moe("deepseek-v3.2", 61, 7168, 128, 1, 576, 18432, 129280, 163840, 256, 8, 2048,
         _hf("deepseek-ai/DeepSeek-V3.2", _MLA_NOTE + "; DeepSeek sparse attention: a lightning indexer of 64 heads x "
             "128 per layer (index_n_heads, index_head_dim), top-2048 keys per query (index_topk), its key cached "
             "beside the latent; routing, experts and YaRN as DeepSeek-V3"),
         moe_layers=58, shared_ffn_dim=2048, index_heads=64, index_dim=128, index_topk=2048, **_MLA),
    _moe("kimi-k2", 61, 7168, 64, 1, 576, 18432, 163840, 131072, 384, 8, 2048,
         _hf("moonshotai/Kimi-K2-Instruct", _MLA_NOTE + "; 64 heads; 384 routed experts of 2048, top 8, 1 shared, "
             "first layer dense"),
         moe_layers=60, shared_ffn_dim=2048, **_MLA),
)
_GDN_NOTE = ("Gated DeltaNet on 3 of every 4 layers (full_attention_interval 4): {lk} key / {lv} value heads of "
             "128, conv kernel 4 (linear_conv_kernel_dim, transformers' default); gated attention (q_proj doubled "
             "into a sigmoid output gate) {h} heads / {kv} KV heads of 256, partial RoPE 0.25")
HYBRID_MODELS = (  # linear-attention hybrids: K/V on the attention layers only, a fixed-size state per request
    _moe("qwen3.5-397b-a17b", 60, 4096, 32, 2, 256, 1024, 248320, 262144, 512, 10, 1024,
         "the public model card of huggingface.co/Qwen/Qwen3.5-397B-A17B (text part): 60 layers = 15 x (3 x "
         "(Gated DeltaNet -> MoE), 1 x (Gated Attention -> MoE)), hidden 4096, vocab 248320 (padded); Gated "
         "DeltaNet 64 value heads / 16 query-key heads of 128; gated attention 32 query / 2 KV heads of 256, "
         "rotary 64 (partial 0.25); 512 experts of 1024, 10 routed + 1 shared; context 262144 native (the card: "
         "up to 1,010,000 with YaRN); conv kernel 4 and the 3:1 layout from transformers' Qwen3_5MoeTextConfig "
         "defaults (linear_conv_kernel_dim 4, full_attention_interval 4); the MTP layer is not counted",
         shared_ffn_dim=1024, linear_layers=45, linear_kind="gdn", linear_k_heads=16, linear_v_heads=64,
         linear_k_dim=128, linear_v_dim=128, linear_conv=4, attn_output_gate=True),
    _moe("qwen3-next-80b-a3b", 48, 2048, 16, 2, 256, 5120, 151936, 262144, 512, 10, 512,
         _hf("Qwen/Qwen3-Next-80B-A3B-Instruct", _GDN_NOTE.format(lk=16, lv=32, h=16, kv=2) +
             "; 512 experts of 512, top 10, a shared expert of 512 (the MTP layer is not counted)"),
         shared_ffn_dim=512, linear_layers=36, linear_kind="gdn", linear_k_heads=16, linear_v_heads=32,
         linear_k_dim=128, linear_v_dim=128, linear_conv=4, attn_output_gate=True),
    _moe("kimi-linear-48b-a3b", 27, 2304, 32, 1, 576, 9216, 163840, 1048576, 256, 8, 1024,
         _hf("moonshotai/Kimi-Linear-48B-A3B-Instruct", "linear_attn_config: KDA on 20 layers (kda_layers), NoPE "
             "MLA on 7 (full_attn_layers 4, 8, ..., 24, 27), KDA 32 heads of 128, short_conv_kernel_size 4; " +
             _MLA_NOTE.replace("q_lora_rank 1536, ", "full-rank queries, ") +
             "; 256 experts of 1024, top 8, 1 shared, first layer dense (intermediate 9216); model_max_length "
             "1048576"),
         moe_layers=26, shared_ffn_dim=1024, **{**_MLA, "q_lora_rank": 0, "router_bias": True},
         linear_layers=20, linear_kind="kda", linear_k_heads=32, linear_v_heads=32, linear_k_dim=128,
         linear_v_dim=128, linear_conv=4),
)
MODELS.update({m.name: m for m in MOE_MODELS + MLA_MODELS + HYBRID_MODELS})
ALIASES = {"llama-3.1-8b": "llama3-8b", "llama-3.1-70b": "llama3-70b", "llama-3.1-405b": "llama3-405b",
           "mistral-small": "mistral-small-3.1-24b", "llama-4-scout-17b-16e": "llama-4-scout",
           "deepseek-r1": "deepseek-v3", "kimi-k2-instruct": "kimi-k2", "qwen3.5-397b": "qwen3.5-397b-a17b",
           "qwen3-next-80b": "qwen3-next-80b-a3b", "kimi-linear": "kimi-linear-48b-a3b",
           "deepseek-v3.2-exp": "deepseek-v3.2"}
MODELS.update({alias: MODELS[name] for alias, name in ALIASES.items()})
