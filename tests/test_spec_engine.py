"""Speculative decoding (prompt lookup) on the real engine: greedy outputs and log-probs with speculation equal those
without, drafts verified as decode rows (the default) and as a partial prefill, — token for token, log-probs within 1e-4 — at CP 1-3 with placement auto and shard, chunked prefill, prefix
sharing, preemption mid-speculation, the host KV tier, FP8 KV, stop strings inside an accepted run, max_tokens,
and n > 1 with streaming. Every case asserts that drafts were accepted, so none can pass without speculating.
One pooled world per CP size serves every engine of the module."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cpinfer.engine.async_llm import AsyncLLM
from cpinfer.engine.llm import LLM
from cpinfer.engine.sampling import SamplingParams
from pooled_engine import PooledLLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def engines():
    """get(path, cp, **kw) → an LLM on the module's pool of cp ranks (CP1: in the driver)."""
    from cpinfer.launch import WorkerPool

    pools: dict[int, WorkerPool] = {}

    def get(path, cp, **kw):
        kw = dict(context_parallel_size=cp, threads_per_rank=1, **kw)
        if cp == 1:
            return LLM(None if path is None else str(path), **kw)
        if cp not in pools:
            pools[cp] = WorkerPool(cp, threads_per_rank=1, timeout_s=120)
        return PooledLLM(None if path is None else str(path), pools[cp], **kw)

    try:
        yield get
    finally:
        for pool in pools.values():
            pool.close()


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return llama_checkpoint("gqa", seed=1, max_position_embeddings=2048)


