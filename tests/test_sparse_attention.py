"""DeepSeek sparse attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): the config readers and their
refusals, the exact top-k over candidates split among ranks (ties by position, the same at every split), the
indexer keys beside the latent in the KV store, and the engine against transformers at CP 1, 2 and 3 with
index_topk 64 far below the prompts (330 tokens whole, 700 chunked, decode, a second turn from the prefix cache)."""
import numpy as np
import pytest
import torch

from checkpoints import tiny_config
from cpinfer import SamplingParams
from cpinfer.attention.sparse import attend_selected, ordered_topk, selected, threshold
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.model.config import ModelConfig

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
# DeepSeek-V3's tiny MLA and MoE (tests/checkpoints.py) with an indexer of 16 heads x 16 channels (8 with RoPE):
# enough heads that no two keys tie at the top-k boundary (transformers' topk breaks ties its own way)
INDEXER = dict(index_topk=64, index_n_heads=16, index_head_dim=16, max_position_embeddings=2048)
GLM_TYPES = ["full", "shared", "full"]


def _config(model_type, **over):
    d = tiny_config("deepseek_v3", model_type=model_type, **{**INDEXER, **over})
    return ModelConfig.from_dict(d)


def _checkpoint(make, model_type, **over):
    extra = {"indexer_types": GLM_TYPES} if model_type == "glm_moe_dsa" else {}
    return make("deepseek_v3", model_type=model_type, **{**INDEXER, **extra, **over})


# ---------------------------------------------------------------- config
def test_readers_take_the_indexer_and_glm_sharing():
    v32 = _config("deepseek_v32")
    assert (v32.dsa.index_topk, v32.dsa.index_n_heads, v32.dsa.index_head_dim, v32.dsa.rope_dim) == (64, 16, 16, 8)
    assert not v32.dsa.rope_interleaved and v32.dsa.indexer_types == ("full",) * 3 and v32.mla.rope_interleaved
    assert v32.moe_layers == (1, 2)
    glm = _config("glm_moe_dsa", indexer_types=GLM_TYPES, mlp_layer_types=["dense", "dense", "sparse"])
    assert glm.dsa.rope_interleaved and glm.dsa.indexer_types == tuple(GLM_TYPES) and glm.moe_layers == (2,)
    # transformers' schedule without indexer_types: full where max(i - offset + 1, 0) % freq == 0
    sched = _config("glm_moe_dsa", num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=2)
    assert sched.dsa.indexer_types == ("full", "full", "shared")
    assert _config("glm_moe_dsa", index_topk_pattern="FSF").dsa.indexer_types == tuple(GLM_TYPES)


@pytest.mark.parametrize("model_type, bad, message", [
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank is required"),
    ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\] must be 'full'"),
    ("glm_moe_dsa", {"indexer_types": ["full", "skip", "full"]}, "unsupported indexer_types"),
    ("glm_moe_dsa", {"indexer_types": ["full", "full"]}, "one indexer_types entry per layer"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    ("deepseek_v32", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, "layer_types"),
])
def test_configs_the_engine_cannot_serve_are_named(model_type, bad, message):
    with pytest.raises(ValueError, match=message):
        _config(model_type, **bad)


def test_the_indexer_key_sits_beside_the_latent():
    """A DSA model's cache row per layer: the latent (16 + 8) then its indexer key (16), one row, so whatever moves
    a token's rows moves both; counted in the bytes; refused without MLA or in an FP8 cache."""
    cfg = _config("deepseek_v32")
    w = KVWidths.of(cfg)
    assert (w.key, w.value, w.values_in_keys, w.index, w.stored) == (24, 16, True, 16, 40)
    assert KVStore.bytes_per_token(3, 1, w, 4) == 3 * (24 + 16) * 4
    store = KVStore(3, 8, 1, w, torch.float32, "cpu")
    assert store.k.shape == (3, 9, 1, 40) and store.index.shape == (3, 9, 16) and store.v.shape == (3, 9, 1, 16)
    store.index[1, 2] = 5.0
    assert bool((store.k[1, 2, 0, 24:] == 5.0).all()) and not store.k[1, 2, 0, :24].any()
    assert KVStore(3, 8, 1, KVWidths(24, 16, True), torch.float32, "cpu").index is None
    with pytest.raises(ValueError, match="beside MLA's latent only"):
        KVWidths(24, 24, False, 16)


