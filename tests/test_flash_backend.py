"""The flash-attn backend's call building, on CPU: a fake flash-attn (`fake_flash_attn.py`) checks every argument and
computes in float64 with flash-attn's own semantics, so packing, cu_seqlens, bottom-right alignment and the LSE
layout are proven exact against the float64 reference — one varlen call per ring step; fp32 through the tiled
Triton kernel; detection by import (FA3 first, a broken install warns and falls back); CP2 with windows.
"""
import os
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # MASK tiles and fp32 go through the Triton kernel (interpreter)
pytest.importorskip("triton", reason="the flash-attn backend falls back to Triton for fp32 and MASK tiles")

import fake_flash_attn as fake  # noqa: E402
from cpinfer.attention import flash_backend  # noqa: E402
from cpinfer.attention.backends import LocalAttention, resolve_name  # noqa: E402
from cpinfer.attention.local import reference_attention  # noqa: E402
from cpinfer.cp import cp_attention  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def fa(request):
    """The fake flash-attn installed (param: FA3 or not) for one test."""
    fake.install(fa3=getattr(request, "param", False))
    fake.CALLS.clear()
    yield fake.CALLS
    fake.uninstall()


def _problem(kind: str, seed: int = 0):
    """(q_seq, q_pos, kv_seq, kv_pos, kv_end or None, window or None) int64 arrays of one step."""
    rng = np.random.default_rng(seed)
    if kind == "causal":  # one prefill: a causal square
        pos = np.arange(70)
        return np.zeros(70, np.int64), pos, np.zeros(70, np.int64), pos, None, None
    if kind == "partial":  # a chunk at 40..69 over a cached 0..39 and itself: FULL + CAUSAL in one sequence
        return np.zeros(30, np.int64), np.arange(40, 70), np.zeros(70, np.int64), np.arange(70), None, None
    if kind == "decode":  # one query per sequence over long cached contexts
        lens = [37, 90, 5, 61]
        kv_seq = np.repeat(np.arange(4), lens)
        return np.arange(4), np.array(lens) - 1, kv_seq, np.concatenate([np.arange(n) for n in lens]), None, None
    if kind == "prefix":  # a prefix tree (root 0 shared by leaves 1, 2), short causal runs, and decode rows
        kv_seq = np.repeat([0, 1, 2], [24, 11, 9])
        kv_pos = np.concatenate([np.arange(24), np.arange(24, 35), np.arange(24, 33)])
        kv_end = np.repeat([3, 2, 3], [24, 11, 9])
        q_seq = np.array([1] * 11 + [2])
        q_pos = np.concatenate([np.arange(24, 35), [32]])
        return q_seq, q_pos, kv_seq, kv_pos, kv_end, None
    if kind == "older":  # FULL blocks of several rows (keys all older: a later pass-KV step) and decode rows
        q_seq = np.array([0] * 12 + [1, 2])
        q_pos = np.concatenate([np.arange(50, 62), [20, 30]])
        kv_seq = np.repeat([0, 1, 2], [40, 21, 31])
        kv_pos = np.concatenate([np.arange(40), np.arange(21), np.arange(31)])
        return q_seq, q_pos, kv_seq, kv_pos, None, None
    if kind == "mixed":  # a causal chunk and an older FULL block of several rows: two calls are needed
        q_seq = np.array([0] * 10 + [1] * 8)
        q_pos = np.concatenate([np.arange(30, 40), np.arange(50, 58)])
        kv_seq = np.repeat([0, 1], [40, 20])
        kv_pos = np.concatenate([np.arange(40), np.arange(20)])
        return q_seq, q_pos, kv_seq, kv_pos, None, None
    if kind == "window":  # two sequences under a sliding window of 9: FULL/CAUSAL inside, MASK edges outside
        q_seq, kv_seq = np.repeat([0, 1], [40, 25]), np.repeat([0, 1], [40, 25])
        pos = np.concatenate([np.arange(40), np.arange(25)])
        return q_seq, pos, kv_seq, pos, None, 9
    if kind in ("chunk", "chunk_window"):  # chunks (CHUNKS): a prefill, a partial prefill, a decode row
        q_seq = np.repeat([0, 1, 2], [40, 30, 1])
        q_pos = np.concatenate([np.arange(40), np.arange(40, 70), [33]])
        kv_seq = np.repeat([0, 1, 2], [40, 70, 34])
        kv_pos = np.concatenate([np.arange(40), np.arange(70), np.arange(34)])
        return q_seq, q_pos, kv_seq, kv_pos, None, 5 if kind == "chunk_window" else None
    if kind == "random":  # fragmented metadata: fixed tiles, many MASK tiles
        return (rng.integers(-1, 3, 37), rng.integers(0, 40, 37), rng.integers(-1, 3, 90), rng.integers(0, 40, 90),
                None, None)
    raise ValueError(kind)


