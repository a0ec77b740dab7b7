"""The CPU's own kernels: the batched decode attention (`attention/cpu_kernels.py`, compiled on first use) against a
float64 reference — GQA group sizes (up to 32 query heads a KV head), head sizes, values as the keys' first
channels (MLA's latent), rows reading
several runs of a strided store, many rows shared among the threads; and MKL's packed small-batch GEMM
(`model/cpu_gemm.py`) against `F.linear`: bit-identical from 16 rows, within float32 rounding below, repacked when
the weight changes in place, `F.linear` itself outside its rows or past its memory budget."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpinfer.attention.cpu_kernels import decode_attention_op
from cpinfer.model import cpu_gemm
from cpinfer.model.cpu_gemm import PackedWeight, pack_linear


def _op():
    op = decode_attention_op()
    if op is None:  # the engine then keeps aten's kernel; that happens only without a C++ compiler
        assert shutil.which(os.environ.get("CXX") or "c++") is None
    return op


def _reference(q, k, v, rows_runs, scale):
    """float64 softmax attention of each row of q [N, H, D] over the store rows of its runs."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for n, runs in enumerate(rows_runs):
        idx = torch.cat([torch.arange(a, e) for a, e in runs])
        kk = k[idx].double().repeat_interleave(g, dim=1)  # [L, H, D]
        vv = v[idx].double().repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[n].double(), kk) * scale, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(outs)


@pytest.mark.parametrize("hkv,g,d,dv", [(3, 3, 64, 64), (2, 4, 128, 128), (1, 1, 32, 32), (1, 8, 80, 48),
                                        (1, 32, 64, 64), (2, 20, 576, 512)])  # more than 16 heads a KV head; MLA
def test_decode_attention_matches_reference(hkv, g, d, dv):
    op = _op()
    if op is None:
        return
    gen = torch.Generator().manual_seed(hkv * 100 + g * 10 + d)
    store = torch.randn(700, hkv, d + 16, generator=gen)  # rows strided: 16 channels past each row's D
    k = store[..., :d]
    v = k[..., :dv] if dv < d else torch.randn(700, hkv, dv, generator=gen)  # MLA-like: v is k's first channels
    rows_runs = [[(0, 1)], [(10, 75), (200, 203), (650, 700)], [(300, 600)], [(80, 81), (90, 91)], [(5, 69)]]
    runs = torch.tensor([r for rr in rows_runs for r in rr], dtype=torch.int64)
    first = torch.tensor([0] + [len(rr) for rr in rows_runs], dtype=torch.int64).cumsum(0)
    q = torch.randn(len(rows_runs), hkv * g, d, generator=gen)
    out = op(q, k, v, runs, first, 0.11)
    assert out.shape == (len(rows_runs), hkv * g, dv)
    torch.testing.assert_close(out.double(), _reference(q, k, v, rows_runs, 0.11), atol=2e-6, rtol=1e-5)


def test_decode_attention_many_rows_one_call_per_thread_count():
    """64 rows shared among 1 and 2 threads: the same result (each row is computed alone)."""
    op = _op()
    if op is None:
        return
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(5000, 3, 64, generator=gen) for _ in range(2))
    rows_runs = [[(70 * i, 70 * i + 1 + 37 * i % 300)] for i in range(64)]
    runs = torch.tensor([r for rr in rows_runs for r in rr], dtype=torch.int64)
    first = torch.arange(65, dtype=torch.int64)
    q = torch.randn(64, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, runs, first, 0.125)
        torch.set_num_threads(2)
        two = op(q, k, v, runs, first, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), _reference(q, k, v, rows_runs, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("hkv,g", [(1, 8), (3, 3)])
def test_decode_attention_split_keys(hkv, g):
    """Fewer rows than twice the threads: each row's keys cut into pieces and merged — a long row over several
    runs, and a one-key row whose first piece is empty."""
    op = _op()
    if op is None:
        return
    gen = torch.Generator().manual_seed(hkv + g)
    k, v = (torch.randn(3000, hkv, 64, generator=gen) for _ in range(2))
    rows_runs = [[(0, 700), (900, 1500), (2000, 2300)], [(2999, 3000)]] if hkv == 1 else [[(100, 2600)]]
    runs = torch.tensor([r for rr in rows_runs for r in rr], dtype=torch.int64)
    first = torch.tensor([0] + [len(rr) for rr in rows_runs], dtype=torch.int64).cumsum(0)
    q = torch.randn(len(rows_runs), hkv * g, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 1 or 2 rows < 4: split into pieces of >= 256 keys
        out = op(q, k, v, runs, first, 0.09)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), _reference(q, k, v, rows_runs, 0.09), atol=2e-6, rtol=1e-5)


def test_decode_attention_rejects_what_it_does_not_take():
    op = _op()
    if op is None:
        return
    k = torch.randn(10, 1, 8)
    runs, first = torch.tensor([[0, 10]]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(1, 2, 8, dtype=torch.float64), k.double(), k.double(), runs, first, 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        op(torch.randn(1, 3, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8), runs, first, 1.0)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 24, 32, 33, 100])
def test_packed_linear_matches_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(384, 96, generator=gen), torch.randn(384, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    packed = PackedWeight()
    with torch.inference_mode():
        out = packed.linear(x, w, b)
    ref = F.linear(x, w, b)
    used = cpu_gemm.MIN_ROWS <= rows <= cpu_gemm.MAX_ROWS and not packed.refused
    assert (packed.packed is not None) == used
    if not used or rows >= 16:  # F.linear itself, or the same sgemm kernel: the same bits
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_packed_linear_follows_weight_changes_and_keeps_module_shape():
    lin = nn.Linear(64, 128, bias=False)
    names = [n for n, _ in lin.state_dict().items()]
    pack_linear(lin)
    assert type(lin) is nn.Linear and [n for n, _ in lin.state_dict().items()] == names
    x = torch.randn(8, 64)
    with torch.no_grad():
        first = lin(x)
        assert lin._packed.packed is not None
        torch.testing.assert_close(first, F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
        lin.weight.mul_(2.0)  # in place: the packed copy is stale and must be made again
        torch.testing.assert_close(lin(x), 2.0 * first, atol=1e-5, rtol=1e-5)
        lin.weight = nn.Parameter(torch.randn(128, 64))  # new storage
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)


def test_packing_stops_at_its_memory_budget(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_budget", [10_000])  # bytes: room for a 24 x 32 weight (x1.3), not 64 x 64
    x = torch.randn(8, 32)
    small, big = PackedWeight(), PackedWeight()
    with torch.no_grad():
        small.linear(x, torch.randn(24, 32))
        x64, w = torch.randn(8, 64), torch.randn(64, 64)
        out = big.linear(x64, w)
    assert small.packed is not None and big.packed is None and big.refused
    assert torch.equal(out, F.linear(x64, w))  # refused: F.linear itself
