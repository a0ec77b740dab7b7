"""Triton step kernel and merge kernel against the float64 reference, in Triton's CPU interpreter.

TRITON_INTERPRET=1 is set here before triton is imported, so a plain `pytest` run covers the kernels on CPU.
With CPINFER_TRITON_ON_GPU=1 and a CUDA device (scripts/gpu_check.sh) the same tests run the compiled kernels.
Shapes are small: the interpreter executes every program in numpy.
"""
import os

import numpy as np
import pytest
import torch

ON_GPU = os.environ.get("CPINFER_TRITON_ON_GPU") == "1" and torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from cpinfer.attention.backends import attend_local  # noqa: E402  (after TRITON_INTERPRET is set)
from cpinfer.attention.local import reference_attention  # noqa: E402
from cpinfer.attention.merge import merge_partials  # noqa: E402
from cpinfer.attention.triton_merge import triton_merge  # noqa: E402
from cpinfer.cp import STRATEGIES, cp_attention  # noqa: E402
from cpinfer.cp.sharding import shard_prefill  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # vs the f64 reference of the same inputs


def _tensors(lq, lk, h, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    return mk(lq, h, d), mk(lk, hkv, d), mk(lk, hkv, d)


def _check(q_seq, q_pos, kv_seq, kv_pos, kv_end=None, h=4, hkv=2, d=16, dtype=torch.float32, seed=0, split=None,
           mode="vectors", window=None, chunk=None):
    """Triton (optionally as two launches over a split of the keys, merged in-kernel) vs the f64 reference.

    mode "vectors": visibility from the metadata vectors in the kernel; "items": from the plan's items alone."""
    q_seq, q_pos, kv_seq, kv_pos = (torch.as_tensor(np.asarray(x), dtype=torch.int64)
                                    for x in (q_seq, q_pos, kv_seq, kv_pos))
    kv_end = None if kv_end is None else torch.as_tensor(np.asarray(kv_end), dtype=torch.int64)
    q, k, v = _tensors(len(q_seq), len(kv_seq), h, hkv, d, dtype, seed)
    kw = dict(backend="triton", use_vectors=mode == "vectors", window=window, chunk=chunk)
    if split is None:
        out, lse = attend_local(q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_end, **kw)
    else:  # a ring step after another: the second launch merges into the first's running (out, lse)
        end = lambda sl: None if kv_end is None else kv_end[sl]  # noqa: E731
        a, b = slice(0, split), slice(split, None)
        acc = attend_local(q, k[a], v[a], q_seq, q_pos, kv_seq[a], kv_pos[a], kv_seq_end=end(a), **kw)
        out, lse = attend_local(q, k[b], v[b], q_seq, q_pos, kv_seq[b], kv_pos[b], kv_seq_end=end(b), acc=acc, **kw)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_end,
                                           window=window, chunk=chunk)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)  # empty rows: lse -inf and out 0
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "vectors"), (torch.bfloat16, "vectors"),
                                        (torch.float16, "vectors"), (torch.float32, "items")])
def test_full_causal(dtype, mode):
    n = 45
    _check([0] * n, range(n), [0] * n, range(n), dtype=dtype, mode=mode)


@pytest.mark.parametrize("mode", ["vectors", "items"])
def test_varlen_batch_and_partial_prefill(mode):
    """Three sequences, one with 20 cached tokens (partial prefill), keys split over two launches."""
    lens, cached = [7, 19, 5], [0, 20, 3]
    q_seq = np.repeat(np.arange(3), lens)
    q_pos = np.concatenate([np.arange(c, c + t) for c, t in zip(cached, lens)])
    kv_seq = np.repeat(np.arange(3), np.add(lens, cached))
    kv_pos = np.concatenate([np.arange(c + t) for c, t in zip(cached, lens)])
    _check(q_seq, q_pos, kv_seq, kv_pos, split=30, mode=mode)


@pytest.mark.parametrize("h,hkv,mode", [(4, 4, "vectors"), (6, 3, "vectors"), (6, 2, "vectors"), (8, 2, "vectors"),
                                         (9, 3, "vectors"), (8, 1, "vectors"), (9, 3, "items")])  # G = 1, 2, 3, 4, 8
