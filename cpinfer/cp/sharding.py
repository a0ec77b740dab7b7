"""Token placement over the CP ranks (paper §3.5.1 load-balanced sharding, §3.6 decode placement).

Prefill (full or partial): each sequence's *new* tokens are split into 2N equal chunks (padded per sequence to
a multiple of 2N); rank i takes chunks i and 2N-1-i, so every rank holds the same number of new tokens and the
same causal work. Cached tokens never move. Decode: one token per sequence, placed round-robin with an offset
that advances every step, so each sequence's KV grows evenly on all ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from cpinfer.utils import ceil_div

PAD_SEQ = -1  # sequence id of padding entries; negative ids never match anything in attention


@dataclasses.dataclass(frozen=True)
class RankShard:
    """The new tokens one rank holds, in its local order. Arrays are int64 of equal length."""

    index: np.ndarray  # index into the flat new-token array (sequences concatenated in batch order); -1 = padding
    seq: np.ndarray  # sequence id (PAD_SEQ for padding)
    pos: np.ndarray  # position within the sequence (0 for padding)

    @property
    def valid(self) -> np.ndarray:
        return self.index >= 0

    def __len__(self) -> int:
        return len(self.index)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """Where every new token of a batch goes. `shards[r]` is rank r's part; `num_tokens` counts real tokens."""

    shards: tuple[RankShard, ...]
    num_tokens: int

    @property
    def num_ranks(self) -> int:
        return len(self.shards)

    def inverse(self) -> tuple[np.ndarray, np.ndarray]:
        """For each real token in sequence order: (rank holding it, slot within that rank's shard)."""
        rank = np.full(self.num_tokens, -1, dtype=np.int64)
        slot = np.full(self.num_tokens, -1, dtype=np.int64)
        for r, sh in enumerate(self.shards):
            ok = sh.valid
            rank[sh.index[ok]] = r
            slot[sh.index[ok]] = np.nonzero(ok)[0]
        return rank, slot

    def shard_tensor(self, x: torch.Tensor, rank: int, pad_value=0) -> torch.Tensor:
        """Rank `rank`'s rows of a per-token tensor x [num_tokens, ...] (padding rows filled with pad_value)."""
        sh = self.shards[rank]
        idx = torch.from_numpy(np.where(sh.valid, sh.index, 0)).to(x.device)
        out = x.index_select(0, idx)
        if not sh.valid.all():
            out[torch.from_numpy(~sh.valid).to(x.device)] = pad_value
        return out

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard_tensor`: per-rank tensors [len(shard_r), ...] → [num_tokens, ...] in sequence order."""
        if len(parts) != self.num_ranks:
            raise ValueError(f"need one part per rank ({self.num_ranks}), got {len(parts)}")
        out = parts[0].new_empty((self.num_tokens,) + tuple(parts[0].shape[1:]))
        for sh, part in zip(self.shards, parts):
            ok = torch.from_numpy(sh.valid)
            out[torch.from_numpy(sh.index[sh.valid])] = part[ok]
        return out


def _check_lengths(values: Sequence[int], what: str, minimum: int) -> list[int]:
    vals = [int(v) for v in values]
    bad = [v for v in vals if v < minimum]
    if bad:
        raise ValueError(f"{what} must all be >= {minimum}, got {bad[:5]}")
    return vals


def shard_prefill(new_lens: Sequence[int], num_ranks: int, cached_lens: Sequence[int] | None = None,
                  seq_ids: Sequence[int] | None = None) -> ShardPlan:
    """Load-balanced 2N-chunk sharding of each sequence's new tokens (full prefill: cached_lens all 0).

    Sequence i has new_lens[i] new tokens at positions cached_lens[i] ... cached_lens[i] + new_lens[i] - 1.
    Every rank gets sum_i ceil(new_lens[i] / 2N) * 2 tokens; the slots past a sequence's end are padding.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    new = _check_lengths(new_lens, "new token counts", 1)
    cached = _check_lengths(cached_lens if cached_lens is not None else [0] * len(new), "cached token counts", 0)
    ids = list(range(len(new))) if seq_ids is None else [int(s) for s in seq_ids]
    if not (len(new) == len(cached) == len(ids)):
        raise ValueError(f"new_lens ({len(new)}), cached_lens ({len(cached)}) and seq_ids ({len(ids)}) differ in length")
    if any(s < 0 for s in ids):
        raise ValueError("sequence ids must be >= 0 (negative ids mark padding)")
    n2 = 2 * num_ranks
    per_rank: list[list[np.ndarray]] = [[] for _ in range(num_ranks)]
    base = 0
    for t, p, sid in zip(new, cached, ids):
        chunk = ceil_div(t, n2)
        offsets = np.arange(chunk * n2, dtype=np.int64).reshape(n2, chunk)  # [2N, chunk] offsets in the new tokens
        for r in range(num_ranks):
            off = np.concatenate((offsets[r], offsets[n2 - 1 - r]))
            real = off < t
            per_rank[r].append(np.stack((
                np.where(real, base + off, -1),
                np.where(real, sid, PAD_SEQ),
                np.where(real, p + off, 0))))
        base += t
    shards = tuple(RankShard(*np.concatenate(parts, axis=1)) for parts in per_rank)
    return ShardPlan(shards, base)


def chunk_ranks(num_tokens: int, num_ranks: int, order: list[int]) -> np.ndarray:
    """2N-chunk load balancing (§3.5.1) of a run of new tokens: chunk k of 2N goes to pair min(k, 2N-1-k);
    pair i is placed on rank order[i] (the caller lists the least loaded ranks first for the larger pairs)."""
    n2 = 2 * num_ranks
    size = ceil_div(num_tokens, n2)
    k = np.arange(num_tokens, dtype=np.int64) // size
    pair = np.minimum(k, n2 - 1 - k)
    counts = np.bincount(pair, minlength=num_ranks)
    by_size = np.argsort(-counts, kind="stable")  # largest pair first
    rank_of_pair = np.empty(num_ranks, dtype=np.int64)
    rank_of_pair[by_size] = np.asarray(order, dtype=np.int64)
    return rank_of_pair[pair]


def decode_ranks(num_seqs: int, num_ranks: int, step: int) -> np.ndarray:
    """Round-robin decode placement: sequence b goes to rank (b + step) mod N at decode step `step`."""
    return (np.arange(num_seqs, dtype=np.int64) + step) % num_ranks


def shard_decode(positions: Sequence[int], ranks: Sequence[int], num_ranks: int,
                 seq_ids: Sequence[int] | None = None) -> ShardPlan:
    """One new token per sequence: token b (at positions[b]) goes to ranks[b]. No padding (pass-Q pads messages)."""
    pos = np.asarray(_check_lengths(positions, "decode positions", 0), dtype=np.int64)
    rk = np.asarray(ranks, dtype=np.int64)
    ids = np.arange(len(pos), dtype=np.int64) if seq_ids is None else np.asarray(seq_ids, dtype=np.int64)
    if not (len(pos) == len(rk) == len(ids)):
        raise ValueError(f"positions ({len(pos)}), ranks ({len(rk)}) and seq_ids ({len(ids)}) differ in length")
    if len(rk) and (rk.min() < 0 or rk.max() >= num_ranks):
        raise ValueError(f"decode ranks must be in [0, {num_ranks}), got {sorted(set(rk.tolist()))}")
    shards = []
    for r in range(num_ranks):
        sel = np.nonzero(rk == r)[0]
        shards.append(RankShard(sel.astype(np.int64), ids[sel], pos[sel]))
    return ShardPlan(tuple(shards), len(pos))