CHUNKS = {"chunk": 16, "chunk_window": 12}  # the attention chunk of a problem kind (else none)


def _run(kind, dtype=torch.float16, vectors=True, seed=0, backend="flash-attn"):
    """One local step of problem `kind` through `backend`, and the float64 reference's output and LSE."""
    q_seq, q_pos, kv_seq, kv_pos, kv_end, window = _problem(kind, seed)
    chunk = CHUNKS.get(kind)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(q_seq), 8, 16, generator=g).to(dtype)
    k = torch.randn(len(kv_seq), 2, 16, generator=g).to(dtype)
    v = torch.randn(len(kv_seq), 2, 16, generator=g).to(dtype)
    step = LocalAttention(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_end, backend=backend, scale=0.3,
                          use_vectors=vectors, window=window, chunk=chunk)
    out, lse = step(q, k, v)
    t = (lambda x: torch.as_tensor(np.asarray(x)))  # noqa: E731
    ref_out, ref_lse = reference_attention(q, k, v, t(q_seq), t(q_pos), t(kv_seq), t(kv_pos), scale=0.3,
                                           kv_seq_end=None if kv_end is None else t(kv_end), window=window,
                                           chunk=chunk)
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("fa", [False, True], indirect=True, ids=["fa2", "fa3"])
@pytest.mark.parametrize("kind,calls", [("causal", 1), ("partial", 1), ("decode", 1), ("prefix", 1), ("older", 1),
                                        ("mixed", 2), ("window", 1), ("chunk", 1), ("chunk_window", 1)])
def test_varlen_packing_is_exact(fa, kind, calls):
    """Every step shape as varlen calls of the fake: equal to the float64 reference (fp16 rounding of the output
    only), empty rows zero with lse -inf, and one call per step unless causal squares meet FULL blocks of several
    rows."""
    out, lse, ref_out, ref_lse = _run(kind)
    assert len(fa) == calls, fa
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert all(c["api"] == (3 if flash_backend.detect().fa3 else 2) for c in fa)


def test_mask_tiles_go_through_the_tiled_kernel_never_through_math(fa, monkeypatch):
    """Fragmented metadata (many MASK tiles) with the plan's vectors: the MASK tiles run the Triton kernel in vector
    mode; without vectors they run as small masked tiles. Both exact; `math` only in the second case."""
    calls = []
    real = flash_backend.sdpa_math_backend
    monkeypatch.setattr(flash_backend, "sdpa_math_backend", lambda *a: calls.append(1) or real(*a))
    for vectors in (True, False):
        calls.clear()
        out, lse, ref_out, ref_lse = _run("random", vectors=vectors, seed=4)
        torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        assert bool(calls) == (not vectors)


def test_fp32_runs_the_tiled_triton_kernel(fa, monkeypatch):
    """flash-attn has no fp32: such a step runs the Triton kernel (tiled), neither flash-attn nor math."""
    from cpinfer.attention import triton_backend

    def boom(*args):
        raise AssertionError("math must not run")

    monkeypatch.setattr(flash_backend, "sdpa_math_backend", boom)
    monkeypatch.setattr(triton_backend, "sdpa_math_backend", boom)
    for kind in ("prefix", "window"):
        out, lse, ref_out, ref_lse = _run(kind, dtype=torch.float32)
        torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert fa == []


def test_detection_by_import(tmp_path, monkeypatch):
    """flash-attn is found by importing it: absent → triton; FA3 preferred over FA2; a broken install (e.g. a wheel
    for another torch) and a too old one fall back with a warning that names the reason."""
    monkeypatch.delenv("CPINFER_ATTENTION_BACKEND", raising=False)
    try:
        fake.uninstall()
        monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)  # shadows a real install, if any
        (tmp_path / "flash_attn").mkdir()
        (tmp_path / "flash_attn" / "__init__.py").write_text(
            "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n")
        flash_backend.detect.cache_clear()
        with pytest.warns(RuntimeWarning, match="cannot be imported.*undefined symbol"):
            assert resolve_name("auto", CUDA) == "triton"
        with pytest.raises(ValueError, match="cannot run on cuda.*not installed \\(or cannot be imported"):
            resolve_name("flash-attn", CUDA)
        fake.install(version="2.0.9")
        with pytest.warns(RuntimeWarning, match="2.0.9 aligns causal masks top-left"):
            assert flash_backend.detect() is None
        fake.install()
        assert flash_backend.detect().name == "flash-attn 2.7.4" and resolve_name("auto", CUDA) == "flash-attn"
        sys.modules["flash_attn_interface"] = fake.make_module(fa3=True)
        flash_backend.detect.cache_clear()
        assert flash_backend.detect().fa3 and flash_backend.detect().name == "flash-attn 3"
    finally:
        sys.modules.pop("flash_attn", None)
        fake.uninstall()


