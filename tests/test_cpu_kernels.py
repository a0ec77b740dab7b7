"""The CPU's own kernels (`attention/cpu_kernels.py`, compiled on first use): the batched decode attention against a
float64 reference — GQA group sizes (up to 32 query heads a KV head), head sizes, values as the keys' first
channels (MLA's latent), rows reading several runs of a strided store, many rows shared among the threads; the
prefill flash attention against float64 — causal and full blocks, ragged lengths, GQA / MQA / MHA, MLA's head sizes,
strided views, 1 vs 2 threads, and `cpu_flash_backend` taking it; the one-pass RoPE bit-identical to aten's
element-wise form; cpinfer's small-batch linear (1-16 rows) against float64, the same bits for a row alone or in any
batch, on 1 or 2 threads and from the weight's interleaved copy; and the CPU Linears' choice (`model/cpu_gemm.py`):
the kernel for 1-4 rows, oneDNN's packed weight from 5, both against float64, copied again when the weight changes
in place, the kernel or `F.linear` past the packing budget (given back when a copy goes)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpinfer.attention import kernels
from cpinfer.attention.cpu_kernels import (decode_attention_op, flash_attention_op, rms_norm_op, rope_op, silu_mul_op,
                                          small_linear_op, small_linear_rows, small_linear_tiled_ops)
from cpinfer.model import blocks, norms, rope
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


# head sizes 64 / 128 in register tiles of query heads (scores 4 at a time, values 4 or 2: every remainder 1-3);
# any other size one dot product at a time; more than 16 heads a KV head; MLA (v: k's first channels)
@pytest.mark.parametrize("hkv,g,d,dv", [(3, 3, 64, 64), (2, 4, 128, 128), (1, 7, 64, 64), (2, 5, 128, 128),
                                        (4, 1, 128, 128), (2, 2, 64, 64), (1, 1, 32, 32), (1, 8, 80, 48),
                                        (1, 32, 64, 64), (2, 20, 576, 512)])
def test_decode_attention_matches_reference(hkv, g, d, dv):
    op = _op()
    if op is None:
        return
    gen = torch.Generator().manual_seed(hkv * 100 + g * 10 + d)
    store = torch.randn(700, hkv, d + 16, generator=gen)  # rows strided: 16 channels past each row's D
    k = store[..., :d]
    v = k[..., :dv] if dv < d else torch.randn(700, hkv, dv, generator=gen)  # MLA-like: v is k's first channels
    # blocks of 64 keys within a run, 16 keys a vector of scores: runs of 1, 3, 15-17, 50, 64, 65 and 300 keys
    rows_runs = [[(0, 1)], [(10, 75), (200, 203), (650, 700)], [(300, 600)], [(80, 81), (90, 91)], [(5, 69)],
                 [(400, 416), (420, 437), (440, 455)]]
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


def _flash_reference(q, k, v, causal, scale, offset=0):
    """float64 (out [Lq, H, Dv], lse [Lq, H]) of q [Lq, H, D] over k / v [Lk, Hkv, *], full or causal (row i sees keys
    0..i + offset)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(offset), -torch.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv), torch.logsumexp(s, -1).T


