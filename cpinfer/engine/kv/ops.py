"""The cache operations that move K/V between a rank's device, host and disk tiers, as the driver decides them
(`tiers.py`) and ships them in a `ForwardBatch`, and the `TierEvent`s a rank reports back (`tier_store.py` applies).

Each names the CP rank whose shard it moves (every TP rank of it applies it to its own heads and files). A rank
applies the operations of a batch in order, before the forward writes new K/V: the driver may free a slot and
reuse it in the same batch, and order is what keeps that safe.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ToHost:
    """Copy device slots to host-pool slots (a segment leaving the device keeps a host copy)."""

    rank: int
    slots: np.ndarray  # [M] device slots
    host_slots: np.ndarray  # [M] host-pool slots, the same tokens in the same order


@dataclasses.dataclass(frozen=True)
class FromHost:
    """Restore: copy host-pool slots into device slots."""

    rank: int
    host_slots: np.ndarray  # [M]
    slots: np.ndarray  # [M] device slots
    positions: np.ndarray  # [M] the tokens' positions (ranks that mirror slot positions record them)
    node: int = -1  # the prefix-tree segment being restored (named in a failure)


@dataclasses.dataclass(frozen=True)
class SaveEntry:
    """Write this rank's shard of a segment to the disk tier: the rows are copied now (from device or host slots),
    written by the rank's writer thread in the background (ack in `RankResult.tier_events`)."""

    rank: int
    entry: str
    source: str  # "device" | "host"
    slots: np.ndarray  # [M] slots in that tier, in position order
    positions: np.ndarray  # [M]
    pos0: int  # the segment's first position
    count: int  # tokens of the segment over every rank
    path: np.ndarray  # [pos0 + count] token ids from the root through the segment's end
    states: tuple = ()  # hybrid models: (position, "device" | "host", state slot) of each recurrent-state snapshot of
    # the segment, written into this rank's file (the entry's first shard carries them; every rank has a replica)


@dataclasses.dataclass(frozen=True)
class LoadEntry:
    """Restore from disk: rows of entry files (any shard: a different CP size re-places tokens) into device
    slots. Sent before the forward in its own call, so that a failed read ends only the requests that needed it."""

    rank: int
    node: int  # the prefix-tree segment being restored (named in a failure)
    parts: tuple[tuple[str, int, np.ndarray], ...]  # (entry, shard, rows [K]) read in this order
    slots: np.ndarray  # [sum K] device slots of the rows, concatenated in the order of `parts`
    positions: np.ndarray  # [sum K]


@dataclasses.dataclass(frozen=True)
class DeleteEntry:
    """Remove an entry's files of one shard (after its write, in the writer's order)."""

    rank: int
    entry: str
    shard: int


@dataclasses.dataclass(frozen=True)
class ForgetEntry:
    """The driver has seen that writing this shard failed: the rank may drop the rows it kept for reads."""

    rank: int
    entry: str
    shard: int


@dataclasses.dataclass(frozen=True)
class StateToHost:
    """Hybrid models: copy a state slot (every recurrent layer's state and conv tail) to a host state slot. Every
    rank applies it to its own replica (`rank` -1)."""

    slot: int
    host_slot: int
    rank: int = -1


@dataclasses.dataclass(frozen=True)
class StateFromHost:
    """Restore a state snapshot from a host state slot into a device state slot, on every rank."""

    node: int  # the segment whose snapshot it is (named in a failure)
    pos: int  # the position it describes (the state after the tokens before it)
    host_slot: int
    slot: int
    rank: int = -1


@dataclasses.dataclass(frozen=True)
class LoadState:
    """Restore a state snapshot from a disk entry's file into a device state slot: CP rank `root` reads it (from its
    writer's memory while the file is being written, else the file) and broadcasts it to the others."""

    node: int
    pos: int
    entry: str
    shard: int  # the file (CP shard of the writing layout) holding it
    root: int  # the CP rank that reads it
    slot: int
    rank: int = -1


STATE_RESTORES = (StateFromHost, LoadState)
CacheOp = ToHost | FromHost | SaveEntry | LoadEntry | DeleteEntry | ForgetEntry | StateToHost | StateFromHost | LoadState


@dataclasses.dataclass(frozen=True)
class TierEvent:
    """What a rank reports about the tiers: kind "saved" (entry, shard, ok, error, errno, nbytes), "deleted" (entry,
    shard, ok, error), "restored" (tier, nbytes, seconds), "load_failed" (node, tier, error) or "state_failed"
    (node, tier, pos, error: a recurrent-state snapshot could not be restored)."""

    kind: str
    rank: int
    entry: str = ""
    shard: int = -1
    ok: bool = True
    error: str = ""
    errno: int = 0
    nbytes: int = 0
    tier: str = ""
    seconds: float = 0.0
    node: int = -1
    pos: int = -1
