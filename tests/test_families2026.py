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
            "num_mtp_modules": 3, "mtp_transformer_layers": 1, "attn_type_list": [1, 1, 1], **over}


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
    ({"attn_type_list": [1, 0, 1]}, r"attn_type_list=\[1, 0, 1\] is not supported"),
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


# ---------------------------------------------------------------- Gemma 4

def _gemma4(**over) -> dict:
    """A Gemma 4 text config.json as the Hub writes it (global_head_dim / num_global_key_value_heads), small."""
    return {"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
            + ["sliding_attention"], "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
            "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 64, **over}


def test_gemma4_config_reading():
    """The last layer is forced global (as transformers does); global layers take global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads; the cache holds the widest; layers 3-5 share the K/V of the last
    earlier layer of their type (sliding: 1, global: 2) and get double-wide MLPs."""
    c = ModelConfig(**config_kwargs(_gemma4()))
    assert c.layer_types[-1] == "full_attention" and c.layer_types[2] == "full_attention"
    assert c.layer_head_dims == (8, 8, 16, 8, 8, 16) and c.layer_kv_heads == (2, 2, 1, 2, 2, 1)
    assert (c.head_dim, c.num_key_value_heads, c.padded_heads) == (16, 2, True)
    assert c.kv_source_layers == (0, 1, 2, 1, 1, 2) and c.layer_intermediate_sizes == (16, 16, 16, 32, 32, 32)
    assert c.k_eq_v_layers == (2, 5) and c.value_norm and c.layer_scalar and c.attention_scale == 1.0
    assert (c.per_layer_input_size, c.per_layer_vocab_size) == (4, 64) and not c.moe_beside_mlp
    assert c.rope["full_attention"] == RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25)
    assert c.rope["sliding_attention"] == RopeConfig(theta=1e4) and c.norm_style == "fp32" and c.tie_word_embeddings
    assert "Gemma 4" in c.tensor_parallel_refusal
    plain = ModelConfig(**config_kwargs(_gemma4(attention_k_eq_v=False, num_kv_shared_layers=0,
                                                hidden_size_per_layer_input=0)))
    assert plain.layer_kv_heads == (2,) * 6 and not plain.k_eq_v_layers and not plain.kv_source_layers
    assert not plain.layer_intermediate_sizes and not plain.per_layer_input_size


@pytest.mark.parametrize("bad, message", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers=6: cpinfer supports 0 to num_hidden_layers - 1"),
    ({"num_kv_shared_layers": 4}, r"no earlier layer of type \['full_attention'\]"),
    ({"per_layer_config": {"2": {"intermediate_size": 8}}},
     r"per_layer_config\['2'\] overrides \['intermediate_size'"),
    ({"per_layer_config": {"full_attention": {"head_dim": 8}}}, "per_layer_config key 'full_attention'"),
    ({"global_head_dim": 7}, "layer 2: head size 7 must be even"),
    ({"num_key_value_heads": 4, "num_global_key_value_heads": 3},
     r"layer 2: 3 KV heads must divide num_key_value_heads \(4\)"),
    ({"rope_parameters": {"full_attention": {"rope_type": "llama4", "rope_theta": 1e6}}}, "unsupported rope type"),
])
def test_gemma4_refusals_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**config_kwargs(_gemma4(**bad)))


def test_gemma4_router_matches_transformers():
    """RMS-normed input times its scale / sqrt(hidden), softmax, top k renormalised, times the expert's scale."""
    from transformers.models.gemma4 import modeling_gemma4 as hf

    from cpinfer.model.gemma4 import Gemma4Router

    d = _gemma4(enable_moe_block=True, num_experts=6, top_k_experts=3, moe_intermediate_size=8)
    cfg = ModelConfig(**config_kwargs(d))
    hf_cfg = transformers.AutoConfig.for_model("gemma4_text", **{k: v for k, v in d.items() if k != "model_type"})
    ref = hf.Gemma4TextRouter(hf_cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(1.0, 0.3)
    ours = Gemma4Router(32, cfg.moe, cfg.rms_norm_eps)
    ours.load_state_dict(ref.state_dict())
    x = 3 * torch.randn(40, 32)
    _, want_w, want_i = ref(x)
    got_w, got_i = ours(x)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)


