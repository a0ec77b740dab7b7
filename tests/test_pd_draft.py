"""A draft model under prefill / decode groups: the draft runs on the decode groups only, and the draft's rows of a
handed-off prompt are recomputed there (`engine/pd/draft_rows.py`). Greedy tokens equal colocated CP1 without
speculation (log-probs within 1e-4) through a decode group of CP1 and of CP2; drafts accepted; the draft's K rows of
every stored position (recomputed after the handoff, or mirrored from the group's forwards) equal a single-device
forward of the draft; a prompt partly cached on the decode group recomputes only from its first missing row; a
preempted request recomputed there. One pool of 3 ranks serves every engine of the module."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpinfer.engine.llm import LLM
from cpinfer.engine.pd.paths import nodes_layout, path_nodes
from cpinfer.engine.sampling import SamplingParams
from cpinfer.engine.spec_decode import draft_runner as DR
from cpinfer.launch import WorkerPool
from pooled_engine import pd_llm
from test_spec_draft import _reference
from wait_utils import settle

K = 4


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(3, threads_per_rank=1, timeout_s=120)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def target(llama_checkpoint):
    return llama_checkpoint("gqa", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def small_draft(llama_checkpoint):
    """A different, smaller model with the target's vocabulary (one layer, 4 query heads on 1 KV head)."""
    return llama_checkpoint("mqa", seed=7, num_hidden_layers=1, max_position_embeddings=1024)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    a = rng.integers(3, 250, size=37).tolist()
    return [a + rng.integers(3, 250, size=11).tolist(), rng.integers(3, 250, size=29).tolist(),
            a + rng.integers(3, 250, size=5).tolist()]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "logprobs": True, "seed": 0, "ignore_eos": True,
                             **kw})


@pytest.fixture(scope="module")
def reference(target):
    """Colocated CP1 without speculation, per (prompts, params)."""
    cache = {}

    def get(prompts, params):
        key = (repr(prompts), repr(params))
        if key not in cache:
            ref = LLM(str(target), threads_per_rank=1)
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


def _draft_rows_match(llm, draft_path, tokens: list[int]) -> int:
    """The draft's K rows of `tokens`' cached path on the decode group (matched in its prefix tree) equal a fresh
    single-device forward of the draft over them; returns how many positions were compared."""
    g = llm.engine.decode[0]
    node, _, matched = g.kv.match(np.asarray(tokens, dtype=np.int64), len(tokens) - 1)
    assert matched > 0
    ranks, slots = nodes_layout(path_nodes(node))
    ranks, slots = ranks[:matched], slots[:matched]
    per_rank = g._pool.run(DR.store_rows, None, "draft")  # [layers, slots, Hkv, D] per rank of the group
    got = torch.stack([per_rank[r][:, s] for r, s in zip(ranks.tolist(), slots.tolist())], dim=1)
    want, _, _ = _reference(draft_path, tokens[:matched])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return matched


def _verify_widths(ctx):
    return tuple(ctx.state["runner"].decode.get("verify_widths", ()))


def _check_spec(llm, outs, accepted: bool = True) -> dict:
    e = llm.engine
    spec = e.stats().spec
    assert spec["num_drafts"] > 0, spec
    if accepted:
        assert spec["num_accepted_tokens"] > 0, spec
    assert e.prefill.proposer is None and e.prefill.draft is None
    for g in e.groups:
        g.kv.check_invariants()
        assert not any(n.unverified for n in g.kv.nodes.values())
    return spec


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda l: "P%d-D%d" % l)
def test_draft_model_on_the_decode_group_equals_colocated(pool, target, reference, layout):
    """A draft equal to the target (every draft accepted) through a decode group of CP1 and CP2: the same tokens as
    plain colocated decoding; the draft's rows of each prompt were recomputed on the decode group after its
    handoff (counted), and every stored row of the draft there equals the draft's own forward."""
    n, m = layout
    prompts, params = _prompts(0), _params()
    llm = pd_llm(pool, target, placement="shard", context_parallel_size=n, pd_decode_cp=m,
                 speculative_config={"model": str(target), "num_speculative_tokens": K},
                 max_kv_tokens_per_rank=1024)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        _same(reference(prompts, params), got)
        spec = _check_spec(llm, got)
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]  # the draft is the target
        assert settle(llm.engine) == []
        fill = llm.engine.pd_stats()["draft_fill"]
        transferred = sum(o.metrics["pd"]["transfer_tokens"] for o in got)
        assert fill["forwards"] > 0 and fill["tokens"] == transferred, (fill, transferred)
        for o in got:
            _draft_rows_match(llm, target, o.prompt_token_ids + o.token_ids)
        # the decode ranks' static decode path would capture the adaptive k's verify widths (k = 1, 2, 4)
        assert pool.run(_verify_widths)[n:] == [(2, 3, 5)] * m
    finally:
        llm.shutdown()


def test_prompt_cached_on_the_decode_group_fills_from_its_first_missing_row(pool, target, small_draft, reference):
    """A smaller draft; the second request shares 37 tokens with the first, which the decode group holds: only its
    rest is transferred and only that is recomputed through the draft, which still equals the draft's forward."""
    prompts, params = _prompts(1), _params(max_tokens=12)
    llm = pd_llm(pool, target, placement="shard", context_parallel_size=1, pd_decode_cp=2,
                 speculative_config={"model": str(small_draft), "num_speculative_tokens": K},
                 max_kv_tokens_per_rank=1024)
    try:
        first = llm.generate([prompts[0]], params, use_tqdm=False)
        assert settle(llm.engine) == []
        filled = llm.engine.pd_stats()["draft_fill"]["tokens"]
        assert filled == len(prompts[0])
        second = llm.generate([prompts[2]], params, use_tqdm=False)
        _same(reference([prompts[0]], params), first)
        _same(reference([prompts[2]], params), second)
        assert settle(llm.engine) == []
        pd = second[0].metrics["pd"]
        assert pd["decode_cached_tokens"] >= 32, pd  # whole blocks of the shared 37 tokens
        assert llm.engine.pd_stats()["draft_fill"]["tokens"] - filled == pd["transfer_tokens"]
        _check_spec(llm, first + second, accepted=False)  # an unrelated random draft may accept nothing
        assert _draft_rows_match(llm, small_draft, second[0].prompt_token_ids + second[0].token_ids) > 37
    finally:
        llm.shutdown()


def test_preemption_with_a_draft_model_on_the_decode_group(pool, target, reference):
    """A decode group too small for every request at once: requests are preempted while they speculate and
    recomputed there (their draft rows then come from those forwards); outputs still equal the reference."""
    prompts, params = _prompts(2) * 2, _params(max_tokens=40)
    llm = pd_llm(pool, target, placement="shard", context_parallel_size=2, pd_decode_cp=1,
                 speculative_config={"model": str(target), "num_speculative_tokens": K},
                 max_num_batched_tokens=32, max_kv_tokens_per_rank=192)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        _same(reference(prompts, params), got)
        assert llm.engine.decode[0].scheduler.num_preemptions > 0
        _check_spec(llm, got)
    finally:
        llm.shutdown()