@pytest.mark.parametrize("lq,lk,hkv,g,d,dv,causal", [
    (100, 100, 3, 3, 64, 64, True),     # SmolLM2's heads; rows not a multiple of the tile or the key block
    (100, 400, 3, 3, 64, 64, 300),      # a chunk after its prefix, in one call (causal offset Lk - Lq)
    (30, 700, 3, 3, 64, 64, 650),       # a short chunk after a long prefix: causal pieces (split-KV)
    (1, 300, 1, 8, 128, 128, 299),      # one row (a decode row among prefill chunks)
    (50, 500, 2, 4, 64, 64, 200),       # keys past the last row's limit: never seen
    (300, 300, 1, 8, 128, 128, True),   # GQA 8, several position blocks and key blocks
    (130, 130, 4, 1, 32, 32, True),     # MHA
    (37, 37, 2, 8, 192, 128, True),     # MLA's expanded head sizes (Dk 192, Dv 128)
    (70, 200, 1, 4, 64, 48, False),     # a full block, Dv a multiple of 16 but not of 64
    (5, 300, 3, 3, 64, 64, False),      # a few queries against many keys
    (20, 1500, 3, 3, 64, 64, False),    # too few items for the threads: the keys split into pieces, merged
    (1, 4000, 1, 8, 128, 128, False),   # one query row, sixteen pieces
    (64, 64, 1, 1, 16, 16, True),       # exactly one tile of keys
])
def test_flash_attention_matches_reference(lq, lk, hkv, g, d, dv, causal):
    op = flash_attention_op()
    if op is None:
        assert shutil.which(os.environ.get("CXX") or "c++") is None
        return
    gen = torch.Generator().manual_seed(lq + lk + d)
    q = torch.randn(lq, hkv * g, d + 8, generator=gen)[..., 8:]  # strided rows: views of wider tensors
    kv = torch.randn(lk, 2, hkv, max(d, dv) + 16, generator=gen)
    k, v = kv[:, 0, :, :d], kv[:, 1, :, 16:16 + dv]
    offset = 0 if causal is True or causal is False else causal  # an int: causal with that offset
    out, lse = op(q, k, v, bool(causal), 0.13, offset)
    ro, rl = _flash_reference(q, k, v, bool(causal), 0.13, offset)
    assert out.shape == (lq, hkv * g, dv) and lse.shape == (lq, hkv * g) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ro, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=2e-6, rtol=1e-5)


