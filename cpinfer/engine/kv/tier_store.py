"""The rank side of the KV tiers: this rank's host pool (pinned memory on CUDA, a separate bounded pool on CPU), a
writer thread that writes disk entries off the forward's path, and `apply` of the cache operations the driver's
KV manager puts in each batch (tiers.py decides; a rank copies its own shard only). Hybrid models: every rank
also keeps host copies of the recurrent-state snapshots (replicas, as on the device); a disk entry's first shard
file carries them, and a restore from disk is read by one rank and broadcast over the CP group.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.engine.kv.ops import (CacheOp, DeleteEntry, ForgetEntry, FromHost, LoadEntry, LoadState, SaveEntry,
                                  StateFromHost, StateToHost, TierEvent, ToHost)
from cpinfer.engine.kv.disk_files import (CorruptEntry, EntryHeader, Layout, file_name, read_rows, read_states,
                                          state_key, write_entry)
from cpinfer.engine.kv.state_store import StateStore
from cpinfer.utils import get_logger

log = get_logger()
WRITE_DELAY_ENV = "CPINFER_TEST_KV_WRITE_DELAY_S"  # tests only: pause between written chunks (kill mid-write)


class DiskWriter:
    """Writes entry files in a background thread, in submission order (a delete queued after a write runs after
    it). Rows submitted stay readable from memory until their file is renamed into place — and, when the write
    failed, until the driver says it has seen the failure (`forget`). At most `max_pending_bytes` wait to be
    written: `submit` blocks beyond that (the forward waits for the disk rather than memory growing)."""

    def __init__(self, directory: Path, tp_rank: int, max_pending_bytes: int):
        self.directory, self.tp_rank = directory, tp_rank
        self.max_pending = max_pending_bytes
        self.delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        self._rows: dict[tuple[str, int], torch.Tensor] = {}  # (entry, shard) → kv [M, 2, L, Hkv, D]
        self._states: dict[tuple[str, int], dict] = {}  # (entry, shard) → its recurrent-state tensors (hybrids)
        self._waiting = 0  # bytes submitted and not yet written
        self._cv = threading.Condition()
        self._events: list[TierEvent] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cpinfer-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, header: EntryHeader, kv: torch.Tensor, rank: int, ready: torch.cuda.Event | None,
               states: dict | None = None) -> None:
        nbytes = kv.numel() * kv.element_size() + sum(t.numel() * t.element_size() for t in (states or {}).values())
        with self._cv:
            self._cv.wait_for(lambda: self._waiting == 0 or self._waiting + nbytes <= self.max_pending)
            self._rows[(header.entry, header.shard)] = kv
            if states:
                self._states[(header.entry, header.shard)] = states
            self._waiting += nbytes
        self._queue.put(("save", header, kv, rank, ready, nbytes, states))

    def hold(self, entry: str, shard: int, kv: torch.Tensor) -> None:
        """Keep rows readable from memory without writing them (another TP rank writes the same rows) until
        `forget` or a delete."""
        with self._cv:
            self._rows[(entry, shard)] = kv

    def delete(self, entry: str, shard: int) -> None:
        self._queue.put(("delete", entry, shard))

    def forget(self, entry: str, shard: int) -> None:
        with self._cv:
            self._rows.pop((entry, shard), None)
            self._states.pop((entry, shard), None)

    def states(self, entry: str, shard: int) -> dict | None:
        """The recurrent-state tensors of a shard file still being written (or failed), else None."""
        with self._cv:
            return self._states.get((entry, shard))

    def rows(self, entry: str, shard: int, rows: np.ndarray) -> torch.Tensor | None:
        """[K, 2, L, Hkv, D] from memory when that shard is still being written (or failed), else None."""
        with self._cv:
            kv = self._rows.get((entry, shard))
        return None if kv is None else kv[torch.from_numpy(np.asarray(rows, dtype=np.int64))]

    def events(self) -> list[TierEvent]:
        with self._cv:
            out, self._events = self._events, []
        return out

    def flush(self) -> None:
        """Wait until everything queued so far is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] == "save":
                    self._save(*item[1:])
                else:
                    self._delete(*item[1:])
            finally:
                self._queue.task_done()

    def _save(self, header: EntryHeader, kv: torch.Tensor, rank: int, ready, nbytes: int, states=None) -> None:
        key = (header.entry, header.shard)
        try:
            if ready is not None:
                ready.synchronize()  # the device → host copy of the rows has landed
            written = write_entry(self.directory, header, kv, self.delay_s, states)
            event = TierEvent("saved", rank, header.entry, header.shard, nbytes=written)
            keep = False
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which drops the entry
            event = TierEvent("saved", rank, header.entry, header.shard, ok=False,
                              error=f"{type(exc).__name__}: {exc}", errno=getattr(exc, "errno", 0) or 0)
            keep = True  # reads issued before the driver saw the failure are served from memory
        with self._cv:
            self._waiting -= nbytes
            if not keep and self._rows.get(key) is kv:
                del self._rows[key]
                self._states.pop(key, None)
            self._events.append(event)
            self._cv.notify_all()

    def _delete(self, entry: str, shard: int) -> None:
        with self._cv:
            self._rows.pop((entry, shard), None)
            self._states.pop((entry, shard), None)
        event = delete_file(self.directory, entry, shard, self.tp_rank)
        with self._cv:
            self._events.append(event)