def test_gqa_ratios_decode(h, hkv, mode):
    """Decode: one query per sequence at its last position, against cached keys of every sequence."""
    lens = [3, 40, 17]
    kv_seq = np.repeat(np.arange(3), lens)
    kv_pos = np.concatenate([np.arange(n) for n in lens])
    _check(np.arange(3), np.array(lens) - 1, kv_seq, kv_pos, h=h, hkv=hkv, d=24, mode=mode)


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "vectors"), (torch.bfloat16, "vectors"),
                                        (torch.bfloat16, "items")])
def test_random_placement_with_padding_and_empty_rows(dtype, mode):
    """Shuffled metadata (the tile planner), padding ids, queries that see nothing; D not a power of two."""
    rng = np.random.default_rng(5)
    q_seq, q_pos = rng.integers(-1, 3, 37), rng.integers(0, 30, 37)
    kv_seq, kv_pos = rng.integers(-1, 3, 90), rng.integers(5, 30, 90)
    q_seq[:3], q_pos[3:6] = 7, 0  # no key of sequence 7; positions before every key
    _check(q_seq, q_pos, kv_seq, kv_pos, d=20, dtype=dtype, split=41, mode=mode)


@pytest.mark.parametrize("mode", ["vectors", "items"])
def test_shared_prefix_intervals(mode):
    """Root 0 shared by leaves 1 and 2 (DFS intervals [0, 3), [1, 2), [2, 3)); queries of both leaves."""
    kv_seq = np.repeat([0, 1, 2], [12, 9, 6])
    kv_end = np.repeat([3, 2, 3], [12, 9, 6])
    kv_pos = np.concatenate([np.arange(12), np.arange(12, 21), np.arange(12, 18)])
    q_seq, q_pos = np.repeat([1, 2], [4, 3]), np.concatenate([np.arange(17, 21), np.arange(15, 18)])
    _check(q_seq, q_pos, kv_seq, kv_pos, kv_end, dtype=torch.bfloat16, mode=mode)


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "vectors"), (torch.bfloat16, "vectors"),
                                        (torch.float32, "items")])
def test_sliding_window(dtype, mode):
    """A window (5, 16, 17) much shorter than the sequences: prefill, a partial prefill split over two launches,
    decode far past the window, shared-prefix intervals, and shuffled metadata (the window in-kernel or in tiles)."""
    n = 70
    for w in (5, 16, 17):
        _check([0] * n, range(n), [0] * n, range(n), dtype=dtype, mode=mode, window=w)
    lens, cached = [7, 40, 5], [0, 20, 3]
    q_seq = np.repeat(np.arange(3), lens)
    q_pos = np.concatenate([np.arange(c, c + t) for c, t in zip(cached, lens)])
    kv_seq = np.repeat(np.arange(3), np.add(lens, cached))
    kv_pos = np.concatenate([np.arange(c + t) for c, t in zip(cached, lens)])
    _check(q_seq, q_pos, kv_seq, kv_pos, split=30, mode=mode, dtype=dtype, window=6)
    dec = [3, 40, 17]
    _check(np.arange(3), np.array(dec) - 1, np.repeat(np.arange(3), dec), np.concatenate([np.arange(m) for m in dec]),
           h=8, hkv=2, mode=mode, dtype=dtype, window=9)
    kv_seq, kv_end = np.repeat([0, 1, 2], [12, 9, 6]), np.repeat([3, 2, 3], [12, 9, 6])
    kv_pos = np.concatenate([np.arange(12), np.arange(12, 21), np.arange(12, 18)])
    q_seq, q_pos = np.repeat([1, 2], [4, 3]), np.concatenate([np.arange(17, 21), np.arange(15, 18)])
    _check(q_seq, q_pos, kv_seq, kv_pos, kv_end, mode=mode, dtype=dtype, window=7)
    rng = np.random.default_rng(6)
    _check(rng.integers(-1, 3, 37), rng.integers(0, 40, 37), rng.integers(-1, 3, 90), rng.integers(0, 40, 90),
           split=41, mode=mode, dtype=dtype, window=8)


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "vectors"), (torch.bfloat16, "vectors"),
                                        (torch.float32, "items")])
