"""The hybrid (Gated DeltaNet) families as models, against transformers: Qwen3-Next (in_proj_qkvz / in_proj_ba,
sparse layers with a gated shared expert, a dense layer between), Qwen3.5 (split projections, dense MLPs, conv
kernel 3) and Qwen3.5-MoE, on tiny random checkpoints with randomised norms, dt_bias, A_log (slow decays) and
conv weights: a 300-token forward's log-probs within 1e-4, the config read (layer types, partial RoPE, the
recurrence's shape), a multimodal Qwen3.5 folder read as its text model, and bad configs refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpinfer.model import ModelConfig, ReferenceAttention, load_model
from cpinfer.model.recurrent.gdn import GDNConfig
from cpinfer.model.recurrent.reference import ReferenceRecurrence
from checkpoints import TINY_VARIANTS, load_hf_model, tiny_config

pytest.importorskip("transformers")

HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _forward_logprobs(path, ids: torch.Tensor) -> torch.Tensor:
    config, model = load_model(path)
    rec = ReferenceRecurrence()
    rec.set_batch([0] * len(ids))
    pos = torch.arange(len(ids))
    attn = ReferenceAttention(torch.zeros(len(ids), dtype=torch.long), pos, config=config)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, attn, rec)).log_softmax(-1)


@pytest.mark.parametrize("variant", HYBRIDS)
def test_forward_matches_transformers(llama_checkpoint, variant):
    path = llama_checkpoint(variant)
    ids = torch.randint(3, 256, (300,), generator=torch.Generator().manual_seed(1))
    ours = _forward_logprobs(path, ids)
    with torch.no_grad():
        ref = load_hf_model(path)(ids[None], use_cache=False).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_config_reads_layer_types_partial_rope_and_the_recurrence(llama_checkpoint):
    c = ModelConfig.from_pretrained(llama_checkpoint("qwen3_next"))
    assert c.layer_types == ("linear_attention", "full_attention") * 2  # full_attention_interval 2
    assert c.recurrent_layers == (0, 2) and c.attention_layers == (1, 3) and c.hybrid
    assert c.rotary_dim == 8 and c.layer_rope_dim(1) == 8 and c.attn_output_gate and c.qk_norm and c.norm_style == "gemma"
    assert c.recurrent == GDNConfig(2, 4, 8, 8, 4, "qkvz")
    assert c.moe_layers == (0, 2, 3) and c.moe.shared_expert_gate and c.moe.norm_topk_prob  # mlp_only_layers [1]
    c5 = ModelConfig.from_pretrained(llama_checkpoint("qwen3_5"))
    assert c5.recurrent == GDNConfig(2, 4, 8, 8, 3, "split") and not c5.moe_layers
    moe = ModelConfig.from_pretrained(llama_checkpoint("qwen3_5_moe"))
    assert moe.moe_layers == (0, 1, 2, 3) and moe.moe.norm_topk_prob
    assert c.layer_rope(0) is None and c.layer_rope(1) is not None


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "unsupported layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"hidden_act": "gelu"}, "conv activation"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types has 2 entries"),
])
def test_bad_hybrid_configs_are_refused_by_name(change, message):
    d = {**tiny_config("qwen3_5"), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)


def test_multimodal_qwen3_5_folder_loads_its_text_model(llama_checkpoint, tmp_path):
    """A Qwen3.5 folder as the Hub ships it (model_type qwen3_5, text_config nested, weights under
    model.language_model, a vision tower and an MTP head beside): the same model as its text checkpoint."""
    text = llama_checkpoint("qwen3_5")
    cfg = json.loads((text / "config.json").read_text())
    folder = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": cfg,
              "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(folder))
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in load_file(str(text / "model.safetensors")).items()}
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    sd["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2))
    assert ModelConfig.from_pretrained(tmp_path).model_type == "qwen3_5"
    assert torch.equal(_forward_logprobs(tmp_path, ids), _forward_logprobs(text, ids))


def test_tiny_variants_are_hybrids():
    for v in HYBRIDS:
        assert ModelConfig.from_dict(tiny_config(v)).hybrid, v
    assert set(HYBRIDS) <= set(TINY_VARIANTS)
