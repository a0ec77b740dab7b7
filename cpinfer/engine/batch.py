"""Typed messages between the driver and the ranks: one `ForwardBatch` per step, one `RankResult` back per rank.

The batch carries every decision (which rank and slot each new token takes, which cached slot runs each sequence
sees, which K/V move between the device, host and disk tiers); ranks apply it and never re-decide. Its size grows
with the new tokens and the number of slot runs, not with the cached context, so a decode step ships a few hundred
bytes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cpinfer.engine.sampling import SampleSpec


@dataclasses.dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a forward: T new tokens at positions start ... start+T-1."""

    token_ids: np.ndarray  # [T] int64
    start: int
    ranks: np.ndarray  # [T] CP rank that computes and stores each new token
    slots: np.ndarray  # [T] its KV slot on that rank (the cache operation the rank applies)
    ctx_runs: tuple[np.ndarray, ...]  # per CP rank: [R, 2] slot runs of every key before `start` on its path
    sample: SampleSpec | None  # sample the next token from the last new token's logits
    next_token: int = -1  # the token after the last new one, when known (prompt log-probabilities of a chunk)
    prompt_logprobs: bool = False  # return log p(next token) for each new token held on a rank
    spread: bool = True  # its keys (cached and new) sit on more than one rank: it takes part in the ring; else all
    # of them, old and new, are on ranks[0] and no other rank needs them
    prompt_top: int = 0  # with prompt_logprobs: also the k most likely tokens at each of those positions


# ---------------------------------------------------------------- cache operations between tiers (kv_tiers.py)
# Each names the CP rank whose shard it moves (every TP rank of it applies it to its own heads and files). A rank
# applies the operations of a batch in order, before the forward writes new K/V: the driver may free a slot and
# reuse it in the same batch, and order is what keeps that safe.

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


CacheOp = ToHost | FromHost | SaveEntry | LoadEntry | DeleteEntry | ForgetEntry


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    seqs: tuple[SeqInput, ...]
    strategy: str  # "pass-kv" | "pass-q" for the ring's sequences; "local" when no sequence spreads (no ring)
    phase: str  # "prefill" | "decode" | "mixed"
    cache_ops: tuple[CacheOp, ...] = ()  # applied in order before the forward


@dataclasses.dataclass(frozen=True)
class SampleResult:
    seq: int  # index into ForwardBatch.seqs
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    error: str | None = None  # this request's sampling failed (token is -1): it ends alone, the forward goes on


@dataclasses.dataclass(frozen=True)
class RankResult:
    samples: tuple[SampleResult, ...]
    prompt_lp: dict[int, tuple]  # seq → (offsets within its new tokens [M], log p(next) [M]) and, when its
    # prompt_top is k > 0, (top ids [M, k], top log-probabilities [M, k])
    forward_s: float
    ring_wait_s: float
    idle: bool = False  # this rank had no token and no ring to serve: it skipped the model
    tier_events: tuple = ()  # `TierEvent`s since the last result: disk writes done or failed, restore timings
    # host-side seconds of this forward's parts on the rank: "plan" (indices, tables and their upload, or the
    # static path's buffers), "model" (the layers and logits up to their copy to the host: it waits for the device;
    # a graph replay on the static path), "sample" (drawing tokens from the logits on the host)
    phases: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TierEvent:
    """What a rank reports about the tiers: kind "saved" (entry, shard, ok, error, errno, nbytes), "deleted" (entry,
    shard, ok, error), "restored" (tier, nbytes, seconds) or "load_failed" (node, tier, error)."""

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
