"""Kimi Linear (KDA + NoPE MLA + DeepSeek-V3 experts) and Nemotron-H (one module per layer: Mamba-2, NoPE attention,
relu^2 MLP, un-gated experts) against transformers, on tiny random checkpoints (decays, dt biases, D, conv
biases, norms and router biases randomised; `checkpoints.TINY_VARIANTS`):

* the model alone: a 300-token forward's log-probs within 1e-4 (several of transformers' KDA / SSD chunks), the
  config read (layer types, block pattern, the recurrence's shape), the checkpoint's own names mapped, bad configs
  refused by name before anything is built.

The engine at CP 1, 2 and 3 (chunked prefill, decode, turn 2 from the state snapshot) runs both families in
`tests/test_hybrid_engine.py`, beside the Gated DeltaNet ones, on that module's pools of ranks."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpinfer import LLM
from cpinfer.model import ModelConfig, ReferenceAttention, load_model
from cpinfer.model.recurrent.kda import KDAShape
from cpinfer.model.recurrent.mamba2 import Mamba2Shape
from cpinfer.model.recurrent.reference import ReferenceRecurrence
from checkpoints import load_hf_model, tiny_config
from recurrent_shards import one_thread  # noqa: F401 (autouse fixture: one torch thread in this process)

pytest.importorskip("transformers")

FAMILIES = ["kimi_linear", "nemotron_h"]


def _forward_logprobs(path, ids: torch.Tensor) -> torch.Tensor:
    config, model = load_model(path)
    rec = ReferenceRecurrence()
    rec.set_batch([0] * len(ids))
    pos = torch.arange(len(ids))
    attn = ReferenceAttention(torch.zeros(len(ids), dtype=torch.long), pos, config=config)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, attn, rec)).log_softmax(-1)


@pytest.mark.parametrize("variant, extra", [("kimi_linear", {}), ("nemotron_h", {}),
                                            ("nemotron_h", {"moe_latent_size": 16})], ids=["kimi", "nemotron", "latent"])
def test_forward_matches_transformers(llama_checkpoint, variant, extra):
    """(Nemotron 3's latent MoE: experts in moe_latent_size, projected in and out.)"""
    path = llama_checkpoint(variant, max_position_embeddings=2048, **extra)
    ids = torch.randint(3, 256, (300,), generator=torch.Generator().manual_seed(1))
    ours = _forward_logprobs(path, ids)
    with torch.no_grad():
        ref = load_hf_model(path)(ids[None], use_cache=False).logits[0].float().log_softmax(-1)
    assert float(ref.exp().max(-1).values.min()) < 0.5  # the tiny model is not trivially confident
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_kimi_linear_config(llama_checkpoint):
    c = ModelConfig.from_pretrained(llama_checkpoint("kimi_linear", max_position_embeddings=2048))
    assert c.layer_types == ("linear_attention", "full_attention") * 2
    assert c.recurrent_layers == (0, 2) and c.attention_layers == (1, 3) and c.hybrid
    assert c.recurrent == KDAShape(hidden_size=64, num_heads=2, head_dim=16, conv_kernel=4, eps=1e-5)
    assert c.mla is not None and c.mla.q_lora_rank == 24 and c.mla.softmax_scale == pytest.approx(16 ** -0.5)
    assert all(c.layer_rope(i) is None for i in range(4))  # NoPE latent attention
    assert c.moe_layers == (1, 2, 3) and c.moe.n_group == 2 and c.moe.score_correction_bias
    assert c.moe.routed_scaling_factor == 1.5 and c.moe.expert_proj_names == ("w1", "w3", "w2")
    assert c.max_position_embeddings == 2048  # config.json says model_max_length


def test_kimi_linear_checkpoint_layout_of_the_hub():
    """The Hub's config.json: linear_attn_config (1-indexed layers), first_k_dense_replace, Kimi's key aliases."""
    d = {"model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 32, "num_experts": 8,
         "num_experts_per_token": 2, "num_shared_experts": 2, "moe_renormalize": False, "num_expert_group": 1,
         "first_k_dense_replace": 2, "mla_use_nope": True, "moe_router_activation_func": "sigmoid",
         "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 2, "head_dim": 8,
                                "short_conv_kernel_size": 3}}
    c = ModelConfig.from_dict(d)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert c.recurrent.conv_kernel == 3 and c.recurrent.num_heads == 2
    assert c.moe_layers == (2, 3) and c.moe.num_experts == 8 and c.moe.top_k == 2
    assert c.moe.shared_intermediate_size == 64 and not c.moe.norm_topk_prob


