"""Adaptive placement end to end on CPU ranks (gloo), exact against Hugging Face transformers at CP 2 and 3.

A spy on every rank counts the torch.distributed calls and records the shape of every ring message and All2All:
forwards whose sequences all sit on one rank issue none, a rank with no token skips the model, and in a mixed
forward only the spread sequence's rows travel. The hardware profile is cpu-gloo with 30x faster links, so that on
the tiny test model prompts above ~130 tokens spread and short ones stay local (the threshold is the cost model's).
"""
import dataclasses
import os

import numpy as np
import pytest
import torch.distributed as dist

from cpinfer import LLM, SamplingParams
from cpinfer.engine.kv.manager import BLOCK
from cpinfer.perf.hardware import load_hardware_profile
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import keyed_engines

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
SPIED = ("batch_isend_irecv", "all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor",
         "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "barrier", "send", "recv")


# ---------------------------------------------------------------- run on every rank

def install_spy(ctx) -> None:
    """Wrap this rank's torch.distributed collectives and its model's forward with counters (once per process)."""
    spy = ctx.state.get("spy")
    if spy is None:
        spy = ctx.state["spy"] = {}
        ctx.state["spy_originals"] = {name: getattr(dist, name) for name in SPIED}
        for name in SPIED:
            setattr(dist, name, _counted(getattr(dist, name), name, spy))
        model = ctx.state["runner"].model
        forward = model.forward

        def counted_forward(*args, **kwargs):
            spy["model_forwards"] = spy.get("model_forwards", 0) + 1
            return forward(*args, **kwargs)

        model.forward = counted_forward
    spy.clear()


def remove_spy(ctx) -> None:
    """Put torch.distributed back (rank 0 runs in the test process: its functions must not stay wrapped)."""
    for name, fn in ctx.state.pop("spy_originals", {}).items():
        setattr(dist, name, fn)
    ctx.state.pop("spy", None)


def _counted(fn, name, spy):
    def wrapper(*args, **kwargs):
        spy[name] = spy.get(name, 0) + 1
        if name == "batch_isend_irecv":  # the ring: the tensor this rank sends
            spy.setdefault("ring_shapes", []).append(tuple(args[0][0].tensor.shape))
        if name == "all_to_all_single":  # pass-Q's partial outputs going home
            spy.setdefault("all2all_shapes", []).append(tuple(args[1].shape))
        return fn(*args, **kwargs)
    return wrapper


def read_spy(ctx) -> dict:
    out = dict(ctx.state["spy"])
    ctx.state["spy"].clear()
    return out


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def model(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def fast_profile(tmp_path_factory):
    hw = load_hardware_profile("cpu-gloo")
    f = 30.0
    fast = dataclasses.replace(hw, name="cpu-fast-links", inter_latency_us=hw.inter_latency_us / f,
                               intra_latency_us=hw.intra_latency_us / f, ring_step_us=hw.ring_step_us / f,
                               inter_gbs=hw.inter_gbs * f, inter_gbs_peak=hw.inter_gbs_peak * f,
                               intra_gbs=hw.intra_gbs * f)
    path = tmp_path_factory.mktemp("profile") / "fast.json"
    fast.to_json(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(model, fast_profile):
    """`engine(cp, **kw)`: the LLM of (CP, options) with spies on its ranks, reused until another one is asked for
    on the same number of ranks; one pool of ranks per CP size serves the module (tests/pooled_engine.py), rank 0 in
    this process as a real engine's."""
    spied: list = []
    for get in keyed_engines(threads_per_rank=1, timeout_s=120, hardware_profile=fast_profile):
        def spied_engine(cp, **kw):
            llm = get(model, cp, **kw)
            if not any(llm is other for other in spied):  # a new engine: spy on its model (the pool's may be older)
                llm.engine._pool.run(remove_spy)
                llm.engine._pool.run(install_spy)
                spied.append(llm)
            return llm
        try:
            yield spied_engine
        finally:  # rank 0 runs in this process: its torch.distributed functions must not stay wrapped
            for llm in spied:
                if llm.engine._pool is not None:  # the pools' engines now (the others were shut down)
                    llm.engine._pool.run(remove_spy)


def spies(llm) -> list[dict]:
    return llm.engine._pool.run(read_spy)


def collectives(spy: dict) -> int:
    return sum(spy.get(name, 0) for name in SPIED)


def placements(out) -> list[str]:
    return [s["placement"] for s in out.metrics["steps"]]


def path_slots(kv, tokens) -> list[tuple[int, int]]:
    """(rank, slot) of each token of the longest cached prefix of `tokens`, read from the prefix tree."""
    node, inside, matched = kv.match(np.asarray(tokens, dtype=np.int64), len(tokens))
    pairs, p = [], node
    take = inside
    while p is not kv.root:
        pairs = list(zip(p.rank.view[:take].tolist(), p.slot.view[:take].tolist())) + pairs
        p = p.parent
        take = len(p) if p is not kv.root else 0
    assert len(pairs) == matched
    return pairs


# ---------------------------------------------------------------- tests

def _pid(ctx) -> int:
    return os.getpid()


def test_lone_requests_decode_on_rank_0_in_this_process_without_a_message(model, engine):
    """At CP2 on CPU rank 0 runs inside the driver (this process). A request arriving alone goes there — the second
    one too, although the first one's cached tokens make rank 0 the more loaded, since it is less ahead than the
    request's own tokens — and none of their forwards sends rank 1 anything. (First test of the module: it needs
    the engine fresh.)"""
    llm = engine(2, max_kv_tokens_per_rank=4096)
    pool = llm.engine._pool
    assert pool.driver_rank and pool.run(_pid)[0] == os.getpid()
    spies(llm)
    sent = []
    send = pool._inboxes[1].send
    pool._inboxes[1].send = lambda msg: (sent.append(getattr(msg[0], "__name__", "?")), send(msg))[1]
    try:
        prompts = prompts_for(256, [40, 60], seed=5)
        outs = [llm.generate([p], SamplingParams(max_tokens=8, **GREEDY))[0] for p in prompts]  # one after the other
    finally:
        pool._inboxes[1].send = send
    check_against_hf(model, outs, prompts, 8, check_prompt_lp=False)
    assert llm.engine.kv.tokens_per_rank()[1] == 0
    assert all(s["new_tokens_per_rank"][1] == 0 and s["placement"] == "local" for o in outs for s in o.metrics["steps"])
    assert sent == [], sent  # not one message to the rank process
    rank0, rank1 = spies(llm)
    assert rank0["model_forwards"] == sum(len(o.metrics["steps"]) for o in outs) and collectives(rank0) == 0
    assert rank1 == {}, rank1


def test_local_forwards_issue_no_collective_and_idle_ranks_skip_the_model(model, engine):
    llm = engine(2, max_kv_tokens_per_rank=4096)
    spies(llm)
    prompts = prompts_for(256, [5, 23, 40, 60], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))
    check_against_hf(model, outs, prompts, 6)
    assert all(p == "local" for o in outs for p in placements(o))
    assert {s["strategy"] for o in outs for s in o.metrics["steps"]} == {"local"}
    ranks = {tuple(np.nonzero(s["new_tokens_per_rank"])[0]) for o in outs for s in o.metrics["steps"]}
    assert ranks == {(0,), (1,)}  # both ranks hold requests: least-loaded first
    first_turn = spies(llm)
    assert [collectives(s) for s in first_turn] == [0, 0], first_turn  # no SendRecv, no All2All, nothing
    # one request alone: its rank runs the model every forward, the other rank never does
    turn2 = prompts[0] + outs[0].token_ids + [9, 10]
    out = llm.generate([turn2], SamplingParams(max_tokens=5, **GREEDY))[0]
    check_against_hf(model, [out], [turn2], 5, check_prompt_lp=False)
    assert out.num_cached_tokens == len(prompts[0]) + 5
    home = int(np.argmax(out.metrics["steps"][0]["new_tokens_per_rank"]))
    alone = spies(llm)
    assert [collectives(s) for s in alone] == [0, 0]
    assert alone[home].get("model_forwards") == len(out.metrics["steps"]) == 5
    assert alone[1 - home].get("model_forwards", 0) == 0
    llm.engine.kv.check_invariants()


def test_mixed_forward_rings_only_the_spread_sequence(model, engine):
    llm = engine(2, max_kv_tokens_per_rank=4096)
    spies(llm)
    long, *short = prompts_for(256, [900, 12, 30, 45], seed=2)
    outs = llm.generate([long, *short], SamplingParams(max_tokens=6, **GREEDY))
    check_against_hf(model, outs, [long, *short], 6, check_prompt_lp=False)
    assert placements(outs[0]) == ["spread"] * 6
    assert all(placements(o) == ["local"] * 6 for o in outs[1:])
    first = outs[0].metrics["steps"][0]
    assert first["placement_inputs"]["method"] == "auto" and first["strategy"] == "pass-kv"
    assert first["placement_inputs"]["spread_s"] < first["placement_inputs"]["local_s"]
    assert [o.metrics["steps"][0]["strategy"] for o in outs[1:]] == ["pass-kv"] * 3  # the forward rang for the long one
    rows_long = max(first["new_tokens_per_rank"])
    layers, heads, kv_heads, d = 2, 8, 2, 8
    for spy in spies(llm):  # every message carries the long sequence's rows only (the short ones' never travel)
        assert spy["batch_isend_irecv"] == layers * 6 and spy["all_to_all_single"] == layers * 5
        assert set(spy["ring_shapes"]) == {(rows_long, kv_heads, 2 * d), (1, heads, d)}  # prefill K|V, decode Q
        assert set(spy["all2all_shapes"]) == {(2, 1, heads, d + 1)}  # one decode query's partial per rank
        assert collectives(spy) == spy["batch_isend_irecv"] + spy["all_to_all_single"]
    llm.engine.kv.check_invariants()


def test_growth_spreads_new_tokens_and_never_moves_old_ones(model, engine):
    llm = engine(2, max_kv_tokens_per_rank=4096)
    chat, document, question = prompts_for(256, [30, 1000, 8], seed=3)
    t1 = llm.generate([chat], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert placements(t1) == ["local"] * 6
    kv = llm.engine.kv
    before = path_slots(kv, chat + t1.token_ids)
    turn2 = chat + t1.token_ids + document  # a long document appended to a short chat
    t2 = llm.generate([turn2], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert t2.num_cached_tokens == len(chat) + 5 and placements(t2) == ["spread"] * 6
    assert path_slots(kv, turn2)[:len(before)] == before  # the chat's K/V stayed where they were
    per_rank = t2.metrics["steps"][0]["new_tokens_per_rank"]
    assert min(per_rank) > 0 and abs(per_rank[0] - per_rank[1]) <= 4  # the document 2N-sharded
    turn3 = turn2 + t2.token_ids + question
    t3 = llm.generate([turn3], SamplingParams(max_tokens=6, **GREEDY))[0]
    assert placements(t3) == ["spread"] * 6 and t3.metrics["steps"][0]["strategy"] in ("pass-kv", "pass-q")
    check_against_hf(model, [t1, t2, t3], [chat, turn2, turn3], 6, check_prompt_lp=False)
    kv.check_invariants()


def test_mixed_batches_with_shared_prefixes_and_chunks_are_exact_at_cp3(model, engine):
    llm = engine(3, max_kv_tokens_per_rank=4096, max_num_batched_tokens=256)
    doc, long, *shorts = prompts_for(256, [700, 500, 9, 25, 14, 40], seed=4)
    questions = [doc + s for s in shorts[:2]]  # two questions on one document (read from the cache)
    prompts = questions + [long] + shorts[2:]
    outs = llm.generate(prompts, SamplingParams(max_tokens=7, **GREEDY))
    check_against_hf(model, outs, prompts, 7, check_prompt_lp=False)
    assert outs[1].num_cached_tokens >= len(doc)
    assert placements(outs[0])[0] == "spread" and placements(outs[2])[0] == "spread"  # chunked, counted whole
    assert all(p == "local" for o in outs[3:] for p in placements(o))
    phases = {(s["phase"], s["placement"]) for o in outs for s in o.metrics["steps"]}
    assert ("mixed", "local") in phases or ("prefill", "local") in phases
    assert len([s for s in outs[2].metrics["steps"] if s["phase"] != "decode"]) >= 2  # the long one was chunked
    # a second turn of a local conversation stays local; of a spread one stays spread
    turns = [shorts[2] + outs[3].token_ids + [5, 6], doc + shorts[0] + outs[0].token_ids + [7]]
    again = llm.generate(turns, SamplingParams(max_tokens=4, **GREEDY))
    check_against_hf(model, again, turns, 4, check_prompt_lp=False)
    assert placements(again[0]) == ["local"] * 4 and placements(again[1]) == ["spread"] * 4
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("cp", [2, 3])
def test_full_ranks_spill_and_preempt_without_changing_outputs(model, engine, cp):
    """Placement "local" with ranks too small for two whole conversations: decode tokens spill to other ranks
    (the sequence then spreads), requests are preempted and recomputed, and every output still equals HF."""
    cap = -(-700 // cp // BLOCK) * BLOCK + BLOCK
    llm = engine(cp, max_kv_tokens_per_rank=cap, placement="local")
    prompts = prompts_for(256, [250, 250, 30], seed=5 + cp)
    outs = llm.generate(prompts, SamplingParams(max_tokens=250, **GREEDY))
    check_against_hf(model, outs, prompts, 250, check_prompt_lp=False)
    steps = [s for o in outs for s in o.metrics["steps"]]
    assert any(s.get("placement_inputs", {}).get("method") == "capacity" for s in steps) or \
        llm.engine.stats().preemptions > 0
    assert {s["placement"] for s in steps} == {"local", "spread"}  # some spilled: their next forwards ring
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("variant", ["gemma3", "mistral"])
def test_sliding_windows_in_mixed_forwards(llama_checkpoint, fast_profile, variant):
    """Sliding-window layers (window 16-24) with some requests spread and some local in the same forwards: the
    windowed plans split the same way (the ring's sequences over every rank, the local ones on their rank), and
    every output equals HF."""
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    with LLM(str(path), context_parallel_size=2, threads_per_rank=1, timeout_s=120, max_kv_tokens_per_rank=2048,
             hardware_profile=fast_profile, max_num_batched_tokens=512) as llm:
        long, *short = prompts_for(llm.config.vocab_size, [700, 10, 33], seed=8)
        outs = llm.generate([long, *short], SamplingParams(max_tokens=6, **GREEDY))
        assert placements(outs[0])[0] == "spread" and all(placements(o) == ["local"] * 6 for o in outs[1:])
        turns = [short[0] + outs[1].token_ids + [4, 5, 6], long + outs[0].token_ids + [7]]
        again = llm.generate(turns, SamplingParams(max_tokens=5, **GREEDY))
    check_against_hf(path, outs, [long, *short], 6, check_prompt_lp=False)
    check_against_hf(path, again, turns, 5, check_prompt_lp=False)
    assert placements(again[0]) == ["local"] * 5 and placements(again[1]) == ["spread"] * 5
