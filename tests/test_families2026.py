"""The 2026 families that need no new mechanism under CP (issue 48, must 6): MiniMax-M2 and Gemma 4 text. Their
pieces against transformers' own (partial and proportional RoPE, the routers), the config reading and every
refusal (before any rank starts); end-to-end exactness at CP 1-3 is in tests/test_families.py (FAMILY_VARIANTS)."""
import pytest
import torch

from checkpoints import tiny_config, write_hf_checkpoint
from cpinfer import LLM
from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import RopeConfig
from cpinfer.model.families import config_kwargs
from cpinfer.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

transformers = pytest.importorskip("transformers")


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank fails the test: the refusals must come before any rank starts."""
    def refuse(*_a, **_k):
        raise AssertionError("a rank was started")
    for name in ("WorkerPool", "InProcessWorld", "JoinedWorld"):
        monkeypatch.setattr(f"cpinfer.engine.startup.{name}", refuse)


# ---------------------------------------------------------------- RoPE pieces against transformers

def test_partial_rope_matches_transformers_minimax_m2():
    """rotary_dim 8 of head_dim 16: the first 8 channels rotate as a head of 8 (frequencies over 8), the rest pass."""
    from transformers.models.minimax_m2 import modeling_minimax_m2 as hf

    d = tiny_config("minimax_m2")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    cfg = ModelConfig(**config_kwargs({**d, "model_type": "minimax_m2"}))
    rope = cfg.rope["full_attention"]
    assert rope.partial_rotary_factor == 0.5
    pos = torch.arange(0, 300, 7)
    x = torch.randn(len(pos), 3, 16)
    inv, scale = rope_inv_freq(16, rope)
    cos, sin = rope_cos_sin(inv, pos, scale)
    hf_cos, hf_sin = hf.MiniMaxM2RotaryEmbedding(hf_cfg)(x, pos[None])
    want, _ = hf.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(apply_rope(x, cos, sin)[..., 8:], x[..., 8:])


def test_proportional_rope_matches_transformers():
    """Gemma 4's global layers: the full head's frequencies on the first f * D / 2 pairs, none after."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.AutoConfig.for_model("gemma4_text", head_dim=16, global_head_dim=32, num_hidden_layers=2,
                                               layer_types=["sliding_attention", "full_attention"])
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf_cfg, layer_type="full_attention")
    got, scale = rope_inv_freq(32, RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25))
    assert scale == 1.0 and got.shape == (16,)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert (got[4:] == 0).all() and (got[:4] > 0).all()


# ---------------------------------------------------------------- MiniMax-M2

def _minimax(**over) -> dict:
    """The released MiniMax-M2 config.json's keys at a small size."""
    return {"model_type": "minimax_m2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rotary_dim": 8, "rope_theta": 5000000, "num_local_experts": 8, "num_experts_per_tok": 2,
            "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
            "num_mtp_modules": 3, "mtp_transformer_layers": 1, **over}


def test_minimax_m2_config_reading():
    c = ModelConfig(**config_kwargs(_minimax()))
    assert c.qk_norm and c.qk_norm_all_heads and c.mlp_module == "block_sparse_moe" and c.moe_layers == (0, 1, 2)
    assert c.rope["full_attention"] == RopeConfig(theta=5e6, partial_rotary_factor=0.5)
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.scoring, m.norm_topk_prob) == (8, 2, 16, "sigmoid", True)
    assert m.score_correction_bias and m.correction_bias_on_block and m.expert_proj_names == ("w1", "w3", "w2")
    assert c.tensor_parallel_refusal and "every attention head" in c.tensor_parallel_refusal


@pytest.mark.parametrize("bad, message", [
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
    ({"use_qk_norm": False}, "use_qk_norm=False"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"use_routing_bias": False}, "use_routing_bias=False"),
    ({"routed_scaling_factor": 2.0}, "routed_scaling_factor=2.0"),
])
def test_minimax_m2_refusals_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**config_kwargs(_minimax(**bad)))


def test_minimax_m2_router_matches_transformers():
    """Sigmoid scores, top-k of scores + the block's correction bias, weights the unbiased scores renormalised."""
    from transformers.models.minimax_m2 import modeling_minimax_m2 as hf

    from cpinfer.model.moe import Router

    d = _minimax()
    hf_cfg = transformers.AutoConfig.for_model("minimax_m2", **{k: v for k, v in d.items() if k != "model_type"})
    cfg = ModelConfig(**config_kwargs(d))
    ref = hf.MiniMaxM2TopKRouter(hf_cfg)
    torch.nn.init.normal_(ref.weight)
    bias = 0.3 * torch.randn(8)
    ours = Router(32, cfg.moe)
    assert ours.e_score_correction_bias is None  # the block holds it
    ours.weight = torch.nn.Parameter(ref.weight.detach().clone())
    x = torch.randn(50, 32)
    _, want_w, want_i = ref(x, bias)
    got_w, got_i = ours(x, bias)
    order_w, order_g = want_i.sort(-1), got_i.sort(-1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))
    _, unbiased = ours(x, torch.zeros(8))
    assert not torch.equal(unbiased.sort(-1).values, got_i.sort(-1).values)  # the bias changes some choices


def test_minimax_m2_mtp_layers_skipped_and_tp_refused_before_any_rank(tmp_path, no_ranks):
    """A checkpoint's multi-token-prediction layers (past num_hidden_layers) are not loaded; TP 2 is refused before
    any rank starts, naming the reason (the q/k norm spans every head)."""
    from safetensors.torch import load_file, save_file

    from cpinfer.model import load_model

    path = write_hf_checkpoint(tmp_path / "m2", "minimax_m2")
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(file), metadata={"format": "pt"})
    load_model(str(path))
    with pytest.raises(ValueError, match="tensor_parallel_size 2 is not supported for model_type 'minimax_m2': its "
                                         "q/k RMSNorm spans every attention head"):
        LLM(str(path), tensor_parallel_size=2)
