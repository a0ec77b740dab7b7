"""The rank side of moving K/V between a prefill group and a decode group: point-to-point sends and receives of
stored rows, on the world group (NCCL on GPUs, gloo on CPUs), one message per (source, destination) pair with every
layer in it. Rows travel as stored: an FP8 cache's bytes, MLA's latent, each TP rank its own heads.

A rank applies a call's `TransferOrders` before its forward: it copies the rows it sends and posts the sends
(non-blocking: it goes on at once, the copies stay alive until they are delivered), then receives what it is sent
and writes it into its slots. The driver makes a request runnable only after the call that received its rows came
back, so nothing is ever computed from rows that have not all arrived.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.autoselect import chosen
from cpinfer.attention.backends import resolve_name
from cpinfer.distributed import ParallelConfig, build_role_groups
from cpinfer.engine import model_runner as MR
from cpinfer.engine.kv.capacity import kv_tokens_from_memory

_TAG_SPAN = 1 << 30  # message tags: transfer ids modulo this


@dataclasses.dataclass(frozen=True)
class KVSend:
    tid: int  # the transfer's id (the message tag)
    peer: int  # global rank of the receiver
    slots: np.ndarray  # [T] this rank's slots, in the order the receiver writes them


@dataclasses.dataclass(frozen=True)
class KVRecv:
    tid: int
    peer: int  # global rank of the sender
    slots: np.ndarray  # [T] this rank's slots the rows go to, in the sender's order


@dataclasses.dataclass(frozen=True)
class SlotMirror:
    """Positions of received slots on each CP rank of the group (windowed layers mirror every rank's slots)."""

    ranks: np.ndarray  # [T] CP rank (in the receiving group)
    slots: np.ndarray  # [T]
    positions: np.ndarray  # [T]


@dataclasses.dataclass(frozen=True)
class TransferOrders:
    sends: tuple[KVSend, ...] = ()
    recvs: tuple[KVRecv, ...] = ()
    mirrors: tuple[SlotMirror, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs or self.mirrors)


def _rows(store, slots: torch.Tensor) -> torch.Tensor:
    """[layers, T, Hkv, W] the stored rows of these slots, K then V channels side by side (MLA: the latent only)."""
    k = store.k.index_select(1, slots)
    if store.widths.values_in_keys:
        return k.contiguous()
    return torch.cat([k, store.v.index_select(1, slots)], dim=-1)


def _write_rows(store, slots: torch.Tensor, rows: torch.Tensor) -> None:
    dk = store.k.shape[-1]
    store.k.index_copy_(1, slots, rows[..., :dk])
    if not store.widths.values_in_keys:
        store.v.index_copy_(1, slots, rows[..., dk:])
    store.note_written(slots.cpu().numpy())


def row_shape(store, num_tokens: int) -> tuple[int, ...]:
    width = store.k.shape[-1] + (0 if store.widths.values_in_keys else store.v.shape[-1])
    return (store.k.shape[0], num_tokens, store.k.shape[2], width)


def apply_orders(ctx, runner, orders: TransferOrders) -> dict:
    """Post this rank's sends, receive its rows and write them, mirror slot positions. Returns the bytes sent, the
    bytes received per transfer id, the seconds spent waiting for rows, and the transfers that failed here (id →
    why: the driver ends their requests alone)."""
    store = runner.store
    host = ctx.group is not None and dist.get_backend(ctx.group) == "gloo" and ctx.device.type != "cpu"
    pending = [p for p in ctx.state.get("pd_sends", []) if not p[0].is_completed()]  # copies still in flight
    sent, received = 0, {}  # bytes posted; bytes received per transfer id
    for s in orders.sends:
        rows = _rows(store, torch.as_tensor(s.slots, device=ctx.device))
        rows = rows.cpu() if host else rows
        pending.append((dist.isend(rows, s.peer, group=ctx.group, tag=s.tid % _TAG_SPAN), rows))
        sent += rows.numel() * rows.element_size()
    ctx.state["pd_sends"] = pending
    t0 = time.perf_counter()
    works, failed = [], {}  # failed: transfer id → why its rows are not usable here (that request alone fails)
    for r in orders.recvs:
        try:
            buf = torch.empty(row_shape(store, len(r.slots)), dtype=store.k.dtype,
                              device="cpu" if host else ctx.device)
            works.append((dist.irecv(buf, r.peer, group=ctx.group, tag=r.tid % _TAG_SPAN), buf, r))
        except Exception as exc:  # noqa: BLE001 - e.g. no memory for the buffer
            failed[r.tid] = f"{type(exc).__name__}: {exc}"
    for work, buf, r in works:
        try:
            work.wait()
            _write_rows(store, torch.as_tensor(r.slots, device=ctx.device), buf.to(ctx.device))
            received[r.tid] = received.get(r.tid, 0) + buf.numel() * buf.element_size()
        except Exception as exc:  # noqa: BLE001 - the rows of this transfer are not (all) here: never used
            failed[r.tid] = f"{type(exc).__name__}: {exc}"
    if runner.slot_positions is not None:
        for m in orders.mirrors:
            runner.slot_positions.pos[m.ranks, m.slots] = m.positions
    return {"sent_bytes": sent, "recv_bytes": received, "recv_wait_s": time.perf_counter() - t0, "failed": failed}


# ---------------------------------------------------------------- functions the P/D driver runs on the ranks

def init_role_runner(ctx, roles: list[tuple[int, int, int]], model_path: str, dtype: str,
                     capacities: list[int | None], attention_backend: str | None = None, decode: dict | None = None,
                     kv_cache_dtype: str = "auto", load_format: str = "auto", sizings: list[dict | None] | None = None
                     ) -> dict:
    """Every rank: build every role's CP / TP groups (roles = (cp, tp, first global rank) each, prefill first), then
    this rank's model runner over its role's groups. With its role's capacity, allocate its KV store now; with None
    (CUDA), measure instead as `model_runner.init_runner` does, with its role's own profile
    (`sizings[role]` = {"tokens", "utilization", "ranks_per_device", "block"}): the answer's `kv_capacity` is what
    this rank could hold; the driver then calls `allocate_role_kv` with each role's smallest."""
    groups = build_role_groups([(ParallelConfig(cp, tp), offset) for cp, tp, offset in roles], ctx.rank)
    role = next(i for i, (cp, tp, offset) in enumerate(roles) if offset <= ctx.rank < offset + cp * tp)
    sizing = None if capacities[role] is not None else sizings[role]
    probe = None
    if sizing is not None:
        probe = MR.MemoryProbe(ctx.device, shared=sizing["ranks_per_device"] > 1)
        probe.start()
    t0 = time.perf_counter()
    runner = MR.ModelRunner(ctx, model_path, getattr(torch, dtype), groups.config, attention_backend, decode,
                            kv_cache_dtype, load_format, groups=groups)
    t1 = time.perf_counter()
    runner.backend = resolve_name(attention_backend, ctx.device, layout=runner.layout)
    ctx.state["runner"] = runner
    ctx.state["pd_sends"] = []
    ctx.state["pd_role"] = role
    choice = chosen(ctx.device, runner.layout, None)
    info = {"pid": os.getpid(), "attention_backend": runner.backend, "load_s": t1 - t0, "role": role,
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "attention_timings_ms": dict(choice.timings_ms) if choice is not None else {}}
    if sizing is None:
        runner.allocate_kv(capacities[role])
        return info
    runner.profile_forward(sizing["tokens"])  # this role's largest forward on one of its ranks
    fig = probe.figures()
    info["memory"] = dataclasses.asdict(fig)
    info["kv_capacity"] = kv_tokens_from_memory(fig, sizing["utilization"], runner.kv_bytes_per_token,
                                                sizing["block"], sizing["ranks_per_device"])
    return info


def allocate_role_kv(ctx, capacities: list[int]) -> None:
    """Every rank: its KV store at its role's capacity (after `init_role_runner` measured)."""
    ctx.state["runner"].allocate_kv(capacities[ctx.state["pd_role"]])


def role_call(ctx, orders: TransferOrders, batch: bytes | None, cache_ops: tuple = ()):
    """One call of a group's rank: tier cache operations decided before the orders (a segment evicted to make room
    for received rows is copied down first), the transfer orders, then the forward when there is one. Returns
    (RankResult or None, transfer figures)."""
    runner = ctx.state["runner"]
    events = runner.apply_cache_ops(cache_ops) if cache_ops else ()
    figures = apply_orders(ctx, runner, orders) if orders else {}
    figures["tier_events"] = events
    result = runner.execute(pickle.loads(batch)) if batch is not None else None
    return result, figures
