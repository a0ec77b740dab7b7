"""Multi-head latent attention and DeepSeek routing: the routers against transformers' DeepSeek routers, the latent
KV layout (what a token costs in the cache), the DeepSeek config reading and its refusals, the tiers; the two
attention forms (absorbed, expanded) each forced on every forward and exact against transformers at CP 1-3 and
TP 2 (full, chunked and partial prefill, decode), and the FLOPs rule that picks one per forward. End-to-end
exactness of the default choice is also in tests/test_families.py; cp_attention with Dv != Dk in
tests/test_cp_attention.py."""
import numpy as np
import pytest
import torch

from checkpoints import tiny_config, write_hf_checkpoint
from cpinfer import SamplingParams
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


@pytest.mark.parametrize("form", ["auto", "expanded"])
def test_tiers_keep_the_latent_across_a_restart_at_another_cp_size(llama_checkpoint, engines, tmp_path, form):
    """CP2 with a device cache of about one conversation: histories go to the host pool and to disk as latent rows
    ([tokens, 1, layers, 1, 24]: keys only, the values inside them), come back exact; the tiers count 288 bytes a
    token; a CP1 engine restarted on the same directory reads them (re-placed) and answers as transformers. In
    either MLA form: "expanded" up-projects the restored latent rows like any other."""
    from safetensors import safe_open

    from cpinfer import SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    kv_dir = tmp_path / "kv"
    kw = dict(kv_disk_dir=kv_dir, max_num_batched_tokens=96, mla_form=form)  # placement "shard", 1 thread a rank
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=4))]
    with engines(path, 2, max_kv_tokens_per_rank=192, kv_host_gib=128 * LATENT_ROW / (1 << 30), **kw) as llm:
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
    with engines(path, 1, max_kv_tokens_per_rank=2048, **kw) as llm:
        out = llm.generate([turn2[0] + [9]], SamplingParams(max_tokens=6, **GREEDY))
        check_against_hf(path, out, [turn2[0] + [9]], 6, check_prompt_lp=False)
        assert out[0].num_cached_tokens >= len(docs[0]) + 5


def _host_pool_slots(ctx):
    tiers = ctx.state["runner"].tiers
    return 0 if tiers.host_k is None else tiers.host_k.shape[1]


@pytest.mark.parametrize("write_through", [True, False])
def test_tp2_keeps_one_host_copy_of_the_latent_per_cp_shard(llama_checkpoint, engines, tmp_path, monkeypatch,
                                                             write_through):
    """CP 2 x TP 2 with a small device cache, a host pool and a disk: histories evicted to the host pool (TP rank 0
    of each CP rank holds it; TP rank 1 none) and to disk come back broadcast to both TP ranks and answer as
    transformers; the host tier counts the latent once (288 bytes a token, not 576). Without write-through, what
    reaches the disk is written from the host pool (TP rank 0's rows, broadcast to the other TP rank, which holds
    them until the file is written)."""
    import functools

    from cpinfer import SamplingParams
    from cpinfer.engine import startup
    from hf_oracle import check_against_hf, prompts_for

    monkeypatch.setattr(startup, "TierConfig", functools.partial(startup.TierConfig, write_through=write_through))
    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=6))]
    with engines(path, 2, 2, max_kv_tokens_per_rank=192, max_num_batched_tokens=96, kv_disk_dir=tmp_path / "kv",
                 kv_host_gib=128 * LATENT_ROW / (1 << 30)) as llm:  # placement "shard", 1 thread a rank
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


def test_tp2_writes_the_latent_once_and_any_tp_size_reads_it(llama_checkpoint, engines, tmp_path):
    """Under TP every rank caches the same latent: only TP rank 0 writes it (one file per CP shard, its bytes
    counted once); an engine at TP1, then one at TP2 again, restore it and answer as transformers."""
    from cpinfer import SamplingParams
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    kv_dir = tmp_path / "kv"
    kw = dict(kv_disk_dir=kv_dir, max_kv_tokens_per_rank=2048)  # placement "shard", 1 thread a rank
    doc = [3] + prompts_for(256, [150], seed=8)[0]
    with engines(path, 1, 2, **kw) as llm:
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
        with engines(path, 1, tp, **kw) as llm:
            out = llm.generate([turn2], SamplingParams(max_tokens=6, **GREEDY))
            check_against_hf(path, out, [turn2], 6, check_prompt_lp=False)
            assert out[0].num_cached_tokens == (len(doc) + 5 if tp == 1 else len(turn2) - 1)  # (TP1 wrote turn 2)
            assert llm.cache_stats()["tiers"]["disk"]["hit_tokens"] == out[0].num_cached_tokens


