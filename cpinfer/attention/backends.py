"""Attention backends by name: the kernel that computes one ring step of a `cp_attention` plan, and the merge.

`"auto"` (default; the env var CPINFER_ATTENTION_BACKEND overrides it) picks `cpu-flash` on CPU; on CUDA the
fastest of the backends that are usable there — `flash-attn` when that package imports (FA3 preferred),
`torch-cudnn` (PyTorch's cuDNN attention ops) and `torch-flash` (PyTorch's own FA2 varlen op) when they exist and
passed their probes on the device, and `triton` — timed briefly at first use per device and shape class when the
caller gives the head layout (`autoselect.py`), else in that fixed order. Every one is a tiled kernel for every
dtype (fp32 steps of the flash / cuDNN backends run Triton); `math` (explicit scores, small blocks) runs only when
asked for by name. `cpu-flash` and `math` run the plan's `AttnItem`s one call each (`step.ItemBackend`); `triton`
runs a whole step in one launch (`triton_backend.py`); `flash-attn` and `torch-flash` in one varlen call
(`flash_backend.py`, `torch_flash.py`), `torch-cudnn` in a few (`cudnn_backend.py`, `torch_cudnn.py`).
Device tables are planned from the plan's `steps` and `step_vectors(j)` and uploaded once per forward
(`tables.py`), so a plan built elsewhere runs too.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time

import numpy as np
import torch

from cpinfer.attention.items import CAUSAL, FULL, AttnItem, mark_first, new_accumulator
from cpinfer.attention.kernels import cpu_flash_backend, sdpa_math_backend
from cpinfer.attention.local import MIN_STAIR, _np, build_items, chunk_labels, seq_end_or_default
from cpinfer.attention.step import (HeadLayout, ItemBackend, StepBackend, plan_key, plan_tables,  # noqa: F401
                                    step_vectors)

log = logging.getLogger(__name__)
ENV_VAR = "CPINFER_ATTENTION_BACKEND"
NAMES = ("auto", "cpu-flash", "triton", "flash-attn", "torch-cudnn", "torch-flash", "math")
IN_KERNEL = ("triton", "flash-attn", "torch-cudnn", "torch-flash")  # take CAUSAL squares of any length in a call


def resolve_name(name: str | None, device: torch.device, probe: bool = True, layout: HeadLayout | None = None,
                 tokens: int | None = None) -> str:
    """The concrete backend for `name` on `device` ("auto" and the env var resolved); ValueError if unusable.
    `probe=False` (a driver that does not own the device): torch-flash / torch-cudnn count as usable when their ops
    exist, without running their probes on the device (the ranks resolve again, with the probes). `layout` (and
    `tokens`, the length to time at): "auto" times the usable backends on that shape class once per device
    (`autoselect.choose`) instead of taking the fixed order."""
    device = torch.device(device)
    name = name or "auto"
    if name == "auto":
        name = os.environ.get(ENV_VAR) or "auto"
        where = f" (from ${ENV_VAR})" if name != "auto" else ""
    else:
        where = ""
    if name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}{where}; allowed: {', '.join(NAMES)}")
    if name == "auto":
        if device.type == "cpu":
            return "cpu-flash"
        return accelerator_default(device, probe, layout, tokens)
    problem = _unusable(name, device, probe)
    if problem:
        raise ValueError(f"attention backend {name!r}{where} cannot run on {device}: {problem}")
    return name


def accelerator_default(device: torch.device, probe: bool = True, layout: HeadLayout | None = None,
                        tokens: int | None = None) -> str:
    """What `auto` means off the CPU: among flash-attn (if it imports), torch-cudnn and torch-flash (if their probes
    passed on `device`) and triton, the fastest on `layout`'s shape class when one is given and the probes ran
    (timed once per device and class), else the first of them in `autoselect.ORDER`."""
    from cpinfer.attention import autoselect

    usable = [n for n in autoselect.ORDER if n == "triton" or not _unusable(n, device, probe)]
    if layout is not None and probe and len(usable) == 1:
        log.info("attention backend auto on %s: %s, the only usable one", device, usable[0])
    if layout is None or not probe or len(usable) == 1:
        return usable[0]
    return autoselect.choose(device, autoselect.ShapeClass.of(layout, tokens), usable, time_backend).name


def time_backend(name: str, device: torch.device, shape, repeat: int = 5) -> float:
    """Median wall seconds of a causal prefill of about `shape.tokens` tokens through backend `name` on `device`
    (random inputs). Two warm-up calls (at two lengths: compilation, both divisibility variants of Triton's), then
    each timed call at a length not seen before — planning, its device tables and any per-shape plan the kernel
    library builds (cuDNN's graph) included, as a new prompt length would pay them."""
    dtype = getattr(torch, shape.dtype)
    n = shape.tokens
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, shape.heads, shape.head_dim, device=device, dtype=dtype, generator=g)  # [L, H, D]
    k = torch.randn(n, shape.kv_heads, shape.head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(n, shape.kv_heads, shape.head_dim, device=device, dtype=dtype, generator=g)
    seq, pos = torch.zeros(n, dtype=torch.long), torch.arange(n)
    times = []
    for i in range(repeat + 2):
        m = n - i  # a new length each call
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        LocalAttention(seq[:m], pos[:m], seq[:m], pos[:m], backend=name, device=device)(q[:m], k[:m], v[:m])
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _unusable(name: str, device: torch.device, probe: bool = True) -> str:
    if name == "cpu-flash" and device.type != "cpu":
        return ("cpu-flash is the CPU kernel; use 'auto', 'triton', 'flash-attn', 'torch-cudnn', 'torch-flash' or "
                "'math' on accelerators")
    if name == "flash-attn":
        from cpinfer.attention import flash_backend

        return flash_backend.unusable(device)
    if name == "torch-flash":
        from cpinfer.attention import torch_flash

        return torch_flash.unusable(device, probe)
    if name == "torch-cudnn":
        from cpinfer.attention import torch_cudnn

        return torch_cudnn.unusable(device, probe)
    if name == "triton":
        if not _has("triton"):
            return "the triton package is not installed"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "Triton kernels need a GPU, or TRITON_INTERPRET=1 to run in Triton's CPU interpreter"
    return ""


_BACKENDS: dict[str, StepBackend] = {}


def get_step_backend(name: str | None, device) -> StepBackend:
    """The backend object for a name (instances are shared; they hold no per-plan state)."""
    concrete = resolve_name(name, device)
    if concrete not in _BACKENDS:
        if concrete == "triton":
            from cpinfer.attention.triton_backend import TritonBackend

            _BACKENDS[concrete] = TritonBackend()
        elif concrete == "flash-attn":
            from cpinfer.attention import flash_backend

            _BACKENDS[concrete] = flash_backend.FlashAttnBackend(flash_backend.detect())
        elif concrete == "torch-flash":
            from cpinfer.attention import flash_backend, torch_flash

            _BACKENDS[concrete] = flash_backend.FlashAttnBackend(torch_flash.api(), name="torch-flash")
        elif concrete == "torch-cudnn":
            from cpinfer.attention import cudnn_backend, torch_cudnn

            _BACKENDS[concrete] = cudnn_backend.CudnnBackend(torch_cudnn.api(device))
        else:
            kernel = {"cpu-flash": cpu_flash_backend, "math": sdpa_math_backend}[concrete]
            _BACKENDS[concrete] = ItemBackend(concrete, kernel)
    return _BACKENDS[concrete]


def min_stair(name: str | None) -> int:
    """`build_items`' min_stair for a concrete backend name: in-kernel backends take causal squares of any length."""
    return 1 if name in IN_KERNEL else MIN_STAIR


def item_kernel(name: str | None, device):
    """The per-item kernel (q, k, v, causal, mask, scale) → (out, lse) of a backend, by name ("auto" resolved).

    For a whole-step backend (triton, flash-attn, torch-cudnn, torch-flash) this is an adapter that runs one item
    per call (tables built per call): correct, but one launch per item and host work per call; `attend_items` runs
    a whole step instead.
    """
    backend = get_step_backend(name, device)
    if isinstance(backend, ItemBackend):
        return backend.kernel

    def one_item(q, k, v, causal, mask, scale):
        if mask is not None:  # an irregular tile: the portable kernel
            return sdpa_math_backend(q, k, v, causal, mask, scale)
        acc_out, acc_lse = new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
        item = AttnItem(0, q.shape[0], 0, k.shape[0], CAUSAL if causal else FULL)
        backend.attend_items([item], None, q, k, v, acc_out, acc_lse, scale)
        return acc_out, acc_lse

    return one_item


def backend_for(plan, device) -> StepBackend:
    """The backend a plan asks for (`plan.backend`, default "auto") on the device of its tensors."""
    return get_step_backend(getattr(plan, "backend", "auto"), device)


# ---------------------------------------------------------------- local attention through a named backend

class _OneStep:
    """A one-step plan (local attention): the items and, unless None, the vectors a backend reads."""

    def __init__(self, items, vectors, window=None, prefix=()):
        self.steps = [items]
        self.step_vectors = None if vectors is None else (lambda j: vectors)
        self.window = window
        self.table_prefix = prefix
        self.tables = None


class LocalAttention:
    """Local (no communication) attention through a named backend, planned once and callable many times.

    Metadata [Lq] / [Lk] int64 (numpy or tensors); `__call__(q [Lq, H, D], k/v [Lk, Hkv, D], acc=None)` →
    (out [Lq, H, D] fp32, lse [Lq, H] fp32), merged into `acc` = (out, lse) when given (a later ring step).
    The device tables are built on the first call, in one upload. `chunk`: an attention chunk, folded into the
    labels (`chunk_labels`) that the items and the in-kernel vectors are built from.
    """

    def __init__(self, q_seq, q_pos, kv_seq, kv_pos, *, kv_seq_end=None, backend="auto", device="cpu",
                 scale=None, use_vectors: bool = True, window: int | None = None, chunk: int | None = None):
        qs, qp, ks, kp = (_np(x) for x in (q_seq, q_pos, kv_seq, kv_pos))
        ke = seq_end_or_default(ks, kv_seq_end)
        [(qs, qp)], [(ks, kp, ke)] = chunk_labels([(qs, qp)], [(ks, kp, ke)], chunk)
        name = resolve_name(backend, device)
        items = build_items(qs, qp, ks, kp, ke, window, min_stair(name))
        vectors = (qs, qp, ks, ke, kp) if use_vectors else None  # without: in-kernel backends use item mode
        self._fresh = _OneStep(items, vectors, window, ("fresh",))  # rows without a partial may be overwritten
        self._merge = _OneStep(mark_first(items, len(qs), np.ones(len(qs), dtype=bool)), vectors, window, ("merge",))
        self.backend = get_step_backend(name, device)
        self.scale = scale

    def __call__(self, q, k, v, acc=None):
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        plan = self._fresh if acc is None else self._merge  # with acc every row holds a partial: merge only
        if plan.tables is None:
            plan.tables = plan_tables(self, q.device)  # both plans share one set of tables
            self.backend.prepare_plan(plan, HeadLayout.of(q, k), plan.tables)
            plan.tables.upload()
        acc_out, acc_lse = acc if acc is not None else new_accumulator(q.shape[0], q.shape[1], v.shape[-1], q.device)
        self.backend.attend(plan, 0, q, k, v, acc_out, acc_lse, scale)
        return acc_out, acc_lse


def attend_local(q, k, v, q_seq, q_pos, kv_seq, kv_pos, *, kv_seq_end=None, scale=None, backend="auto",
                 acc=None, use_vectors=True, window=None, chunk=None):
    """One-shot `LocalAttention`: q [Lq, H, D] against k/v [Lk, Hkv, D] → (out fp32, lse fp32), merged into acc."""
    step = LocalAttention(q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_seq_end, backend=backend, device=q.device,
                          scale=scale, use_vectors=use_vectors, window=window, chunk=chunk)
    return step(q, k, v, acc)