def test_the_fp8_latent_cache_keeps_the_indexer_key_in_its_row():
    """FP8 cache: the row is bytes, the latent's 24 e4m3 then the indexer key — its fp32 bytes (a plain checkpoint;
    a 26-wide latent is padded to 28 so they view as fp32) or 16 e4m3 and a 4-byte scale (an FP8 indexer)."""
    from cpinfer.engine.kv import fp8 as kv_fp8

    x = torch.randn(5, 16)
    for w, row in ((KVWidths(24, 16, True, 16), 24 + 64), (KVWidths(26, 16, True, 16), 28 + 64),
                   (KVWidths(24, 16, True, 16, index_fp8=True), 24 + 20)):
        assert KVStore.bytes_per_token(3, 1, w, 4, "fp8") == 3 * row
        store = KVStore(3, 8, 1, w, torch.float32, "cpu", kv_cache_dtype="fp8")
        assert store.k.dtype == torch.uint8 and store.k.shape == (3, 9, 1, row)
        store.write_index(1, torch.tensor([0, 2, 3, 4, 7]), x)
        got = store.read_index(store.index[1, [0, 2, 3, 4, 7]])
        if w.index_fp8:
            assert store.index.dtype == torch.uint8 and store.index.shape == (3, 9, 20)
            torch.testing.assert_close(got, kv_fp8.decode(kv_fp8.encode(x), torch.float32), rtol=0, atol=0)
            assert not torch.equal(got, x)
        else:
            assert store.index.dtype == torch.float32 and store.index.shape == (3, 9, 16)
            assert torch.equal(got, x) and torch.equal(store.k[1, 2, 0, row - 64:].view(torch.float32), x[1])
        assert not store.k[1, :, 0, :w.key].any() and not store.k[0].any()  # the latent's bytes untouched
    assert KVWidths.of(_config("deepseek_v32")).index_fp8 is False


# ---------------------------------------------------------------- exact top-k from candidates
def _by_order(scores: torch.Tensor, pos: torch.Tensor, k: int) -> set:
    """The single-device top-k of one row by (score desc, position asc), visible (finite) keys only."""
    keys = sorted((-float(s), int(p)) for s, p in zip(scores, pos) if torch.isfinite(s))
    return {p for _, p in keys[:k]}


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_candidates_from_any_split_give_the_single_device_top_k(world):
    """Scores with many ties (rounded to a few values) and invisible keys; keys dealt to `world` ranks at random:
    each rank's local top-k, the union's k-th as the threshold, and each rank's kept keys together are exactly
    the single-device top-k under (score desc, position asc), row by row; fewer visible keys than k keep all."""
    gen = torch.Generator().manual_seed(world)
    q, n, k = 40, 97, 12
    scores = torch.round(torch.randn(q, n, generator=gen) * 2) / 2  # ties everywhere
    scores[torch.rand(q, n, generator=gen) < 0.3] = -torch.inf
    scores[0, :] = -torch.inf
    scores[1, :5] = 1.0
    scores[1, 5:] = -torch.inf  # 5 visible < k
    pos = torch.randperm(n, generator=gen) * 3 + 7
    owner = torch.randint(0, world, (n,), generator=gen)
    cands = []
    for r in range(world):
        mine = torch.nonzero(owner == r).flatten()
        mine = mine[torch.argsort(pos[mine])]  # a rank's keys in position order
        cands.append((mine,) + ordered_topk(scores[:, mine], pos[mine], k))
    ts, tp = threshold(torch.cat([c[1] for c in cands], 1), torch.cat([c[2] for c in cands], 1), k)
    for row in range(q):
        got = set()
        for mine, vals, where, idx in cands:
            keep = selected(vals, where, ts, tp)[row]
            got |= {int(pos[mine][i]) for i in idx[row][keep]}
        assert got == _by_order(scores[row], pos, k), row
    assert not selected(*cands[0][1:3], ts, tp)[0].any()


def test_the_static_top_k_equals_the_dynamic_one():
    """The static path's selection (a key list per row, padded at an unreachable position; no data-dependent shape)
    takes the same keys, values and positions as `ordered_topk`, ties by position, rows with fewer than k visible
    keys padded alike."""
    from cpinfer.engine.sparse_decode import FAR, static_topk

    gen = torch.Generator().manual_seed(3)
    q, n, k = 30, 50, 12
    scores = torch.round(torch.randn(q, n, generator=gen) * 2) / 2
    scores[torch.rand(q, n, generator=gen) < 0.3] = -torch.inf
    scores[1, 4:] = -torch.inf
    pos = torch.sort(torch.randperm(200, generator=gen)[:n]).values
    want = ordered_topk(scores, pos, k)
    padded = torch.cat((scores, torch.full((q, 14), -torch.inf)), 1)
    got = static_topk(padded, torch.cat((pos, torch.full((14,), FAR))).expand(q, -1), k)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(static_topk(scores[:, :5], pos[:5].expand(q, -1), k)[1], ordered_topk(scores[:, :5], pos[:5],
                                                                                               k)[1])


