"""Faults below the server: a rank that raises while its peers wait in a collective fails the call within seconds
(not the collective timeout), a rank killed while idle is seen through its process sentinel, local ranks listen on
loopback only, and a request whose own sampling fails ends alone with its KV blocks freed. The same faults with rank
0 in this process (`driver_rank=True`): this process waiting in a collective for a rank that raised or died is
freed within seconds too.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cpinfer.launch import RemoteError, WorkerPool, driver_can_host_rank
from server_utils import is_loopback, listening_addresses
from wait_utils import DEAD_RANK_SEEN_S

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


def _raise_on_last_rank_else_wait(ctx):
    if ctx.rank == ctx.world_size - 1:
        raise ValueError("this rank fails inside the forward")
    dist.barrier(group=ctx.group)  # waits for the failed rank: only killing the pool ends it
    return ctx.rank


def _raise_on_first_rank_else_wait(ctx):
    if ctx.rank == 0:
        raise ValueError("rank 0 fails inside the forward")
    dist.barrier(group=ctx.group)


def _sum_of_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=ctx.group)
    return float(t)


def _barrier_after(ctx, seconds):
    time.sleep(seconds if ctx.rank else 0.0)
    dist.barrier(group=ctx.group)
    return ctx.rank


def _pid(ctx):
    return os.getpid()


def _ended(pool) -> bool:
    deadline = time.monotonic() + 60  # polled: a loaded machine reaps slowly, a process left behind still fails
    while any(p.is_alive() for p in pool._procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in pool._procs)


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
    assert time.monotonic() - t0 < DEAD_RANK_SEEN_S  # the collective timeout is 120 s
    assert "raised" in pool.dead_reason
    assert _ended(pool)  # the waiting rank was ended too


@pytest.mark.parametrize("driver_rank", [False, True], ids=["ranks in processes", "rank 0 in this process"])
def test_a_rank_killed_while_idle_is_seen_in_seconds(driver_rank):
    """Within 2 s on an idle machine (the watcher wakes on the process sentinel); a loaded one is allowed
    DEAD_RANK_SEEN_S, far below the 120 s collective timeout."""
    with WorkerPool(2, timeout_s=120, driver_rank=driver_rank) as pool:
        pids = pool.run(_pid)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while pool.dead_reason is None and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        assert time.monotonic() - t0 < DEAD_RANK_SEEN_S, pool.dead_reason
        assert pool.dead_reason == (f"rank 1 (pid {pids[1]}) was killed by SIGKILL: check the rank's output above "
                                    "and the system log (out of memory?)")
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL") as failed:
            pool.run(_pid)
        assert "__main__" not in str(failed.value)  # no script guard hint: the rank was killed, not a script's fault
        with pytest.raises(RuntimeError, match=r"closed: rank 1 \(pid \d+\) was killed"):  # even a call only rank 0
            pool.run_some(_pid, [(), None])  # would answer


def test_a_rank_death_names_the_rank_its_fate_and_what_to_do(monkeypatch):
    """The `__main__` guard is suggested only where it can be the cause: a rank that exited with an error while the
    pool started, under a user's script; never for a killed rank, a rank lost later, or the cpinfer command line."""
    from cpinfer.launch import common

    check = "check the rank's output above and the system log (out of memory?)"
    monkeypatch.setattr(common, "user_script_program", lambda: True)
    assert common.rank_death(1, 42, -9, starting=True) == f"rank 1 (pid 42) was killed by SIGKILL: {check}"
    assert common.rank_death(2, 43, 1, starting=False) == f"rank 2 (pid 43) exited with code 1: {check}"
    guard = common.rank_death(1, 42, 1, starting=True)
    assert guard.startswith("rank 1 (pid 42) exited with code 1 during start-up: see its output above")
    assert 'needs an `if __name__ == "__main__":` guard' in guard
    monkeypatch.setattr(common, "user_script_program", lambda: False)  # the cpinfer command line (serve, generate)
    assert common.rank_death(1, 42, 1, starting=True) == f"rank 1 (pid 42) exited with code 1 during start-up: {check}"


def test_user_script_program_is_false_under_the_command_line(monkeypatch):
    from cpinfer.launch import common

    monkeypatch.setitem(common._PROGRAM, "cli", True)
    assert not common.user_script_program()
    monkeypatch.setitem(common._PROGRAM, "cli", False)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "/home/user/train.py", raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert common.user_script_program()


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """A script that starts ranks at import: each spawned rank imports it again and fails at start-up; the error
    names the rank, its exit and the missing guard."""
    script = tmp_path / "no_guard.py"
    script.write_text("from cpinfer.launch import WorkerPool\nWorkerPool(2, timeout_s=60).close()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"worker pool failed during start-up: rank \d \(pid \d+\) exited with code 1 during start-up: "
                     r"see its output above; a script that starts ranks needs an `if __name__ == \"__main__\":` guard",
                     last), proc.stderr[-3000:]


