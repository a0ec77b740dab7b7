"""One rank of a 3-rank joined world in subset mode (started with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT):
rank 0 drives and checks that calls on disjoint ranks are in flight side by side, that the late replies of an
abandoned call are dropped, then that a rank which raises is reported; it writes what it saw to the file named by
argv[1]."""
import json
import sys
import time

import torch.distributed as dist

from cpinfer.launch import JoinedWorld, RemoteError


def nap(ctx, seconds: float) -> int:
    time.sleep(seconds)
    return ctx.rank


def ring_sum(ctx, group_ranks: list[int]) -> int:
    """An all-reduce on a group of its own (the world group is rank 0's worker thread's, like a role's groups)."""
    import torch

    group = ctx.state.get(tuple(group_ranks))
    t = torch.tensor([ctx.rank + 1])
    dist.all_reduce(t, group=group)
    return int(t.item())


def make_group(ctx, group_ranks: list[int]) -> None:
    ctx.state[tuple(group_ranks)] = dist.new_group(group_ranks)


def tagged(ctx, seconds: float, tag: str) -> list:
    time.sleep(seconds)
    return [ctx.rank, tag]


def boom(ctx) -> None:
    raise ValueError(f"rank {ctx.rank} fails on purpose")


def main(out: str) -> None:
    w = JoinedWorld("gloo", 1, timeout_s=60, subsets=True)
    if w.rank != 0:
        w.serve_forever()  # exits the process
    seen = {"run": w.run(nap, 0.0)}
    w.run(make_group, [0, 1])
    seen["run_some"] = w.run_some(ring_sum, [([0, 1],), ([0, 1],), None])
    # rank 0 (the driver's own rank, on its worker thread) sleeps 2 s; ranks 1 and 2 answer many calls meanwhile
    t0 = time.monotonic()
    w.submit_some(nap, {0: (2.0,)})
    rounds = 0
    while not w.answered([0]) and time.monotonic() - t0 < 60:  # a bound for a loaded machine; 2 s when idle
        w.submit_some(nap, {1: (0.01,), 2: (0.01,)})
        w.wait_any([1, 2], 5.0)
        assert w.collect_some([1, 2]) == [1, 2]
        rounds += 1
    seen.update(rounds=rounds, rank0=w.collect_some([0]), waited_s=time.monotonic() - t0)
    # a call given up while the ranks are inside it: its late replies are dropped, the next call gets its own
    w.abandon(w.submit_some(tagged, {0: (0.5, "old"), 1: (0.5, "old"), 2: (0.5, "old")}))
    seen["fresh"] = w.run_some(tagged, [(0.0, "new"), None, (0.0, "new")])
    seen["fresh"] += w.run_some(tagged, [None, (0.0, "new"), None])
    deadline = time.monotonic() + 60  # the reader files (drops) what is still in flight: polled, bounded
    while w._book.dropped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["dropped"] = w._book.dropped
    w.submit_some(boom, {2: ()})
    try:
        w.collect_some([2], "boom")
        seen["error"] = None
    except RemoteError as exc:
        seen["error"] = [sorted(exc.errors), exc.exception_type, exc.errors[2][1]]
    seen["dead_reason"] = w.dead_reason
    try:
        w.submit_some(nap, {1: (0.0,)})
        seen["after"] = "accepted"
    except RuntimeError as exc:
        seen["after"] = str(exc)
    with open(out, "w") as f:
        json.dump(seen, f)
    w.close(force=True)


if __name__ == "__main__":
    main(sys.argv[1])