def test_attention_over_the_selected_keys_merges_exactly(monkeypatch):
    """Partials of each rank over its kept keys merge (by LSE) into the dense softmax restricted to them (rows
    gathered in chunks of 2)."""
    from cpinfer.attention import sparse
    from cpinfer.attention.merge import merge_partials

    monkeypatch.setattr(sparse, "_GATHER_ELEMS", 2 * 5 * 10)

    gen = torch.Generator().manual_seed(0)
    q, h, d, dv, n, k = 6, 3, 10, 7, 30, 5
    qs, keys = torch.randn(q, h, d, generator=gen), torch.randn(n, d, generator=gen)
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(q)])
    keep = torch.rand(q, k, generator=gen) < 0.7
    keep[:, 0] = True
    halves = [keep & (idx < 15), keep & (idx >= 15)]
    parts = [attend_selected(qs, keys, idx, m, dv, 0.3) for m in halves]
    out, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    mask = torch.full((q, n), -torch.inf)
    for i in range(q):
        mask[i, idx[i][keep[i]]] = 0.0
    ref = torch.softmax(torch.einsum("qhd,nd->qhn", qs, keys) * 0.3 + mask[:, None], -1) @ keys[:, :dv]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- the engine against transformers
@pytest.fixture(scope="module")
def engines():
    from pooled_engine import shard_engines

    yield from shard_engines()


@pytest.mark.parametrize("cp, tp", [(1, 1), (2, 1), (3, 1), (1, 2)])
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_matches_transformers(llama_checkpoint, engines, monkeypatch, model_type, cp, tp):
    """index_topk 64: a 330-token prompt prefilled whole, a 700-token one in chunks of <= 400, decode, and second
    turns over both from the prefix cache (partial prefills): prompt log-probs within 1e-4 of transformers,
    greedy tokens equal, at CP 1, 2 and 3 and TP 2 (the indexer whole on every TP rank; GLM: its middle layer
    reuses layer 0's selection)."""
    from hf_oracle import check_against_hf, prompts_for

    from cpinfer.engine import sparse_attention

    monkeypatch.setattr(sparse_attention, "_SCORE_ELEMS", 16 * 700 * 50)  # CP1 (in this process): 50 rows at once
    path = _checkpoint(llama_checkpoint, model_type)
    with engines(path, cp, tp, max_num_batched_tokens=400, max_kv_tokens_per_rank=2048) as llm:
        prompts = prompts_for(llm.config.vocab_size, [330, 700], seed=cp + tp)
        outs = [llm.generate([p], SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))[0] for p in prompts]
        check_against_hf(path, outs, prompts, 6)
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        short = prompts_for(llm.config.vocab_size, [1, 3], seed=7)  # held by one rank: attended where they live,
        outs2 = llm.generate(turn2 + short, SamplingParams(max_tokens=5, **GREEDY))  # beside the ring's sequences
        assert [o.num_cached_tokens for o in outs2[:2]] == [len(p) + 5 for p in prompts]
        check_against_hf(path, outs2, turn2 + short, 5, check_prompt_lp=False)


def test_placement_auto_at_cp2_plans_a_dsa_model(llama_checkpoint):
    """The default placement reads the model into the planner (DSA layers costed as full MLA) and serves it."""
    from cpinfer.perf.models import load_model_spec

    path = _checkpoint(llama_checkpoint, "glm_moe_dsa")
    spec = load_model_spec(str(path))
    assert spec.mla and spec.window_layers == 0


def test_top_k_above_the_context_selects_everything_and_the_selection_matters(llama_checkpoint, engines):
    """The same weights with index_topk 4096 (above every context): exact against transformers at CP2 (every key
    selected); its prompt log-probs differ from index_topk 64's past position 64, so the selection is real."""
    from hf_oracle import check_against_hf, prompts_for

    prompts = prompts_for(256, [200], seed=9)
    lps = {}
    for topk in (64, 4096):
        path = _checkpoint(llama_checkpoint, "deepseek_v32", index_topk=topk)
        with engines(path, 2, max_kv_tokens_per_rank=2048) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=True, **GREEDY))
            check_against_hf(path, outs, prompts, 3)
            lps[topk] = np.asarray(outs[0].prompt_logprobs[1:])
    assert np.abs(lps[64][:63] - lps[4096][:63]).max() < 1e-4  # <= 64 keys: the same attention
    assert np.abs(lps[64][100:] - lps[4096][100:]).max() > 1e-2


