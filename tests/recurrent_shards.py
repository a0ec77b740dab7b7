"""Shared checks of a recurrence's CP contract (tests only): cut a sequence into runs as CP would (the paper's
2N load-balanced chunks, or arbitrary cut points), summarise each run from zero, compose the maps in sequence
order into each run's starting state, run each from it, and compare with the uncut run; the same for the conv
with its halo. Composition is written here (S -> M S + B, M a matrix or a per-head decay) so that the tests do
not depend on the engine's affine algebra."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpinfer.cp.sharding import shard_prefill

TOL = dict(atol=1e-5, rtol=1e-5)  # fp32 reordering across cuts
Y_TOL = dict(atol=2e-4, rtol=1e-4)  # a layer's outputs, after its output norm (see check_staged)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors on a busy 2-core machine: OpenMP threads beyond the free cores slow torch several times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def denormals(x: torch.Tensor) -> int:
    """How many of x's entries are float32 denormals (nonzero, below the smallest normal)."""
    return int(((x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)).sum())


def apply(m: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """M S + B; M [H, Dk, Dk] (matrix) or [H] (per-head decay)."""
    if m.dim() == 1:
        return m.view(-1, *([1] * (s.dim() - 1))) * s + b
    return m @ s + b


def then(first, later):
    """The map of `first` followed by `later`: (Ml Mf, Ml Bf + Bl)."""
    (mf, bf), (ml, bl) = first, later
    return (ml * mf if ml.dim() == 1 else ml @ mf), apply(ml, bl, bf)


def cp_runs(num_tokens: int, num_ranks: int) -> list[list[tuple[int, int]]]:
    """Per rank, the contiguous runs [a, b) of the sequence it holds under the load-balanced 2N-chunk sharding
    (cpinfer.cp.sharding.shard_prefill, paper §3.5.1)."""
    plan = shard_prefill([num_tokens], num_ranks)
    out = []
    for sh in plan.shards:
        idx = sh.index[sh.valid]
        breaks = np.nonzero(np.diff(idx) != 1)[0] + 1
        out.append([(int(p[0]), int(p[-1]) + 1) for p in np.split(idx, breaks) if len(p)])
    return out


def runs_at(cuts: list[int], num_tokens: int) -> list[tuple[int, int]]:
    edges = [0, *sorted(cuts), num_tokens]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def check_composed(run, summary, inp, state0: torch.Tensor, rank_runs: list[list[tuple[int, int]]]) -> None:
    """Every rank summarises its runs from zero; the maps are 'exchanged' (gathered); each rank composes the maps
    of the runs before each of its own into that run's start state and runs it. Outputs and the final state
    (composed from all maps, as every rank can) must equal the uncut run's."""
    o_ref, s_ref = run(inp, state0)
    maps = {r: summary(inp[r[0]:r[1]]) for runs in rank_runs for r in runs}  # computed where they are held
    order = sorted(maps)
    assert order[0][0] == 0 and order[-1][1] == len(inp) and all(
        a[1] == b[0] for a, b in zip(order, order[1:])), f"runs {order} do not tile the sequence"
    o = torch.full_like(o_ref, float("nan"))
    for runs in rank_runs:
        for a, b in runs:
            start = state0
            for r in order[:order.index((a, b))]:
                start = apply(*maps[r], start)
            o[a:b], s_out = run(inp[a:b], start)
            torch.testing.assert_close(s_out, apply(*maps[(a, b)], start), **TOL)  # run and summary agree
    total = maps[order[0]]
    for r in order[1:]:
        total = then(total, maps[r])
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(apply(*total, state0), s_ref, **TOL)


def check_conv_halo(conv, u: torch.Tensor, runs: list[tuple[int, int]], kernel: int) -> None:
    """conv(u [T, C], tail) -> (out, tail): each run with its kernel-1 preceding rows (zeros before the start)
    reproduces the uncut conv's rows, and its new tail is the last kernel-1 rows up to its end."""
    full, _ = conv(u, None)
    padded = torch.cat([u.new_zeros(kernel - 1, u.shape[1]), u])  # row i of u is row i + kernel - 1 here
    for a, b in runs:
        out, tail = conv(u[a:b], padded[a:a + kernel - 1])
        torch.testing.assert_close(out, full[a:b], atol=1e-6, rtol=1e-6)  # the same sums, maybe vectorised apart
        torch.testing.assert_close(tail, padded[b:b + kernel - 1], atol=0, rtol=0)


def check_staged(mixer, run, summary, x: torch.Tensor, rank_runs: list[list[tuple[int, int]]]) -> None:
    """The mixer's stages as the engine runs them under CP, each run on its own: project, conv with the halo of
    the kernel-1 pre-conv rows before it (sent by whoever holds them), inputs, summary; the maps exchanged and
    composed into each run's start state; run; output. Equals the uncut mixer: the recurrence's outputs and final
    state within TOL, the conv tail exactly, the layer's outputs within Y_TOL (an output RMSNorm divides o by its
    rms, here as small as ~0.1, so o's fp32 reordering shows ~10x larger in y; the uncut fp32 run is itself as far
    from an fp64 one)."""
    y_ref, s_ref, tail_ref = mixer(x)
    u, side = mixer.project(x)
    o_ref, _ = run(mixer.inputs(mixer.conv(u, None)[0], side), None)
    runs = sorted(r for per_rank in rank_runs for r in per_rank)
    proj = {r: mixer.project(x[r[0]:r[1]]) for r in runs}
    k1 = mixer.shape.conv_kernel - 1
    pre = torch.cat([x.new_zeros(k1, u.shape[1]), *(proj[r][0] for r in runs)])  # [K-1+T, C]
    inputs, maps, tails = {}, {}, {}
    for a, b in runs:
        conv_out, tails[a, b] = mixer.conv(proj[a, b][0], pre[a:a + k1])  # the halo: rows a-K+1 .. a-1
        inputs[a, b] = mixer.inputs(conv_out, proj[a, b][1])
        maps[a, b] = summary(inputs[a, b])
    o, y, start = torch.full_like(o_ref, float("nan")), torch.full_like(y_ref, float("nan")), None
    for r in runs:  # every rank can compose the maps before its own runs: here all runs, in order
        s0 = torch.zeros(s_ref.shape) if start is None else start
        o[r[0]:r[1]], _ = run(inputs[r], s0)
        y[r[0]:r[1]] = mixer.output(o[r[0]:r[1]], proj[r][1])
        start = apply(*maps[r], s0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(start, s_ref, **TOL)
    torch.testing.assert_close(tails[runs[-1]], tail_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, **Y_TOL)
