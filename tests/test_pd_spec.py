"""Prefill and decode groups with n-gram speculation on the decode groups, and each role's KV cache sized from device
memory with its own profile: greedy tokens equal colocated CP1 without speculation (log-probs within 1e-4), drafts
accepted, multi-turn history moved back without unverified rows; a bad config refused before any rank starts; the
memory sizing on CPU with injected figures (`fake_gpu_memory.py`), and a CUDA P/D engine that gets to its ranks
without `max_kv_tokens_per_rank`. One pool of 3 ranks serves every engine of the module."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import fake_gpu_memory as FG
from checkpoints import write_hf_checkpoint
from cpinfer.engine.kv.capacity import kv_tokens_from_memory, profile_tokens_per_rank
from cpinfer.engine.kv.manager import BLOCK
from cpinfer.engine.llm import LLM
from cpinfer.engine import pd as PD
from cpinfer.engine.pd.group import RoleStartup
from cpinfer.engine.sampling import SamplingParams
from cpinfer.launch import WorkerPool
from pooled_engine import pd_llm
from wait_utils import settle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _pd_llm(pool, path, **kw) -> LLM:
    return pd_llm(pool, path, placement="shard", **kw)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(3, threads_per_rank=1, timeout_s=120)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("pd-spec-llama"), "gqa")


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup finds matches), one sharing it, one that does not repeat."""
    rng = np.random.default_rng(seed)
    a = rng.integers(3, 250, size=29).tolist()
    b = rng.integers(3, 250, size=17).tolist()
    return [a * 3 + a[:6], b + a + b + a[:9], rng.integers(3, 250, size=41).tolist()]


def _params(**kw) -> SamplingParams:
    """Greedy with log-probs; a seed keeps each request's k independent of timings (the same verify steps each run)."""
    return SamplingParams(**{"max_tokens": 32, "temperature": 0.0, "logprobs": True, "seed": 0, **kw})


@pytest.fixture(scope="module")
def reference(llama):
    """Colocated CP1 without speculation, per (prompts, params)."""
    cache = {}

    def get(prompts, params):
        key = (repr(prompts), repr(params))
        if key not in cache:
            ref = LLM(str(llama), threads_per_rank=1)
            try:
                cache[key] = ref.generate(prompts, params, use_tqdm=False)
            finally:
                ref.shutdown()
        return cache[key]
    return get


def _same(ref, got) -> None:
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids, (a.request_id, a.token_ids, b.token_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def _check_spec(llm, outs) -> None:
    """Drafts were verified and accepted on the decode groups, counted per request and per engine; the prefill group
    never speculated nor decoded, and no tree holds unverified rows."""
    e = llm.engine
    spec = e.stats().spec
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] > 0, spec
    per_req = [o.metrics["spec"] for o in outs if "spec" in o.metrics]
    assert sum(m["num_accepted_tokens"] for m in per_req) == spec["num_accepted_tokens"]
    assert spec["num_emitted_tokens"] == spec["num_drafts"] + spec["num_accepted_tokens"]
    assert e.prefill.proposer is None and not e.prefill.stats().spec
    assert all(k.startswith("prefill/") for k in e.prefill.stats().forwards), e.prefill.stats().forwards
    for g in e.groups:
        g.kv.check_invariants()
        assert not any(n.unverified for n in g.kv.nodes.values())


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=lambda l: "%d-%d_k%d" % l)
def test_ngram_speculation_on_the_decode_group_equals_colocated(pool, llama, reference, layout):
    n, m, k = layout
    prompts, params = _prompts(0), _params()
    llm = _pd_llm(pool, llama, context_parallel_size=n, pd_decode_cp=m, pd_decode_groups=k, speculative_config=NGRAM)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        _same(reference(prompts, params), got)
        _check_spec(llm, got)
        assert all(o.metrics["pd"]["transfer_tokens"] + o.metrics["pd"]["decode_cached_tokens"]
                   == len(o.prompt_token_ids) for o in got)  # each handed over once, then speculated there
        if k > 1:  # both groups took requests; the engine's counters sum theirs
            assert {o.metrics["pd"]["decode_group"] for o in got} == set(range(k))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