def test_chunked_attention(dtype, mode):
    """Chunks (8, 13) much shorter than the sequences, alone and with a window: prefill, a partial prefill split over
    two launches (a chunk straddling the split), decode in a chunk's first and middle positions, shared-prefix
    intervals and shuffled metadata; the chunk rule reaches the kernel as labels (`chunk_labels`)."""
    n = 45
    for c, w in ((8, None), (13, None), (13, 5)):
        _check([0] * n, range(n), [0] * n, range(n), dtype=dtype, mode=mode, chunk=c, window=w)
    lens, cached = [7, 40, 5], [0, 20, 3]
    q_seq = np.repeat(np.arange(3), lens)
    q_pos = np.concatenate([np.arange(c, c + t) for c, t in zip(cached, lens)])
    kv_seq = np.repeat(np.arange(3), np.add(lens, cached))
    kv_pos = np.concatenate([np.arange(c + t) for c, t in zip(cached, lens)])
    _check(q_seq, q_pos, kv_seq, kv_pos, split=30, mode=mode, dtype=dtype, chunk=8)
    dec = [3, 41, 17]  # decode at positions 2 (mid-chunk), 40 and 16 (each the first of its chunk of 8: sees itself)
    _check(np.arange(3), np.array(dec) - 1, np.repeat(np.arange(3), dec), np.concatenate([np.arange(m) for m in dec]),
           h=8, hkv=2, mode=mode, dtype=dtype, chunk=8)
    kv_seq, kv_end = np.repeat([0, 1, 2], [12, 9, 6]), np.repeat([3, 2, 3], [12, 9, 6])
    kv_pos = np.concatenate([np.arange(12), np.arange(12, 21), np.arange(12, 18)])
    q_seq, q_pos = np.repeat([1, 2], [4, 3]), np.concatenate([np.arange(17, 21), np.arange(15, 18)])
    _check(q_seq, q_pos, kv_seq, kv_pos, kv_end, mode=mode, dtype=dtype, chunk=10)
    rng = np.random.default_rng(7)
    _check(rng.integers(-1, 3, 37), rng.integers(0, 40, 37), rng.integers(-1, 3, 90), rng.integers(0, 40, 90),
           split=41, mode=mode, dtype=dtype, chunk=6)


@pytest.mark.parametrize("causal", [False, True])
def test_per_item_adapter_for_item_loops(causal):
    """backends.item_kernel("triton"): one item per launch, for code that loops over items (run_items)."""
    from cpinfer.attention.backends import item_kernel

    q, k, v = _tensors(20, 20, 6, 2, 16, torch.float32, 4)
    out, lse = item_kernel("triton", DEV)(q, k, v, causal, None, 0.3)
    pos = torch.arange(20) if causal else torch.full((20,), 99)
    zeros = torch.zeros(20, dtype=torch.long)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), zeros, pos, zeros, torch.arange(20), scale=0.3)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["vectors", "items"])
