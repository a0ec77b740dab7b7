"""The online engine end to end on CPU ranks (gloo), exact against Hugging Face transformers, CP 1, 2 and 3:
shared prefixes computed once, segment splits, chunked prefill beside running decodes, preemption, abort, streaming.
One engine per (CP, options) for the whole module."""
import asyncio

import numpy as np
import pytest

from cpinfer import AsyncLLM, SamplingParams
from cpinfer.engine.kv.manager import BLOCK
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import keyed_engines
from wait_utils import async_wait_until

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)


@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def engine(model):
    """`engine(cp, **kw)`: the LLM of (CP, options), reused until another one is asked for on the same number of
    ranks; one pool of ranks per CP size serves the module (tests/pooled_engine.py)."""
    # placement "shard": these tests exercise the ring; tests/test_placement.py the rest
    for get in keyed_engines(threads_per_rank=1, timeout_s=120, placement="shard"):
        yield lambda cp, **kw: get(model, cp, **kw)


def _total(llm) -> int:
    return sum(llm.cache_stats()["kv_tokens_per_rank"])


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_four_questions_on_one_document_compute_it_once(model, engine, cp):
    llm = engine(cp, max_kv_tokens_per_rank=4096)
    doc, *questions = prompts_for(256, [2000, 9, 14, 11, 20], seed=10 + cp)
    prompts = [doc + q for q in questions]
    before, hits_before = llm.cache_stats(), llm.cache_stats()["prefix_cache_hits"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    check_against_hf(model, outs, prompts, 6, check_prompt_lp=False)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(doc) for o in outs[1:])  # arrived together, read the first one's K/V
    after = llm.cache_stats()
    stored = sum(after["kv_tokens_per_rank"]) - sum(before["kv_tokens_per_rank"])
    assert stored == len(doc) + sum(map(len, questions)) + 4 * 5  # one copy of the document (+ fed output tokens)
    assert after["prefix_cache_hits"] - hits_before >= 3 * len(doc)
    grown = np.asarray(after["kv_tokens_per_rank"]) - np.asarray(before["kv_tokens_per_rank"])
    assert grown.max() - grown.min() <= 5 * 2 * cp, grown  # balanced: < 2N per segment (2N-chunk rounding)
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_branching_mid_segment_stays_exact(model, engine, cp):
    llm = engine(cp, max_kv_tokens_per_rank=4096)
    a, tail = prompts_for(256, [300, 50], seed=20 + cp)
    first = llm.generate([a], SamplingParams(max_tokens=5, **GREEDY))[0]
    branch = a[:150] + tail  # diverges in the middle of the cached segment: the segment splits
    b = llm.generate([branch], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert b.num_cached_tokens == 150
    turn2 = a + first.token_ids + [7, 8, 9]
    c = llm.generate([turn2], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert c.num_cached_tokens == len(a) + len(first.token_ids) - 1
    d = llm.generate([branch + b.token_ids + [5]], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert d.num_cached_tokens == len(branch) + len(b.token_ids) - 1
    check_against_hf(model, [b, c, d], [branch, turn2, branch + b.token_ids + [5]], 5, check_prompt_lp=False)
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_chunked_prefill_is_exact_while_another_request_decodes(model, engine, cp):
    budget = 64
    llm = engine(cp, max_kv_tokens_per_rank=2048, max_num_batched_tokens=budget)
    eng = llm.engine
    short, long = prompts_for(256, [12, 8 * budget], seed=30 + cp)
    eng.add_request("short", short, SamplingParams(max_tokens=40, **GREEDY))
    eng.step()  # the short request's prefill
    eng.add_request("long", long, SamplingParams(max_tokens=4, prompt_logprobs=True, **GREEDY))
    final, short_tokens_during_long_prefill, long_prefill_steps = {}, 0, 0
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        prefilling = "long" in eng.requests and eng.requests["long"].num_stored < len(long)
        outs = eng.step()
        long_prefill_steps += prefilling
        short_tokens_during_long_prefill += prefilling and any(o.request_id == "short" for o in outs)
        final.update({o.request_id: o for o in outs if o.finished})
    assert long_prefill_steps >= 8 and short_tokens_during_long_prefill >= 7  # decode kept going between chunks
    chunk_steps = [s for s in final["long"].metrics["steps"] if s["phase"] != "decode"]
    assert len(chunk_steps) >= 8
    assert {s["strategy"] for s in chunk_steps} <= ({"pass-kv", "pass-q"} if cp > 1 else {"local"})
    check_against_hf(model, [final["long"]], [long], 4)  # prompt log-probs too
    check_against_hf(model, [final["short"]], [short], 40, check_prompt_lp=False)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_preemption_keeps_outputs_and_abort_frees_everything(model, engine, cp):
    cap = -(-(-(-700 // cp)) // BLOCK) * BLOCK + BLOCK
    llm = engine(cp, max_kv_tokens_per_rank=cap)
    eng = llm.engine
    prompts = prompts_for(256, [250, 250], seed=40 + cp)
    before = eng.stats().preemptions
    outs = llm.generate(prompts, SamplingParams(max_tokens=250, **GREEDY))  # together they overflow the cache
    assert eng.stats().preemptions > before
    check_against_hf(model, outs, prompts, 250, check_prompt_lp=False)
    eng.kv.check_invariants()
    # abort mid-decode: everything the request held is freed at the next step
    used = _total(llm)
    fresh = prompts_for(256, [100], seed=50 + cp)[0]
    eng.add_request("to-abort", fresh, SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(5):
        eng.step()
    assert eng.requests["to-abort"].out and _total(llm) > used
    eng.abort("to-abort")
    outs = eng.step()
    assert [o.finish_reason for o in outs if o.request_id == "to-abort"] == ["abort"]
    assert not eng.has_unfinished_requests()
    assert _total(llm) <= used  # (an eviction for room may have freed cached tokens too)
    eng.kv.check_invariants()


def test_bad_requests_are_refused_before_compute(model, engine):
    llm = engine(2, max_kv_tokens_per_rank=4096)
    eng = llm.engine
    cases = [([], "prompt is empty"), ([1, 2, 256], r"outside \[0, 256\)"), (list(range(3, 100)) * 50, "exceeds")]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.add_request("bad", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="maximum model length 4096"):
        llm.generate([[5] * 4000], SamplingParams(max_tokens=100))
    eng.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unknown request id"):
        eng.abort("never-added")
    while eng.has_unfinished_requests():
        eng.step()
    ok = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, **GREEDY))[0]
    check_against_hf(model, [ok], [[5, 6, 7, 8]], 3, check_prompt_lp=False)


def test_seeded_sampling_and_stop_tokens(model, engine):
    llm = engine(2, max_kv_tokens_per_rank=4096)
    prompt = prompts_for(256, [40], seed=3)[0]
    sp = SamplingParams(max_tokens=12, seed=7, top_k=30, top_p=0.9, temperature=0.8, top_logprobs=3, ignore_eos=True)
    a, b = llm.generate([prompt, prompt], sp)
    assert a.token_ids == b.token_ids and len(a.top_logprobs) == 12 and all(len(t) == 3 for t in a.top_logprobs)
    for lp, top, tok in zip(a.logprobs, a.top_logprobs, a.token_ids):  # top-k are the largest, the chosen is exact
        assert max(top.values()) >= lp - 1e-6 and (tok not in top or abs(top[tok] - lp) < 1e-6)
    greedy = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].token_ids
    stopped = llm.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[greedy[2]], **GREEDY))[0]
    assert stopped.token_ids == greedy[:greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == greedy[2]


def test_async_stream_deltas_concatenate_to_the_output(model):
    async def main(allm, prompts):
        async def one(i, p):
            seen, deltas = [], []
            async for out in allm.generate(p, SamplingParams(max_tokens=12, **GREEDY), request_id=f"s{i}"):
                deltas.append(out.token_ids[len(seen):])
                seen = list(out.token_ids)
            return deltas, out
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        # a stream closed early is aborted and frees its blocks
        stream = allm.add_request("early", prompts[0] + [9, 9], SamplingParams(max_tokens=200, **GREEDY))
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        await stream.aclose()

        def freed():  # the abort reaches the engine loop and is applied there: no time is promised, wait with a bound
            st = allm.stats()
            return st.num_running == 0 and st.num_waiting == 0 and st.requests_finished.get("abort", 0) >= 1

        await async_wait_until(freed, what="the early-closed stream aborted and freed")
        return results

    prompts = prompts_for(256, [30, 50, 70], seed=60)
    allm = AsyncLLM(str(model), context_parallel_size=2, threads_per_rank=1, timeout_s=120,
                    max_kv_tokens_per_rank=2048)
    try:
        results = asyncio.run(main(allm, prompts))
        stats = allm.stats()
    finally:
        allm.shutdown()
    for (deltas, final), p in zip(results, prompts):
        assert final.finished and sum(deltas, []) == final.token_ids
        assert len(deltas) >= 2 and all(len(d) >= 1 for d in deltas)
    check_against_hf(model, [r[1] for r in results], prompts, 12, check_prompt_lp=False)
    assert stats.requests_finished.get("abort", 0) == 1 and stats.num_running == 0
    # the hand-off of each step's outputs to the event loop is timed in the step's host timings
    assert all(st["host"]["stream_s"] >= 0 for _, final in results for st in final.metrics["steps"])