def test_flash_attention_same_result_on_one_and_two_threads_and_no_keys():
    """Each item is computed alone: the thread count does not change a bit. No keys: out 0, lse -inf."""
    op = flash_attention_op()
    if op is None:
        return
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(700, 9, 64, generator=gen), torch.randn(700, 3, 64, generator=gen), torch.randn(700, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(q, k, v, True, 0.125)
        torch.set_num_threads(2)
        two = op(q, k, v, True, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    out, lse = op(q[:4], k[:0], v[:0], False, 0.125)
    assert torch.equal(out, torch.zeros(4, 9, 64)) and bool(torch.isneginf(lse).all())


def test_flash_attention_rejects_what_it_does_not_take():
    op = flash_attention_op()
    if op is None:
        return
    x = torch.randn(10, 2, 16)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), x.double(), x.double(), True, 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        op(torch.randn(10, 3, 16), x, x, True, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(x, x, torch.randn(10, 2, 8), True, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(10, 2, 32)[..., ::2], x, x, True, 1.0)
    for causal, offset in ((False, 3), (True, -1)):
        with pytest.raises(RuntimeError, match="causal_offset"):
            op(x, x, x, causal, 1.0, offset)


def test_cpu_flash_backend_runs_the_prefill_kernel_and_aten_where_it_does_not_apply(monkeypatch):
    """Prefill blocks (causal, or more than a few query rows) go to the compiled kernel; a masked tile and float64
    stay on aten's kernel; a value head size that is not a multiple of 16 runs padded to the key's (exact) — all
    against float64."""
    if flash_attention_op() is None:
        return
    calls = []
    real = flash_attention_op()
    monkeypatch.setattr(kernels, "flash_attention_op", lambda: lambda *a: calls.append(a[0].shape) or real(*a))
    gen = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(90, 6, 32, generator=gen), torch.randn(90, 2, 32, generator=gen), torch.randn(90, 2, 32)
    out, lse = kernels.cpu_flash_backend(q, k, v, True, None, 0.2)
    assert calls == [(90, 6, 32)]
    ro, rl = _flash_reference(q, k, v, True, 0.2)
    torch.testing.assert_close(out.double(), ro, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl, atol=2e-6, rtol=1e-5)
    mask = torch.rand(90, 90, generator=gen) > 0.3
    kernels.cpu_flash_backend(q, k, v, False, mask, 0.2)
    kernels.cpu_flash_backend(q.double(), k.double(), v.double(), True, None, 0.2)
    o8, _ = kernels.cpu_flash_backend(q, k, v[..., :8], True, None, 0.2)
    assert calls == [(90, 6, 32)] * 2 and o8.shape == (90, 6, 8)
    torch.testing.assert_close(o8.double(), _flash_reference(q, k, v[..., :8], True, 0.2)[0], atol=2e-6, rtol=1e-5)


def test_bench_cpu_attention_times_both_kernels_on_the_blocks_given(capsys):
    """`cpinfer bench cpu-attention` on two small blocks: a row per block with both kernels' times and results that
    agree within float32 rounding."""
    if flash_attention_op() is None:
        return
    from cpinfer.cli import main

    assert main(["bench", "cpu-attention", "--blocks", "64x64x4x2x16c", "10x300x2x1x32", "--repeat", "2",
                 "--threads", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["block"] for r in res["rows"]] == ["64x64x4x2x16c", "10x300x2x1x32"] and res["threads"] == 1
    for r in res["rows"]:
        assert r["aten_ms"] > 0 and r["cpinfer_ms"] > 0 and r["max_diff"] < 1e-4


@pytest.mark.parametrize("length,heads,d,rot", [(1, 9, 64, 64), (5, 3, 64, 64), (700, 9, 128, 128), (33, 4, 64, 32)])
def test_rope_kernel_is_bit_identical_to_the_element_wise_ops(monkeypatch, length, heads, d, rot):
    """`apply_rope` through the compiled op and through aten's ops (the op switched off): the same bits, on a strided
    view of a fused projection; partial rotary (rot < D) rotates the first channels and passes the rest."""
    if rope_op() is None:
        assert shutil.which(os.environ.get("CXX") or "c++") is None
        return
    gen = torch.Generator().manual_seed(length + d)
    fused = torch.randn(length, heads * d + 40, generator=gen) * 4
    x = fused[:, 40:].view(length, heads, d)  # rows strided, channels contiguous
    angles = torch.arange(length, dtype=torch.float32)[:, None] * 1000 ** -torch.linspace(0, 1, rot // 2)[None]
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
    ours = rope.apply_rope(x, cos, sin)
    monkeypatch.setattr(rope, "rope_op", lambda: None)
    aten = rope.apply_rope(x, cos, sin)
    assert ours.shape == aten.shape == (length, heads, d) and torch.equal(ours, aten)
    if rot < d:
        assert torch.equal(ours[..., rot:], x[..., rot:])


def test_rope_kernel_rejects_what_it_does_not_take():
    op = rope_op()
    if op is None:
        return
    x, c = torch.randn(4, 2, 8), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), c.double(), c.double())
    with pytest.raises(RuntimeError, match="shapes"):
        op(x, c[:, :3], c[:, :3])
    assert torch.equal(op(x, c, c), rope.apply_rope(x, c, c))


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 576), (5, 3, 128), (2, 1, 40), (33, 200)])
def test_rms_norm_kernel_matches_float64_and_a_row_alone(monkeypatch, shape):
    """`RMSNorm` through the compiled op: within float32 rounding of a float64 reference and of torch's rms_norm (the
    op switched off), on strided rows (a view of a fused projection); each row's bits the same alone as among many."""
    if rms_norm_op() is None:
        assert shutil.which(os.environ.get("CXX") or "c++") is None
        return
    gen = torch.Generator().manual_seed(sum(shape))
    c = shape[-1]
    wide = torch.randn(shape[0], (shape[1] if len(shape) == 3 else 1) * c + 24, generator=gen) * 3
    x = wide[:, 24:].view(*shape)  # rows strided, channels contiguous (C % 16 may be anything)
    norm = norms.RMSNorm(c, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c, generator=gen))
    ours = norm(x)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double())
    torch.testing.assert_close(ours, ref.float(), rtol=2e-6, atol=2e-6)
    assert torch.equal(norm(x[-1:]), ours[-1:])  # a row's bits do not depend on its company
    monkeypatch.setattr(norms, "rms_norm_op", lambda: None)
    torch.testing.assert_close(ours, norm(x))  # torch's rms_norm: the same values within float32 rounding


def test_norm_and_mlp_keep_torch_ops_where_a_gradient_is_wanted():
    """The compiled ops have no backward: with grad enabled and a parameter that wants one, RMSNorm and the gated
    MLP run torch's ops (a gradient flows); under no_grad they take the kernels (no graph either way)."""
    norm, mlp = norms.RMSNorm(32, 1e-6), blocks.MLP(32, 48)
    x = torch.randn(5, 32)
    out = mlp(norm(x))
    assert out.grad_fn is not None
    out.sum().backward()
    assert norm.weight.grad is not None and mlp.gate_proj.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(mlp(norm(x)), out.detach())