# ---------------------------------------------------------------- what the engine refuses, and what it carries
@pytest.mark.parametrize("kw, message", [
    ({"kv_cache_dtype": "fp8_per_token"}, "kv_cache_dtype='fp8_per_token' is not supported"),
    ({"mla_form": "expanded"}, "mla_form='expanded' is not supported"),
    ({"speculative_config": {"model": "DRAFT", "num_speculative_tokens": 2}},
     "draft model with DeepSeek sparse attention"),
])
def test_features_that_do_not_carry_the_indexer_keys_are_refused_before_ranks_start(llama_checkpoint, kw, message):
    from cpinfer import LLM

    path = _checkpoint(llama_checkpoint, "deepseek_v32")
    if "speculative_config" in kw:
        kw["speculative_config"] = {**kw["speculative_config"], "model": str(path)}
    with pytest.raises(ValueError, match=message):
        LLM(str(path), max_kv_tokens_per_rank=2048, **kw)


def test_ngram_speculation_verifies_with_each_rows_own_top_k(llama_checkpoint, engines):
    """CP2, prompt-lookup drafts on a repetitive 220-token prompt: each verify row selects its own top-k; greedy
    tokens and log-probs as transformers', some drafts accepted."""
    from hf_oracle import check_against_hf, prompts_for

    path = _checkpoint(llama_checkpoint, "deepseek_v32")
    base = prompts_for(256, [100], seed=3)[0]
    prompts = [base + base[:60] + base[:60]]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with engines(path, 2, max_kv_tokens_per_rank=2048, speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    check_against_hf(path, outs, prompts, 12, check_prompt_lp=False)
    assert sum((st.get("spec") or {}).get("drafted", 0) for st in outs[0].metrics["steps"]) > 0


def test_fp8_block_checkpoint_loads_the_indexer_too(llama_checkpoint, engines, tmp_path):
    """GLM-5 as DeepSeek ships FP8 (block-wise e4m3, every linear of attention, the indexer's and the experts'):
    the engine at CP2 on the FP8 folder answers as transformers on the same weights dequantized."""
    from safetensors.torch import load_file

    from fp8_checkpoint import write_fp8_pair
    from hf_oracle import check_against_hf, prompts_for

    src = _checkpoint(llama_checkpoint, "glm_moe_dsa")
    fp8_dir, deq_dir = tmp_path / "fp8", tmp_path / "deq"
    write_fp8_pair(src, fp8_dir, deq_dir, "fp8_block", fuse_experts=True)
    stored = load_file(str(fp8_dir / "model.safetensors"))
    assert stored["model.layers.0.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    prompts = prompts_for(256, [200], seed=5)
    with engines(fp8_dir, 2, max_kv_tokens_per_rank=2048) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, prompt_logprobs=True, **GREEDY))
    check_against_hf(deq_dir, outs, prompts, 4)


