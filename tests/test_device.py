"""Choosing the hardware (issue 16): `auto` device and dtype, CUDA asked for where there is none (ValueError / exit 2
before any rank starts), more ranks than GPUs, KV capacity from injected device-memory figures, CUDA-event spans,
and prompt log-probs that cross to the host as the chosen values only. All on CPU: CUDA is faked where needed."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cpinfer import LLM, SamplingParams, device, launch, timing
from cpinfer.cli import main
from cpinfer.engine import model_runner as MR
from cpinfer.engine.kv.capacity import (MemoryFigures, kv_tokens_from_host_ram, kv_tokens_from_memory,
                                        profile_tokens_per_rank)
from cpinfer.engine.kv.manager import BLOCK
from cpinfer.engine.config import EngineConfig
from cpinfer.engine.startup import EngineStartup

GiB = 1 << 30
CUDA_MISSING = not torch.cuda.is_available()


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors exit directly
        return exc.code


@pytest.fixture
def fake_gpus(monkeypatch):
    """`fake_gpus(n)`: torch reports CUDA with n GPUs (nothing is ever placed on them in these tests)."""
    def set_gpus(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_gpus


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank fails the test: errors must come before any rank starts."""
    def refuse(*_a, **_k):
        raise AssertionError("a rank was started")
    for name in ("WorkerPool", "InProcessWorld", "JoinedWorld"):
        monkeypatch.setattr(f"cpinfer.engine.startup.{name}", refuse)


# ---------------------------------------------------------------- Must 1: device, dtype, GPUs per node

def test_auto_resolves_to_what_the_machine_has(fake_gpus):
    fake_gpus(0)
    assert device.resolve_device("auto") == "cpu" and device.resolve_dtype("auto", "cpu") == "float32"
    cfg = EngineConfig()
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")
    fake_gpus(2)
    assert device.resolve_device("auto") == "cuda" and device.resolve_dtype("auto", "cuda") == "bfloat16"
    cfg = EngineConfig(context_parallel_size=2)
    assert (cfg.device, cfg.dtype) == ("cuda", "bfloat16")
    assert EngineConfig(device="cpu").dtype == "float32"  # CPU stays fp32 even on a GPU node
    assert EngineConfig(device="cuda", dtype="float16").dtype == "float16"


