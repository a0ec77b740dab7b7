"""Time spans on the device's own timeline: CUDA events on CUDA, the wall clock on CPU.

On a GPU the host only enqueues work (and `work.wait()` of an NCCL transfer just makes the compute stream wait),
so wall-clock spans read ~0; events recorded on the stream measure what the GPU did. A span is read only after
the forward (`seconds`, one synchronisation), never inside the layer loop.
"""
from __future__ import annotations

import contextlib
import time

import torch

_PAUSED = [0]  # > 0 while a CUDA graph is captured: no events may be recorded then


class Span:
    """A pending CUDA span between two recorded events; `float(span)` waits for the end event."""

    __slots__ = ("start", "end")

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __float__(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Stopwatch:
    """`mark()` a point on the device's timeline; `span(a, b)` is seconds (CPU) or a pending `Span` (CUDA)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if _PAUSED[0]:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def span(self, a, b):
        if a is None or b is None:  # marked while paused
            return 0.0
        return Span(a, b) if self.cuda else b - a


@contextlib.contextmanager
def paused():
    """No spans while this is active (a CUDA graph capture: event records would break it); they read 0."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def resolve(timings: list[dict] | None) -> list[dict]:
    """Replace every pending span in `timings` (ring steps: {"step", "compute_s", "wait_s"}) by its seconds."""
    for entry in timings or ():
        for key, value in entry.items():
            if isinstance(value, Span):
                entry[key] = float(value)
    return timings or []


def median_seconds(fn, repeat: int, device, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` untimed ones, for benchmarks: CUDA events on a
    CUDA device (each run synchronised), the wall clock elsewhere."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
