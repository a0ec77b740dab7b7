"""Prefill and decode on separate groups of ranks: outputs equal colocated CP1, the K/V moved once per token.

One worker pool per world size serves every P/D layout of that size (each engine builds its roles' groups on it),
so the ranks start once per module.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

from checkpoints import write_hf_checkpoint
from cpinfer.cp.pd_plan import plan_transfer
from cpinfer.engine.llm import LLM
from cpinfer.engine.sampling import SamplingParams
from cpinfer.launch import WorkerPool
from pooled_engine import pd_llm as _pd_llm
from wait_utils import SETTLE_S, async_wait_until, settle

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)


@pytest.fixture(scope="module")
def pools():
    made: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        if world not in made:
            made[world] = WorkerPool(world, threads_per_rank=1, timeout_s=120)
        return made[world]

    try:
        yield get
    finally:
        for p in made.values():
            p.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("pd-llama"), "gqa")


def _prompts(seed=0, lengths=(37, 90, 5, 61)):
    rng = np.random.default_rng(seed)
    doc = rng.integers(3, 250, size=40).tolist()  # a shared document: prefix sharing on both sides
    out = [rng.integers(3, 250, size=n).tolist() for n in lengths]
    return out + [doc + [7, 8, 9], doc + [10, 11]]


def _reference(path, prompts, params=GREEDY):
    ref = LLM(str(path), threads_per_rank=1)
    try:
        return ref.generate(prompts, params, use_tqdm=False)
    finally:
        ref.shutdown()


def _assert_same(ref, got, atol=1e-4):
    worst = 0.0
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids, (a.request_id, a.token_ids, b.token_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=atol, rtol=0)
        worst = max(worst, float(np.abs(np.subtract(a.logprobs, b.logprobs)).max()))
    return worst


LAYOUTS = [  # (N, M, K, TP): prefill CP, decode CP, decode groups, TP
    (2, 1, 1, 1), (1, 2, 1, 1), (3, 2, 1, 1), (2, 2, 1, 1), (2, 1, 1, 2), (2, 1, 2, 1)]


def test_plan_maps_every_token_once_grouped_per_pair():
    rng = np.random.default_rng(1)
    t = 200
    src_r, dst_r = rng.integers(0, 3, t), rng.integers(0, 2, t)
    src_s, dst_s = rng.permutation(1000)[:t], rng.permutation(1000)[:t]
    plan = plan_transfer(np.arange(t), src_r, src_s, dst_r, dst_s)
    assert plan.num_tokens == t
    seen = np.concatenate([p.src_slots for p in plan.pairs])
    assert sorted(seen.tolist()) == sorted(src_s.tolist())  # every token exactly once
    assert len({(p.src, p.dst) for p in plan.pairs}) == len(plan.pairs) <= 6  # one entry per pair
    for p in plan.pairs:
        idx = np.flatnonzero((src_r == p.src) & (dst_r == p.dst))  # position order inside the pair
        np.testing.assert_array_equal(p.src_slots, src_s[idx])
        np.testing.assert_array_equal(p.dst_slots, dst_s[idx])
        np.testing.assert_array_equal(p.positions, idx)


def _window_bytes(engine, pd: dict, stored: int) -> int:
    """The bytes a handoff of positions [cached, stored) moves: every row of a full-attention layer, the rows at
    positions >= stored - window of a sliding-window layer (one layer's share of kv_bytes_per_token each)."""
    windows = engine.prefill.config.windows
    per_layer = engine.kv_bytes_per_token // len(windows)
    pos = np.arange(pd["decode_cached_tokens"], stored)
    return sum(per_layer * (len(pos) if w is None else int((pos >= stored - w).sum())) for w in windows)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "%d-%d_k%d_tp%d" % l)