def delete_file(directory: Path, entry: str, shard: int, tp_rank: int) -> TierEvent:
    """Delete one entry file; the "deleted" event says whether it is gone (a missing file is gone)."""
    try:
        os.unlink(directory / file_name(entry, shard, tp_rank))
    except FileNotFoundError:
        pass
    except OSError as exc:  # the driver counts its bytes again and retries when writing works again
        return TierEvent("deleted", shard, entry, shard, ok=False, error=f"{type(exc).__name__}: {exc}",
                         errno=exc.errno or 0)
    return TierEvent("deleted", shard, entry, shard)


def _parts(store) -> int:
    """2: keys and values stored apart, of one head size (the tier entries' [M, 2, L, Hkv, D]); 1: the values are
    the keys' first channels (MLA's latent), so the keys alone are the token's rows."""
    if getattr(store, "widths", None) is not None and store.widths.values_in_keys:
        return 1
    if store.v.shape != store.k.shape:
        raise ValueError(f"KV tiers keep keys and values of one head size (or values inside the keys); got keys "
                         f"{tuple(store.k.shape)} and values {tuple(store.v.shape)}")
    return 2


@dataclasses.dataclass(frozen=True)
class SharedRows:
    """Every TP rank of this CP rank caches the same rows (MLA's latent under TP): TP rank 0 (global rank `root`)
    alone keeps the host copy and broadcasts the rows it restores or saves to the others over `group`."""

    group: object
    root: int


