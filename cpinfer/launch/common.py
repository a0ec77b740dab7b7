"""What every part of the launcher shares: the context a rank's function gets, the error a failed call raises,
how a call runs on one rank and how an exit reads, and the loopback / port helpers of local ranks."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import traceback
from typing import Any

import torch


@dataclasses.dataclass
class RankContext:
    """What a function running on one rank gets: its rank, the world, and the groups to pass down explicitly."""

    rank: int
    world_size: int
    group: Any  # the world process group (tensors)
    cpu_group: Any  # a gloo group for control metadata (same as `group` on CPU)
    device: torch.device
    state: dict  # per-rank scratch space that persists across `run` calls (e.g. an engine worker)


class RemoteError(RuntimeError):
    """A function raised on one or more ranks; `errors` maps rank → (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        first = min(errors)
        kind, msg, tb = errors[first]
        super().__init__(f"rank {first} raised {kind}: {msg}\n--- traceback of rank {first} ---\n{tb}")

    @property
    def exception_type(self) -> str:
        return self.errors[min(self.errors)][0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str | None:
    """Name of the loopback network interface ("lo" on Linux), or None when it cannot be found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def bind_to_loopback() -> None:
    """Gloo and NCCL sockets of local ranks listen on loopback only (a user's choice in the environment wins)."""
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def joined_world_requested() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_call(fn, ctx, args, kwargs) -> tuple:
    """`fn(ctx, *args, **kwargs)` here, as ("ok", result) or ("error", (type name, message, traceback))."""
    try:
        return ("ok", fn(ctx, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to rank 0
        return ("error", (type(exc).__name__, str(exc), traceback.format_exc()))


def heartbeat(ctx) -> int:
    """A no-op every rank answers: the driver's idle check that a joined world's ranks are still there."""
    return ctx.rank