@pytest.mark.parametrize("kwargs,fragment", [(dict(device="gpu"), "device must be one of auto, cpu, cuda"),
                                             (dict(dtype="fp8"), "dtype must be one of"),
                                             (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization")])
def test_bad_names_are_value_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(**kwargs)


def test_cuda_asked_for_without_cuda_fails_before_any_rank(fake_gpus, no_ranks, random_checkpoint):
    fake_gpus(0)
    with pytest.raises(ValueError, match="CUDA"):
        LLM(str(random_checkpoint(seed=1)), device="cuda")


@pytest.mark.parametrize("argv", [
    ["generate", "--device", "cuda", "--prompt", "hi"],
    ["serve", "--device", "cuda"],
    ["demo", "--device", "cuda"],
    ["bench", "prefill", "--device", "cuda"],
    ["bench", "decode", "--device", "cuda", "--dtype", "bfloat16"],
    ["calibrate", "--cp", "2", "--device", "cuda"],
])
def test_cli_exits_2_naming_cuda(fake_gpus, capsys, argv):
    fake_gpus(0)
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and "CUDA" in err


def test_more_ranks_than_gpus_fails_up_front_naming_both(fake_gpus, monkeypatch, no_ranks, random_checkpoint):
    fake_gpus(1)
    with pytest.raises(ValueError, match=r"2 ranks on this node .* 1 GPU\(s\) are visible"):
        EngineConfig(context_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match=r"4 ranks on this node .* 1 GPU"):
        LLM(str(random_checkpoint(seed=1)), context_parallel_size=2, tensor_parallel_size=2, device="cuda")
    with pytest.raises(ValueError, match=r"3 ranks .* 1 GPU"):  # the launcher checks before spawning
        launch.WorkerPool(3, backend="nccl")
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks on this node
    with pytest.raises(ValueError, match=r"4 ranks on this node .* 2 GPU"):
        EngineConfig(context_parallel_size=8, device="cuda")


def test_ranks_share_a_gpu_only_when_asked_and_then_over_gloo(fake_gpus):
    fake_gpus(1)
    assert EngineConfig(context_parallel_size=2, device="cuda", share_gpus=True).device == "cuda"
    assert device.comm_backend("cuda", 2, share_gpus=True) == "gloo"  # NCCL refuses two ranks on one GPU
    assert device.comm_backend("cuda", 1) == "nccl"
    assert device.comm_backend("cpu", 4) == "gloo"
    fake_gpus(8)
    assert device.comm_backend("cuda", 8) == "nccl"  # a GPU node: one rank per GPU, NCCL for the tensors


# ---------------------------------------------------------------- Must 2: KV capacity from device memory

def test_kv_tokens_from_injected_memory_figures():
    per_token = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16: 128 KiB per token
    fig = MemoryFigures(total=80 * GiB, free_at_start=79 * GiB, peak=20 * GiB, non_torch=GiB)
    expect = int((0.9 * 80 - 21) * GiB // per_token) // BLOCK * BLOCK
    assert kv_tokens_from_memory(fig, 0.9, per_token, BLOCK) == expect
    assert kv_tokens_from_memory(fig, 0.5, per_token, BLOCK) == int((40 - 21) * GiB // per_token) // BLOCK * BLOCK
    # other processes hold memory: never more than was free before the model loaded
    busy = MemoryFigures(total=80 * GiB, free_at_start=50 * GiB, peak=20 * GiB, non_torch=GiB)
    assert kv_tokens_from_memory(busy, 0.9, per_token, BLOCK) == int(29 * GiB // per_token) // BLOCK * BLOCK
    # two ranks on one GPU: each gets half of the budget
    assert kv_tokens_from_memory(fig, 0.9, per_token, BLOCK, ranks_per_device=2) == \
        int((0.45 * 80 - 21) * GiB // per_token) // BLOCK * BLOCK
    with pytest.raises(ValueError, match=r"no room for the KV cache: gpu_memory_utilization 0.25 of 80.00 GiB"):
        kv_tokens_from_memory(fig, 0.25, per_token, BLOCK)
    # a draft model loaded after the measurement: its weights and scratch come off the budget first
    assert kv_tokens_from_memory(fig, 0.9, per_token, BLOCK, reserve=3 * GiB) == \
        int((0.9 * 80 - 24) * GiB // per_token) // BLOCK * BLOCK
    with pytest.raises(ValueError, match=r"\+3.00 GiB for the draft model"):
        kv_tokens_from_memory(fig, 0.3, per_token, BLOCK, reserve=3 * GiB)
    with pytest.raises(ValueError, match="memory figure peak"):
        MemoryFigures(total=GiB, free_at_start=GiB, peak=-1)


def test_cpu_keeps_host_ram_sizing_and_profile_tokens():
    assert kv_tokens_from_host_ram(0.25, 2, 1024, BLOCK, 4096, total_bytes=64 * GiB) == 4 * 4096  # capped
    assert kv_tokens_from_host_ram(0.25, 2, 1 << 20, BLOCK, 1 << 20, total_bytes=8 * GiB) == 1024
    # a share of exactly k tokens' bytes holds k tokens whatever the RAM (float rounding once lost a block here:
    # 25,276,510,208 bytes x (131072 / that) is 131071.99..., truncated to 1023 bf16 tokens, then to 960)
    for total in (25_276_510_208, 24 * 1024 ** 3, 17_179_869_184, 1_099_511_627_776, 33_554_432_001):
        fraction = 512 * 256 / total
        got = [kv_tokens_from_host_ram(fraction, 1, bpt, 64, 2048, total_bytes=total) for bpt in (256, 128, 64)]
        assert got == [512, 1024, 2048], (total, got)
    assert profile_tokens_per_rank(8192, 131072, 1) == 8192
    assert profile_tokens_per_rank(None, 131072, 4) == 32768  # no chunking: a whole max_model_len prompt
    assert profile_tokens_per_rank(1000, 4096, 3) == 2 * 167  # its two of the 2N chunks


class _FakeProbe:
    """Injected device memory: 1 GiB total; the peak is the bytes the weights take plus a fixed activation share."""

    figures_seen: list = []

    def __init__(self, device, shared=False):
        self.shared = shared

    def start(self):
        pass

    def figures(self):
        fig = MemoryFigures(total=GiB, free_at_start=GiB - (64 << 20), peak=300 << 20, non_torch=20 << 20)
        _FakeProbe.figures_seen.append(fig)
        return fig


def test_engine_sizes_its_cache_from_the_profiled_figures(monkeypatch, random_checkpoint):
    """The CUDA sizing path end to end on CPU: the rank runs the profiling forward, the memory figures are injected,
    every rank's capacity comes back, the engine takes it, logs it and serves requests within it."""
    monkeypatch.setattr(EngineStartup, "default_capacity", lambda self, fraction: None)  # as on CUDA
    monkeypatch.setattr(MR, "MemoryProbe", _FakeProbe)
    forwards = []
    real = MR.ModelRunner.profile_forward
    monkeypatch.setattr(MR.ModelRunner, "profile_forward", lambda self, n: (forwards.append(n), real(self, n)))
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("cpinfer").addHandler(handler)
    path = random_checkpoint(seed=2)
    try:
        with LLM(str(path), device="cpu", gpu_memory_utilization=0.5, max_num_batched_tokens=300,
                 threads_per_rank=1) as llm:
            c = llm.config
            per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
            expect = int((GiB // 2 - (300 << 20) - (20 << 20)) // per_token) // BLOCK * BLOCK
            assert llm.cache_stats()["kv_capacity_per_rank"] == expect
            store = llm.engine._pool.ctx.state["runner"].store
            assert store.k.shape[1] == expect + 1 and store.sink == expect  # that size, plus the decode pad's row
            out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
            assert len(out.token_ids) == 3
    finally:
        logging.getLogger("cpinfer").removeHandler(handler)
    assert forwards == [300]  # one profiling forward of the batch budget (CP1: all of it on the one rank)
    assert any(f"KV cache: {expect} tokens per rank" in r.getMessage() for r in records)


def test_profile_forward_runs_the_model_without_a_cache(random_checkpoint):
    """The profiling forward needs no KV store (it runs before one exists) and leaves none behind."""
    ctx = launch.InProcessWorld("cpu", 1).ctx
    runner = MR.ModelRunner(ctx, str(random_checkpoint(seed=2)), torch.float32, MR.ParallelConfig(1, 1))
    assert runner.store is None
    runner.profile_forward(257)
    assert runner.store is None
    runner.allocate_kv(128)
    assert runner.store.k.shape[1] == 129 and runner.store.sink == 128  # 128 slots and the static decode's pad


# ---------------------------------------------------------------- Must 6: CUDA-event spans, read after the forward

class _FakeEvent:
    clock = [0.0]

    def __init__(self, enable_timing=False):
        self.t, self.synced = None, False

    def record(self, stream=None):
        _FakeEvent.clock[0] += 0.25
        self.t = _FakeEvent.clock[0]

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):  # milliseconds, as CUDA reports them
        return 1e3 * (end.t - self.t)


def test_cuda_spans_are_events_read_only_when_resolved(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    clock = timing.Stopwatch("cuda")
    a, b = clock.mark(), clock.mark()
    span = clock.span(a, b)
    assert isinstance(span, timing.Span) and not b.synced  # nothing waited for yet
    steps = [{"step": 0, "compute_s": span, "wait_s": 0.5}]
    assert timing.resolve(steps) == [{"step": 0, "compute_s": pytest.approx(0.25), "wait_s": 0.5}] and b.synced
    cpu = timing.Stopwatch("cpu")
    assert isinstance(cpu.span(cpu.mark(), cpu.mark()), float)


def test_tp_all_reduce_spans_fold_into_comm_s(monkeypatch):
    from cpinfer.tensor_parallel import RowParallelLinear

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    layer = RowParallelLinear(torch.nn.Linear(2, 2), group=None)
    clock = timing.Stopwatch("cuda")
    layer._comm = [clock.span(clock.mark(), clock.mark()), 0.5]
    assert layer.comm_s == pytest.approx(0.75) and layer._comm == []
    layer.comm_s = 0.0
    assert layer.comm_s == 0.0


# ---------------------------------------------------------------- Must 8: prompt log-probs gathered where the logits are

def test_prompt_logprobs_cross_to_the_host_as_chosen_values_only(monkeypatch, random_checkpoint):
    """Every tensor `_prompt_logprobs` moves to the host is 1-D (the chosen values, one copy per forward), and the
    values equal log_softmax of the rank's own logits at the next tokens."""
    moved, checked = [], []
    real_cpu, real = torch.Tensor.cpu, MR.ModelRunner._prompt_logprobs

    def spy_cpu(self, *a, **k):
        moved.append(tuple(self.shape))
        return real_cpu(self, *a, **k)

    def wrapped(self, batch, plan, hidden):
        monkeypatch.setattr(torch.Tensor, "cpu", spy_cpu)
        try:
            result = real(self, batch, plan, hidden)
        finally:
            monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
        for b, (offsets, values) in result.items():
            s = batch.seqs[b]
            rows = torch.from_numpy(plan.qoff[0, b] + np.arange(len(offsets)))
            targets = torch.from_numpy(np.append(s.token_ids[1:], s.next_token)[offsets])
            ref = torch.log_softmax(self.model.compute_logits(hidden[rows]), -1).gather(1, targets[:, None])[:, 0]
            torch.testing.assert_close(torch.from_numpy(values), ref, rtol=1e-5, atol=1e-5)
            checked.append(len(offsets))
        return result

    monkeypatch.setattr(MR.ModelRunner, "_prompt_logprobs", wrapped)
    with LLM(str(random_checkpoint(seed=3, max_position_embeddings=2048)), device="cpu", threads_per_rank=1,
             max_kv_tokens_per_rank=4096) as llm:
        prompts = [list(range(3, 40)), [3 + i % 500 for i in range(1150)]]  # the second: more than one 1024-row chunk
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=True, ignore_eos=True))
    assert sorted(checked) == [36, 1149]
    assert moved and all(len(shape) == 1 for shape in moved), moved
    assert sum(shape[0] for shape in moved) == 36 + 1149
    assert outs[1].prompt_logprobs[0] is None and len(outs[1].prompt_logprobs) == 1150


def test_calibrate_measures_the_engines_backend_and_dtype(fake_gpus):
    """`cpinfer calibrate` on CUDA defaults to the engine's dtype (bf16) and backend (auto → triton / flash-attn),
    and its attention timings go through that backend (checked on CPU with `math` against the reference)."""
    import argparse

    from cpinfer.attention.backends import resolve_name
    from cpinfer.attention.local import reference_attention
    from cpinfer.commands import calibrate as cmd
    from cpinfer.perf import calibrate as cal

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    fake_gpus(2)
    cfg = cmd.config_from_args(parser.parse_args(["--cp", "2"]))
    assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cuda", "bfloat16", "auto")
    assert resolve_name(cfg.attention_backend, torch.device("cuda")) in ("triton", "flash-attn")
    fake_gpus(0)
    cfg = cmd.config_from_args(parser.parse_args(["--cp", "2", "--attention-backend", "math"]))
    assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cpu", "float32", "math")
    with pytest.raises(ValueError, match="flash-attn"):
        cal.CalibrationConfig(2, attention_backend="flash-attn")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, h, 16, generator=g) for h in (4, 2, 2))
    pos = torch.arange(40)
    for causal in (False, True):
        out, _ = cal.local_attention_fn(cal.CalibrationConfig(2, head_dim=16, attention_backend="math"), "cpu",
                                        40, causal)(q, k, v)
        ref, _ = reference_attention(q, k, v, torch.zeros(40, dtype=torch.long), pos if causal else pos + 40,
                                     torch.zeros(40, dtype=torch.long), pos)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


_FAULTS = """
import resource, sys, torch
from cpinfer.device import keep_freed_host_memory
kept = keep_freed_host_memory()
assert keep_freed_host_memory() == kept  # once per process
faults = []
for _ in range(4):  # a forward's activation: 24 MiB made, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(6 << 20)
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, faults[-1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
@pytest.mark.parametrize("setting", ["keep", "default"])
def test_host_malloc_keeps_freed_activations(setting):
    """CPU ranks keep freed activation memory: a 24 MiB block freed and made again faults in none of its 6,144 pages
    (with the thresholds glibc adapts, some processes faulted a prefill's activations in at every forward);
    CPINFER_HOST_MALLOC=default leaves malloc as it is."""
    import platform

    env = dict(os.environ, CPINFER_HOST_MALLOC=setting)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    kept, faults = out.stdout.split()
    glibc = platform.libc_ver()[0] == "glibc"
    assert kept == str(setting == "keep" and glibc)
    if kept == "True":
        assert int(faults) < 100, faults