def test_multi_turn_history_moves_back_verified_only(pool, llama, reference, layout):
    """A speculating chat's first answer moves back to the prefill tree (verified rows only): the second turn finds
    its whole history cached and still equals the reference."""
    n, m = layout
    params = _params(max_tokens=24)
    llm = _pd_llm(pool, llama, context_parallel_size=n, pd_decode_cp=m, speculative_config=NGRAM)
    try:
        first = llm.generate([_prompts(0)[1]], params, use_tqdm=False)  # one whose output repeats itself
        _same(reference([_prompts(0)[1]], params), first)
        _check_spec(llm, first)
        turn2 = first[0].prompt_token_ids + first[0].token_ids + [5, 6, 7, 8]
        second = llm.generate([turn2], params, use_tqdm=False)
        _same(reference([turn2], params), second)
        history = len(first[0].prompt_token_ids) + len(first[0].token_ids) - 1  # the last token has no K/V yet
        assert second[0].num_cached_tokens == history, (second[0].num_cached_tokens, history)
        # each answer moves back once its request retires; generate does not wait for the second's rows: settle
        assert settle(llm.engine) == []
        s = llm.engine.pd_stats()
        assert s["move_backs"] == 2 and s["move_backs_skipped"] == 0
        moved = len(first[0].token_ids) - 1 + len(second[0].token_ids) - 1  # verified rows of each answer
        assert s["move_back_bytes"] == moved * llm.engine.kv_bytes_per_token, s
        _check_spec(llm, first + second)
    finally:
        llm.shutdown()


def test_preemption_mid_speculation_on_the_decode_group(pool, llama, reference):
    """A decode group too small for every request at once: requests are preempted while they speculate and recomputed
    there (in 32-token chunks); outputs still equal the reference."""
    prompts, params = _prompts(0) * 2, _params(max_tokens=40)
    llm = _pd_llm(pool, llama, context_parallel_size=2, pd_decode_cp=1, speculative_config=NGRAM,
                  max_num_batched_tokens=32, max_kv_tokens_per_rank=256)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        _same(reference(prompts, params), got)
        assert llm.engine.decode[0].scheduler.num_preemptions > 0
        _check_spec(llm, got)
    finally:
        llm.shutdown()


def test_bad_speculative_config_refused_before_any_rank(monkeypatch, llama):
    """(A draft model is served under P/D: tests/test_pd_draft.py.)"""
    def refuse(*_a, **_k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr("cpinfer.engine.pd.driver.WorkerPool", refuse)
    with pytest.raises(ValueError, match="prompt_lookup_min"):  # a bad config still names its own fault
        LLM(str(llama), context_parallel_size=2, pd_decode_cp=1,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0})


# ---------------------------------------------------------------- the KV cache sized per role from device memory

