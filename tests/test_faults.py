"""Faults below the server: a rank that raises while its peers wait in a collective fails the call within seconds
(not the collective timeout), a rank killed while idle is seen through its process sentinel, local ranks listen on
loopback only, and a request whose own sampling fails ends alone with its KV blocks freed.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from cpinfer.launch import RemoteError, WorkerPool
from server_utils import is_loopback, listening_addresses

pytestmark = pytest.mark.timeout(300)


def _raise_on_last_rank_else_wait(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("this rank fails inside the forward")
    dist.barrier(group=ctx.group)  # waits for the failed rank: only killing the pool ends it
    return ctx.rank


def _pid(ctx):
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, timeout_s=120, fail_grace_s=1.0)
    yield p
    p.close(force=True)


def test_local_ranks_listen_on_loopback_only(pool):
    pids = pool.run(_pid)
    listening = listening_addresses(pids)
    assert any(listening.values()), listening  # gloo listens: the check has something to check
    assert all(is_loopback(a) for addrs in listening.values() for a in addrs), listening


def test_a_rank_raising_inside_a_collective_fails_the_call_in_seconds(pool):
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="fails inside the forward"):
        pool.run(_raise_on_last_rank_else_wait)
    assert time.monotonic() - t0 < 15  # the collective timeout is 120 s
    assert "raised" in pool.dead_reason
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in pool._procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in pool._procs)  # the waiting rank was ended too


def test_a_rank_killed_while_idle_is_seen_within_two_seconds():
    with WorkerPool(2, timeout_s=120) as pool:
        pids = pool.run(_pid)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while pool.dead_reason is None and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 2.0, pool.dead_reason
        assert pool.dead_reason == "rank 1 exited (killed by SIGKILL)"
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            pool.run(_pid)


def test_a_failed_sample_ends_only_its_request_and_frees_its_blocks(llama_checkpoint, monkeypatch):
    from cpinfer.engine import LLMEngine
    from cpinfer.engine import model_runner
    from cpinfer.engine.sampling import SamplingParams, sample

    def flaky(logits, spec):
        if spec.seed == 666 and spec.step == 2:
            raise RuntimeError("injected sampling failure")
        return sample(logits, spec)

    path = llama_checkpoint("gqa")
    engine = LLMEngine(str(path), context_parallel_size=1, max_model_len=128, enable_prefix_caching=False,
                       threads_per_rank=1)
    try:
        good = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        engine.add_request("ref", [5, 6, 7, 8, 9], good)
        ref = [o for _ in range(20) for o in engine.step() if o.finished]
        kept = engine.kv.tokens_per_rank()  # a finished request's tokens stay cached (LRU), even without reuse
        monkeypatch.setattr(model_runner, "sample", flaky)
        engine.add_request("good", [5, 6, 7, 8, 9], good)
        engine.add_request("bad", [3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0, seed=666, ignore_eos=True))
        finished = {}
        for _ in range(20):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if len(finished) == 2:
                break
        bad, ok = finished["bad"], finished["good"]
        assert bad.finish_reason == "error" and "injected sampling failure" in bad.error
        assert len(bad.token_ids) == 2  # steps 0 and 1 were sampled; step 2 failed
        assert ok.error is None and ok.token_ids == ref[0].token_ids  # the other request is untouched
        assert engine.dead_error is None and not engine.has_unfinished_requests()
        engine.kv.check_invariants()
        assert engine.kv.tokens_per_rank() == [2 * kept[0]]  # "good" kept as much as "ref"; "bad" freed all
        engine.add_request("after", [5, 6, 7, 8, 9], good)  # the engine keeps serving
        after = [o for _ in range(20) for o in engine.step() if o.finished]
        assert after[0].token_ids == ref[0].token_ids
    finally:
        engine.shutdown()
