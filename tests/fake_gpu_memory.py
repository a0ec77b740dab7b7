"""Injected device memory for sizing the KV cache on CPU ranks (tests only): run `install` on a pool's ranks and
each rank's `MemoryProbe` reports a peak that grows with the tokens its profiling forward ran and with its rank, so
roles with different profiles (and ranks of one role) measure different capacities; `uninstall` restores both."""
from __future__ import annotations

from cpinfer.engine import model_runner as MR
from cpinfer.engine.kv.capacity import MemoryFigures

MiB = 1 << 20
TOTAL = 96 * MiB  # the fake device, shared by every rank of the pool (no CUDA: one "device")
BASE = 4 * MiB  # the weights' share of the peak
PER_TOKEN = 32 * 1024  # activation bytes per profiled token
PER_RANK = MiB  # rank r peaks r MiB higher: the group takes its smallest


def peak(rank: int, tokens: int) -> int:
    return BASE + tokens * PER_TOKEN + rank * PER_RANK


def figures(rank: int, tokens: int) -> MemoryFigures:
    return MemoryFigures(total=TOTAL, free_at_start=TOTAL, peak=peak(rank, tokens), non_torch=0)


_saved: dict = {}
_profiled: list[int] = []  # tokens of every profiling forward on this rank since `install`


class _Probe:
    rank = 0

    def __init__(self, device, shared=False):
        self.shared = shared

    def start(self) -> None:
        _profiled.clear()

    def figures(self) -> MemoryFigures:
        return figures(_Probe.rank, _profiled[-1])


def install(ctx) -> None:
    _saved.update(probe=MR.MemoryProbe, profile=MR.ModelRunner.profile_forward)
    _Probe.rank = ctx.rank
    real = _saved["profile"]

    def profile(self, tokens: int) -> None:
        _profiled.append(tokens)
        real(self, tokens)

    MR.MemoryProbe = _Probe
    MR.ModelRunner.profile_forward = profile


def uninstall(ctx) -> None:
    if _saved:
        MR.MemoryProbe = _saved.pop("probe")
        MR.ModelRunner.profile_forward = _saved.pop("profile")


def store_slots(ctx) -> int:
    """The rows of this rank's KV store (its capacity plus the decode pad's row)."""
    return int(ctx.state["runner"].store.k.shape[1])