# ---------------------------------------------------------------- CP2 through cp_attention, the fake on every rank

@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, timeout_s=120) as p:
        yield p


def _rank_fake_fa(ctx, q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_end, strategy, window, chunk=None, sinks=None):
    fake.install()
    fake.CALLS.clear()
    out = cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=ctx.group, strategy=strategy, kv_seq_end=kv_end,
                       backend="flash-attn", window=window, chunk=chunk, sinks=sinks)
    return out, len(fake.CALLS)


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q", "all-gather"])
@pytest.mark.parametrize("window,chunk", [(None, None), (6, None), (None, 10)])
def test_cp2_with_flash_attn_is_exact(pool, strategy, window, chunk):
    """CP2, a prefix tree split over both ranks, with and without a window, chunked with sinks: at most one varlen
    call per ring step per rank, the result equal to the float64 reference."""
    kv_seq = np.repeat([0, 1, 2], [24, 11, 9])
    kv_pos = np.concatenate([np.arange(24), np.arange(24, 35), np.arange(24, 33)])
    kv_end = np.repeat([3, 2, 3], [24, 11, 9])
    q_rows = np.arange(24, 44)  # the queries are the leaves' tokens
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(44, 2, 16, generator=g).half() for _ in range(2))
    q = torch.randn(44, 8, 16, generator=g).half()[q_rows]
    sinks = None if chunk is None else torch.randn(8, generator=g)
    t = (lambda x: torch.as_tensor(np.asarray(x)))  # noqa: E731
    q_seq, q_pos = t(kv_seq[q_rows]), t(kv_pos[q_rows])
    ranks_q = [np.arange(0, 20, 2), np.arange(1, 20, 2)]  # interleaved: every step has work
    ranks_kv = [np.arange(0, 44, 2), np.arange(1, 44, 2)]
    args = [(q[a], k[b], v[b], q_seq[a], q_pos[a], t(kv_seq[b]), t(kv_pos[b]), t(kv_end[b]), strategy, window, chunk,
             sinks) for a, b in zip(ranks_q, ranks_kv)]
    res = pool.run_each(_rank_fake_fa, args)
    out = torch.zeros(20, 8, 16, dtype=torch.float64)
    for a, (o, calls) in zip(ranks_q, res):
        out[a] = o.double()
        assert 1 <= calls <= 2  # a call per ring step with work (2 steps), never one per item
    ref, _ = reference_attention(q, k, v, q_seq, q_pos, t(kv_seq), t(kv_pos), kv_seq_end=t(kv_end), window=window,
                                 chunk=chunk, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-3)


def test_engine_one_varlen_call_per_layer(fa, llama_checkpoint):
    """The engine at CP1 (fp16, the fake flash-attn): prefills, a partial prefill reusing a cached prefix and batched
    decodes each make exactly one varlen call per layer (store and new keys read together), and generate the
    tokens and log-probs the `math` backend gives."""
    check_one_call_per_layer("flash-attn", fa, llama_checkpoint("gqa", max_position_embeddings=512))


def check_one_call_per_layer(backend: str, calls: list, path) -> None:
    """Engine at CP1 in fp16 with `backend` (whose fake records each varlen call in `calls`) vs `math`: one call per
    layer and forward, the second prompt reading the shared document from the cache, the same tokens and log-probs."""
    from cpinfer import LLM, SamplingParams

    rng = np.random.default_rng(0)
    doc = rng.integers(3, 256, 40).tolist()
    prompts = [doc + rng.integers(3, 256, n).tolist() for n in (5, 17)] + [rng.integers(3, 256, 9).tolist()]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, ignore_eos=True)
    runs = {}
    for name in (backend, "math"):
        with LLM(str(path), dtype="float16", attention_backend=name, max_kv_tokens_per_rank=1024,
                 threads_per_rank=1) as llm:
            before = len(calls)
            outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)  # the 2nd reuses the doc
            forwards = sum(llm.engine.stats().forwards.values())
            runs[name] = (outs, len(calls) - before, forwards, llm.config.num_hidden_layers)
    outs, n_calls, forwards, layers = runs[backend]
    assert n_calls == forwards * layers and runs["math"][1] == 0
    assert outs[1].num_cached_tokens >= 40
    for mine, ref in zip(outs, runs["math"][0]):
        assert mine.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=2e-2)
