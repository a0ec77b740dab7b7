"""Host work once per forward (issue 16, Must 4): every index a forward needs reaches the device in ONE upload before
layer 0, and while the layers run nothing is made from host data and nothing is read back — for prefill, chunked
prefill, partial prefill on a cached prefix, batched decode; pass-KV and pass-Q; with and without sliding windows;
CP1 and CP2; cpu-flash, and Triton (interpreter) / flash-attn (fake) / torch-flash (fake op) for their host code. The recorder
(`host_sync_guard.py`) is also shown to catch a planted `.item()` and `torch.from_numpy`.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the pool spawns: its ranks run Triton's interpreter

import host_sync_guard as guard  # noqa: E402
from cpinfer import LLM, SamplingParams  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402
from pooled_engine import PooledLLM  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, threads_per_rank=1, timeout_s=120) as p:
        yield p


def _engine(path, cp, pool, **kw):
    """placement "shard" unless asked otherwise: at CP2 every request in the ring (short prompts would stay local)."""
    kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=1024, max_num_batched_tokens=32,
              **{"placement": "shard", **kw})
    return LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)


def _workload(llm) -> dict:
    """Chunked prefill of a 73-token prompt (32-token chunks), its decode; then a partial prefill on the cached
    document beside a fresh prompt, decoded together. Returns the engine's forwards by phase/strategy."""
    rng = np.random.default_rng(0)
    doc = rng.integers(3, 256, 70).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([doc + [5, 6, 7]], params)
    outs = llm.generate([doc + [9, 10], rng.integers(3, 256, 6).tolist()], params)
    assert outs[0].num_cached_tokens >= 64
    return llm.engine.stats().forwards


def _check(llm, run) -> dict:
    pool = llm.engine._pool
    pool.run(guard.install)
    try:
        forwards = run()
        got = pool.run(guard.collect)
    finally:
        pool.run(guard.uninstall)
    for rank in got:
        assert rank["layer_loops"], "the recorder saw no layer loop"
        events = [e for loop in rank["layer_loops"] for e in loop["events"]]
        assert not events, "host work inside the layers:\n" + "\n".join(events[:20])
        assert rank["uploads"] and all(u == {"before": 1, "inside the layers": 0} for u in rank["uploads"]), \
            rank["uploads"]
    return forwards


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("variant", ["gqa", "gemma3"])  # full attention only; sliding layers 0 and 2 + a full one
@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_no_host_work_inside_the_layers(llama_checkpoint, pool, cp, variant, strategy):
    path = llama_checkpoint(variant, max_position_embeddings=512)
    with _engine(path, cp, pool, strategy=strategy) as llm:
        forwards = _check(llm, lambda: _workload(llm))
    ran = strategy if cp > 1 else "local"  # one rank: no ring
    assert {"prefill/" + ran, "decode/" + ran} <= set(forwards), forwards


@pytest.mark.parametrize("variant", ["gqa", "gemma3"])
def test_no_host_work_with_local_placement_at_cp2(llama_checkpoint, pool, variant):
    """Requests kept on one rank each (issue 18): local forwards, a rank without a request idle."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    with _engine(path, 2, pool, placement="local") as llm:
        forwards = _check(llm, lambda: _workload(llm))
    assert {"prefill/local", "decode/local"} <= set(forwards), forwards


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_no_host_work_with_the_triton_backend(llama_checkpoint, pool, strategy):
    """The Triton backend's host code at CP2 with windows (its kernels, numpy in the interpreter, run unrecorded)."""
    path = llama_checkpoint("gemma3", max_position_embeddings=512)
    with _engine(path, 2, pool, strategy=strategy, attention_backend="triton") as llm:
        _check(llm, lambda: _workload(llm))


@pytest.mark.parametrize("cp", [1, 2])
def test_no_host_work_in_the_static_decode_path(llama_checkpoint, pool, cp):
    """The static-shape decode path (what CUDA graphs capture; eager here, Triton interpreter): one upload per
    decode step, nothing from the host inside the layers, windows and full layers, CP1 and CP2."""
    path = llama_checkpoint("gemma3", max_position_embeddings=512)
    with _engine(path, cp, pool, static_decode=True) as llm:
        _check(llm, lambda: _workload(llm))
        served = llm.engine._pool.run(_static_forwards)
    assert min(served) >= 6  # the decode steps went through it


