"""The default bound on one forward's tokens (`max_num_batched_tokens`, 2048 unless told otherwise): a burst of long
prompts is prefilled oldest first, a chunk at a time, so first tokens come one prompt after another; without a
bound one forward takes every prompt whole and every first token comes at its end. The scheduler alone (no ranks,
no timing): what each step schedules."""
from __future__ import annotations

import pytest

from cpinfer.engine.config import EngineConfig
from cpinfer.engine.kv.manager import KVManager
from cpinfer.engine.request import Request
from cpinfer.engine.sampling import SamplingParams
from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, Scheduler, SchedulerConfig

BURST, PROMPT = 8, 3000


def test_the_engine_bounds_a_forward_by_default_and_none_lifts_the_bound():
    assert EngineConfig().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    assert EngineConfig(max_num_batched_tokens=None).max_num_batched_tokens is None
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer or None, got 0"):
        EngineConfig(max_num_batched_tokens=0)


def _burst(budget: int | None, n: int = 2) -> tuple[list[int], list[int]]:
    """BURST prompts of PROMPT tokens arriving together on a CP-n cache, stepped (every sampled token appended, as
    the engine does) until each has its first token: (the step of each one's first token, each step's tokens)."""
    kv = KVManager(n, BURST * (PROMPT + 256) // n + 1024)
    sched = Scheduler(kv, SchedulerConfig(budget, max_num_seqs=64))
    reqs = [Request(f"r{i}", [3 + (i * 7 + j) % 500 for j in range(PROMPT)], SamplingParams(max_tokens=64), seed=0)
            for i in range(BURST)]
    for r in reqs:
        sched.add(r)
    first: dict[str, int] = {}
    sizes: list[int] = []
    while len(first) < BURST:
        assert len(sizes) < 100, "the burst never got all its first tokens"
        scheduled = sched.schedule()
        sizes.append(sum(len(s.tokens) for s in scheduled))
        for s in scheduled:
            if s.sample:
                s.request.out.append(5)
                first.setdefault(s.request.request_id, len(sizes))
    kv.check_invariants()
    return [first[r.request_id] for r in reqs], sizes


@pytest.mark.parametrize("n", [1, 2])
def test_a_burst_of_long_prompts_gets_first_tokens_one_prompt_after_another(n):
    steps, sizes = _burst(EngineConfig().max_num_batched_tokens, n)
    budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert max(sizes) <= budget  # no forward beyond the bound
    assert steps == sorted(steps) and len(set(steps)) == BURST  # oldest first, each in a step of its own
    for i, step in enumerate(steps):  # the i-th first token waits for the prompts before it, not for the burst
        assert sum(sizes[:step]) <= (i + 1) * PROMPT + budget, (i, step, sizes)
    assert steps[0] == -(-PROMPT // budget)  # the first prompt's chunks go first: its token after ceil(T / B) forwards
    assert sum(sizes[:steps[-1]]) >= BURST * PROMPT  # the last one after every prompt, as it must


def test_without_a_bound_one_forward_takes_the_whole_burst():
    steps, sizes = _burst(None)
    assert steps == [1] * BURST and sizes[0] == BURST * PROMPT  # every first token at the end of one forward