@pytest.mark.parametrize("cp", [1, 2])
def test_preemption_recomputes_the_indexer_keys_with_the_latent(llama_checkpoint, engines, cp):
    """Two 250-token prompts decoding 250 tokens each overflow a cache of about 700 tokens: one is preempted, its
    latent and indexer keys recomputed when it resumes; both answer as transformers."""
    from cpinfer.engine.kv.manager import BLOCK
    from hf_oracle import check_against_hf, prompts_for

    path = _checkpoint(llama_checkpoint, "glm_moe_dsa")
    cap = -(-(-(-700 // cp)) // BLOCK) * BLOCK + BLOCK
    with engines(path, cp, max_kv_tokens_per_rank=cap) as llm:
        prompts = prompts_for(256, [250, 250], seed=20 + cp)
        outs = llm.generate(prompts, SamplingParams(max_tokens=250, **GREEDY))
        assert llm.engine.stats().preemptions > 0
        check_against_hf(path, outs, prompts, 250, check_prompt_lp=False)
        llm.engine.kv.check_invariants()


# ---------------------------------------------------------------- `cpinfer bench sparse`
def test_bench_counts_the_work_and_times_both_paths_in_one_process():
    """The bench's batch deals the context in blocks of 64 and puts the new tokens last; its work formula gives the
    sparse layer less work than dense past top-k (the indexer's pairs plus attention over top-k); one tiny run of
    both paths through the engine's code at CP1."""
    from cpinfer.bench import sparse as bench
    from cpinfer.launch import InProcessWorld

    batch, cached = bench._batch(1000, 40, 3)
    s = batch.seqs[0]
    assert s.start == 960 and sum(len(c) for c in cached) == 960 and set(s.ranks) <= {0, 1, 2} and s.spread
    assert [int(r[0, 1]) for r in s.ctx_runs] == [len(c) for c in cached] == [320, 320, 320]
    shape = dict(bench.DEFAULTS, topk=64)
    w = bench.work(shape, 4096, 16, 2, "absorbed")
    pairs = 16 * 4080 + 16 * 17 // 2
    assert w["sparse"] == 16 * 64 * 16 * 2 * (2 * 512 + 64) + 16 * 16 * 2 * 512 * 256 + pairs * 2 * 8 * 128
    assert w["dense"] > 3 * w["sparse"]
    with InProcessWorld() as world:
        (out,) = world.run(bench.rank_time, dict(shape, heads=2, rank=32, rope=8, nope=8, v=8, index_dim=16), 300,
                           20, 1)
    assert out["form"] in ("absorbed", "expanded") and out["dense"] > 0 and out["sparse"] > 0


DSA_ROW = 3 * (16 + 8 + 16) * 4  # tiny: 3 layers x (latent 16 + rotary 8 + indexer key 16) fp32 per token


def test_tiers_carry_the_indexer_keys_across_a_restart_at_another_cp_size(llama_checkpoint, engines, tmp_path):
    """CP2 with a device cache of about one conversation: histories go to the host pool and to disk as rows of
    [latent ; indexer key] ([tokens, 1, layers, 1, 40]), come back exact (the top-k over restored indexer keys);
    the tiers count 480 bytes a token; a CP1 engine restarted on the directory reads them and answers as
    transformers."""
    from safetensors import safe_open

    from hf_oracle import check_against_hf, prompts_for

    path = _checkpoint(llama_checkpoint, "glm_moe_dsa")
    kv_dir = tmp_path / "kv"
    kw = dict(kv_disk_dir=kv_dir, max_num_batched_tokens=96)
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=4))]
    with engines(path, 2, max_kv_tokens_per_rank=192, kv_host_gib=128 * DSA_ROW / (1 << 30), **kw) as llm:
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
        assert t["device"]["bytes"] == t["device"]["tokens"] * DSA_ROW
        llm.engine.kv.check_invariants()
    files = sorted(p for p in kv_dir.iterdir() if p.suffix == ".safetensors")
    with safe_open(str(files[0]), framework="pt") as f:
        assert tuple(f.get_slice("kv").get_shape()[1:]) == (1, 3, 1, 40)
        assert "latent16+rope8+index16" in f.metadata()["layout"]
    with engines(path, 1, max_kv_tokens_per_rank=2048, **kw) as llm:
        out = llm.generate([turn2[0] + [9]], SamplingParams(max_tokens=6, **GREEDY))
        check_against_hf(path, out, [turn2[0] + [9]], 6, check_prompt_lp=False)
        assert out[0].num_cached_tokens >= len(docs[0]) + 5


def test_prefill_and_decode_groups_move_the_indexer_keys_with_the_latent(llama_checkpoint):
    """Prefill on a CP2 group (chunks of 96), decode on a CP1 group: the rows sent between them are [latent ;
    indexer key], so the decode group's top-k over the moved keys answers as transformers."""
    from cpinfer.launch import WorkerPool
    from hf_oracle import check_against_hf, prompts_for
    from pooled_engine import pd_llm

    path = _checkpoint(llama_checkpoint, "deepseek_v32")
    prompts = prompts_for(256, [230, 120], seed=11)
    with WorkerPool(3, threads_per_rank=1, timeout_s=120) as pool:
        llm = pd_llm(pool, path, context_parallel_size=2, pd_decode_cp=1, placement="shard",
                     max_num_batched_tokens=96, max_kv_tokens_per_rank=1024)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
            decode = llm.engine.decode[0].stats().forwards
            assert decode and not any(k.startswith("prefill/") for k in decode), decode  # it never prefilled
        finally:
            llm.shutdown()
    check_against_hf(path, outs, prompts, 8, check_prompt_lp=False)