def test_pd_equals_colocated_cp1(pools, llama, layout):
    n, m, k, tp = layout
    prompts = _prompts()
    ref = _reference(llama, prompts)
    llm = _pd_llm(pools((n + k * m) * tp), llama, context_parallel_size=n, pd_decode_cp=m, pd_decode_groups=k,
                  tensor_parallel_size=tp, placement="shard")
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        worst = _assert_same(ref, got)
        print(f"P/D {n}->{m} x{k} TP{tp}: max |d logprob| {worst:.2e}")
        groups = {o.metrics["pd"]["decode_group"] for o in got}
        assert groups <= set(range(k)) and (k == 1 or len(groups) == k)  # spread over the decode groups
        for o in got:  # every request moved once, with its prompt's bytes: tokens x bytes per token x TP ranks
            pd = o.metrics["pd"]
            assert pd["transfer_tokens"] + pd["decode_cached_tokens"] == len(o.prompt_token_ids)
            if tp == 1:
                assert pd["transfer_bytes"] == pd["transfer_tokens"] * llm.engine.kv_bytes_per_token
        s = llm.engine.pd_stats()
        assert s["handoffs"] == len(prompts) and s["parked"] == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
def test_pd_equals_transformers(pools, llama, layout):
    """Greedy tokens and log-probs (output and prompt) of P/D against transformers' uncached forward."""
    from hf_oracle import check_against_hf

    n, m = layout
    prompts = _prompts(seed=2, lengths=(33, 70))
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    llm = _pd_llm(pools(n + m), llama, context_parallel_size=n, pd_decode_cp=m, placement="shard")
    try:
        worst = check_against_hf(llama, llm.generate(prompts, params, use_tqdm=False), prompts, 10)
        print(f"P/D {n}->{m} vs transformers: max |d logprob| {worst:.2e}")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("variant", ["gqa", "gemma3"])
def test_chunked_prefill_and_preemption_on_the_decode_group(pools, family_checkpoint, variant):
    """Chunked prefill on the prefill group, and preemption on a small decode group (it recomputes there; with
    sliding windows, from rows of which only the window was sent)."""
    llama = family_checkpoint(variant)
    prompts = _prompts(seed=3, lengths=(45, 52, 38))
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=True)
    ref = _reference(llama, prompts, params)
    llm = _pd_llm(pools(3), llama, context_parallel_size=2, pd_decode_cp=1, placement="shard",
                  max_num_batched_tokens=32, max_kv_tokens_per_rank=192)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        _assert_same(ref, got)
        assert llm.engine.decode[0].scheduler.num_preemptions > 0  # the decode group ran out and recomputed
        st = llm.engine.prefill.stats()
        assert sum(st.forwards.values()) >= -(-st.prompt_tokens // 32)  # chunks of at most 32 tokens
        assert all(k.startswith("prefill/") for k in st.forwards), st.forwards  # the prefill group never decodes
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
def test_multi_turn_history_cached_on_the_prefill_group(pools, llama, layout):
    """A chat's second turn finds its whole history, the first answer included, in the prefill ranks' tree."""
    n, m = layout
    llm = _pd_llm(pools(n + m), llama, context_parallel_size=n, pd_decode_cp=m, placement="shard")
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True)
    try:
        first = llm.generate([_prompts(seed=5)[0]], params, use_tqdm=False)[0]
        turn2 = first.prompt_token_ids + first.token_ids + [5, 6, 7, 8]
        second = llm.generate([turn2], GREEDY, use_tqdm=False)
        _assert_same(_reference(llama, [turn2], GREEDY), second)
        history = len(first.prompt_token_ids) + len(first.token_ids) - 1  # the last answer token has no K/V yet
        assert second[0].num_cached_tokens == history, (second[0].num_cached_tokens, history)
        # each answer moves back once its request retires; generate does not wait for the second's rows: settle
        assert settle(llm.engine) == []
        s = llm.engine.pd_stats()
        moved = len(first.token_ids) - 1 + len(second[0].token_ids) - 1  # both answers, less their last tokens
        assert s["move_backs"] == 2 and s["move_back_bytes"] == moved * llm.engine.kv_bytes_per_token, s
        for g in llm.engine.groups:
            g.kv.check_invariants()
    finally:
        llm.shutdown()