def test_rms_norm_kernel_rejects_what_it_does_not_take():
    op = rms_norm_op()
    if op is None:
        return
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="channels"):
        op(x, w[:5], 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x.t(), torch.randn(4), 1e-6)


@pytest.mark.parametrize("rows,inter,fused", [(1, 64, True), (5, 40, False), (300, 1536, True), (17, 24, True)])
def test_silu_mul_kernel_matches_float64_in_the_mlp(monkeypatch, rows, inter, fused):
    """The gated MLP through the compiled SiLU(gate) * up (gate / up as column views of the fused GEMM, or two
    GEMMs; I % 16 anything): within float32 rounding of float64 and of torch's silu and mul (the op switched off)."""
    if silu_mul_op() is None:
        assert shutil.which(os.environ.get("CXX") or "c++") is None
        return
    torch.manual_seed(rows + inter)
    mlp = blocks.MLP(48, inter)
    x = torch.randn(rows, 48) * 3
    if fused:
        assert mlp.fuse_projections()
    calls = []
    real = silu_mul_op()
    monkeypatch.setattr(blocks, "silu_mul_op", lambda: lambda g, u: calls.append(g.stride()) or real(g, u))
    with torch.no_grad():
        ours = mlp(x)
        g, u = mlp.gate_proj(x).double(), mlp.up_proj(x).double()
        ref = F.linear(g * torch.sigmoid(g) * u, mlp.down_proj.weight.double())
        monkeypatch.setattr(blocks, "silu_mul_op", lambda: None)
        aten = mlp(x)
    assert len(calls) == 1 and calls[0][0] == (2 * inter if fused else inter)  # the fused GEMM's views, read in place
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, aten)


def test_silu_mul_kernel_rejects_what_it_does_not_take():
    op = silu_mul_op()
    if op is None:
        return
    g = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32"):
        op(g.double(), g.double())
    with pytest.raises(RuntimeError, match="one shape"):
        op(g, g[:, :5])
    with pytest.raises(RuntimeError, match="contiguous"):
        op(g.t(), g.t())
    big = torch.tensor([[-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0]])  # e^-|x| underflows at both ends: no inf
    torch.testing.assert_close(op(big, torch.ones_like(big)), F.silu(big))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 17, 33, 100, 2048])
def test_packed_linear_matches_linear(rows):
    """1-4 rows: cpinfer's kernel (no packed copy); from 5 rows oneDNN over the packed copy; both within float32
    rounding of float64."""
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(384, 96, generator=gen), torch.randn(384, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    packed = PackedWeight()
    with torch.inference_mode():
        out = packed.linear(x, w, b)
    small = rows < cpu_gemm.ONEDNN_FROM and small_linear_rows() > 0
    assert (packed.packed is None) == (small or packed.refused) and packed.takes(rows)
    assert packed.refused == (not torch.backends.mkldnn.is_available())
    torch.testing.assert_close(out.double(), F.linear(x.double(), w.double(), b.double()), atol=1e-4, rtol=1e-5)
    if small:
        assert torch.equal(out, small_linear_op()(x, w, b))


def _small_linear():
    op = small_linear_op()
    if op is None:  # the engine then keeps F.linear / MKL; that happens only without a C++ compiler
        assert shutil.which(os.environ.get("CXX") or "c++") is None
    return op


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 5, 7), (2, 4, 16), (3, 17, 33), (4, 64, 96), (5, 130, 576),
                                     (8, 576, 1536), (13, 99, 40), (16, 960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_float64(m, n, k, bias):
    """Every tile shape: rows of x in fours and a remainder of 1-3, weight rows in fours and a ragged last tile
    (repeats computed and dropped), K in steps of 16 and a zero-padded tail; with and without a bias."""
    op = _small_linear()
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen, dtype=torch.float64), torch.randn(n, k, generator=gen, dtype=torch.float64)
    b = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    out = op(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), F.linear(x, w, b), atol=1e-4 * (1 + k ** 0.5), rtol=1e-5)