def _prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup finds matches) and one that does not."""
    rng = np.random.default_rng(seed)
    a = rng.integers(3, vocab, size=37).tolist()
    b = rng.integers(3, vocab, size=23).tolist()
    return [a * 3 + a[:6], b + a + b + a[:9], rng.integers(3, vocab, size=50).tolist()]


def _params(**kw) -> SamplingParams:
    """Greedy with log-probs. A seed makes each request's k independent of timings (docs/engine.md, "Adaptive k"):
    the tests see the same verify steps on every run."""
    return SamplingParams(**{"max_tokens": 40, "temperature": 0.0, "logprobs": True, "top_logprobs": 2, "seed": 0,
                             **kw})


def _run(llm, prompts, params, shutdown=True):
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.kv.check_invariants()
        stats = llm.engine.stats()
    finally:
        if shutdown:
            llm.shutdown()
    return outs, stats


def _same(ref, got) -> None:
    """Token-for-token equal, log-probs (chosen and top) within 1e-4."""
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        assert a.finish_reason == b.finish_reason and a.text == b.text
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert list(ta) == list(tb)
            torch.testing.assert_close(torch.tensor(list(tb.values())), torch.tensor(list(ta.values())),
                                       atol=1e-4, rtol=0)


def _speculated(stats) -> None:
    assert stats.spec["num_drafts"] > 0 and stats.spec["num_accepted_tokens"] > 0, stats.spec


@pytest.fixture(scope="module")
def reference(model, engines):
    """The single-rank reference without speculation, per prompt set."""
    cache = {}

    def get(seed, **kw):
        key = (seed, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = _run(engines(model, 1, max_kv_tokens_per_rank=4096), _prompts(seed), _params(**kw))[0]
        return cache[key]
    return get


@pytest.mark.parametrize("verify", ["decode", "prefill"])
@pytest.mark.parametrize("cp,placement", [(1, "auto"), (2, "auto"), (2, "shard"), (3, "auto"), (3, "shard")])
def test_greedy_with_speculation_equals_without(model, engines, reference, cp, placement, verify):
    """Both verify paths (`spec_verify`): drafts as decode rows (pass-Q, the decode rule) and as a partial prefill
    (the ring chosen as for a mixed forward); every verify step of a spread request took the path asked for."""
    outs, stats = _run(engines(model, cp, placement=placement, max_kv_tokens_per_rank=4096,
                               speculative_config=NGRAM, spec_verify=verify), _prompts(0), _params())
    _same(reference(0), outs)
    _speculated(stats)
    ring = [st for o in outs for st in o.metrics["steps"] if "spec" in st and st["placement"] == "spread"]
    assert bool(ring) == (placement == "shard")  # shard: every request spreads; auto keeps these on one rank
    for st in ring:
        assert (st["method"] == "decode" and st["strategy"] == "pass-q") if verify == "decode" else \
            st["method"] in ("alg5", "empirical"), st
    spec = [o.metrics["spec"] for o in outs if "spec" in o.metrics]
    assert sum(m["num_accepted_tokens"] for m in spec) == stats.spec["num_accepted_tokens"]
    assert stats.spec["num_emitted_tokens"] == stats.spec["num_drafts"] + stats.spec["num_accepted_tokens"]


@pytest.mark.parametrize("cp", [2, 3])
def test_chunked_prefill_and_prefix_sharing(model, engines, reference, cp):
    """Prompts sharing a passage admitted together in 16-token chunks, then the same prompts again (their prefixes
    now cached, finished requests' leaves holding only verified tokens)."""
    llm = engines(model, cp, placement="shard" if cp == 3 else "auto", max_kv_tokens_per_rank=4096,
                  max_num_batched_tokens=16, speculative_config=NGRAM)
    try:
        first, _ = _run(llm, _prompts(0), _params(), shutdown=False)
        again, stats = _run(llm, _prompts(0), _params(), shutdown=False)
        assert stats.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    _same(reference(0), first)
    _same(reference(0), again)
    _speculated(stats)


def test_preemption_mid_speculation(model, engines, reference):
    """A cache too small for every request at once: requests are preempted while they speculate and recomputed."""
    prompts = _prompts(0) * 3
    llm = engines(model, 2, max_kv_tokens_per_rank=256, max_num_seqs=9, speculative_config=NGRAM)
    outs, stats = _run(llm, prompts, _params())
    assert stats.preemptions > 0
    _same(reference(0) * 3, outs)
    _speculated(stats)


def test_host_tier_and_fp8(model, engines, reference):
    """Evicted prefixes go to the host tier and come back; an FP8 cache speculates as it decodes (its reference:
    FP8 without speculation, on the same ranks)."""
    llm = engines(model, 2, max_kv_tokens_per_rank=384, kv_host_gib=0.01, speculative_config=NGRAM)
    try:
        first, _ = _run(llm, _prompts(0), _params(), shutdown=False)
        _run(llm, _prompts(1), _params(), shutdown=False)  # pushes the first prompts' cache to the host tier
        again, stats = _run(llm, _prompts(0), _params(), shutdown=False)
        assert stats.tiers["host"]["hit_tokens"] > 0
    finally:
        llm.shutdown()
    _same(reference(0), first)
    _same(reference(0), again)
    _speculated(stats)
    ref8, _ = _run(engines(model, 2, max_kv_tokens_per_rank=4096, kv_cache_dtype="fp8"), _prompts(0), _params())
    got8, stats8 = _run(engines(model, 2, max_kv_tokens_per_rank=4096, kv_cache_dtype="fp8",
                                speculative_config=NGRAM), _prompts(0), _params())
    _same(ref8, got8)
    _speculated(stats8)


def _runs(out) -> list[dict]:
    """The verify steps of an output that emitted two tokens or more (each with `first`: its first token's index)."""
    return [st["spec"] for st in out.metrics["steps"] if st.get("spec", {}).get("emitted", 0) >= 2]


PASSAGE = ("The quick brown fox jumps over the lazy dog near the river bank, while the old farmer watches from his "
           "porch and sips his tea.")


@pytest.fixture(scope="module")
def quoting():
    """The embedded model asked to repeat a passage (its answer quotes the prompt: long accepted runs), and its
    plain (non-speculative) greedy decoding on one rank: ref(params) → outputs."""
    llm = LLM(None, max_kv_tokens_per_rank=4096, threads_per_rank=1)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly: {PASSAGE}"}],
                                               add_generation_prompt=True, tokenize=False)
    cache = {}

    def ref(params):
        key = repr(params)
        if key not in cache:
            cache[key] = llm.generate([prompt], params, use_tqdm=False)
        return cache[key]
    try:
        yield prompt, ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("cp", [1, 2])