def test_refusals(llama):
    with pytest.raises(ValueError, match="placement 'local'"):
        LLM(str(llama), context_parallel_size=2, pd_decode_cp=1, placement="local")
    with pytest.raises(ValueError, match="pd_decode_groups"):
        LLM(str(llama), pd_decode_groups=2)
    with pytest.raises(ValueError, match="pd_decode_cp must be a positive integer"):
        LLM(str(llama), context_parallel_size=2, pd_decode_cp=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        LLM(str(llama), context_parallel_size=2, pd_decode_cp=1, tensor_parallel_size=3)


FAMILIES = [("gemma3", "auto"), ("gpt_oss", "auto"), ("deepseek_v3", "auto"), ("gqa", "fp8"), ("deepseek_v3", "fp8")]


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = write_hf_checkpoint(tmp_path_factory.mktemp(f"pd-{variant}"), variant)
        return made[variant]

    return get


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "-".join(f))
def test_families_and_fp8_equal_colocated(pools, family_checkpoint, family, layout):
    """Sliding window (gemma3: the decode group mirrors the received slots' positions), MoE with sinks (gpt_oss),
    MLA latents (deepseek_v3) and an FP8 cache (its stored bytes move): equal to colocated CP1 of the same cache
    dtype, and each request's transfer is its tokens x the stored bytes per token."""
    variant, kv_dtype = family
    n, m = layout
    path = family_checkpoint(variant)
    prompts = _prompts(seed=7, lengths=(70, 21))
    ref = LLM(str(path), threads_per_rank=1, kv_cache_dtype=kv_dtype)
    try:
        want = ref.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        ref.shutdown()
    llm = _pd_llm(pools(n + m), path, context_parallel_size=n, pd_decode_cp=m, placement="shard",
                  kv_cache_dtype=kv_dtype)
    try:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        worst = _assert_same(want, got)
        per_token = llm.engine.kv_bytes_per_token
        print(f"P/D {n}->{m} {variant} kv {kv_dtype}: max |d logprob| {worst:.2e}, {per_token} bytes/token")
        for o in got:  # full-attention layers: every row; windowed ones: the window's
            pd = o.metrics["pd"]
            assert pd["transfer_bytes"] == _window_bytes(llm.engine, pd, len(o.prompt_token_ids))
            if variant not in ("gemma3", "gpt_oss"):
                assert pd["transfer_bytes"] == pd["transfer_tokens"] * per_token
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
@pytest.mark.parametrize("variant", ["gemma3", "gpt_oss"])
def test_window_rows_only_and_decode_side_sharing(pools, family_checkpoint, variant, layout):
    """Sliding-window layers send only the rows a decode still sees (positions >= S - W): the bytes are exactly
    full_layers x S + window_layers x min(S, W) rows, and the outputs equal colocated CP1. Requests sharing a long
    document on the decode group: one that needs none of the rows the first did not send shares the whole document;
    a shorter one whose window reaches rows the first did not send matches only up to them and gets the rest sent."""
    n, m = layout
    path = family_checkpoint(variant)
    rng = np.random.default_rng(17)
    doc = rng.integers(3, 250, size=60).tolist()
    a = doc + rng.integers(3, 250, size=20).tolist()  # S = 80: sends doc rows >= 64 only on windowed layers
    c = doc + rng.integers(3, 250, size=20).tolist()  # S = 80: needs rows >= 64 (its own): shares the document
    b = doc[:50] + rng.integers(3, 250, size=5).tolist()  # S = 55: needs doc rows >= 39, which a did not send
    ref = _reference(path, [a, c, b])
    llm = _pd_llm(pools(n + m), path, context_parallel_size=n, pd_decode_cp=m, placement="shard")
    eng = llm.engine
    try:
        windows = [w for w in eng.prefill.config.windows if w is not None]
        assert windows and len(windows) < len(eng.prefill.config.windows)  # both kinds of layer
        w = max(windows)
        got = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in (a, c, b)]  # one after another
        _assert_same(ref, got)
        for o in got:
            pd = o.metrics["pd"]
            assert pd["transfer_bytes"] == _window_bytes(eng, pd, len(o.prompt_token_ids)), pd
        full = eng.kv_bytes_per_token // len(eng.prefill.config.windows)
        s = len(a)
        assert got[0].metrics["pd"]["transfer_bytes"] == full * (
            sum(s if x is None else min(s, x) for x in eng.prefill.config.windows))
        assert got[1].metrics["pd"]["decode_cached_tokens"] == len(doc)  # the document, shared
        assert got[2].metrics["pd"]["decode_cached_tokens"] == len(b) - w  # cut at its window's first row
        eng.decode[0].kv.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("variant", ["gqa", "gemma3"])
