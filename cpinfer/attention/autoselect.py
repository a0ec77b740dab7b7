"""`auto` on an accelerator: the fastest attention backend that is usable there (its probe passed), by a short
timing at first use, cached per device and shape class (head dim, heads / KV heads, dtype, a power-of-two length
bucket); one log line says what was chosen and why. Without a shape class the fixed `ORDER` applies.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch

from cpinfer.attention.step import HeadLayout

log = logging.getLogger(__name__)

# The fixed order (no timing): flash-attn when installed; then cuDNN, which PyTorch's dense SDPA ran at 561-660
# TFLOP/s on an H100 where torch-flash (FA2) reached 250-352 (docs/benchmarks.md, "GPU"); then torch-flash; then
# the portable Triton kernel.
ORDER = ("flash-attn", "torch-cudnn", "torch-flash", "triton")
DEFAULT_TOKENS = 8192  # the causal prefill timed when the caller names no length
MIN_BUCKET, MAX_BUCKET = 1024, 32768  # timed lengths: long enough to fill the GPU, short enough to take ~ms


@dataclasses.dataclass(frozen=True)
class ShapeClass:
    """What the timing is cached by: the head layout and a power-of-two length bucket."""

    head_dim: int
    heads: int
    kv_heads: int
    dtype: str
    tokens: int

    def __post_init__(self):
        if min(self.head_dim, self.heads, self.kv_heads, self.tokens) < 1 or self.heads % self.kv_heads:
            raise ValueError(f"a shape class needs positive sizes and heads divisible by KV heads, got {self}")

    @classmethod
    def of(cls, layout: HeadLayout, tokens: int | None = None) -> "ShapeClass":
        n = DEFAULT_TOKENS if tokens is None else int(tokens)
        bucket = min(MAX_BUCKET, max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1))))))
        return cls(layout.head_dim, layout.heads, layout.kv_heads, str(layout.dtype).removeprefix("torch."), bucket)

    def describe(self) -> str:
        return f"D={self.head_dim} H={self.heads}/{self.kv_heads} {self.dtype}, causal prefill of {self.tokens} tokens"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `auto` chose on a device for a shape class, with the timings it chose by (ms; inf: failed)."""

    name: str
    device: str
    shape: ShapeClass
    timings_ms: dict

    def line(self) -> str:
        times = ", ".join(f"{n} {t:.3g} ms" if math.isfinite(t) else f"{n} failed" for n, t in self.timings_ms.items())
        return f"attention backend auto on {self.device} for {self.shape.describe()}: {self.name} ({times})"


Timer = Callable[[str, torch.device, ShapeClass], float]  # (backend, device, shape class) → seconds
_CHOICES: dict[tuple, Choice] = {}


def choose(device, shape: ShapeClass, candidates, timer: Timer) -> Choice:
    """The fastest of `candidates` (usable backend names, in `ORDER`) on `device` for `shape`: each timed once by
    `timer` (`backends.time_backend`), cached per (device, shape class); ties and failures go by the order given.
    Inside a CUDA graph capture nothing is timed: the first candidate."""
    device = torch.device(device)
    key = (_device_name(device), shape)
    if key in _CHOICES:
        return _CHOICES[key]
    candidates = list(candidates)
    if not candidates:
        raise ValueError("no attention backend to choose from")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return Choice(candidates[0], key[0], shape, {})
    timings = {}
    for name in candidates:
        try:
            timings[name] = 1e3 * float(timer(name, device, shape))
        except Exception as exc:  # noqa: BLE001 - a backend that fails here is not chosen; the reason is logged
            log.warning("timing the %s attention backend on %s failed: %s: %s", name, device, type(exc).__name__, exc)
            timings[name] = math.inf
        if not timings[name] > 0:  # NaN / non-positive: not a timing
            timings[name] = math.inf
    best = min(candidates, key=lambda n: (timings[n], candidates.index(n)))
    choice = Choice(best, key[0], shape, timings)
    log.info(choice.line())
    _CHOICES[key] = choice
    return choice


def chosen(device, layout: HeadLayout, tokens: int | None = None) -> Choice | None:
    """The cached choice for `layout` on `device`, if `auto` timed one."""
    return _CHOICES.get((_device_name(torch.device(device)), ShapeClass.of(layout, tokens)))


def forget() -> None:
    """Time again at the next use (tests)."""
    _CHOICES.clear()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


__all__ = ["ORDER", "ShapeClass", "Choice", "choose", "chosen", "forget"]
