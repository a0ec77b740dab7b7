"""Llama-3 model family (no distributed code: attention is injected)."""
from cpinfer.model.config import Llama3RopeScaling, ModelConfig
from cpinfer.model.llama import (
    AttentionFn,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
)
from cpinfer.model.loader import WeightSlicer, build_model, checkpoint_files, full_tensor, load_model, load_weights
from cpinfer.model.random_checkpoint import write_random_checkpoint
from cpinfer.model.reference import ReferenceAttention
from cpinfer.model.resolve import DEFAULT_MODEL_NAME, resolve_model
from cpinfer.model.rope import RotaryEmbedding, apply_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "DEFAULT_MODEL_NAME", "AttentionFn", "Llama3RopeScaling", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP",
    "LlamaModel", "ModelConfig", "RMSNorm", "ReferenceAttention", "RotaryEmbedding", "WeightSlicer",
    "apply_rope", "build_model", "checkpoint_files", "full_tensor", "load_model", "load_weights",
    "resolve_model", "rope_cos_sin", "rope_inv_freq", "write_random_checkpoint",
]