def test_ending_at_the_first_token_after_early_placement(pools, family_checkpoint, variant, tmp_path):
    """Requests placed on the decode group when their last prefill forward was scheduled, that end at their first
    token (max_tokens=1, a stop token): their outputs come back while their rows are still on their way (held on
    the decode rank here, as a slow machine may leave them), the rows then arrive and their decode slots are released
    (kept as that group's prefix cache), nothing decodes them; a later request sharing their document there is exact
    (a windowed model's partial rows included) and shares it."""
    path = family_checkpoint(variant)
    rng = np.random.default_rng(23)
    doc = rng.integers(3, 250, size=60).tolist()
    a, b = doc + rng.integers(3, 250, size=20).tolist(), doc + rng.integers(3, 250, size=20).tolist()
    d = rng.integers(3, 250, size=33).tolist()
    first = _reference(path, [d])[0].token_ids[0]
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True)
    stop = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, stop_token_ids=[first])
    ref = _reference(path, [a, d], [one, stop]) + _reference(path, [b])
    pool = pools(3)
    llm = _pd_llm(pool, path, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    eng = llm.engine
    with _decode_receives_held(pool, llm, tmp_path) as release:
        got = llm.generate([a, d], [one, stop], use_tqdm=False)
        assert [o.finish_reason for o in got] == ["length", "stop"] and all(len(o.token_ids) == 1 for o in got)
        assert all(o.metrics["pd"]["placed_early"] for o in got)
        dec = eng.decode[0]
        assert not dec.requests  # ended on the prefill side: never decode group's requests
        # generate returns with their outputs, not waiting for their rows (held: surely still on their way)
        assert eng.handoffs.transfers.in_flight and any(eng.handoffs.pending.values()) and eng.has_unfinished_requests()
        release()  # the rows may come in now: wait for them (bounded), however slow the machine
        assert settle(eng) == []  # nothing more to output: the rows only arrive
        assert not any(h for h in eng.handoffs.pending.values()) and not eng.handoffs.transfers.in_flight
        assert not dec.requests
        assert not any(nd.ref for nd in dec.kv.nodes.values()) and dec.kv.used.sum() > 0  # kept as cache
        dec.kv.check_invariants()
        got += llm.generate([b], GREEDY, use_tqdm=False)
        _assert_same(ref, got)
        assert got[2].metrics["pd"]["decode_cached_tokens"] == len(doc)  # a's rows, left on the decode group
        for g in eng.groups:
            g.kv.check_invariants()


def test_abort_mid_transfer_frees_both_sides(pools, llama, tmp_path):
    """A request aborted after its prompt left the prefill group, before its rows arrived, ends alone: its decode
    blocks are freed once the rows are in (nothing decodes from them), the other request's output is unchanged.
    The decode rank holds its receives until the abort: on a busy machine the rows may otherwise be in before any
    step boundary shows the handoff pending."""
    prompts = _prompts(seed=11, lengths=(50, 30))[:2]
    ref = _reference(llama, prompts)
    pool = pools(3)
    llm = _pd_llm(pool, llama, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    eng = llm.engine
    dec = eng.decode[0]
    with _decode_receives_held(pool, llm, tmp_path) as release:
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, GREEDY)
        outs = {}

        def joined():  # a handoff whose request left the prefill group for the decode group
            return next((h for h in eng.handoffs.pending[1] if h.ready and h.req.request_id in dec.requests), None)

        deadline = time.monotonic() + SETTLE_S
        while joined() is None:
            assert eng.has_unfinished_requests() and time.monotonic() < deadline, "no request left the prefill group"
            for o in eng.step():
                outs[o.request_id] = o
        h = joined()
        victim = h.req.request_id
        assert h.tid in eng.handoffs.transfers.in_flight  # its rows not received (held)
        eng.abort(victim)
        release()  # the rows may come in now
        outs.update((o.request_id, o) for o in settle(eng))
        assert outs[victim].finish_reason == "abort"
        assert len(outs[victim].token_ids) == 1  # only the prefill's first token: it never decoded
        other = "r1" if victim == "r0" else "r0"
        _assert_same([ref[int(other[1])]], [outs[other]])
        assert not dec.requests and not dec.scheduler.running
        for g in eng.groups:
            g.kv.check_invariants()
        assert not any(nd.ref for nd in dec.kv.nodes.values())  # no block held by a request any more


@contextlib.contextmanager
def _decode_receives_held(pool, llm, tmp_path):
    """The decode rank (rank 2 of the module's 3-rank pool) reports no receive in until the yielded `release()` is
    called. The block's end releases it too (never leave the module's decode rank holding its receives), then shuts
    `llm` down."""
    flag = tmp_path / "hold"
    flag.touch()
    try:
        pool.run_some(_hold_receives, [None, None, (str(flag),)])
        yield lambda: flag.unlink(missing_ok=True)
    finally:
        flag.unlink(missing_ok=True)
        llm.shutdown()


def _hold_receives(ctx, flag: str) -> None:
    """On a rank: while the file `flag` exists its calls report no receive in (the messages stay pending), then as
    usual. A file, not a number of calls: an idle decode group's calls come back at once while a prefill forward
    runs, so any count would be a guess about the machine's speed."""
    import os

    from cpinfer.engine.kv import transfer

    real = transfer.RankTransfers.settle

    def held(self, wait):
        if os.path.exists(flag):
            return {}, {}
        transfer.RankTransfers.settle = real
        return real(self, wait)

    transfer.RankTransfers.settle = held


def test_abort_after_joining_the_decode_group_before_the_rows_are_in(pools, llama, tmp_path):
    """A request whose first token is sampled (it belongs to its decode group now) and whose rows are not all in yet
    is aborted: it never decodes, its decode blocks are freed once the rows are in, later requests are exact."""
    prompts = _prompts(seed=19, lengths=(44, 31))[:2]
    ref = _reference(llama, prompts)
    pool = pools(3)
    llm = _pd_llm(pool, llama, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    eng = llm.engine
    with _decode_receives_held(pool, llm, tmp_path) as release:
        eng.add_request("v", prompts[0], GREEDY)
        outs = {}
        dec = eng.decode[0]
        while "v" not in dec.requests:  # joined: first token sampled, moved to the decode group
            for o in eng.step():
                outs[o.request_id] = o
        h = eng.handoffs.pending[1][0]
        assert h.req.request_id == "v" and h.ready
        assert h.tid in eng.handoffs.transfers.in_flight  # its rows not reported in yet
        eng.abort("v")
        release()  # the rows may come in now
        outs.update((o.request_id, o) for o in settle(eng))
        assert outs["v"].finish_reason == "abort" and len(outs["v"].token_ids) == 1
        assert not dec.requests and not any(nd.ref for nd in dec.kv.nodes.values())
        for g in eng.groups:
            g.kv.check_invariants()
        _assert_same(ref, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_pd_metrics_exported():
    from cpinfer.engine.request import EngineStats
    from cpinfer.server.metrics import ServerMetrics

    pd = {"transfers": 3, "transfer_bytes": 4096, "transfer_s": 0.5, "move_back_bytes": 512,
          "utilization": {"prefill": 0.75, "decode0": 0.25}}
    stats = EngineStats(0, 0, [0, 0, 0], 64, 0, 0, 0, 0, {}, 0, {}, pd=pd)
    text = ServerMetrics("m", lambda: stats, lambda: False).render().decode()
    assert 'cpinfer_pd_transfer_bytes_total{model_name="m"} 4096.0' in text
    assert 'cpinfer_pd_role_utilization{model_name="m",role="decode0"} 0.25' in text


def test_kv_tiers_below_the_prefill_tree(pools, llama, tmp_path):
    """Host and disk tiers under the prefill group's tree: chats whose history (prompt and moved-back answer) was
    evicted from the prefill ranks come back from host or disk at the next turn, recompute none of it, and answer
    as transformers."""
    from hf_oracle import check_against_hf, prompts_for

    out_n = 6
    greedy = SamplingParams(max_tokens=out_n, temperature=0.0, logprobs=True, ignore_eos=True)
    host_tokens = 128
    gib = host_tokens * 256 / (1 << 30)  # 256 B per token per rank (fp32 K and V, 2 layers, 2 KV heads of 8)
    llm = _pd_llm(pools(3), llama, context_parallel_size=2, pd_decode_cp=1, placement="shard",
                  max_kv_tokens_per_rank=256, kv_host_gib=gib, kv_disk_dir=tmp_path / "kv", max_num_batched_tokens=96)
    try:
        docs = [[3 + i] + p for i, p in enumerate(prompts_for(256, [150, 140, 150, 130], seed=12))]
        first = []
        for d in docs:  # one at a time: each pushes older ones down a tier
            outs = llm.generate([d], greedy, use_tqdm=False)
            check_against_hf(llama, outs, [d], out_n, check_prompt_lp=False)
            first.append(outs[0])
        for i in (2, 1, 0, 3):
            turn2 = docs[i] + first[i].token_ids + [5, 6, 7]
            out = llm.generate([turn2], greedy, use_tqdm=False)
            check_against_hf(llama, out, [turn2], out_n, check_prompt_lp=False)
            assert out[0].num_cached_tokens == len(docs[i]) + out_n - 1  # the whole history, restored or on device
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] + t["disk"]["hit_tokens"] > 0, t
        llm.engine.prefill.kv.check_invariants()
    finally:
        llm.shutdown()


def test_decode_steps_go_on_during_a_long_prefill(pools, tmp_path_factory):
    """The point of the groups: a chat keeps getting tokens while a long prompt is prefilled on the other ranks."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("pd-wide"), "gqa", hidden_size=256, intermediate_size=512,
                               num_hidden_layers=4, max_position_embeddings=4096)
    llm = _pd_llm(pools(3), path, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    eng = llm.engine
    try:
        eng.add_request("chat", _prompts()[0], SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True))
        while "chat" not in eng.decode[0].requests or not eng.decode[0].scheduler.running:
            eng.step()  # the chat decodes on the decode group
        eng.step()
        long = np.random.default_rng(4).integers(3, 250, size=3500).tolist()
        eng.add_request("long", long, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        done = {}
        while "long" not in done:
            done.update({o.request_id: o for o in eng.step() if o.finished})
        chat = eng.requests["chat"]
        eng.abort("chat")
        while eng.has_unfinished_requests():
            eng.step()
        m, lm = chat.metrics, done["long"].metrics
        times = m["first_token_time"] + np.cumsum(m["ttit_s"])
        during = int(((times > lm["arrival_time"]) & (times < lm["first_token_time"])).sum())
        print(f"chat tokens during the long prefill ({lm['ttft_s']:.2f} s): {during}")
        assert during >= 3, (during, lm["ttft_s"])  # decode steps overlapped the prefill forward
        # the long prompt's sends rode its prefill forward, one message per (prefill rank, decode rank, layer),
        # each posted right after its layer was written; the chat kept decoding while they were incomplete
        pd = lm["pd"]
        assert pd["placed_early"] and pd["send_messages"] == pd["send_messages_in_forward"] == 2 * 4, sorted(pd.items())
        moving = int(((times > pd["t_placed"]) & (times < pd["t_runnable"])).sum())
        print(f"chat tokens while the long prompt's K/V moved ({pd['t_runnable'] - pd['t_placed']:.2f} s): {moving}")
        assert moving >= 2, (moving, pd)
    finally:
        llm.shutdown()


def _fail_next_write(ctx) -> None:
    """On a rank: the next received rows cannot be written (as if that transfer broke); once."""
    from cpinfer.engine.kv import transfer

    real = transfer._write_rows

    def broken(*args):
        transfer._write_rows = real
        raise RuntimeError("injected transfer failure")

    transfer._write_rows = broken


def test_failed_transfer_ends_that_request_alone(pools, llama):
    """A transfer whose rows cannot be written on the decode rank ends its request with an error (its decode blocks
    freed, nothing decoded from them); the other requests and later transfers are unaffected."""
    prompts = _prompts(seed=13, lengths=(40, 55))[:2]
    ref = _reference(llama, prompts)
    pool = pools(3)
    llm = _pd_llm(pool, llama, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    try:
        pool.run_some(_fail_next_write, [None, None, ()])  # the decode rank
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        bad = [o for o in outs if o.finish_reason == "error"]
        good = [(r, o) for r, o in zip(ref, outs) if o.finish_reason != "error"]
        assert len(bad) == 1 and len(bad[0].token_ids) == 1 and "injected" in bad[0].error
        _assert_same([r for r, _ in good], [o for _, o in good])
        dec = llm.engine.decode[0]
        dec.kv.check_invariants()
        assert not dec.requests and not any(nd.ref for nd in dec.kv.nodes.values())
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # later transfers work
        _assert_same(ref, again)
    finally:
        llm.shutdown()


def test_async_engine_streams_over_pd(llama):
    """`AsyncLLM` (the server's engine) over P/D 1 -> 1: streams equal transformers, a stream closed early is
    aborted and freed, and the P/D counters reach `stats()` (what /metrics reads)."""
    import asyncio

    from cpinfer.engine.async_llm import AsyncLLM
    from hf_oracle import check_against_hf, prompts_for

    greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)

    async def main(allm, prompts):
        async def one(i, p):
            async for out in allm.generate(p, greedy, request_id=f"s{i}"):
                pass
            return out
        finals = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        stream = allm.add_request("early", prompts[0] + [9, 9], SamplingParams(max_tokens=200, temperature=0.0))
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        await stream.aclose()

        def freed():  # the abort reaches the engine loop and is applied there: no time is promised, wait with a bound
            st = allm.stats()
            return st.num_running == 0 and st.num_waiting == 0 and st.requests_finished.get("abort", 0) >= 1

        await async_wait_until(freed, what="the early-closed stream aborted and freed")
        return finals

    prompts = prompts_for(256, [30, 50, 70], seed=61)
    allm = AsyncLLM(str(llama), context_parallel_size=1, pd_decode_cp=1, threads_per_rank=1, timeout_s=120)
    try:
        finals = asyncio.run(main(allm, prompts))
        stats = allm.stats()
    finally:
        allm.shutdown()
    check_against_hf(llama, finals, prompts, 10, check_prompt_lp=False)
    assert stats.requests_finished.get("abort", 0) == 1 and stats.num_running == 0
    assert stats.pd["transfers"] >= len(prompts) and stats.pd["transfer_bytes"] > 0
    assert set(stats.pd["utilization"]) == {"prefill", "decode0"}


def test_max_model_len_is_what_every_group_holds(pools, llama):
    """The model's 512 tokens: the prefill group (CP 2 x 512 KV tokens per rank) holds 888 for one request, the
    decode group (CP 1) 446. Set by the user it is refused, naming the decode group; else every group serves 446."""
    with pytest.raises(ValueError, match=r"max_model_len 500 does not fit the KV cache: 512 KV tokens per rank x CP 1 "
                                         r"on the decode0 group hold at most 446 tokens"):
        LLM(str(llama), context_parallel_size=2, pd_decode_cp=1, max_kv_tokens_per_rank=512, max_model_len=500,
            threads_per_rank=1)
    llm = _pd_llm(pools(3), llama, context_parallel_size=2, pd_decode_cp=1, placement="shard",
                  max_kv_tokens_per_rank=512)
    try:
        assert llm.engine.max_model_len == 446
        assert [g.max_model_len for g in llm.engine.groups] == [446, 446]
        with pytest.raises(ValueError, match=r"= 447 exceeds the maximum model length 446 \(what the KV cache holds"):
            llm.generate([[5] * 440], SamplingParams(max_tokens=7))
        assert len(llm.generate([[5] * 440], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_dead_decode_rank_is_seen_in_seconds(pools, llama):
    """Last in the module (it kills a rank of the 3-rank pool): a decode rank that dies ends the engine at the next
    step with the reason, within seconds, instead of hanging."""
    import os
    import signal
    import time

    from cpinfer.engine.llm_engine import EngineDeadError

    llm = _pd_llm(pools(3), llama, context_parallel_size=2, pd_decode_cp=1, placement="shard")
    try:
        llm.generate([_prompts()[0]], GREEDY, use_tqdm=False)
        os.kill(llm.engine.rank_pids[2], signal.SIGKILL)  # the decode rank
        t0 = time.monotonic()
        with pytest.raises((EngineDeadError, RuntimeError)):
            for _ in range(3):
                llm.generate([_prompts()[1]], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert llm.engine.check_ranks() is not None
    finally:
        llm.shutdown()