def test_split_kv_decode_and_prefill(mode):
    """Split-KV forced (every program over more than 16 keys is cut): decode rows over long contexts and a
    partial prefill, merged into a running partial of an earlier step, equal the reference."""
    from cpinfer.attention.backends import _OneStep
    from cpinfer.attention.local import build_items, mark_first, new_accumulator
    from cpinfer.attention.step import plan_tables
    from cpinfer.attention.triton_backend import TritonBackend

    backend = TritonBackend(block_m=16, block_n=16, min_programs=10 ** 6, split_keys=16)
    lens = [3, 70, 41]
    kv_seq = np.repeat(np.arange(3), lens)
    kv_pos = np.concatenate([np.arange(n) for n in lens])
    q_seq = np.concatenate([np.arange(3), np.full(6, 1)])  # 3 decode rows, then 6 prefill rows of sequence 1
    q_pos = np.concatenate([np.array(lens) - 1, np.arange(64, 70)])
    kv_end = kv_seq + 1
    q, k, v = _tensors(len(q_seq), len(kv_seq), 8, 2, 16, torch.bfloat16, 6)
    acc_out, acc_lse = new_accumulator(len(q_seq), 8, 16, DEV)
    for keys in (slice(0, 50), slice(50, None)):  # two ring steps into one accumulator
        items = build_items(q_seq, q_pos, kv_seq[keys], kv_pos[keys], kv_end[keys])
        items = mark_first(items, len(q_seq), np.ones(len(q_seq), dtype=bool))
        vectors = (q_seq, q_pos, kv_seq[keys], kv_end[keys], kv_pos[keys]) if mode == "vectors" else None
        plan = _OneStep(items, vectors)
        backend.attend(plan, 0, q, k[keys], v[keys], acc_out, acc_lse, 0.25)
        assert plan_tables(plan, DEV).meta[(0,)]["n_slots"] > 1  # the split really happened
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), torch.from_numpy(q_seq), torch.from_numpy(q_pos),
                                           torch.from_numpy(kv_seq), torch.from_numpy(kv_pos), scale=0.25)
    torch.testing.assert_close(acc_out.cpu().double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(acc_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_prepare_items_builds_the_tables_attend_items_uses():
    """Tables put before the ring (prepare_items) and uploaded once are the ones the launch reads: attend_items
    adds none and makes no second upload."""
    from cpinfer.attention.backends import get_step_backend
    from cpinfer.attention.local import build_items, new_accumulator
    from cpinfer.attention.step import HeadLayout
    from cpinfer.attention.tables import ForwardTables

    backend = get_step_backend("triton", DEV)
    q, k, v = _tensors(12, 12, 4, 2, 16, torch.float32, 8)
    zeros, pos = np.zeros(12, dtype=np.int64), np.arange(12)
    items, tables = build_items(zeros, pos, zeros, pos, min_stair=1), ForwardTables(DEV)
    backend.prepare_items(items, None, tables, ("step0",), HeadLayout.of(q, k))
    assert tables.pending == 8 and ("step0",) in tables.meta  # the tile table's 8 int32 arrays
    tables.upload()
    acc = new_accumulator(12, 4, 16, DEV)
    backend.attend_items(items, None, q, k, v, *acc, 0.25, tables, ("step0",))
    assert tables.uploads == 1 and tables.pending == 0
    ref, _ = reference_attention(q.cpu(), k.cpu(), v.cpu(), torch.from_numpy(zeros), torch.from_numpy(pos),
                                 torch.from_numpy(zeros), torch.from_numpy(pos), scale=0.25)
    torch.testing.assert_close(acc[0].cpu().double(), ref, rtol=2e-5, atol=2e-5)


def test_merge_kernel_matches_merge_partials():
    g = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 10, 4, 17, generator=g)
    lses = torch.randn(3, 10, 4, generator=g) * 5
    lses[1, :4] = -torch.inf  # an empty partial
    lses[:, 7] = -torch.inf  # rows empty in every partial
    packed = torch.cat([outs, lses[..., None]], dim=-1).to(DEV)  # pass-Q's [S, rows, H, D+1] layout
    out, lse = triton_merge(packed[..., :17], packed[..., 17], torch.bfloat16)
    ref_out, ref_lse = merge_partials(list(outs), list(lses))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.float().cpu(), ref_out.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[7].float().cpu(), torch.zeros(4, 17)) and torch.isneginf(lse[7]).all()


def _rank_cp(ctx, q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_end, strategy, backend, window=None, chunk=None,
             sinks=None):
    args = [x.to(ctx.device) for x in (q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_end)]  # cuda:rank under NCCL
    out = cp_attention(*args[:7], group=ctx.group, strategy=strategy, kv_seq_end=args[7], backend=backend,
                       control_group=ctx.cpu_group, window=window, chunk=chunk,
                       sinks=None if sinks is None else sinks.to(ctx.device))
    return out.cpu()