def _static_forwards(ctx) -> int:
    return ctx.state["runner"].static.forwards


def test_no_host_work_with_the_flash_attn_backend(llama_checkpoint, monkeypatch):
    """The flash-attn backend's host code (fake flash-attn, fp16, CP1, windows: varlen calls + Triton MASK tiles)."""
    import fake_flash_attn as fake

    fake.install()
    try:
        mod = __import__("flash_attn")
        real = mod.flash_attn_varlen_func

        def varlen(*args, **kwargs):  # the fake checks its arguments on the host: not the engine's doing
            with guard.paused():
                return real(*args, **kwargs)

        monkeypatch.setattr(mod, "flash_attn_varlen_func", varlen)
        path = llama_checkpoint("gemma3", max_position_embeddings=512)
        n0 = len(fake.CALLS)
        with _engine(path, 1, None, attention_backend="flash-attn", dtype="float16") as llm:
            _check(llm, lambda: _workload(llm))
        assert len(fake.CALLS) > n0
    finally:
        fake.uninstall()


@pytest.mark.parametrize("layout", ["hp", "padded"])
def test_no_host_work_with_the_torch_flash_backend(llama_checkpoint, monkeypatch, layout):
    """The torch-flash backend's host code (fake op, fp16, CP1, windows), its LSE read in the layout of today's torch
    and in the padded one (unpacked on the device)."""
    import fake_torch_flash as fake
    from cpinfer.attention import torch_flash

    fake.install(monkeypatch, layout=layout)
    real = torch_flash.aten_op()

    def op(*args, **kwargs):  # the fake checks its arguments on the host: not the engine's doing
        with guard.paused():
            return real(*args, **kwargs)

    monkeypatch.setattr(torch_flash, "aten_op", lambda: op)
    path = llama_checkpoint("gemma3", max_position_embeddings=512)
    with _engine(path, 1, None, attention_backend="torch-flash", dtype="float16") as llm:
        _check(llm, lambda: _workload(llm))
    assert fake.CALLS


@pytest.mark.parametrize("groups", [4, 0], ids=["dense", "ragged"])
def test_no_host_work_with_the_torch_cudnn_backend(llama_checkpoint, monkeypatch, groups):
    """The torch-cudnn backend's host code (fake ops, fp16, CP1, windows): dense calls per shape, or every FULL block
    in one ragged call; GQA folded, one-key rows, stores and merges all on the device."""
    import fake_torch_cudnn as fake
    from cpinfer.attention import cudnn_backend, torch_cudnn

    fake.install(monkeypatch)
    monkeypatch.setattr(cudnn_backend, "DENSE_GROUPS_MAX", groups)
    dense, ragged = torch_cudnn.aten_ops()

    def paused(fn):  # the fakes check their arguments on the host: not the engine's doing
        def run(*args, **kwargs):
            with guard.paused():
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch_cudnn, "aten_ops", lambda: (paused(dense), paused(ragged)))
    path = llama_checkpoint("gemma3", max_position_embeddings=512)
    with _engine(path, 1, None, attention_backend="torch-cudnn", dtype="float16") as llm:
        _check(llm, lambda: _workload(llm))
    assert fake.CALLS and (groups or any(c["op"] == "ragged" for c in fake.CALLS))


def test_the_recorder_catches_host_work(llama_checkpoint, pool):
    """Negative control: a `.item()` and a `torch.from_numpy` planted in the last layer are reported on every rank."""
    path = llama_checkpoint("gqa", max_position_embeddings=512)
    with _engine(path, 2, pool) as llm:
        llm.engine._pool.run(guard.install)
        llm.engine._pool.run(guard.inject_item)
        try:
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            got = llm.engine._pool.run(guard.collect)
        finally:
            llm.engine._pool.run(guard.remove_injection)
            llm.engine._pool.run(guard.uninstall)
    for rank in got:
        events = " ".join(e for loop in rank["layer_loops"] for e in loop["events"])
        assert "aten.item" in events and "from_numpy" in events