# ---------------------------------------------------------------- the FP8 latent cache
def _fake_quant_logprobs(path, tokens, index_fp8: bool, latent_fp8: bool = True):
    """The model run alone over `tokens` with DeepSeek sparse attention over FP8-dequantized rows: the latent
    [c ; k_r] by the scales calibrated at load (as the engine's), the indexer key by its own per-token scale when
    `index_fp8` (else as computed); each row's top-k by (score desc, position asc), GLM's "shared" layers reusing
    the last selection (`latent_fp8` False: the latent unquantized) -> log-probs [len - 1, vocab] of the next
    tokens. The Linears run as the engine's runner runs them on the CPU (fused, oneDNN over packed weights): a
    float32 rounding anywhere before the e4m3 rounding can move a value across one of its steps."""
    from cpinfer.attention.sparse import ordered_topk
    from cpinfer.engine.kv import fp8 as kv_fp8
    from cpinfer.model import load_model
    from cpinfer.model.indexer import index_scores

    cfg, model = load_model(path)
    model.fuse_projections()
    model.pack_linears()
    codecs = kv_fp8.layer_codecs("fp8", kv_fp8.calibrate_kv_scales(model, cfg, "cpu"), cfg.num_hidden_layers, 1,
                                 "cpu")
    n = len(tokens)
    ids, pos = torch.tensor(tokens), torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    keep = {}

    def attn(layer, q, k, v, sinks=None, index=None):
        kq = (codecs[layer][0].decode(codecs[layer][0].encode(k), k.dtype) if latent_fp8 else k)[:, 0]  # [n, D]
        if index is not None:
            ik = kv_fp8.decode(kv_fp8.encode(index.k), index.k.dtype) if index_fp8 else index.k
            s = index_scores(index.q, index.w, ik, index.scale).masked_fill(~causal, -torch.inf)
            m = min(cfg.dsa.index_topk, n)
            vals, _, idx = ordered_topk(s, pos, m)
            keep["mask"] = torch.zeros(n, n, dtype=torch.bool).scatter_(1, idx, torch.isfinite(vals))
        logits = torch.einsum("qhd,kd->qhk", q.float(), kq.float()) * cfg.attention_scale
        p = torch.softmax(logits.masked_fill(~keep["mask"][:, None], -torch.inf), dim=-1)
        return torch.einsum("qhk,kd->qhd", p, kq[:, :v.shape[-1]].float()).to(q.dtype)

    with torch.no_grad():
        return model.compute_logits(model(ids, pos, attn)).float().log_softmax(-1)[:-1]


@pytest.mark.parametrize("model_type, fp8_weights, cp", [
    ("deepseek_v32", False, 1), ("deepseek_v32", False, 2), ("glm_moe_dsa", False, 3), ("glm_moe_dsa", True, 2)])
