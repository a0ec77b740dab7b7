"""Multi-head latent attention and DeepSeek routing, in one process: the routers against transformers' DeepSeek
routers, the latent KV layout (what a token costs in the cache), the DeepSeek config reading and its refusals.
End-to-end exactness at CP 1-3 and TP 2 is in tests/test_families.py; cp_attention with Dv != Dk in
tests/test_cp_attention.py."""
import pytest
import torch

from checkpoints import tiny_config, write_hf_checkpoint
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import MoEConfig
from cpinfer.model.families import config_kwargs
from cpinfer.model.moe import Router

transformers = pytest.importorskip("transformers")

HIDDEN = 32


def _hf_config(variant: str, **over):
    d = tiny_config(variant, hidden_size=HIDDEN, **over)
    return transformers.AutoConfig.for_model(d.pop("model_type"), **d), d


@pytest.mark.parametrize("variant, over", [
    ("deepseek_v3", {}),  # sigmoid, 4 groups of 2 (2 eligible), correction bias, renormalised, x2.5
    ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),  # Kimi K2's shape: no groups
    ("deepseek_v2", {}),  # softmax, group_limited_greedy (a group's best), x1.5
    ("deepseek_v2", {"topk_method": "greedy"}),
])
def test_deepseek_router_matches_transformers(variant, over):
    hf_cfg, d = _hf_config(variant, **over)
    cfg = ModelConfig(**config_kwargs({**d, "model_type": variant}))
    module = transformers.models.deepseek_v3.modeling_deepseek_v3 if variant == "deepseek_v3" else \
        transformers.models.deepseek_v2.modeling_deepseek_v2
    hf = (module.DeepseekV3TopkRouter if variant == "deepseek_v3" else module.DeepseekV2TopkRouter)(hf_cfg)
    ours = Router(HIDDEN, cfg.moe)
    torch.manual_seed(0)
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.3)
        ours.weight.copy_(hf.weight)
        if variant == "deepseek_v3":
            hf.e_score_correction_bias.normal_(0.0, 0.2)
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, HIDDEN)
    _, hf_w, hf_e = hf(x)
    w, e = ours(x)
    hf_e, order = hf_e.sort(-1)  # both unsorted top-k: compare as sets with their weights
    e, mine = e.sort(-1)
    assert torch.equal(e, hf_e)
    torch.testing.assert_close(w.gather(1, mine), hf_w.gather(1, order), atol=1e-6, rtol=1e-6)


def test_correction_bias_chooses_but_does_not_weigh():
    """A large bias on expert 5 puts it in every token's top k; its weight stays its unbiased score."""
    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=4, scoring="sigmoid", score_correction_bias=True)
    r = Router(HIDDEN, cfg)
    with torch.no_grad():
        r.weight.normal_(0.0, 0.3)
        r.e_score_correction_bias.zero_()
        r.e_score_correction_bias[5] = 10.0
    x = torch.randn(16, HIDDEN)
    w, e = r(x)
    assert bool((e == 5).any(-1).all())
    scores = torch.sigmoid(x @ r.weight.T)
    torch.testing.assert_close(w, scores.gather(1, e))


def test_the_cache_holds_the_latent_once():
    """DeepSeek-V3's shape: one KV head of 512 + 64 per token and layer, the values a view of its first 512."""
    d = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
         "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "n_routed_experts": 0}
    cfg = ModelConfig(**config_kwargs(d))
    widths = KVWidths.of(cfg)
    assert (widths.key, widths.value, widths.values_in_keys, widths.stored) == (576, 512, True, 576)
    assert cfg.cached_kv_heads == 1 and cfg.attention_scale == pytest.approx(192 ** -0.5)
    assert KVStore.bytes_per_token(61, cfg.cached_kv_heads, widths, 2) == 61 * 576 * 2  # vs 61 * 128 * 320 * 2
    store = KVStore(2, 8, 1, widths, torch.float32, "cpu")
    assert store.k.shape == (2, 9, 1, 576) and store.v.shape == (2, 9, 1, 512)
    assert store.v.data_ptr() == store.k.data_ptr() and store.v.untyped_storage().nbytes() == store.k.numel() * 4
    gqa = KVWidths(128, 128)
    assert gqa.stored == 256 and KVStore(2, 8, 2, gqa, torch.float32, "cpu").v.shape == (2, 9, 2, 128)


def test_yarn_mscale_corrects_the_softmax_scale():
    cfg = ModelConfig(**config_kwargs({**tiny_config("deepseek_v3"), "model_type": "deepseek_v3"}))
    mscale = 0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert cfg.attention_scale == pytest.approx(16 ** -0.5 * mscale ** 2)
    assert cfg.mla.q_lora_rank == 24 and cfg.moe_layers == (1, 2) and cfg.moe.shared_name == "shared_experts"