class RankTiers:
    """This rank's host pool and disk writer; `apply` runs the driver's cache operations for this CP rank. With
    `shared` (MLA under TP) only TP rank 0 has a host pool."""

    def __init__(self, store, cp_rank: int, tp_rank: int, host_slots: int, disk_dir: str | None, writable: bool,
                 layout: Layout | None, cp: int, device: torch.device, max_pending_bytes: int = 2 << 30,
                 shared: SharedRows | None = None, states: StateStore | None = None, host_state_slots: int = 0,
                 cp_group=None):
        """states / host_state_slots / cp_group (hybrid models): the rank's state slots, the host state snapshots it
        keeps, and the CP group a state read from disk is broadcast over."""
        self.store, self.cp_rank, self.tp_rank, self.cp = store, cp_rank, tp_rank, cp
        self.states, self.cp_group = states, cp_group
        self.host_states = StateStore(states.layers, states.dtype, torch.device("cpu"), host_state_slots) \
            if states is not None and host_slots and host_state_slots else None
        self.layout, self.device, self.shared = layout, device, shared
        k, v = store.k, store.v
        self.parts = _parts(store)  # K/V tensors a token's rows are kept as: (k, v), or (k,) when v is in k (MLA)
        if shared is not None and self.parts != 1:
            raise ValueError("a host pool shared by the TP ranks needs one row per token (MLA's latent)")
        pin = device.type == "cuda"
        if shared is not None and tp_rank:
            host_slots = 0  # TP rank 0 holds the one copy
        self.host_k = torch.empty((k.shape[0], host_slots) + k.shape[2:], dtype=k.dtype, pin_memory=pin) \
            if host_slots else None  # [layers, host slots, Hkv, Dk]
        self.host_v = torch.empty((v.shape[0], host_slots) + v.shape[2:], dtype=v.dtype, pin_memory=pin) \
            if host_slots and self.parts == 2 else None
        self.directory = Path(disk_dir) if disk_dir else None
        self.writer = DiskWriter(self.directory, tp_rank, max_pending_bytes) if disk_dir and writable else None
        self._events: list[TierEvent] = []

    @property
    def token_bytes(self) -> int:
        k, v = self.store.k, self.store.v
        values = 0 if self.parts == 1 else v.shape[3]
        return k.shape[0] * k.shape[2] * (k.shape[3] + values) * k.element_size()

    def apply(self, ops: tuple[CacheOp, ...]) -> None:
        """Run this rank's operations in order (a failed disk read is reported as a "load_failed" event)."""
        timings: dict[str, list[float]] = {}
        for op in ops:
            if isinstance(op, (StateToHost, StateFromHost, LoadState)):  # every rank: its replica
                self._state_op(op)
                continue
            if op.rank != self.cp_rank:
                continue
            if isinstance(op, ToHost):
                self._to_host(op)
            elif isinstance(op, FromHost):
                self._timed(timings, "host", self._restore, op, "host", self._from_host)
            elif isinstance(op, SaveEntry):
                self._save(op)
            elif isinstance(op, LoadEntry):
                self._timed(timings, "disk", self._restore, op, "disk", self._load)
            elif isinstance(op, DeleteEntry):
                self._delete(op)
            elif isinstance(op, ForgetEntry) and self.writer is not None:
                self.writer.forget(op.entry, op.shard)
        for tier, (nbytes, seconds) in timings.items():
            self._events.append(TierEvent("restored", self.cp_rank, tier=tier, nbytes=int(nbytes), seconds=seconds))

    def events(self) -> tuple[TierEvent, ...]:
        out = self._events + (self.writer.events() if self.writer is not None else [])
        self._events = []
        return tuple(out)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ recurrent states (hybrid models)
    def _state_op(self, op) -> None:
        if isinstance(op, StateToHost):
            self.states.ensure(op.slot + 1)
            _copy_state(self.states, op.slot, self.host_states, op.host_slot)
            return
        tier = "host" if isinstance(op, StateFromHost) else "disk"
        try:
            self.states.ensure(op.slot + 1)
            if tier == "host":
                _copy_state(self.host_states, op.host_slot, self.states, op.slot)
            else:
                self._load_state(op)
        except Exception as exc:  # noqa: BLE001 - a missing, damaged or mismatched state: a cache miss
            self._events.append(TierEvent("state_failed", self.cp_rank, node=op.node, tier=tier, pos=op.pos,
                                          error=f"{type(exc).__name__}: {exc}"))

    def _load_state(self, op: LoadState) -> None:
        """Rank `root` reads the snapshot (checked against this model's state shapes) and broadcasts it: first
        whether it could, then each layer's state and tail. Every rank raises when it could not."""
        error, tensors = None, None
        if self.cp_rank == op.root:
            try:
                tensors = self.writer.states(op.entry, op.shard) if self.writer is not None else None
                if tensors is None:
                    tensors = read_states(self.directory / file_name(op.entry, op.shard, 0), op.pos)
                tensors = _fit_states(self.states, tensors, op.pos)
            except Exception as exc:  # noqa: BLE001 - raised after telling the others
                error = exc
        if self.cp > 1:
            ok = torch.tensor([int(error is None)], dtype=torch.int64, device=self.device)
            dist.broadcast(ok, group=self.cp_group, group_src=op.root)
            if not ok.item() and error is None:
                raise CorruptEntry(f"CP rank {op.root} could not read the state snapshot")
        if error is not None:
            raise error
        for layer in sorted(self.states.layers):
            for part, table in (("state", self.states.states), ("tail", self.states.tails)):
                t = tensors[state_key(op.pos, layer, part)].to(self.device) if tensors is not None else \
                    torch.empty_like(table[layer][op.slot])
                if self.cp > 1:
                    dist.broadcast(t, group=self.cp_group, group_src=op.root)
                table[layer][op.slot].copy_(t)

    def _gather_states(self, op: SaveEntry) -> dict | None:
        """The snapshots a save carries, copied now (the slots may be reused next): `state_key` -> CPU tensor."""
        if not op.states:
            return None
        out = {}
        for pos, source, slot in op.states:
            store = self.states if source == "device" else self.host_states
            for layer in store.layers:
                out[state_key(pos, layer, "state")] = store.states[layer][slot].cpu().clone()
                out[state_key(pos, layer, "tail")] = store.tails[layer][slot].cpu().clone()
        return out

    # ------------------------------------------------------------------ operations
    def _timed(self, timings: dict, tier: str, fn, *args) -> None:
        t0 = time.perf_counter()
        nbytes = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        acc = timings.setdefault(tier, [0.0, 0.0])
        acc[0] += nbytes
        acc[1] += time.perf_counter() - t0

    def _to_host(self, op: ToHost) -> None:
        if self.shared is not None and self.tp_rank:
            return  # TP rank 0 keeps the one host copy
        s = torch.from_numpy(op.slots).to(self.device)
        hs = torch.from_numpy(op.host_slots)
        self.host_k.index_copy_(1, hs, self.store.k.index_select(1, s).cpu())  # [L, M, Hkv, D]
        if self.parts == 2:
            self.host_v.index_copy_(1, hs, self.store.v.index_select(1, s).cpu())

    def _restore(self, op, tier: str, fn) -> int:
        """One restore; any failure to read, check or place its rows is reported ("load_failed"), never raised:
        the driver recomputes what it would have restored."""
        try:
            return fn(op)
        except Exception as exc:  # noqa: BLE001 - damaged bytes, a vanished file, an I/O or host-pool error
            self._events.append(TierEvent("load_failed", self.cp_rank, node=op.node, tier=tier,
                                          error=f"{type(exc).__name__}: {exc}"))
            return 0

    def _broadcast_host_rows(self, host_slots: np.ndarray) -> torch.Tensor:
        """Shared rows: TP rank 0's host rows [L, M, Hkv, D] on every TP rank (on the device: NCCL moves device
        tensors). TP rank 0 always takes part — on a failed read it sends zeros and then raises — so no TP rank
        waits for ever."""
        k, error, rows = self.store.k, None, None
        if self.tp_rank == 0:
            try:
                rows = self.host_k.index_select(1, torch.from_numpy(host_slots)).to(self.device)
            except Exception as exc:  # noqa: BLE001 - raised after the broadcast, reported by `_restore`
                error = exc
        if rows is None:
            rows = torch.zeros((k.shape[0], len(host_slots)) + tuple(k.shape[2:]), dtype=k.dtype, device=self.device)
        dist.broadcast(rows, src=self.shared.root, group=self.shared.group)
        if error is not None:
            raise error
        return rows

    def _from_host(self, op: FromHost) -> int:
        s = torch.from_numpy(op.slots).to(self.device)
        if self.shared is not None:  # one host copy (TP rank 0's), broadcast to the TP ranks
            k = self._broadcast_host_rows(op.host_slots)
            self.store.k.index_copy_(1, s, k)
            return k.numel() * k.element_size()
        hs = torch.from_numpy(op.host_slots)
        k = self.host_k.index_select(1, hs)  # [L, M, Hkv, D]
        self.store.k.index_copy_(1, s, k.to(self.device, non_blocking=True))
        if self.parts == 1:
            return k.numel() * k.element_size()
        v = self.host_v.index_select(1, hs)
        self.store.v.index_copy_(1, s, v.to(self.device, non_blocking=True))
        return k.numel() * k.element_size() + v.numel() * v.element_size()

    def _gather(self, op: SaveEntry) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The rows to write, [M, P, L, Hkv, D] in host memory (P = 2: keys, values; P = 1: the keys holding the
        values, MLA's latent), copied now (the slots may be reused next)."""
        if op.source == "host" and self.shared is not None:
            kv = [self._broadcast_host_rows(op.slots).cpu()]
        elif op.source == "host":
            hs = torch.from_numpy(op.slots)
            parts = (self.host_k, self.host_v)[:self.parts]
            kv = [t.index_select(1, hs) for t in parts]
        else:
            s = torch.from_numpy(op.slots).to(self.device)
            kv = [t.index_select(1, s) for t in (self.store.k, self.store.v)[:self.parts]]
        kv = torch.stack(kv, 0).permute(2, 0, 1, 3, 4)  # [M, P, L, Hkv, D]
        if kv.device.type != "cuda":
            return kv.contiguous(), None
        out = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        out.copy_(kv, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return out, ready

    def _save(self, op: SaveEntry) -> None:
        if self.writer is None:
            return
        kv, ready = self._gather(op)
        if self.layout.tp_shared and self.tp_rank:  # TP rank 0 writes the same rows: keep them until it has
            if ready is not None:
                ready.synchronize()
            self.writer.hold(op.entry, self.cp_rank, kv)
            return
        states = self._gather_states(op)
        header = EntryHeader(self.layout, op.entry, self.cp_rank, self.cp, self.tp_rank, op.pos0, op.count,
                             op.path, op.positions, 0, tuple(p for p, _, _ in op.states))
        self.writer.submit(header, kv, self.cp_rank, ready, states)

    def _load(self, op: LoadEntry) -> int:
        parts = []
        for entry, shard, rows in op.parts:  # every file's checksum is verified before any of its bytes is used
            kv = self.writer.rows(entry, shard, rows) if self.writer is not None else None
            if kv is None:
                tp = 0 if self.layout.tp_shared else self.tp_rank  # MLA: one file, TP rank 0's
                kv = read_rows(self.directory / file_name(entry, shard, tp), rows)
            parts.append(kv)
        kv = torch.cat(parts) if len(parts) > 1 else parts[0]  # [K, P, L, Hkv, D]
        fits = (self.parts,) + (self.store.k.shape[0],) + tuple(self.store.k.shape[2:])  # (P, L, Hkv, D)
        if tuple(kv.shape[1:]) != fits:
            raise CorruptEntry(f"rows of shape {tuple(kv.shape)} do not fit this rank's KV store")
        s = torch.from_numpy(op.slots).to(self.device)
        self.store.k.index_copy_(1, s, kv[:, 0].transpose(0, 1).to(self.device, self.store.k.dtype))
        if self.parts == 2:
            self.store.v.index_copy_(1, s, kv[:, 1].transpose(0, 1).to(self.device, self.store.v.dtype))
        return kv.numel() * kv.element_size()

    def _delete(self, op: DeleteEntry) -> None:
        if self.writer is not None:
            self.writer.delete(op.entry, op.shard)
        elif self.directory is not None:
            self._events.append(delete_file(self.directory, op.entry, op.shard, self.tp_rank))


def _copy_state(src: StateStore, src_slot: int, dst: StateStore, dst_slot: int) -> None:
    """One slot's every recurrent layer (state and conv tail) from one store to another."""
    for layer in src.layers:
        dst.states[layer][dst_slot].copy_(src.states[layer][src_slot])
        dst.tails[layer][dst_slot].copy_(src.tails[layer][src_slot])


def _fit_states(store: StateStore, tensors: dict, pos: int) -> dict:
    """The snapshot's tensors in this store's dtypes, or CorruptEntry naming the first that does not fit."""
    out = {}
    for layer in store.layers:
        for part, table in (("state", store.states), ("tail", store.tails)):
            key = state_key(pos, layer, part)
            t, want = tensors.get(key), table[layer].shape[1:]
            if t is None or tuple(t.shape) != tuple(want):
                raise CorruptEntry(f"state snapshot {key}: {None if t is None else tuple(t.shape)}, this model "
                                   f"keeps {tuple(want)}")
            out[key] = t.to(table[layer].dtype)
    return out
