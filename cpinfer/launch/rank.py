"""What a local rank process runs (`worker_main`: join the world, then answer the driver's calls in order) and
the exit helpers every rank process uses, local or joined (parent-death signal, shutdown left to the driver)."""
from __future__ import annotations

import datetime
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from cpinfer.device import gpu_of_rank
from cpinfer.launch.calls import START_UP
from cpinfer.launch.common import RankContext, bind_to_loopback


def set_parent_death_signal() -> None:
    """Ask Linux to kill this rank if the driver dies, so no orphan ranks are left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: rely on daemon processes
        pass


def leave_shutdown_to_driver() -> None:
    """A rank ignores SIGINT and SIGTERM: Ctrl-C, systemd's stop (SIGTERM to the whole control group) and torchrun's
    agent signal every process, and the driver then finishes in-flight requests and stops the ranks itself (a rank
    whose driver dies is killed by the parent-death signal, or its world's connections close)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def worker_main(rank, world_size, store_path, backend, threads, timeout_s, inbox, outbox, device_type="cpu",
                alarm=None):
    """A local rank process: join the world, then answer the driver's calls in order until told to stop."""
    set_parent_death_signal()
    leave_shutdown_to_driver()
    os.environ["RANK"] = str(rank)
    bind_to_loopback()
    if threads:
        torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if device_type == "cuda":  # one GPU per rank (the pool checked there are enough), or shared over gloo
        device = gpu_of_rank(rank)
        torch.cuda.set_device(device)
    try:
        store = dist.FileStore(store_path, world_size)  # a file, not a TCP store listening on every interface
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        group = dist.group.WORLD
        cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        ctx = RankContext(rank, world_size, group, cpu_group, device, {})
        outbox.send((START_UP, rank, "ready", None))
    except Exception as exc:  # noqa: BLE001 - report start-up failure to the driver
        outbox.send((START_UP, rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    _answer_calls(ctx, inbox, outbox, alarm)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    exit_rank()


def _answer_calls(ctx: RankContext, inbox, outbox, alarm) -> None:
    """Run each call from the driver's pipe and reply `(call id, rank, status, payload)`, until None or EOF."""
    while True:
        try:
            msg = inbox.recv()
        except EOFError:  # the driver is gone
            return
        if msg is None:
            return
        fn, args, kwargs, call = msg  # call: its id, which the reply carries back
        try:
            result = fn(ctx, *args, **kwargs)
            outbox.send((call, ctx.rank, "ok", result))  # pickled here: an unpicklable result is this call's error
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            outbox.send((call, ctx.rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
            if alarm is not None:  # the driver may be inside this call as rank 0: its watcher reads this at once
                alarm.send_bytes(call.to_bytes(8, "little"))


def exit_after_error(rank: int, what: str, error: tuple[str, str, str]) -> None:
    """A joined world's rank whose call raised: say so on stderr and exit at once (peers stuck in a collective with
    it then fail at once, and torchrun ends the job). error: (type name, message, traceback)."""
    print(f"rank {rank}: {what} raised {error[0]}: {error[1]}\n{error[2]}", file=sys.stderr, flush=True)
    os._exit(1)


def exit_rank() -> None:
    """End a rank process that has left its group, at once: the interpreter's teardown and the C++ libraries' exit
    work after it (gloo's, the thread pools') take 1-5 s per pool on a busy CPU, and now and then hang until the
    pool's close kills the rank. The rank holds nothing that needs them: its output is flushed here, and the driver
    waits for the KV tiers' disk writes before it closes the pool."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more to write
            pass
    os._exit(0)