def test_cp_attention_cp2_triton_equals_cpu_backend():
    """cp_attention at CP2, every strategy, with and without a sliding window, and chunked with sinks: the Triton
    backend equals the CPU backend (a prefix tree, bf16)."""
    kv_lens, kv_end = [24, 11, 9], [3, 2, 3]  # root 0 shared by leaves 1 and 2
    starts = [0, 24, 24]
    new = [5, 4]  # new tokens of leaves 1 and 2 (their last tokens)
    g = torch.Generator().manual_seed(0)
    nq, nk = sum(new), sum(kv_lens)
    q = torch.randn(nq, 6, 16, generator=g).bfloat16()
    k, v = torch.randn(nk, 2, 16, generator=g).bfloat16(), torch.randn(nk, 2, 16, generator=g).bfloat16()
    kv_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(kv_lens))
    kv_e = torch.repeat_interleave(torch.tensor(kv_end), torch.tensor(kv_lens))
    kv_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, kv_lens)])
    q_seq = torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor(new))
    q_pos = torch.cat([torch.arange(s + n - t, s + n) for s, n, t in zip(starts[1:], kv_lens[1:], new)])
    q_shards = shard_prefill(new, 2).shards
    kv_shards = shard_prefill(kv_lens, 2).shards
    kv_off = np.cumsum([0] + kv_lens)
    q_idx = [torch.from_numpy(sh.index[sh.valid]) for sh in q_shards]
    kv_idx = [torch.from_numpy(kv_off[sh.seq[sh.valid]] + sh.pos[sh.valid]) for sh in kv_shards]
    two_gpus = ON_GPU and torch.cuda.device_count() >= 2  # one GPU: both ranks on it, tensors over gloo
    with WorkerPool(2, backend="nccl" if two_gpus else "gloo", device="cuda" if ON_GPU else "cpu",
                    timeout_s=300) as pool:
        sinks = torch.randn(6, generator=g)
        for strategy, window, chunk in [(s, w, None) for s in STRATEGIES for w in (None, 7)] + \
                [(s, None, 16) for s in STRATEGIES]:
            outs, sk = {}, None if chunk is None else sinks
            for backend in ("triton", "math" if ON_GPU else "cpu-flash"):
                args = [(q[qi], k[ki], v[ki], q_seq[qi], q_pos[qi], kv_seq[ki], kv_pos[ki], kv_e[ki], strategy, backend,
                         window, chunk, sk) for qi, ki in zip(q_idx, kv_idx)]
                outs[backend] = torch.cat(pool.run_each(_rank_cp, args))
            a, b = outs.values()
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            ref, _ = reference_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_e, window=window,
                                         chunk=chunk, sinks=sk)
            order = torch.cat(q_idx)
            torch.testing.assert_close(a.double(), ref[order], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("in_keys,dv", [(True, 16), (False, 8), (False, 40)])
def test_value_head_size_differs(in_keys, dv):
    """Dv != Dk through the Triton step kernel (which takes one head size: run padded, exactly): MLA's values as the
    keys' first channels (the keys serve as values), a narrower and a wider value; varlen with cached keys, split
    over two launches."""
    g = torch.Generator().manual_seed(5)
    lens, cached = [9, 21], [0, 12]
    q_seq = torch.as_tensor(np.repeat(np.arange(2), lens))
    q_pos = torch.as_tensor(np.concatenate([np.arange(c, c + t) for c, t in zip(cached, lens)]))
    kv_seq = torch.as_tensor(np.repeat(np.arange(2), np.add(lens, cached)))
    kv_pos = torch.as_tensor(np.concatenate([np.arange(c + t) for c, t in zip(cached, lens)]))
    q = torch.randn(len(q_seq), 8, 24, generator=g).to(DEV)
    k = torch.randn(len(kv_seq), 1, 24, generator=g).to(DEV)
    v = k[..., :dv] if in_keys else torch.randn(len(kv_seq), 1, dv, generator=g).to(DEV)
    a, b = slice(0, 20), slice(20, None)
    acc = attend_local(q, k[a], v[a], q_seq, q_pos, kv_seq[a], kv_pos[a], backend="triton")
    out, lse = attend_local(q, k[b], v[b], q_seq, q_pos, kv_seq[b], kv_pos[b], backend="triton", acc=acc)
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), q_seq, q_pos, kv_seq, kv_pos)
    assert out.shape == (len(q_seq), 8, dv)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the tuned classes (triton_tuning), in the interpreter