def test_small_linear_is_batch_invariant_and_thread_invariant():
    """A row's result is the same bits alone, in any batch, in a strided view and on 1 or 2 threads: the same sum
    in the same order for every output."""
    op = _small_linear()
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(300, 200, generator=gen), torch.randn(300, generator=gen)
    x = torch.randn(16, 200, generator=gen)
    full = op(x, w, b)
    for i in range(16):
        assert torch.equal(op(x[i:i + 1], w, b), full[i:i + 1])
    for lo, hi in ((0, 3), (5, 11), (2, 16)):
        assert torch.equal(op(x[lo:hi], w, b), full[lo:hi])
    wide = torch.randn(16, 256, generator=gen)
    wide[:, :200] = x
    assert torch.equal(op(wide[:, :200], w, b), full)  # rows 256 apart: the stride is honoured
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (4, 16), (17, 33), (130, 200), (8, 576)])
def test_small_linear_tiled_is_the_same_product(n, k):
    """The interleaved copy (ragged last tile of weight rows, K's tail zero-padded) gives the kernel's own bits for
    1-16 rows, with and without a bias; the copy holds each tile's rows 16 values at a time, zeros past N and K."""
    op, tiled_ops = _small_linear(), small_linear_tiled_ops()
    if op is None:
        return
    tiles, tiled = tiled_ops
    gen = torch.Generator().manual_seed(n * 100 + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    t = tiles(w)
    n4, k16 = (n + 3) // 4 * 4, (k + 15) // 16 * 16
    assert t.shape == (n4 // 4, k16 // 16, 4, 16) and t.is_contiguous()
    rows = t.transpose(1, 2).reshape(n4, k16)  # back to [N, K] (padded)
    assert torch.equal(rows[:n, :k], w) and not rows[n:].any() and not rows[:, k:].any()
    for m in (1, 2, 3, 4, 5, 9, 16):
        x = torch.randn(m, k, generator=gen)
        for bias in (None, b):
            assert torch.equal(tiled(x, t, n, bias), op(x, w, bias)), (m, bias is None)
    with pytest.raises(RuntimeError, match="do not hold"):
        tiled(torch.randn(2, k), t, n + 4, None)
    with pytest.raises(RuntimeError, match="do not hold"):
        tiled(torch.randn(2, k + 16), t, n, None)
    with pytest.raises(RuntimeError, match="tiles float32"):
        tiled(torch.randn(2, k), rows, n, None)


def test_packed_weight_reads_the_interleaved_copy_within_the_budget(monkeypatch):
    """1-4 rows: the kernel over the weight's interleaved copy, made once and charged to the packing budget, made
    again when the weight changes in place; past the budget the kernel reads the weight itself (the same bits)."""
    if _small_linear() is None:  # (no compiler: the engine keeps F.linear)
        return
    monkeypatch.setattr(cpu_gemm, "_budget", [100_000])
    gen = torch.Generator().manual_seed(11)
    rows = min(4, small_linear_rows())  # (the kernel's rows before oneDNN: 4 with AVX-512, 1 without)
    w, x = torch.randn(50, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    packed = PackedWeight()
    wb = torch.randn(512, 96, generator=gen)  # 196 KB: past what is left after the first copy
    with torch.inference_mode():
        wi = w.clone()  # an inference tensor: no version counter to follow, so no copy (the weight itself)
        assert torch.equal(PackedWeight().linear(x, wi), small_linear_op()(x, wi, None))
        assert cpu_gemm._budget == [100_000]
        out = packed.linear(x, w)
        copy = packed.tiles.tensor
        assert copy is not None and packed.packed is None
        assert cpu_gemm._budget == [100_000 - packed.tiles.charged] and packed.tiles.charged == 52 * 96 * 4
        assert torch.equal(out, small_linear_op()(x, w, None))
        assert packed.linear(x[:1], w).data_ptr() != out.data_ptr() and packed.tiles.tensor is copy  # made once
        w.mul_(-2.0)  # in place: the copy is stale and made again
        assert torch.equal(packed.linear(x, w), small_linear_op()(x, w, None))
        assert packed.tiles.tensor is not copy
        big = PackedWeight()
        assert torch.equal(big.linear(x, wb), small_linear_op()(x, wb, None))
        assert big.tiles.refused and big.tiles.tensor is None
    del packed  # its copy's bytes go back
    assert cpu_gemm._budget == [100_000]


def test_small_linear_refusals():
    op = _small_linear()
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        op(torch.randn(17, 8), w)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w.double())
    with pytest.raises(RuntimeError, match="columns"):
        op(torch.randn(2, 9), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="bias"):
        op(x, w, torch.randn(5))
    assert op(torch.randn(0, 8), w).shape == (0, 4)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "avx512f" in flags:  # built with -march=native: the 4 x 4 tiles, the callers' choice up to 16 rows
        assert small_linear_rows() == 16
    elif "avx2" in flags:
        assert small_linear_rows() == 1


def test_packed_linear_keeps_f_linear_where_the_kernel_cannot():
    """A transposed weight at 2 rows: not the kernel's (oneDNN's packed copy of it); a gradient wanted, float64:
    F.linear itself, the same bits."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 32, generator=gen), torch.randn(32, 48, generator=gen).t()  # weight not contiguous
    packed = PackedWeight()
    with torch.inference_mode():
        torch.testing.assert_close(packed.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        assert (packed.packed is not None) == (not packed.refused)
        assert torch.equal(packed.linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    wg = torch.randn(48, 32, requires_grad=True)
    out = packed.linear(x, wg)
    out.sum().backward()
    assert wg.grad is not None and torch.equal(out.detach(), F.linear(x, wg.detach()))


def test_packed_linear_follows_weight_changes_and_keeps_module_shape():
    lin = nn.Linear(64, 128, bias=False)
    names = [n for n, _ in lin.state_dict().items()]
    pack_linear(lin)
    assert type(lin) is nn.Linear and [n for n, _ in lin.state_dict().items()] == names
    x = torch.randn(20, 64)  # from 5 rows: oneDNN's packed copy (1-4: cpinfer's kernel, reading the weight itself)
    with torch.no_grad():
        first = lin(x)
        assert lin._packed.packed is not None
        torch.testing.assert_close(first, F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
        lin.weight.mul_(2.0)  # in place: the packed copy is stale and must be made again
        torch.testing.assert_close(lin(x), 2.0 * first, atol=1e-5, rtol=1e-5)
        lin.weight = nn.Parameter(torch.randn(128, 64))  # new storage
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin(x[:2]), F.linear(x[:2], lin.weight), atol=1e-5, rtol=1e-5)
        x3 = torch.randn(2, 5, 64)  # [..., in]: rows over the leading dims
        torch.testing.assert_close(lin(x3), F.linear(x3, lin.weight), atol=1e-5, rtol=1e-5)


def test_packing_stops_at_its_memory_budget_and_gives_it_back(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_budget", [10_000])  # bytes: room for a 24 x 32 weight (x1.3), not 64 x 64
    x = torch.randn(20, 32)
    small, big = PackedWeight(), PackedWeight()
    with torch.no_grad():
        small.linear(x, torch.randn(24, 32))
        x64, w = torch.randn(20, 64), torch.randn(64, 64)
        out = big.linear(x64, w)
        assert small.packed is not None and big.packed is None and big.refused
        assert cpu_gemm._budget == [10_000 - small.charged]
        # refused: cpinfer's kernel up to 16 rows (no copy needed), F.linear itself above
        torch.testing.assert_close(out, F.linear(x64, w), atol=1e-5, rtol=1e-5)
        assert torch.equal(big.linear(x64[:16], w), small_linear_op()(x64[:16], w, None))
        assert torch.equal(big.linear(torch.cat([x64, x64]), w), F.linear(torch.cat([x64, x64]), w))
    del small  # its copy's bytes go back
    assert cpu_gemm._budget == [10_000]


def test_packed_linear_lm_head_rows():
    """The LM head's PackedWeight (max_rows 16): past it `takes` is False (compute_logits then multiplies weight
    first) and `linear` is F.linear itself."""
    packed = PackedWeight(max_rows=16)
    w, x = torch.randn(200, 48), torch.randn(17, 48)
    assert packed.takes(16) and not packed.takes(17)
    with torch.no_grad():
        assert torch.equal(packed.linear(x, w), F.linear(x, w))