# ---------------------------------------------------------------- the two forms: absorbed and expanded attention
FORM_DELTAS: dict[tuple, float] = {}  # (family, cp, tp, form, path) -> max |Δ log-prob| vs transformers


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, tp=1, **kw)`: placement "shard" engines on pools shared by the module; prints the
    exactness table (family x CP x TP x form x path) at the end."""
    from pooled_engine import shard_engines

    yield from shard_engines()
    if FORM_DELTAS:
        rows = [f"| {f} | {cp} | {tp} | {form} | {path} | {d:.1e} |"
                for (f, cp, tp, form, path), d in sorted(FORM_DELTAS.items())]
        print("\nmax |Δ log-prob| vs transformers\n| family | CP | TP | form | path | max |Δ| |\n|---|---|---|---|---|---|\n"
              + "\n".join(rows))


def _deltas(path, outs, prompts) -> tuple[float, float]:
    """(max |Δ| of the prompt log-probs, max |Δ| of the generated tokens' log-probs) against transformers."""
    from hf_oracle import hf_logprobs

    prompt_d = gen_d = 0.0
    for o, p in zip(outs, prompts):
        lp = hf_logprobs(path, list(p) + list(o.token_ids)[:-1])
        ref = lp[len(p) - 1:][torch.arange(len(o.token_ids)), torch.tensor(o.token_ids)]
        gen_d = max(gen_d, float((torch.tensor(o.logprobs) - ref).abs().max()))
        if o.prompt_logprobs is not None and len(p) > 1:
            ref_p = lp[torch.arange(len(p) - 1), torch.tensor(p[1:])]
            prompt_d = max(prompt_d, float((torch.tensor(o.prompt_logprobs[1:]) - ref_p).abs().max()))
    return prompt_d, gen_d


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("cp, tp", [(1, 1), (2, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_both_forms_match_transformers(llama_checkpoint, engines, family, cp, tp, form):
    """Every forward forced into one form: a full prefill (37 tokens), a chunked one (130 tokens in chunks of
    48, over pass-KV at CP > 1), decode (pass-Q), and a second turn whose history comes from the prefix cache
    (a partial prefill): log-probs within 1e-4 of transformers, greedy tokens equal."""
    from hf_oracle import check_against_hf, prompts_for

    path = llama_checkpoint(family, max_position_embeddings=2048)
    with engines(path, cp, tp, mla_form=form, max_num_batched_tokens=48, max_kv_tokens_per_rank=2048) as llm:
        prompts = prompts_for(llm.config.vocab_size, [1, 37, 130], seed=cp + tp)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=True, **GREEDY))
        check_against_hf(path, outs, prompts, 8)
        assert {st["mla"]["form"] for o in outs for st in o.metrics["steps"]} == {form}
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=6, **GREEDY))
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 7 for p in prompts]
        check_against_hf(path, outs2, turn2, 6, check_prompt_lp=False)
    key = (family, cp, tp, form)
    FORM_DELTAS[key + ("full",)] = _deltas(path, outs[1:2], prompts[1:2])[0]
    FORM_DELTAS[key + ("chunked",)] = _deltas(path, outs[2:], prompts[2:])[0]
    FORM_DELTAS[key + ("decode",)] = _deltas(path, outs, prompts)[1]
    FORM_DELTAS[key + ("partial",)] = _deltas(path, outs2, turn2)[1]


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_expanded_partial_prefill_over_each_ring_strategy(llama_checkpoint, engines, strategy):
    """CP2, a 100-token document in the cache, questions of 9, 30 and 1 tokens over it with the ring strategy
    forced: pass-KV up-projects each received latent block, pass-Q each rank's own rows; exact either way."""
    from hf_oracle import check_against_hf

    path = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)
    rng = np.random.default_rng(7)
    doc = rng.integers(3, 256, 100).tolist()
    questions = [doc + rng.integers(3, 256, n).tolist() for n in (9, 30, 1)]
    with engines(path, 2, mla_form="expanded", strategy=strategy, max_num_batched_tokens=40,
                 max_kv_tokens_per_rank=2048) as llm:
        first = llm.generate([questions[0]], SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))
        check_against_hf(path, first, questions[:1], 6)
        rest = llm.generate(questions[1:], SamplingParams(max_tokens=6, **GREEDY))
        assert [o.num_cached_tokens for o in rest] == [100, 100]
        assert all(st["strategy"] == strategy and st["mla"]["form"] == "expanded"
                   for o in rest for st in o.metrics["steps"])
        check_against_hf(path, rest, questions[1:], 6, check_prompt_lp=False)


def test_auto_form_follows_the_flops():
    """DeepSeek-V3's attention (16 heads, 512 + 64 latent, 128 / 128 heads): a long prefill is expanded, a decode
    step and a short partial prefill over a long cache stay absorbed; pass-KV's N-fold up-projection counts."""
    from cpinfer.engine.mla_form import attention_flops, choose_form
    from cpinfer.model.config_parts import MLAConfig

    mla = MLAConfig(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
    pair = attention_flops(mla, 1, 1, 0, 0)
    assert (pair["absorbed"], pair["expanded"]) == (2 * (1024 + 64), 2 * (128 + 64 + 128))  # 3.4x per pair
    assert attention_flops(mla, 1, 0, 0, 1)["expanded"] == attention_flops(mla, 1, 0, 1, 0)["absorbed"] == 2 * 512 * 256

    def form(start, t, world=1, strategy="pass-kv"):
        return choose_form(mla, 16, [(start, t, world > 1)], world, strategy).form

    assert form(0, 8192) == form(0, 16384, 2) == "expanded"
    assert form(16384, 1) == form(16384, 1, 2, "pass-q") == "absorbed"  # decode
    assert form(16384, 64) == "absorbed" and form(16384, 512) == "expanded"
    assert form(16384, 256) == "expanded" and form(16384, 256, 4, "pass-kv") == "absorbed"  # 4 up-projections
    forced = choose_form(mla, 16, [(16384, 1, False)], 1, "local", "expanded")
    assert forced.as_metrics()["form"] == "expanded" and forced.forced


def test_mla_form_is_checked():
    from cpinfer import LLM

    with pytest.raises(ValueError, match="mla_form must be one of"):
        LLM(None, mla_form="fast")