def test_rank_0_in_this_process_runs_calls_here_and_frees_its_slot_on_close():
    assert driver_can_host_rank()
    with WorkerPool(3, timeout_s=60, fail_grace_s=1.0, driver_rank=True) as pool:
        pids = pool.run(_pid)
        assert pids[0] == os.getpid() and len(set(pids)) == 3 and pool.pids == pids
        assert pool.run(_sum_of_ranks) == [3.0, 3.0, 3.0]  # rank 0 joined the ranks' collectives
        assert pool.run_some(_pid, [(), None, None]) == [os.getpid(), None, None]  # no message to any process
        assert pool.run_some(_pid, [None, (), ()]) == [None, *pids[1:]]
        assert not driver_can_host_rank()  # one pool's rank 0 per process (torch's default group)
        with pytest.raises(RuntimeError, match="already hosts rank 0"):
            WorkerPool(2, driver_rank=True)
        with WorkerPool(2, timeout_s=60) as other:  # a pool of rank processes only is fine beside it
            assert os.getpid() not in other.run(_pid)
    assert driver_can_host_rank() and not dist.is_initialized()  # closed: the next pool may host rank 0 again
    with pytest.raises(ValueError, match="gloo on CPU"):
        WorkerPool(2, backend="nccl", driver_rank=True)


@pytest.mark.parametrize("fault", ["rank 2 raises", "rank 0 raises", "rank 1 killed"])
def test_rank_0_in_this_process_is_never_stuck_in_a_collective(fault):
    """This process, as rank 0, waits in a barrier for a rank that raised or died: the call fails within seconds
    with that rank's own error (the collective timeout is 60 s), and every rank process is ended."""
    pool = WorkerPool(3, timeout_s=60, fail_grace_s=1.0, driver_rank=True)
    try:
        pids = pool.run(_pid)
        t0 = time.monotonic()
        if fault == "rank 2 raises":
            with pytest.raises(RemoteError, match="rank 2 raised ValueError: this rank fails inside the forward"):
                pool.run(_raise_on_last_rank_else_wait)
            assert pool.dead_reason == "rank 2 raised while rank 0 (this process) waited for it"
        elif fault == "rank 0 raises":
            with pytest.raises(RemoteError, match="rank 0 raised ValueError: rank 0 fails"):
                pool.run(_raise_on_first_rank_else_wait)
            assert "rank 0 raised" in pool.dead_reason
        else:
            threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL)).start()
            with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pids[1]}\) was killed by SIGKILL: check"):
                pool.run(_barrier_after, 30.0)
        assert time.monotonic() - t0 < DEAD_RANK_SEEN_S  # (the collective timeout is 60 s; the barrier's sleep 30 s)
        assert _ended(pool)
        with pytest.raises(RuntimeError):
            pool.run(_pid)
    finally:
        pool.close(force=True)
    assert driver_can_host_rank() and not dist.is_initialized()


def test_a_failed_sample_ends_only_its_request_and_frees_its_blocks(llama_checkpoint, monkeypatch):
    from cpinfer.engine import LLMEngine
    from cpinfer.engine import model_runner
    from cpinfer.engine.sampling import SamplingParams, sample

    def flaky(logits, spec):
        if spec.seed == 666 and spec.step == 2:
            raise RuntimeError("injected sampling failure")
        return sample(logits, spec)

    def batch_fails(logits):  # a decode batch's greedy rows in one pass failing: each row is then drawn alone
        raise RuntimeError("injected failure of the batched greedy draw")

    path = llama_checkpoint("gqa")
    engine = LLMEngine(str(path), context_parallel_size=1, max_model_len=128, enable_prefix_caching=False,
                       threads_per_rank=1)
    try:
        good = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        engine.add_request("ref", [5, 6, 7, 8, 9], good)
        ref = [o for _ in range(20) for o in engine.step() if o.finished]
        kept = engine.kv.tokens_per_rank()  # a finished request's tokens stay cached (LRU), even without reuse
        monkeypatch.setattr(model_runner, "sample", flaky)
        monkeypatch.setattr(model_runner, "greedy_rows", batch_fails)
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
