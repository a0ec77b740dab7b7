"""Host and disk tiers below the device KV cache, on the driver: which prefix-tree segments have a copy in the ranks'
host pools or in the disk directory, each tier LRU within its bound, and the typed cache operations that move a
segment's shards between tiers (the ranks apply them, tier_store.py; the KV manager calls in here).

A segment (`Node`) is on the device when `on_device`; `host` gives each token's host-pool slot on its rank; `disk`
each token's (shard file, row) in one disk entry. Copies are inclusive: a restored segment keeps its lower copies.

Hybrid models: a segment's recurrent-state snapshots (`Node.snapshots`, device state slots) go down with its K/V: to
host state slots (`Node.state_host`; every rank keeps a replica, as on the device) and into the disk entry (the
file of its first shard; `DiskEntry.states`), and a match restores the one snapshot it continues from (`restore_state`).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from cpinfer.engine.kv.ops import (CacheOp, DeleteEntry, ForgetEntry, FromHost, LoadEntry, LoadState, SaveEntry,
                                  StateFromHost, StateToHost, TierEvent, ToHost)
from cpinfer.engine.kv.disk_files import TIER_ERRNOS, Layout, entry_name
from cpinfer.utils import get_logger

log = get_logger()
TIERS = ("device", "host", "disk")
MAX_BACKOFF_S = 60.0  # the longest pause between retries of a failing disk directory


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """host_slots: host-pool tokens per CP rank (0: no host tier); disk_dir / disk_bytes: the disk tier (None: no
    disk tier); token_bytes: one token's K/V over the TP ranks of a CP rank (the disk bound counts these)."""

    host_slots: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    token_bytes: int = 1
    layout: Layout | None = None
    tp: int = 1
    write_through: bool = True  # a finished request's segments are written to disk in the background at once
    disk_token_bytes: int = 0  # one token in a disk entry, when not token_bytes (MLA: its latent once, not per TP rank)
    host_token_bytes: int = 0  # one token in the host pool, when not token_bytes (MLA: TP rank 0's copy alone)
    writable: bool = True  # False: a read-only directory (its entries are read, nothing is written or deleted)
    host_state_slots: int = 0  # hybrid models: recurrent-state snapshots the host tier holds (replicated per rank)
    state_bytes: int = 0  # ... and one snapshot's bytes (counted in a disk entry that carries it)

    def __post_init__(self):
        if self.host_slots < 0 or self.token_bytes < 1 or self.tp < 1:
            raise ValueError(f"bad tier config: host_slots {self.host_slots}, token_bytes {self.token_bytes}, "
                             f"tp {self.tp}")
        if self.disk_dir is not None and (self.disk_bytes <= 0 or self.layout is None):
            raise ValueError("a disk tier needs a positive byte bound and the model layout")

    @property
    def enabled(self) -> bool:
        return self.host_slots > 0 or self.disk_dir is not None


class HostPool:
    """Free host-pool slots of every CP rank (a stack per rank)."""

    def __init__(self, n: int, slots: int):
        self.capacity = slots
        self._free = [np.arange(slots - 1, -1, -1, dtype=np.int64) for _ in range(n)]
        self._top = [slots] * n

    def num_free(self, r: int) -> int:
        return self._top[r]

    def alloc(self, r: int, k: int) -> np.ndarray:
        if k > self._top[r]:
            raise RuntimeError("host pool exhausted (the caller checks room first; this is a bug)")
        self._top[r] -= k
        return self._free[r][self._top[r]:self._top[r] + k][::-1].copy()

    def free(self, r: int, slots: np.ndarray) -> None:
        top = self._top[r]
        self._free[r][top:top + len(slots)] = slots
        self._top[r] = top + len(slots)


@dataclasses.dataclass(eq=False)
class DiskEntry:
    """One segment written to disk: a file per (CP shard, TP rank) of the layout that wrote it."""

    name: str
    cp: int  # CP size when written
    shards: tuple[int, ...]  # CP ranks that hold rows (one file each per TP rank)
    nbytes: int
    last_access: float
    nodes: dict = dataclasses.field(default_factory=dict)  # node id → Node whose tokens are rows of it
    unacked: int = 0  # files whose write has not been confirmed yet
    states: dict = dataclasses.field(default_factory=dict)  # hybrid models: snapshot position → shard file holding it