def test_fp8_latent_cache_is_sparse_attention_over_dequantized_rows(llama_checkpoint, engines, tmp_path, model_type,
                                                                    fp8_weights, cp):
    """kv_cache_dtype fp8: the latent in e4m3 by MLA's static scales, the indexer key in the compute dtype (a plain
    checkpoint) or in e4m3 with its own scale (GLM-5's FP8 release, whose indexer is FP8). A 200-token prompt in
    chunks of 96, then a second turn from the prefix cache decoding 4 tokens: prompt and decode log-probs within
    1e-4 of the model run alone with every row quantized and dequantized (top-k over the dequantized indexer
    keys), greedy tokens equal, as the MLA families' FP8 test holds (FP8 weights: another GEMM than the
    reference's, so the median within 1e-4 and the mean 10x closer than a wrong format's); the cache counts the
    bytes of that row."""
    from hf_oracle import prompts_for

    path = _checkpoint(llama_checkpoint, model_type)
    ref_path = path
    if fp8_weights:
        from fp8_checkpoint import write_fp8_pair

        path, ref_path = tmp_path / "fp8", tmp_path / "deq"
        write_fp8_pair(_checkpoint(llama_checkpoint, model_type), path, ref_path, "fp8_block", fuse_experts=True)
    prompt = prompts_for(256, [200], seed=30 + cp)[0]
    with engines(path, cp, kv_cache_dtype="fp8", max_num_batched_tokens=96, max_kv_tokens_per_rank=1024) as llm:
        first = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True, **GREEDY))[0]
        turn2 = prompt + first.token_ids + [7, 8]
        second = llm.generate([turn2], SamplingParams(max_tokens=4, **GREEDY))[0]
        assert second.num_cached_tokens >= 192
        assert llm.cache_stats()["kv_bytes_per_token"] == 3 * (24 + (16 + 4 if fp8_weights else 16 * 4))
    want = _fake_quant_logprobs(ref_path, prompt, fp8_weights)
    got = torch.tensor(first.prompt_logprobs[1:])
    at = (torch.arange(len(prompt) - 1), torch.tensor(prompt[1:]))
    d = (got - want[at]).abs()
    if fp8_weights:
        # the engine's block-FP8 GEMM (its tiles and split-K chosen by the rows of a chunk) against F.linear over the
        # dequantized weights run once over the whole prompt: float32 roundings apart, enough to move a latent or
        # indexer value across an e4m3 step or to flip a near-tie of the indexer's top-k past its 128 keys (seen on
        # one machine: 26 of 199 positions past 1e-4, the largest 0.015, the median 4e-7); the wrong formats below
        # are ~100x further off on average
        assert d.median() <= 1e-4 and d.mean() <= 1e-3
    else:
        torch.testing.assert_close(got, want[at], rtol=0, atol=1e-4)
    for other in (_fake_quant_logprobs(ref_path, prompt, not fp8_weights),  # the indexer key's format matters
                  _fake_quant_logprobs(ref_path, prompt, fp8_weights, latent_fp8=False)):  # and the latent's
        assert (other[at] - got).abs().max() > 1e-2 and (other[at] - got).abs().mean() > 10 * max(d.mean(), 1e-4)
    full = turn2 + second.token_ids
    want2 = _fake_quant_logprobs(ref_path, full, fp8_weights)[len(turn2) - 1:]
    assert second.token_ids == want2.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(second.logprobs), want2.max(-1).values, rtol=0,
                               atol=2e-2 if fp8_weights else 1e-4)


def _check_fake_quant(path, outs, prompts, index_fp8: bool) -> None:
    """Greedy outputs (`logprobs` on) equal the model run alone over FP8-dequantized rows, log-probs within 1e-4."""
    for o, p in zip(outs, prompts):
        want = _fake_quant_logprobs(path, p + o.token_ids, index_fp8)[len(p) - 1:]
        assert o.token_ids == want.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(o.logprobs), want.max(-1).values, rtol=0, atol=1e-4)


