"""Model families (Llama, Mistral, Qwen2/3, Gemma 3, SmolLM3, and the mixtures of experts Qwen-MoE, Mixtral,
gpt-oss, Llama 4) as one decoder with options; no distributed code (attention is injected)."""
from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import MoEConfig, RopeConfig
from cpinfer.model.decoder import (
    MLP,
    Attention,
    AttentionFn,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from cpinfer.model.families import FAMILIES, Family
from cpinfer.model.loader import WeightSlicer, build_model, checkpoint_files, full_tensor, load_model, load_weights
from cpinfer.model.moe import SparseMoE
from cpinfer.model.norms import RMSNorm
from cpinfer.model.random_checkpoint import write_random_checkpoint
from cpinfer.model.reference import ReferenceAttention
from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model
from cpinfer.model.rope import RotaryEmbedding, apply_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "DEFAULT_MODEL_NAME", "FAMILIES", "MLP", "Attention", "AttentionFn", "CausalLM", "DecoderLayer", "DecoderModel",
    "Family", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel", "ModelConfig",
    "MoEConfig", "RMSNorm", "ReferenceAttention", "RopeConfig", "RotaryEmbedding", "SparseMoE", "WeightSlicer",
    "apply_rope", "build_model", "checkpoint_files", "full_tensor", "load_model", "load_weights", "resolve_model",
    "rope_cos_sin", "rope_inv_freq", "write_random_checkpoint",
]