def test_kimi_k2_reads_as_deepseek_v3():
    d = tiny_config("deepseek_v3")
    v3 = ModelConfig(**config_kwargs(d))
    k2 = ModelConfig(**config_kwargs({**d, "model_type": "kimi_k2", "topk_method": "noaux_tc",
                                      "scoring_func": "sigmoid", "ep_size": 8}))  # ep_size: no change to the math
    assert (k2.mla, k2.moe, k2.moe_layers) == (v3.mla, v3.moe, v3.moe_layers)


@pytest.mark.parametrize("variant, bad, message", [
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=true is not supported"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3", {"n_group": 3}, "divisible by n_group"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group must be in"),
    ("deepseek_v3", {"num_experts_per_tok": 5}, "exceeds the experts of the topk_group"),
])
def test_unsupported_deepseek_options_are_named(variant, bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**config_kwargs({**tiny_config(variant), **bad}))


def test_multi_token_prediction_layers_are_skipped_at_load(tmp_path):
    """DeepSeek-V3 checkpoints carry the MTP draft layer as model.layers.<num_hidden_layers>: not loaded (as
    transformers does); any other unexpected tensor is still an error."""
    from safetensors.torch import load_file, save_file

    from cpinfer.model import load_model

    path = write_hf_checkpoint(tmp_path / "v3", "deepseek_v3", num_hidden_layers=2)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(file), metadata={"format": "pt"})
    load_model(str(path))
    tensors["model.layers.1.extra.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(str(path))


GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
LATENT_ROW = 3 * (16 + 8) * 4  # deepseek_v3 tiny: 3 layers x (latent 16 + rotary 8) fp32 per token, one KV head


def test_tiers_keep_the_latent_across_a_restart_at_another_cp_size(llama_checkpoint, tmp_path):
    """CP2 with a device cache of about one conversation: histories go to the host pool and to disk as latent rows
    ([tokens, 1, layers, 1, 24]: keys only, the values inside them), come back exact; the tiers count 288 bytes a
    token; a CP1 engine restarted on the same directory reads them (re-placed) and answers as transformers."""
    from safetensors import safe_open

    from cpinfer import LLM, SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    kv_dir = tmp_path / "kv"
    kw = dict(placement="shard", threads_per_rank=1, kv_disk_dir=kv_dir, max_num_batched_tokens=96)
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=4))]
    with LLM(str(path), context_parallel_size=2, max_kv_tokens_per_rank=192,
             kv_host_gib=128 * LATENT_ROW / (1 << 30), **kw) as llm:
        first = []
        for d in docs:  # one at a time: each pushes the one before down a tier
            first += llm.generate([d], SamplingParams(max_tokens=6, **GREEDY))
        check_against_hf(path, first, docs, 6, check_prompt_lp=False)
        turn2 = [d + o.token_ids + [5, 6] for d, o in zip(docs, first)]
        outs = [llm.generate([t], SamplingParams(max_tokens=6, **GREEDY))[0] for t in turn2[::-1]]
        check_against_hf(path, outs, turn2[::-1], 6, check_prompt_lp=False)
        assert [o.num_cached_tokens for o in outs] == [len(d) + 5 for d in docs[::-1]]
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] > 0 and t["disk"]["hit_tokens"] > 0, t
        assert t["device"]["bytes"] == t["device"]["tokens"] * LATENT_ROW
        assert t["host"]["capacity_bytes"] == 2 * 128 * LATENT_ROW
        llm.engine.kv.check_invariants()
    files = sorted(p for p in kv_dir.iterdir() if p.suffix == ".safetensors")
    with safe_open(str(files[0]), framework="pt") as f:
        assert tuple(f.get_slice("kv").get_shape()[1:]) == (1, 3, 1, 24)
        assert "latent16+rope8" in f.metadata()["layout"]
    with LLM(str(path), context_parallel_size=1, max_kv_tokens_per_rank=2048, **kw) as llm:
        out = llm.generate([turn2[0] + [9]], SamplingParams(max_tokens=6, **GREEDY))
        check_against_hf(path, out, [turn2[0] + [9]], 6, check_prompt_lp=False)
        assert out[0].num_cached_tokens >= len(docs[0]) + 5


def _host_pool_slots(ctx):
    tiers = ctx.state["runner"].tiers
    return 0 if tiers.host_k is None else tiers.host_k.shape[1]