def test_gemma4_tp_refused_before_any_rank_and_shared_kv_weights_skipped(tmp_path, no_ranks):
    """TP 2 is refused before any rank starts; the K/V weights a checkpoint may still hold for a KV-sharing layer
    are not loaded (transformers skips them too), any other unexpected tensor still fails."""
    from safetensors.torch import load_file, save_file

    from cpinfer.model import load_model

    path = write_hf_checkpoint(tmp_path / "g4", "gemma4")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 is not supported for model_type 'gemma4_text': "
                                         "Gemma 4's per-layer head sizes"):
        LLM(str(path), tensor_parallel_size=2)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["model.layers.4.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # layer 4 reuses layer 2's K/V
    tensors["model.layers.5.self_attn.v_norm.weight"] = torch.zeros(32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    load_model(str(path))
    tensors["model.layers.2.self_attn.v_norm.weight"] = torch.zeros(16)  # layer 2 has its own K/V: no such weight
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(str(path))


def test_gemma4_released_multimodal_folder_serves_its_text_model(llama_checkpoint):
    """A `gemma4` folder (Gemma4ForConditionalGeneration: text_config nested, the text weights under
    model.language_model.) reads as the text family and answers as transformers' multimodal model on text: prompt
    log-probs within 1e-4, greedy tokens equal, a second turn from the cache (CP 1; the CP paths are the text
    family's, tests/test_families.py)."""
    from cpinfer import SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("gemma4_folder", max_position_embeddings=2048)
    text = ModelConfig(**config_kwargs(tiny_config("gemma4")))
    folder = ModelConfig.from_pretrained(path)
    assert folder.weights_prefix == "model.language_model." and folder.model_type == "gemma4_text"
    assert folder.layer_head_dims == text.layer_head_dims and folder.kv_source_layers == text.kv_source_layers
    greedy = dict(temperature=0.0, logprobs=True, ignore_eos=True)
    with LLM(str(path), threads_per_rank=1, max_num_batched_tokens=48, max_kv_tokens_per_rank=2048) as llm:
        prompts = prompts_for(256, [5, 90], seed=3)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, prompt_logprobs=True, **greedy))
        check_against_hf(path, outs, prompts, 6)
        turn2 = [p + o.token_ids + [7, 8] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=5, **greedy))
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 5 for p in prompts]
        check_against_hf(path, outs2, turn2, 5, check_prompt_lp=False)


@pytest.fixture(scope="module")
def engines():
    from pooled_engine import shard_engines

    yield from shard_engines()


GEMMA4_ROW = 6 * 2 * 2 * 32 * 4  # the gemma4 variant's cache row: 6 layers x 2 KV heads x (K + V) x 32 channels fp32


def test_gemma4_kv_sharing_and_padded_rows_through_the_tiers_and_a_restart(llama_checkpoint, engines, tmp_path):
    """CP 2 with a device cache of about one conversation: histories go to the host pool and to disk (every layer's
    padded rows, the sharing layers' copies of their sources' K/V included), come back exact; a CP 1 engine restarted
    on the same directory reads them (re-placed) and answers as transformers."""
    from cpinfer import SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("gemma4", max_position_embeddings=2048)
    greedy = dict(temperature=0.0, logprobs=True, ignore_eos=True)
    kw = dict(kv_disk_dir=tmp_path / "kv", max_num_batched_tokens=96)
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=4))]
    with engines(path, 2, max_kv_tokens_per_rank=192, kv_host_gib=128 * GEMMA4_ROW / (1 << 30), **kw) as llm:
        first = []
        for d in docs:  # one at a time: each pushes the one before down a tier
            first += llm.generate([d], SamplingParams(max_tokens=6, **greedy))
        check_against_hf(path, first, docs, 6, check_prompt_lp=False)
        turn2 = [d + o.token_ids + [5, 6] for d, o in zip(docs, first)]
        outs = [llm.generate([t], SamplingParams(max_tokens=6, **greedy))[0] for t in turn2[::-1]]
        check_against_hf(path, outs, turn2[::-1], 6, check_prompt_lp=False)
        assert [o.num_cached_tokens for o in outs] == [len(d) + 5 for d in docs[::-1]]
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] > 0 and t["disk"]["hit_tokens"] > 0, t
        assert t["device"]["bytes"] == t["device"]["tokens"] * GEMMA4_ROW
    with engines(path, 1, max_kv_tokens_per_rank=2048, **kw) as llm:
        out = llm.generate([turn2[0] + [9]], SamplingParams(max_tokens=6, **greedy))
        check_against_hf(path, out, [turn2[0] + [9]], 6, check_prompt_lp=False)
        assert out[0].num_cached_tokens >= len(docs[0]) + 5


def test_gemma4_speculative_decoding_keeps_transformers_greedy_tokens(llama_checkpoint, engines):
    """Prompt-lookup speculation at CP 2 on Gemma 4: every verify step writes the drafts' K/V into every layer (the
    sharing layers' copies included) and rolls the rejected ones back; the tokens stay transformers' greedy ones."""
    import numpy as np

    from cpinfer import SamplingParams
    from hf_oracle import check_against_hf

    path = llama_checkpoint("gemma4", max_position_embeddings=2048)
    rng = np.random.default_rng(5)
    a = rng.integers(3, 256, size=29).tolist()
    prompts = [a * 3 + a[:5], rng.integers(3, 256, size=40).tolist() + a + a[:7]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with engines(path, 2, max_kv_tokens_per_rank=1024, speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, ignore_eos=True))
        assert llm.engine.stats().spec["num_drafts"] > 0
        llm.engine.kv.check_invariants()
    check_against_hf(path, outs, prompts, 16, check_prompt_lp=False)
