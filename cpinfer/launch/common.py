"""What every part of the launcher shares: the context a rank's function gets, the error a failed call raises,
how a call runs on one rank and how an exit reads, and the loopback / port helpers of local ranks."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
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


_PROGRAM = {"cli": False}  # whether the `cpinfer` command line (cli.main) is the program running now


def set_cli_program(running: bool) -> None:
    """cli.main marks the `cpinfer` command line as the program (its ranks never re-import a user's script)."""
    _PROGRAM["cli"] = bool(running)


def user_script_program() -> bool:
    """Whether this process runs a user's script that spawned ranks import again (where the script needs an
    `if __name__ == "__main__":` guard): a `__main__` module with a file that is not the cpinfer command line."""
    if _PROGRAM["cli"]:
        return False
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) is None:  # python -c, an interactive session, an embedding program
        return False
    spec = getattr(main, "__spec__", None)
    return spec is None or not (spec.name or "").startswith("cpinfer.")  # python -m cpinfer: the command line


def rank_death(rank: int, pid: int | None, code: int | None, starting: bool) -> str:
    """What happened to a rank process that exited unasked, and what to do about it. The `__main__` guard is named
    only where it can be the cause: a rank that exited with an error while the pool started, under a user's script."""
    who = f"rank {rank}" + (f" (pid {pid})" if pid is not None else "")
    if code is not None and code < 0:
        fate = f"was {describe_exit(code)}"
    elif code is None:
        fate = "is exiting"
    else:
        fate = f"exited with code {code}" + (" during start-up" if starting else "")
    if starting and code is not None and code > 0 and user_script_program():
        hint = ("see its output above; a script that starts ranks needs an `if __name__ == \"__main__\":` guard "
                "(each rank is a spawned process that imports the script again)")
    else:
        hint = "check the rank's output above and the system log (out of memory?)"
    return f"{who} {fate}: {hint}"


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