@dataclasses.dataclass
class DiskRef:
    """A node's tokens in a disk entry: per token its shard file and row there."""

    entry: DiskEntry
    shard: np.ndarray  # [len] int64
    row: np.ndarray  # [len] int64

    def cut(self, a: int, b: int | None = None) -> "DiskRef":
        return DiskRef(self.entry, self.shard[a:b], self.row[a:b])


@dataclasses.dataclass
class TierStats:
    hit_tokens: int = 0  # prompt tokens whose K/V came from this tier at a request's first admission
    restored_tokens: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    written_bytes: int = 0
    write_errors: int = 0
    evicted_tokens: int = 0  # tokens this tier let go of (moved down or dropped)


class Tiers:
    """The host and disk tier index of one KV manager. `lost(node)` is the manager's: a segment lost its last copy
    (it becomes a hole when copies below it survive, else it goes with its subtree).

    Disk writes that fail for the whole directory (full, read-only, no permission) pause writing, retried with
    backoff; files in the directory that are not usable entries (another model's or TP size's, quarantined junk,
    files whose delete failed) are counted in `disk_used` until deleted, first when room is needed."""

    def __init__(self, config: TierConfig, n: int, lost):
        self.config, self.n = config, n
        self.host = HostPool(n, config.host_slots) if config.host_slots else None
        self.host_nodes: dict[int, object] = {}  # node id → Node with a host copy
        # hybrid models: free host state slots (a stack), when the host tier keeps recurrent-state snapshots
        self.host_states = list(range(config.host_state_slots - 1, -1, -1)) if self.host is not None else []
        self.state_nodes: dict[int, object] = {}  # node id → Node with host state snapshots
        self.entries: dict[str, DiskEntry] = {}
        self.disk_used = 0
        self.disk_on = config.disk_dir is not None
        self.writable = self.disk_on and config.writable
        self._lost = lost
        self.ops: list[CacheOp] = []
        self.stray: dict[str, int] = {}  # file path → bytes: counted on disk, not an entry (deleted first)
        self.deleting: dict[tuple[str, int], int] = {}  # (entry, shard) → bytes of its files, until the ranks ack
        self.undeleted: dict[tuple[str, int], int] = {}  # (entry, shard) whose delete failed → bytes, still counted
        self._paused_until = 0.0  # disk writes paused after a failure of the directory, until then
        self._backoff_s = 0.0
        self.stats = {t: TierStats() for t in TIERS}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ the device lets a segment go
    def demote(self, node) -> bool:
        """node (on device, unreferenced) leaves the device: keep a copy below it if possible (the copies are
        made before any later operation can reuse its device slots). False: nothing kept it (drop it)."""
        if node.host is None and self.host is not None:
            self._to_host(node)
        if node.host is not None or node.disk is not None:
            return True
        return self.save(node, "device")

    def _to_host(self, node) -> None:
        need = np.asarray(node.count, dtype=np.int64)
        if not len(node) or need.max() > self.host.capacity or not self._host_room(need, node):
            return
        hs = np.empty(len(node), dtype=np.int64)
        ranks, slots = node.rank.view, node.slot.view
        for r in np.flatnonzero(need).tolist():
            idx = np.flatnonzero(ranks == r)
            hs[idx] = self.host.alloc(r, len(idx))
            self.ops.append(ToHost(r, slots[idx].copy(), hs[idx].copy()))
        node.host = hs
        self.host_nodes[node.id] = node
        for pos, slot in sorted(node.snapshots.items()):  # its recurrent states (hybrid models) go with it
            if pos not in node.state_host:
                hslot = self._host_state_slot(node)
                if hslot is None:
                    break
                self.ops.append(StateToHost(slot, hslot))
                node.state_host[pos] = hslot
                self.state_nodes[node.id] = node

    def _host_state_slot(self, keep) -> int | None:
        """A free host state slot, dropping the least recently used other unlocked segment's host states if needed."""
        while not self.host_states:
            victims = [nd for nd in self.state_nodes.values() if nd is not keep and nd.ref == 0]
            if not victims:
                return None
            self.forget_host_states(min(victims, key=_lru_key))
        return self.host_states.pop()

    def forget_host_states(self, node, pos: int | None = None) -> None:
        """Drop node's host state snapshots (only the one at `pos` when given); its K/V copies stay."""
        for p in [pos] if pos is not None else list(node.state_host):
            hslot = node.state_host.pop(p, None)
            if hslot is not None:
                self.host_states.append(hslot)
        if not node.state_host:
            self.state_nodes.pop(node.id, None)

    def _host_room(self, need: np.ndarray, keep) -> bool:
        """Evict host copies, least recently used first, until every rank has `need` free host slots."""
        while True:
            short = np.asarray([self.host.num_free(r) < need[r] for r in range(self.n)])
            if not short.any():
                return True
            victims = [nd for nd in self.host_nodes.values() if nd is not keep and not _pinned(nd)
                       and np.asarray(nd.count)[short].any()]
            if not victims:
                return False
            self._host_evict(min(victims, key=_lru_key))

    def _host_evict(self, node) -> None:
        """Drop node's host copy: moved to disk first when nothing else holds it, else its subtree goes."""
        hs = node.host
        if not node.on_device and node.disk is None:
            self.save(node, "host")  # reads the host rows now, before a later operation can reuse them
        self.forget_host_states(node)
        node.host = None
        del self.host_nodes[node.id]
        for r in range(self.n):
            mine = hs[node.rank.view == r]
            if len(mine):
                self.host.free(r, mine)
        self.stats["host"].evicted_tokens += len(node)
        if not node.on_device and node.disk is None:
            self._lost(node)

    def forget_host(self, node) -> None:
        """Drop node's host copy without moving it anywhere (it failed to restore)."""
        self.forget_host_states(node)
        for r in range(self.n):
            mine = node.host[node.rank.view == r]
            if len(mine):
                self.host.free(r, mine)
        node.host = None
        del self.host_nodes[node.id]

    # ------------------------------------------------------------------ disk writes
    def save(self, node, source: str) -> bool:
        """Write node's shards to disk from its device or host slots (background; readable at once). False when
        the disk tier is off, read-only or cannot hold it."""
        c = self.config
        if not self.can_write or not len(node):
            return False
        states = {pos: ("device", slot) for pos, slot in node.snapshots.items()}  # hybrid models: its snapshots
        states.update({pos: ("host", hs) for pos, hs in node.state_host.items() if pos not in states})
        nbytes = len(node) * (c.disk_token_bytes or c.token_bytes) + len(states) * c.state_bytes
        if nbytes > c.disk_bytes or not self._disk_room(nbytes, node):
            return False
        path = path_tokens(node)
        name = entry_name(c.layout, path, node.pos0)
        ranks = node.rank.view
        counts = np.bincount(ranks, minlength=self.n)
        shards = tuple(np.flatnonzero(counts).tolist())
        writers = 1 if c.layout.tp_shared else c.tp  # MLA's latent: TP rank 0 writes it, the others hold it
        entry = DiskEntry(name, self.n, shards, nbytes, time.monotonic(), unacked=len(shards) * writers)
        slots = node.slot.view if source == "device" else node.host
        rows = np.empty(len(node), dtype=np.int64)
        positions = node.pos0 + np.arange(len(node), dtype=np.int64)
        for r in shards:
            idx = np.flatnonzero(ranks == r)
            rows[idx] = np.arange(len(idx))
            carried = tuple((pos, *states[pos]) for pos in sorted(states)) if r == shards[0] else ()
            self.ops.append(SaveEntry(r, name, source, slots[idx].copy(), positions[idx], node.pos0, len(node),
                                      path, carried))
        entry.states = dict.fromkeys(states, shards[0])
        node.disk = DiskRef(entry, ranks.copy(), rows)
        entry.nodes[node.id] = node
        self.entries[name] = entry
        self.disk_used += nbytes
        return True

    @property
    def can_write(self) -> bool:
        return self.writable and time.monotonic() >= self._paused_until

    def write_through(self, path: list) -> None:
        """A finished request's segments (root first) that have no disk copy yet are written in the background."""
        if self.can_write and self.config.write_through:
            for node in path:
                if node.disk is None and node.on_device and len(node):
                    if not self.save(node, "device"):
                        return  # a child without its parent on disk could not be used after a restart

    def _disk_room(self, nbytes: int, keep=None) -> bool:
        """Delete entries, least recently used first, until nbytes more fit. Never one a restore in progress reads,
        nor one holding an ancestor of `keep` (the segment about to be written)."""
        above = set()
        p = keep.parent if keep is not None else None
        while p is not None:
            above.add(p.id)
            p = p.parent
        for path in sorted(self.stray, key=_stray_age):  # files that are no usable entry go first, oldest first
            if self.disk_used + nbytes <= self.config.disk_bytes:
                break
            if _remove(path):  # (one that cannot be deleted stays counted)
                self.disk_used -= self.stray.pop(path)
        while self.disk_used + nbytes > self.config.disk_bytes:
            victims = [e for e in self.entries.values()
                       if not any(_pinned(nd) or nd.id in above for nd in e.nodes.values())]
            if not victims:
                return False
            self.drop_entry(min(victims, key=_entry_lru_key))
        return True

    def trim(self) -> None:
        """Back within the disk bound (after adopting a directory that holds more)."""
        self._disk_room(0)

    def drop_entry(self, entry: DiskEntry) -> None:
        """Forget an entry and delete its files (after their writes, in each writer's order); segments it was the
        last copy of are lost (holes when copies below them survive, else gone with their subtrees)."""
        if self.entries.pop(entry.name, None) is None:
            return
        self.stats["disk"].evicted_tokens += sum(len(nd) for nd in entry.nodes.values())
        self.disk_used -= entry.nbytes  # a delete that fails is reported back and counted again
        for shard in entry.shards if self.config.writable else ():
            self.ops.append(DeleteEntry(shard % self.n, entry.name, shard))
            self.deleting[(entry.name, shard)] = entry.nbytes // len(entry.shards)
        orphans = []
        for nd in entry.nodes.values():
            nd.disk = None
            if not nd.on_device and nd.host is None:
                orphans.append(nd)
        entry.nodes = {}
        for nd in orphans:
            if nd.parent is not None:  # not already removed with an earlier orphan's subtree
                self._lost(nd)

    # ------------------------------------------------------------------ restoring
    def restore(self, node) -> str:
        """node was given device slots (node.slot, on node.rank): copy its K/V there, from host if it has a host
        copy, else from disk. Returns the tier it came from."""
        ranks, slots = node.rank.view, node.slot.view
        positions = node.pos0 + np.arange(len(node), dtype=np.int64)
        tier = "host" if node.host is not None else "disk"
        for r in np.flatnonzero(np.bincount(ranks, minlength=self.n)).tolist():
            idx = np.flatnonzero(ranks == r)
            if tier == "host":
                self.ops.append(FromHost(r, node.host[idx].copy(), slots[idx].copy(), positions[idx], node.id))
                continue
            ref = node.disk
            parts, order = [], []
            for shard in np.unique(ref.shard[idx]).tolist():
                sel = idx[ref.shard[idx] == shard]
                parts.append((ref.entry.name, shard, ref.row[sel].copy()))
                order.append(sel)
            sel = np.concatenate(order)
            self.ops.append(LoadEntry(r, node.id, tuple(parts), slots[sel].copy(), positions[sel]))
        if node.disk is not None:
            node.disk.entry.last_access = time.monotonic()
        st = self.stats[tier]
        st.restored_tokens += len(node)
        return tier

    def state_positions(self, node) -> list[int]:
        """Positions of node's recurrent-state snapshots held below the device (host or its disk entry)."""
        out = list(node.state_host)
        if node.disk is not None:
            end = node.pos0 + len(node)
            out += [p for p in node.disk.entry.states if node.pos0 < p <= end]
        return out

    def restore_state(self, node, pos: int, slot: int) -> str | None:
        """Copy node's snapshot at pos into device state slot `slot`, from its host copy, else its disk entry.
        Returns the tier (None: no copy below the device)."""
        if pos in node.state_host:
            self.ops.append(StateFromHost(node.id, pos, node.state_host[pos], slot))
            return "host"
        entry = node.disk.entry if node.disk is not None else None
        if entry is None or pos not in entry.states:
            return None
        shard = entry.states[pos]
        root = shard if entry.cp == self.n else 0  # its writer (the rows may still be in its memory), else rank 0
        self.ops.append(LoadState(node.id, pos, entry.name, shard, root, slot))
        entry.last_access = time.monotonic()
        return "disk"

    def drop_state(self, node, pos: int, tier: str) -> None:
        """node's snapshot at pos failed to restore from `tier`: that copy is dropped (its K/V copies stay)."""
        if tier == "host":
            self.forget_host_states(node, pos)
        elif node.disk is not None:
            node.disk.entry.states.pop(pos, None)

    # ------------------------------------------------------------------ tree changes
    def split(self, head, node, m: int) -> None:
        """node's first m tokens became `head` (a new parent segment): cut its lower copies the same way."""
        end = node.pos0 + m
        head.state_host = {p: hs for p, hs in node.state_host.items() if p <= end}
        node.state_host = {p: hs for p, hs in node.state_host.items() if p > end}
        for nd in (head, node):
            if nd.state_host:
                self.state_nodes[nd.id] = nd
            else:
                self.state_nodes.pop(nd.id, None)
        if node.host is not None:
            head.host, node.host = node.host[:m], node.host[m:]
            self.host_nodes[head.id] = head
        if node.disk is not None:
            head.disk, node.disk = node.disk.cut(0, m), node.disk.cut(m)
            node.disk.entry.nodes[head.id] = head

    def forget(self, node) -> None:
        """node leaves the tree: free its host slots; an entry no segment uses any more is deleted."""
        if node.host is not None:
            self.forget_host(node)
        self.forget_host_states(node)
        if node.disk is not None:
            entry = node.disk.entry
            entry.nodes.pop(node.id, None)
            node.disk = None
            if not entry.nodes:
                self.drop_entry(entry)

    # ------------------------------------------------------------------ what the ranks report
    def on_events(self, events: list[TierEvent]) -> None:
        restored: dict[str, list[float]] = {}
        for ev in events:
            if ev.kind == "saved":
                self._saved(ev)
            elif ev.kind == "deleted":
                self._deleted(ev)
            elif ev.kind == "restored":
                acc = restored.setdefault(ev.tier, [0, 0.0])
                acc[0] += ev.nbytes
                acc[1] = max(acc[1], ev.seconds)  # ranks restore side by side: the slowest one is the time
        for tier, (nbytes, seconds) in restored.items():
            self.stats[tier].restored_bytes += nbytes
            self.stats[tier].restore_s += seconds

    def _saved(self, ev: TierEvent) -> None:
        entry = self.entries.get(ev.entry)
        if ev.ok:
            self.stats["disk"].written_bytes += ev.nbytes
            if entry is not None:
                entry.unacked -= 1
            if self.config.layout.tp_shared and self.config.tp > 1:  # the other TP ranks let go of their rows
                self.ops.append(ForgetEntry(ev.rank, ev.entry, ev.shard))
            if self._backoff_s:
                log.info("KV disk tier: writing to %s works again", self.config.disk_dir)
                self._backoff_s = 0.0
                self._retry_deletes()
            return
        self.stats["disk"].write_errors += 1
        self.ops.append(ForgetEntry(ev.rank, ev.entry, ev.shard))
        if ev.errno in TIER_ERRNOS:  # the directory (full, read-only): pause writing, try again later
            if not self._backoff_s or time.monotonic() >= self._paused_until:
                self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S) if self._backoff_s else 1.0
                self._paused_until = time.monotonic() + self._backoff_s
                self.warn_once(f"write-{ev.errno}", f"KV disk tier: writing to {self.config.disk_dir} failed "
                               f"({ev.error}); serving goes on, writes are retried with backoff (up to "
                               f"{MAX_BACKOFF_S:.0f} s)")
        else:
            self.warn_once("write", f"KV disk tier: an entry could not be written ({ev.error}); it is dropped")
        if entry is not None:
            self.drop_entry(entry)

    def _deleted(self, ev: TierEvent) -> None:
        """A rank deleted an entry file (or could not: its bytes are counted again until a retry deletes it)."""
        nbytes = self.deleting.pop((ev.entry, ev.shard), 0)
        if not ev.ok and nbytes:
            self.undeleted[(ev.entry, ev.shard)] = nbytes
            self.disk_used += nbytes
            self.warn_once("delete", f"KV disk tier: an entry file could not be deleted ({ev.error}); its bytes stay "
                           "counted and the delete is retried when writing works again")

    def _retry_deletes(self) -> None:
        for (name, shard), nbytes in self.undeleted.items():
            self.disk_used -= nbytes
            self.deleting[(name, shard)] = nbytes  # counted again if it fails again
            self.ops.append(DeleteEntry(shard % self.n, name, shard))
        self.undeleted.clear()

    def save_ancestors(self) -> int:
        """Before a clean stop: every segment above a disk entry that has no disk copy itself is written (from the
        device or the host), so that a restart finds each entry's prefix. Returns the segments written."""
        todo, seen = [], set()
        for entry in list(self.entries.values()):
            for nd in list(entry.nodes.values()):
                p = nd.parent
                while p is not None and p.parent is not None and p.id not in seen:
                    seen.add(p.id)
                    if p.disk is None and (p.on_device or p.host is not None):
                        todo.append(p)
                    p = p.parent
        written = 0
        for nd in sorted(todo, key=lambda nd: nd.pos0):  # parents before children
            written += self.save(nd, "device" if nd.on_device else "host")
        return written

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def take_ops(self) -> list[CacheOp]:
        ops, self.ops = self.ops, []
        return ops

    @property
    def unacked(self) -> int:
        return sum(e.unacked for e in self.entries.values())

    # ------------------------------------------------------------------ introspection
    def snapshot(self, device_tokens: int) -> dict:
        """Per tier: its bound and what it holds (bytes, tokens), hits, restores and writes."""
        c = self.config
        out = {}
        host_tokens = sum(len(nd) for nd in self.host_nodes.values())
        host_bytes = c.host_token_bytes or c.token_bytes
        held = {"device": (device_tokens * c.token_bytes, device_tokens, None),
                "host": (host_tokens * host_bytes, host_tokens, c.host_slots * self.n * host_bytes),
                "disk": (self.disk_used, sum(sum(len(nd) for nd in e.nodes.values()) for e in self.entries.values()),
                         c.disk_bytes if self.disk_on else 0)}
        for tier in TIERS:
            nbytes, tokens, cap = held[tier]
            out[tier] = dict(dataclasses.asdict(self.stats[tier]), bytes=nbytes, tokens=tokens, capacity_bytes=cap)
        out["disk"]["entries"] = len(self.entries)
        out["disk"]["writable"] = self.can_write
        out["disk"]["stray_bytes"] = sum(self.stray.values()) + sum(self.undeleted.values())
        return out

    def check(self, nodes: dict) -> None:
        """Invariants (tests): host slots distinct and accounted, entries and their segments agree."""
        if self.host is not None:
            used = [[] for _ in range(self.n)]
            for nd in self.host_nodes.values():
                assert nd.id in nodes and nd.host is not None and len(nd.host) == len(nd)
                for r in range(self.n):
                    used[r].append(nd.host[nd.rank.view == r])
            for r in range(self.n):
                flat = np.concatenate(used[r]) if used[r] else np.zeros(0, dtype=np.int64)
                assert len(np.unique(flat)) == len(flat), "a host slot holds two tokens"
                assert len(flat) + self.host.num_free(r) == self.host.capacity, "host slots leaked"
        held = [hs for nd in self.state_nodes.values() for hs in nd.state_host.values()]
        assert len(set(held)) == len(held), "a host state slot holds two snapshots"
        assert all(nid in nodes for nid in self.state_nodes), "host states of a segment no longer in the tree"
        assert len(held) + len(self.host_states) == self.config.host_state_slots * (self.host is not None)
        for nd in nodes.values():
            assert (nd.host is not None) == (nd.id in self.host_nodes)
            assert bool(nd.state_host) == (nd.id in self.state_nodes), f"host states of node {nd.id} unindexed"
            if nd.disk is not None:
                assert self.entries.get(nd.disk.entry.name) is nd.disk.entry and nd.id in nd.disk.entry.nodes
                assert len(nd.disk.shard) == len(nd.disk.row) == len(nd)
        for e in self.entries.values():
            assert e.nodes, f"entry {e.name} is used by no segment"
            for nid, nd in e.nodes.items():
                assert nid in nodes and nd.disk is not None and nd.disk.entry is e
        assert self.disk_used == (sum(e.nbytes for e in self.entries.values()) + sum(self.stray.values())
                                  + sum(self.undeleted.values()))
        assert self.disk_used <= max(self.config.disk_bytes, 0) or not self.disk_on


def _stray_age(path: str) -> float:
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return 0.0


def _remove(path: str) -> bool:
    """Delete a stray file (True when it is gone)."""
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _pinned(node) -> bool:
    """A segment locked by a request but not on the device is being restored: its lower copies must stay."""
    return node.ref > 0 and not node.on_device


def _lru_key(node):
    return node.last_access, -node.pos0  # deeper segments first among equals (their parents stay usable)


def _entry_lru_key(entry: DiskEntry):
    """An entry is as recent as the most recently used segment it backs (or its own restore / write)."""
    nodes = entry.nodes.values()
    last = max([entry.last_access] + [nd.last_access for nd in nodes])
    return last, -max((nd.pos0 for nd in nodes), default=0)


def path_tokens(node) -> np.ndarray:
    """[pos0 + len] every token from the root through the end of node."""
    parts = []
    p = node
    while p.parent is not None:
        parts.append(p.tokens.view)
        p = p.parent
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)


def disk_dir_path(disk_dir: str | None) -> Path | None:
    return Path(disk_dir) if disk_dir is not None else None