def test_role_capacities_take_each_roles_smallest():
    infos = [{"kv_capacity": c} for c in (4096, 3072, 8192, 2048, 5120)]
    assert PD.role_capacities([None, None, 512], infos, [[0, 1], [2, 3], [4]]) == [3072, 2048, 512]


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "%d-%d" % l)
def test_each_role_sized_from_its_own_profile(monkeypatch, pool, llama, reference, layout):
    """The measured path on CPU (as on CUDA without max_kv_tokens_per_rank): the prefill ranks profile their
    prefill budget, the decode ranks their decode batch (max_num_seqs x (k + 1)); each role's ranks allocate the
    smallest capacity of that role, the start-up log names each, and the engine serves requests within them."""
    n, m = layout
    monkeypatch.setattr(RoleStartup, "default_capacity", lambda self, fraction: None)  # as on CUDA
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("cpinfer").addHandler(handler)
    pool.run(FG.install)
    util, budget, seqs = 0.5, 64, 8
    try:
        tiers = {"kv_host_gib": 0.001} if n == 2 else {}  # a host tier below the measured prefill cache
        llm = _pd_llm(pool, llama, context_parallel_size=n, pd_decode_cp=m, speculative_config=NGRAM,
                      gpu_memory_utilization=util, max_num_batched_tokens=budget, max_num_seqs=seqs, **tiers)
        try:
            e = llm.engine
            assert (e.prefill.kv.tiers is not None) == bool(tiers) and e.decode[0].kv.tiers is None
            tokens = [profile_tokens_per_rank(budget, e.max_model_len, n), seqs * (1 + 4)]
            assert [g.sizing["tokens"] for g in e.groups] == tokens
            per_token = e.kv_bytes_per_token
            ranks = [list(range(n)), list(range(n, n + m))]
            expect = [min(kv_tokens_from_memory(FG.figures(r, t), util, per_token, BLOCK, 3) for r in rs)
                      for t, rs in zip(tokens, ranks)]
            assert expect[0] != expect[1]  # the roles' profiles differ, and so do their caches
            assert [g.kv.capacity_per_rank for g in e.groups] == expect
            slots = pool.run(FG.store_slots)
            assert slots == [expect[0] + 1] * n + [expect[1] + 1] * m  # every rank: its role's smallest, plus a pad
            assert e.decode[0].scheduler.config.max_num_batched_tokens == tokens[1]  # no forward beyond its profile
            assert e.prefill.scheduler.config.max_num_batched_tokens == budget
            prompts, params = _prompts(1), _params(max_tokens=16)
            got = llm.generate(prompts, params, use_tqdm=False)
            _same(reference(prompts, params), got)
        finally:
            llm.shutdown()
    finally:
        pool.run(FG.uninstall)
        logging.getLogger("cpinfer").removeHandler(handler)
    said = [r.getMessage() for r in records]
    for role, cap in zip(("prefill", "decode0"), expect):
        assert any(f"KV cache: {role} group: {cap} tokens per rank" in s and "profiling forward" in s
                   for s in said), said


def test_cuda_pd_without_max_kv_tokens_gets_to_its_ranks(monkeypatch, llama):
    """CUDA (faked) without max_kv_tokens_per_rank is no longer refused: the roles are validated, each with the
    profile its ranks will measure, and the world is asked for (stopped there: no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)

    class Started(Exception):
        pass

    seen = {}

    def make_pool(self, world, backend, threads):
        seen.update(world=world, backend=backend, sizings=[g.sizing for g in self.groups])
        raise Started

    monkeypatch.setattr(PD.PDEngine, "_make_pool", make_pool)
    with pytest.raises(Started):
        PD.PDEngine(str(llama), device="cuda", context_parallel_size=2, pd_decode_cp=1, pd_decode_groups=2,
                    max_num_batched_tokens=256, max_num_seqs=16, speculative_config=NGRAM)
    assert seen["world"] == 4 and seen["backend"] == "nccl"
    prefill, *decode = seen["sizings"]
    assert prefill["tokens"] == profile_tokens_per_rank(256, 512, 2) == 128
    assert [d["tokens"] for d in decode] == [16 * 5] * 2
    assert all(s["ranks_per_device"] == 1 and s["utilization"] == 0.9 for s in seen["sizings"])


def test_cli_generate_speculates_on_the_decode_group(llama, reference, capsys):
    """`cpinfer generate --pd-decode-cp 1 --speculative-config ngram`: the summary reports the drafts of the decode
    group and the K/V moved to it, and the tokens equal colocated CP1 without speculation."""
    from cpinfer.cli import main

    prompt = _prompts(0)[1]
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    assert main(["generate", "--model", str(llama), "--cp", "1", "--pd-decode-cp", "1", "--threads-per-rank", "1",
                 "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "24", "--ignore-eos", "--seed", "0",
                 "--speculative-config", spec, "--json"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert "speculation: " in out and res["spec"]["num_accepted_tokens"] > 0, out
    assert res["pd"]["transfer_tokens"] == len(prompt)
    ref = reference([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, seed=0))
    assert res["token_ids"] == ref[0].token_ids