def test_stops_inside_accepted_runs(quoting, engines, cp):
    """Stop tokens and stop strings taken from inside accepted runs (and a stop token with min_tokens), and
    max_tokens there, end the output exactly where plain decoding ends it — text, tokens and log-probs — and they cut verify steps' runs short
    (the rest of the run dropped, its K/V rolled back)."""
    prompt, ref = quoting
    params = _params(max_tokens=32)
    llm = engines(None, cp, max_kv_tokens_per_rank=4096, speculative_config=NGRAM)
    try:
        out, _ = _run(llm, [prompt], params, shutdown=False)
        _same(ref(params), out)
        o = out[0]
        tok = llm.tokenizer
        # accepted drafts (not a run's last token) new in the output: plain decoding stops right there
        picks = [j for r in _runs(o) for j in range(r["first"], r["first"] + r["accepted"])
                 if o.token_ids[j] not in o.token_ids[:j]]
        assert len(picks) >= 3, _runs(o)
        cut_short = 0
        for j in picks[1:4]:
            piece = tok.decode([o.token_ids[j]]).strip()
            cases = [_params(max_tokens=32, stop_token_ids=(o.token_ids[j],)),
                     _params(max_tokens=32, stop_token_ids=(o.token_ids[j],), min_tokens=j)]
            cases += [_params(max_tokens=32, stop=(piece,))] if len(piece) >= 2 else []
            cases += [_params(max_tokens=m) for m in (j, j + 1)]  # max_tokens inside the run
            for p in cases:
                got, _ = _run(llm, [prompt], p, shutdown=False)
                _same(ref(p), got)
                assert got[0].finish_reason == ("length" if not p.stop and not p.stop_token_ids else "stop")
                last = got[0].metrics["steps"][-1].get("spec")
                cut_short += last is not None and last["emitted"] < last["accepted"] + 1
        assert cut_short > 0
        _speculated(llm.engine.stats())
    finally:
        llm.shutdown()


def test_streaming_and_n_samples(model):
    """AsyncLLM: three samples of one prompt (the server's n=3) and another prompt stream together; chunks may
    carry several tokens; the streamed tokens and the finals equal plain decoding's."""
    prompts = [_prompts(0)[0]] * 3 + [_prompts(0)[1]]

    async def main(allm):
        async def one(p):
            chunks, final = [], None
            async for out in allm.generate(p, _params()):
                chunks.append(len(out.token_ids))
                final = out
            return chunks, final
        return await asyncio.gather(*(one(p) for p in prompts))

    finals = {}
    for spec in (None, NGRAM):
        allm = AsyncLLM(str(model), max_kv_tokens_per_rank=4096, speculative_config=spec)
        try:
            finals[spec is not None] = asyncio.run(main(allm))
            stats = allm.stats()
        finally:
            allm.shutdown()
    _same([f for _, f in finals[False]], [f for _, f in finals[True]])
    _speculated(stats)
    steps = [b - a for chunks, _ in finals[True] for a, b in zip(chunks, chunks[1:])]
    assert max(steps) >= 2  # a chunk carried an accepted run


def test_structured_output_and_seeded_sampling(quoting, engines):
    """A JSON-schema grammar: the draft is walked through the grammar and cut where it forbids a token; the output
    equals plain decoding's under the same grammar. Seeded sampling with speculation gives the same tokens again and
    at another CP size (every draw derives from the request's seed and the output index)."""
    from cpinfer.engine.structured import json_schema_grammar

    prompt, ref = quoting
    grammar = json_schema_grammar({"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"], "additionalProperties": False})
    constrained = _params(max_tokens=32, grammar=grammar)
    sampled = _params(max_tokens=32, temperature=0.8, top_p=0.95, seed=5)
    runs = {}
    for cp in (1, 2):
        llm = engines(None, cp, max_kv_tokens_per_rank=4096, speculative_config=NGRAM)
        try:
            if cp == 1:
                got, _ = _run(llm, [prompt], constrained, shutdown=False)
                _same(ref(constrained), got)
                assert got[0].text.startswith("{") and got[0].metrics["spec"]["num_accepted_tokens"] > 0
            runs[cp] = [_run(llm, [prompt], sampled, shutdown=False)[0][0] for _ in range(2)]
        finally:
            llm.shutdown()
    assert runs[1][0].token_ids == runs[1][1].token_ids == runs[2][0].token_ids == runs[2][1].token_ids
    assert runs[1][0].metrics["spec"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("variant", ["gemma3", "mistral", "deepseek_v3"])
def test_other_families(llama_checkpoint, engines, variant):
    """Models with sliding-window layers (the ranks' slot positions stay valid through rollbacks: a rejected slot
    is written again by the token that takes it next) and multi-head latent attention (a verify sequence is a
    partial prefill in whichever form the cost model picks)."""
    path = llama_checkpoint(variant, seed=2, max_position_embeddings=2048)
    ref, _ = _run(engines(path, 1, max_kv_tokens_per_rank=4096), _prompts(0), _params())
    got, stats = _run(engines(path, 2, placement="shard", max_kv_tokens_per_rank=4096, speculative_config=NGRAM),
                      _prompts(0), _params())
    _same(ref, got)
    _speculated(stats)