def test_nemotron_h_config(llama_checkpoint):
    c = ModelConfig.from_pretrained(llama_checkpoint("nemotron_h", max_position_embeddings=2048))
    assert c.layer_types == ("linear_attention", "ffn", "full_attention", "ffn", "linear_attention", "ffn")
    assert c.num_hidden_layers == 6 and c.mixer_blocks and not c.mlp_gated and c.hidden_act == "relu2"
    assert c.recurrent_layers == (0, 4) and c.attention_layers == (2,) and c.moe_layers == (1, 5)
    assert c.recurrent == Mamba2Shape(hidden_size=64, num_heads=4, head_dim=8, n_groups=2, state_size=12,
                                      conv_kernel=4, use_bias=True, chunk_size=32, dt_min=0.001)
    assert not c.moe.gated and c.moe.shared_name == "shared_experts" and c.layer_rope(2) is None
    legacy = {**{k: v for k, v in tiny_config("nemotron_h").items() if k != "layers_block_type"},
              "hybrid_override_pattern": "ME*-ME"}
    assert ModelConfig.from_dict(legacy).layer_types == c.layer_types


def test_checkpoint_names_are_mapped(llama_checkpoint):
    """Nemotron-H's backbone.* (embeddings, norm_f) and per-expert up / down tensors; Kimi Linear's
    block_sparse_moe (dense layers too) and per-expert w1 / w3 / w2: what transformers' save_pretrained writes."""
    for variant, names in (("nemotron_h", ("backbone.embeddings.weight", "backbone.norm_f.weight",
                                           "backbone.layers.1.mixer.experts.3.up_proj.weight")),
                           ("kimi_linear", ("model.layers.0.block_sparse_moe.gate_proj.weight",
                                            "model.layers.1.block_sparse_moe.experts.7.w3.weight",
                                            "model.layers.0.self_attn.q_conv1d.weight"))):
        path = llama_checkpoint(variant, max_position_embeddings=2048)
        assert set(names) <= set(load_file(str(path / "model.safetensors")))
        _, model = load_model(path)  # every parameter found, nothing left over
        assert model.model.layers[0].recurrent


@pytest.mark.parametrize("variant, change, message", [
    ("kimi_linear", {"mla_use_nope": False}, "mla_use_nope=false"),
    ("kimi_linear", {"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ("kimi_linear", {"hidden_act": "gelu"}, "kimi_linear hidden_act"),
    ("kimi_linear", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ("kimi_linear", {"layer_types": ["linear_attention", "sliding_attention"] * 2}, "kimi_linear layer_types"),
    ("nemotron_h", {"moe_latent_size": -4}, "moe_latent_size must be positive"),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "cross_attention"]}, "unknown block type"),
    ("nemotron_h", {"mamba_num_heads": 3}, "mamba_num_heads"),
    ("nemotron_h", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "mlp"]}, "no attention layer"),
    ("nemotron_h", {"mlp_hidden_act": "tanh"}, "hidden_act 'tanh'"),
])
def test_bad_configs_are_refused_by_name(variant, change, message):
    d = {**tiny_config(variant), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


def test_nemotron_h_refused_before_any_rank_starts(llama_checkpoint, tmp_path):
    """A config piece cpinfer cannot build stops `LLM` before it starts a rank."""
    src = llama_checkpoint("nemotron_h", max_position_embeddings=2048)
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mamba_hidden_act": "gelu"}))
    save_file(load_file(str(src / "model.safetensors")), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="nemotron_h mamba_hidden_act 'gelu'"):
        LLM(str(tmp_path), context_parallel_size=2, max_kv_tokens_per_rank=2048)