def _tuned_run(backend, q_seq, q_pos, kv_seq, kv_pos, kv_end=None, h=8, hkv=2, d=128, dtype=torch.bfloat16,
               mode="vectors", window=None, chunk=None, split=None, seed=0):
    """The backend's step(s) (keys split over two ring steps at `split`) vs the f64 reference; returns the step
    configurations used, the tables' mask-free key count and the most split-KV slots a step used."""
    from cpinfer.attention.backends import _OneStep
    from cpinfer.attention.local import build_items, chunk_labels, new_accumulator, seq_end_or_default
    from cpinfer.attention.step import plan_tables
    from cpinfer.attention.tiles import TABLE_FIELDS, TileTable, mask_free_keys

    q_seq, q_pos, kv_seq, kv_pos = (np.asarray(x, dtype=np.int64) for x in (q_seq, q_pos, kv_seq, kv_pos))
    kv_end = seq_end_or_default(kv_seq, kv_end)
    [(qs, qp)], [(ks, kp, ke)] = chunk_labels([(q_seq, q_pos)], [(kv_seq, kv_pos, kv_end)], chunk)
    q, k, v = _tensors(len(q_seq), len(kv_seq), h, hkv, d, dtype, seed)
    acc_out, acc_lse = new_accumulator(len(q_seq), h, d, DEV)
    cfgs, free, slots = [], 0, 0
    for keys in ((slice(None),) if split is None else (slice(0, split), slice(split, None))):
        items = build_items(qs, qp, ks[keys], kp[keys], ke[keys], window, 1)
        vectors = (qs, qp, ks[keys], ke[keys], kp[keys]) if mode == "vectors" else None
        plan = _OneStep(items, vectors, window)
        backend.attend(plan, 0, q, k[keys], v[keys], acc_out, acc_lse, 0.3)
        meta = plan_tables(plan, DEV).meta[(0,)]
        cfgs.append(meta["config"])
        slots = max(slots, meta["n_slots"])
        tab = [plan_tables(plan, DEV)[(0, f)].cpu().numpy().astype(np.int64) for f in TABLE_FIELDS]
        free += int(mask_free_keys(TileTable(0, *tab), meta["config"].block_n).sum())
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), torch.from_numpy(q_seq), torch.from_numpy(q_pos),
                                           torch.from_numpy(kv_seq), torch.from_numpy(kv_pos),
                                           kv_seq_end=torch.from_numpy(kv_end), scale=0.3, window=window, chunk=chunk)
    tol = TOL[dtype]
    torch.testing.assert_close(acc_out.cpu().double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(acc_lse.cpu()), ~finite)
    torch.testing.assert_close(acc_lse.cpu().double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    return cfgs, free, slots


def _prefill(lens, cached):
    q_seq = np.repeat(np.arange(len(lens)), lens)
    q_pos = np.concatenate([np.arange(c, c + t) for c, t in zip(cached, lens)])
    kv_seq = np.repeat(np.arange(len(lens)), np.add(lens, cached))
    kv_pos = np.concatenate([np.arange(c + t) for c, t in zip(cached, lens)])
    return q_seq, q_pos, kv_seq, kv_pos


@pytest.mark.parametrize("d,dtype,sms,want", [
    (128, torch.bfloat16, 1, (128, 64)),  # long prefill, D=128: 128 lanes, 8 warps
    (48, torch.float16, 1, (128, 128)),  # long prefill, D<=64 (48: channels masked)
    (160, torch.bfloat16, 1, (128, 32)),  # D<=256
    (128, torch.bfloat16, 10 ** 6, (64, 64)),  # short prefill: 64 lanes, 4 warps
    (64, torch.bfloat16, 10 ** 6, (64, 64)),
    (200, torch.bfloat16, 10 ** 6, (64, 32)),
    (128, torch.float32, 1, (64, 32)),  # fp32 (ieee dots)
    (256, torch.float32, 1, (32, 32)),
    (300, torch.bfloat16, 1, (64, 16))])  # past 256 (MLA's 576): the wide tiles
def test_tuned_prefill_classes_exact(d, dtype, sms, want):
    """Every prefill class of the tuned table, in the interpreter: a causal prefill of 70-164 rows (G = 4: 32 rows per
    128-lane program), then a varlen batch with a cached prefix split over two ring steps (a FULL step: the pass-KV
    off-diagonal class); both with unmasked interior blocks, masked diagonals and range edges."""
    from cpinfer.attention.triton_backend import TritonBackend

    backend = TritonBackend(tuned=True, sms=sms)
    n = max(70, want[1] + 36)  # some program's first row past one key block: its interior runs unmasked
    cfgs, free, _ = _tuned_run(backend, [0] * n, range(n), [0] * n, range(n), d=d, dtype=dtype)
    assert (cfgs[0].block_m, cfgs[0].block_n) == want and free > 0  # the mask-free phase ran
    assert cfgs[0].num_warps == (8 if want[0] == 128 else 4)
    cfgs, free, _ = _tuned_run(backend, *_prefill([30, 60], [140, 0]), d=d, dtype=dtype, split=140, mode="items")
    assert cfgs[0].block_m == want[0] and free > 0


@pytest.mark.parametrize("mode", ["vectors", "items"])
def test_tuned_windows_chunks_and_mask_tiles_exact(mode):
    """The long D=128 class with a sliding window (FULL band blocks unmasked, window edges masked), chunked
    attention labels (chunk edges), and shuffled metadata (vector mode: MASK tiles decided by the vectors)."""
    from cpinfer.attention.triton_backend import TritonBackend

    backend = TritonBackend(tuned=True, sms=1)
    n = 200
    _, free, _ = _tuned_run(backend, [0] * n, range(n), [0] * n, range(n), mode=mode, window=100)
    assert free > 0
    _, free, _ = _tuned_run(backend, [0] * n, range(n), [0] * n, range(n), mode=mode, chunk=130, window=70)
    assert free > 0
    _tuned_run(backend, *_prefill([70, 90], [0, 40]), mode=mode, split=100, chunk=48)
    if mode == "vectors":
        rng = np.random.default_rng(9)
        q_seq, q_pos = rng.integers(-1, 3, 90), rng.integers(0, 40, 90)
        kv_seq, kv_pos = rng.integers(-1, 3, 100), rng.integers(0, 40, 100)
        _tuned_run(backend, q_seq, q_pos, kv_seq, kv_pos, split=50, window=20)


@pytest.mark.parametrize("h,hkv,d,dtype,lanes", [(8, 2, 128, torch.bfloat16, 16), (32, 1, 64, torch.bfloat16, 32),
                                                  (6, 3, 256, torch.bfloat16, 16), (4, 4, 64, torch.float32, 16)])
def test_tuned_decode_split_kv_exact(h, hkv, d, dtype, lanes):
    """Decode rows (M = one row's GQA group) with split-KV sized by `decode_splits` (the launch is far below 2
    programs per multiprocessor), merged into a running partial of an earlier ring step; G = 4, 32 (MQA), 2, 1."""
    from cpinfer.attention.triton_backend import TritonBackend

    backend = TritonBackend(tuned=True, min_programs=10 ** 6)
    lens = [3, 700, 300]  # pieces of 4 K/V tiles (decode_splits' floor): 256 keys at D<=128, 128 at D=256
    kv_seq = np.repeat(np.arange(3), lens)
    kv_pos = np.concatenate([np.arange(m) for m in lens])
    cfgs, free, slots = _tuned_run(backend, np.arange(3), np.array(lens) - 1, kv_seq, kv_pos, h=h, hkv=hkv, d=d,
                                   dtype=dtype, split=350, mode="items")
    assert cfgs[0].block_m == lanes and cfgs[0].num_warps == 4 and free > 0 and slots > 1  # really split
    _, _, slots = _tuned_run(backend, np.arange(3), np.array(lens) - 1, kv_seq, kv_pos, h=h, hkv=hkv, d=d,
                             dtype=dtype, window=400, mode="vectors")
    assert slots > 1


def test_vector_table_leaves_masks_to_mask_tiles_and_longest_first_keeps_pairs():
    """vector_table: FULL / CAUSAL ranges exact by their diagonal, MASK tiles flagged VEC_DIAG; longest_first
    permutes programs (most keys first) and keeps every range with its program."""
    from cpinfer.attention.local import build_items, visible
    from cpinfer.attention.tiles import NO_DIAG, VEC_DIAG, longest_first, program_keys, vector_table

    empty = vector_table([], 0, 8)  # a step with no visible pair (e.g. a pass-KV step of a later rank's keys)
    assert empty.num_programs == 0 and longest_first(empty)[0].off.tolist() == [0]
    rng = np.random.default_rng(3)
    for shuffled in (False, True):
        if shuffled:
            q_seq, q_pos = rng.integers(-1, 3, 60), rng.integers(0, 40, 60)
            kv_seq, kv_pos = rng.integers(-1, 3, 80), rng.integers(0, 40, 80)
        else:
            q_seq, q_pos, kv_seq, kv_pos = (np.asarray(x) for x in _prefill([30, 50], [10, 0]))
        kv_end = kv_seq + 1
        tab = vector_table(build_items(q_seq, q_pos, kv_seq, kv_pos, kv_end, min_stair=1), len(q_seq), 8)
        vis = visible(q_seq, q_pos, kv_seq, kv_pos, kv_end)
        seen = np.zeros_like(vis)
        for t in range(tab.num_programs):
            for r in range(tab.off[t], tab.off[t + 1]):
                i = np.arange(tab.row0[t], tab.row1[t])[:, None]
                j = np.arange(tab.k0[r], tab.k1[r])[None, :]
                block = vis[tab.row0[t]:tab.row1[t], tab.k0[r]:tab.k1[r]]
                if tab.diag[r] <= NO_DIAG:  # exact without the vectors
                    assert np.array_equal(block, (j - i) <= tab.diag[r])
                else:
                    assert tab.diag[r] == VEC_DIAG
                seen[tab.row0[t]:tab.row1[t], tab.k0[r]:tab.k1[r]] |= (j - i) <= tab.diag[r]
        assert not (vis & ~seen).any() and (tab.diag == VEC_DIAG).any() == shuffled
        new, _ = longest_first(tab)
        keys = program_keys(new)
        assert (np.diff(keys) <= 0).all() and sorted(keys.tolist()) == sorted(program_keys(tab).tolist())
        ranges = {(a, b): sorted(zip(*(getattr(x, f)[x.off[t]:x.off[t + 1]].tolist() for f in ("k0", "k1", "diag"))))
                  for x in (tab,) for t, (a, b) in enumerate(zip(x.row0.tolist(), x.row1.tolist()))}
        for t in range(new.num_programs):
            got = sorted(zip(*(getattr(new, f)[new.off[t]:new.off[t + 1]].tolist() for f in ("k0", "k1", "diag"))))
            assert ranges[(int(new.row0[t]), int(new.row1[t]))] == got


def test_tuning_table_rules_and_decode_splits():
    """No 8 warps below 128 lanes; every class selectable; decode_splits fills 2 programs per multiprocessor and
    never cuts pieces below 4 K/V tiles."""
    from cpinfer.attention import triton_tuning as tt

    for cfg in list(tt.TABLE.values()) + list(tt.DECODE.values()):
        assert cfg.num_warps == 4 or cfg.block_m >= 128
    with pytest.raises(ValueError, match="8 warps need 128-lane tiles"):
        tt.StepConfig(64, 64, 8, 3)
    assert tt.select(16, 576, 128, True, 1000, 1000, 1).block_m == 128  # MLA: one row's 128 heads; wide tiles
    assert tt.select(16, 576, 16, True, 1000, 1000, 1) == tt.WIDE["16"]
    assert tt.select(16, 576, 16, True, 1, 8, 1).block_m == 16
    assert tt.select(16, 128, 4, True, 16384, 16384, 8) == tt.TABLE[("16", 128, "causal")]
    assert tt.select(16, 128, 4, False, 16384, 16384, 8) == tt.TABLE[("16", 128, "full")]
    assert tt.select(16, 128, 4, True, 200, 200, 8).block_m == 64  # 7 programs x 8 heads < 132
    assert tt.select(16, 128, 8, True, 1, 64, 8).block_m == 16 and tt.select(16, 128, 1, True, 64, 64, 8).block_m == 64
    # batch 4 x 8 KV heads = 32 programs over 4 x 32K keys: 2 x 132 / 32 -> 9 pieces of ~3.7K keys
    per = tt.decode_splits(4, 8, 4 * 32768, 32)
    assert per % 32 == 0 and 4 * 8 * -(-32768 // per) >= 2 * 132 and -(-32768 // per) <= 10
    assert tt.decode_splits(300, 8, 10 ** 6, 32) == 0 and tt.decode_splits(1, 1, 50, 32) == 128