def test_fp8_rows_with_fp8_indexer_keys_go_through_the_tiers_and_to_a_decode_group(llama_checkpoint, engines,
                                                                                   tmp_path):
    """GLM-5's FP8 release with kv_cache_dtype fp8 (rows of 24 latent e4m3 + 16 indexer e4m3 + its 4-byte scale):
    CP2 with a device cache of about one conversation pushes histories to host and disk; second turns come back
    from both, a CP1 engine restarted on the directory reads them, and a prefill group (CP2) hands its rows to a
    decode group (CP1) — every answer as the model run alone over the dequantized rows."""
    from cpinfer.launch import WorkerPool
    from fp8_checkpoint import write_fp8_pair
    from hf_oracle import prompts_for
    from pooled_engine import pd_llm

    path, deq = tmp_path / "fp8", tmp_path / "deq"
    write_fp8_pair(_checkpoint(llama_checkpoint, "glm_moe_dsa"), path, deq, "fp8_block", fuse_experts=True)
    row = 3 * (24 + 16 + 4)
    kw = dict(kv_disk_dir=tmp_path / "kv", max_num_batched_tokens=96, kv_cache_dtype="fp8")
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150], seed=6))]
    with engines(path, 2, max_kv_tokens_per_rank=192, kv_host_gib=128 * row / (1 << 30), **kw) as llm:
        first = [llm.generate([d], SamplingParams(max_tokens=4, **GREEDY))[0] for d in docs]
        turn2 = [d + o.token_ids + [5, 6] for d, o in zip(docs, first)]
        outs = [llm.generate([t], SamplingParams(max_tokens=4, **GREEDY))[0] for t in turn2[::-1]]
        assert [o.num_cached_tokens for o in outs] == [len(d) + 3 for d in docs[::-1]]
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] > 0 and t["disk"]["hit_tokens"] > 0, t
        assert t["device"]["bytes"] == t["device"]["tokens"] * row
        llm.engine.kv.check_invariants()
    _check_fake_quant(deq, first + outs, docs + turn2[::-1], True)
    with engines(path, 1, max_kv_tokens_per_rank=2048, **kw) as llm:
        again = llm.generate([turn2[0] + [9]], SamplingParams(max_tokens=4, **GREEDY))
        assert again[0].num_cached_tokens >= len(docs[0]) + 3
    _check_fake_quant(deq, again, [turn2[0] + [9]], True)
    with WorkerPool(3, threads_per_rank=1, timeout_s=120) as pool:
        pd = pd_llm(pool, path, context_parallel_size=2, pd_decode_cp=1, placement="shard", kv_cache_dtype="fp8",
                    max_num_batched_tokens=96, max_kv_tokens_per_rank=1024)
        try:
            moved = pd.generate(docs[:2], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
            assert not any(k.startswith("prefill/") for k in pd.engine.decode[0].stats().forwards)
        finally:
            pd.shutdown()
    _check_fake_quant(deq, moved, docs[:2], True)


# ---------------------------------------------------------------- draft-model speculation
def _lookup_draft(llama_checkpoint, tmp_path, follows: dict) -> str:
    """A one-layer Llama draft with the target's vocabulary whose greedy next token is follows[current token]:
    its attention and MLP write nothing (o_proj, down_proj zero), so the final hidden is the current token's
    embedding (random, nearly orthogonal), and lm_head row v sums the embeddings of the tokens that v follows."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = llama_checkpoint("mqa", seed=5, num_hidden_layers=1, max_position_embeddings=2048)
    dst = tmp_path / "lookup_draft"
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    emb = torch.randn(w["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(0))
    head = torch.zeros_like(emb)
    for cur, nxt in follows.items():
        head[nxt] += 10 * emb[cur] / emb[cur].norm()
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb, head
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    return str(dst)


@pytest.mark.parametrize("cp", [1, 2])
def test_draft_model_speculation_verifies_each_row_with_its_own_top_k(llama_checkpoint, engines, tmp_path, cp):
    """A DSA target (index_topk 64, 200-token prompts) with a Llama draft that mostly proposes the target's own
    greedy continuation: verify rows of up to 4 drafts, each selecting its own top-k at its own position, give the
    same greedy tokens and log-probs (1e-4) as decoding without speculation and as transformers, with drafts
    accepted and rejected, at CP 1 and 2; a second turn speculates from the prefix cache."""
    from hf_oracle import check_against_hf, prompts_for

    path = _checkpoint(llama_checkpoint, "glm_moe_dsa")
    prompts = prompts_for(256, [200, 150], seed=40 + cp)
    params = SamplingParams(max_tokens=16, **GREEDY)
    with engines(path, cp, max_kv_tokens_per_rank=1024) as llm:
        plain = llm.generate(prompts, params)
    follows = {}
    for p, o in zip(prompts, plain):
        seq = p[-1:] + o.token_ids
        follows.update({a: b for a, b in zip(seq[:-1], seq[1:])})
    spec = {"model": _lookup_draft(llama_checkpoint, tmp_path, follows), "num_speculative_tokens": 4}
    with engines(path, cp, max_kv_tokens_per_rank=1024, speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
        turn2 = [p + o.token_ids[:8] for p, o in zip(prompts, plain)]
        again = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
        stats = llm.engine.stats().spec
    for o, r in zip(outs, plain):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    assert [o.token_ids for o in again] == [o.token_ids[8:] for o in plain]
    assert all(o.num_cached_tokens >= 192 - 64 for o in again)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    check_against_hf(path, outs, prompts, 16, check_prompt_lp=False)


def test_fp8_cache_preemption_recomputes_the_rows(llama_checkpoint, engines):
    """kv_cache_dtype fp8 at CP2 with a cache of about 700 tokens: two 250-token prompts decoding 200 tokens each
    preempt; the resumed request re-encodes its latent and indexer rows; both answer as the model run alone over
    dequantized rows."""
    from cpinfer.engine.kv.manager import BLOCK
    from hf_oracle import prompts_for

    path = _checkpoint(llama_checkpoint, "deepseek_v32")
    cap = -(-(-(-700 // 2)) // BLOCK) * BLOCK + BLOCK
    with engines(path, 2, max_kv_tokens_per_rank=cap, kv_cache_dtype="fp8") as llm:
        prompts = prompts_for(256, [250, 250], seed=27)
        outs = llm.generate(prompts, SamplingParams(max_tokens=200, **GREEDY))
        assert llm.engine.stats().preemptions > 0
        llm.engine.kv.check_invariants()
    _check_fake_quant(path, outs, prompts, False)