@pytest.mark.parametrize("write_through", [True, False])
def test_tp2_keeps_one_host_copy_of_the_latent_per_cp_shard(llama_checkpoint, tmp_path, monkeypatch, write_through):
    """CP 2 x TP 2 with a small device cache, a host pool and a disk: histories evicted to the host pool (TP rank 0
    of each CP rank holds it; TP rank 1 none) and to disk come back broadcast to both TP ranks and answer as
    transformers; the host tier counts the latent once (288 bytes a token, not 576). Without write-through, what
    reaches the disk is written from the host pool (TP rank 0's rows, broadcast to the other TP rank, which holds
    them until the file is written)."""
    import functools

    from cpinfer import LLM, SamplingParams
    from cpinfer.engine import llm_engine
    from hf_oracle import check_against_hf, prompts_for

    monkeypatch.setattr(llm_engine, "TierConfig", functools.partial(llm_engine.TierConfig,
                                                                    write_through=write_through))
    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=6))]
    with LLM(str(path), context_parallel_size=2, tensor_parallel_size=2, placement="shard", threads_per_rank=1,
             max_kv_tokens_per_rank=192, max_num_batched_tokens=96, kv_disk_dir=tmp_path / "kv",
             kv_host_gib=128 * LATENT_ROW / (1 << 30)) as llm:
        assert llm.engine._pool.run(_host_pool_slots) == [128, 0, 128, 0]  # ranks (cp, tp) = 00, 01, 10, 11
        first = [llm.generate([d], SamplingParams(max_tokens=6, **GREEDY))[0] for d in docs]
        turn2 = [d + o.token_ids + [5, 6] for d, o in zip(docs, first)]
        outs = [llm.generate([t], SamplingParams(max_tokens=6, **GREEDY))[0] for t in turn2[::-1]]
        check_against_hf(path, first + outs, docs + turn2[::-1], 6, check_prompt_lp=False)
        assert [o.num_cached_tokens for o in outs] == [len(d) + 5 for d in docs[::-1]]
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] > 0 and t["disk"]["hit_tokens"] > 0, t
        assert t["host"]["bytes"] == t["host"]["tokens"] * LATENT_ROW
        assert t["host"]["capacity_bytes"] == 2 * 128 * LATENT_ROW
        assert t["device"]["bytes"] == t["device"]["tokens"] * 2 * LATENT_ROW  # each TP rank's device copy
        llm.engine.kv.check_invariants()


def test_bench_measures_the_ring_message_of_the_latent():
    """`cpinfer bench mla`'s probe packs pass-KV's real message: 576 values a token for MLA, H x (192 + 128) for the
    per-head layout of the same layer."""
    from cpinfer.bench.mla import message_bytes_per_token

    cfg = dict(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert message_bytes_per_token(cfg, 64) == {"mla": 576 * 4, "per_head": 16 * 320 * 4}


def test_tp2_writes_the_latent_once_and_any_tp_size_reads_it(llama_checkpoint, tmp_path):
    """Under TP every rank caches the same latent: only TP rank 0 writes it (one file per CP shard, its bytes
    counted once); an engine at TP1, then one at TP2 again, restore it and answer as transformers."""
    from cpinfer import LLM, SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    kv_dir = tmp_path / "kv"
    kw = dict(placement="shard", threads_per_rank=1, kv_disk_dir=kv_dir, max_kv_tokens_per_rank=2048)
    doc = [3] + prompts_for(256, [150], seed=8)[0]
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        first = llm.generate([doc], SamplingParams(max_tokens=6, **GREEDY))
        check_against_hf(path, first, [doc], 6, check_prompt_lp=False)
        llm.engine.sync_tiers(force=True)
        llm.engine.flush_tiers()
        t = llm.cache_stats()["tiers"]["disk"]
        assert t["bytes"] == t["tokens"] * LATENT_ROW  # once, not once per TP rank
    files = sorted(p.name for p in kv_dir.iterdir() if p.suffix == ".safetensors")
    assert files and all(".t0." in f for f in files), files
    turn2 = doc + first[0].token_ids + [5]
    for tp in (1, 2):
        with LLM(str(path), tensor_parallel_size=tp, **kw) as llm:
            out = llm.generate([turn2], SamplingParams(max_tokens=6, **GREEDY))
            check_against_hf(path, out, [turn2], 6, check_prompt_lp=False)
            assert out[0].num_cached_tokens == (len(doc) + 5 if tp == 1 else len(turn2) - 1)  # (TP1 wrote turn 2)
            assert llm.cache_stats()["tiers"]["disk"]["hit_tokens"] == out[0].num_cached_tokens
