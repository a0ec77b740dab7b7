"""The K/V transfer plan between a prefill group and a decode group (paper §4.3: prefill and decode decoupled).

Pure data from two layouts: where each token's K/V sit in the source group (CP rank, slot) and where the
destination group's KV manager reserved them (CP rank, slot). Tokens are grouped per (source rank, destination
rank) pair, in position order, so each pair moves in one message per layer, never one per token.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PairSlots:
    """The tokens one source CP rank sends one destination CP rank: slots on each side, in position order."""

    src: int  # source CP rank (in its group)
    dst: int  # destination CP rank (in its group)
    src_slots: np.ndarray  # [T] int64
    dst_slots: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: the tokens' positions (a windowed layer sends only the recent ones)


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    positions: np.ndarray  # [T] the moved tokens' positions
    dst_ranks: np.ndarray  # [T] destination CP rank of each
    dst_slots: np.ndarray  # [T] its slot there
    pairs: tuple[PairSlots, ...]  # one entry per (source, destination) pair that has tokens

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


def plan_transfer(positions: np.ndarray, src_ranks: np.ndarray, src_slots: np.ndarray, dst_ranks: np.ndarray,
                  dst_slots: np.ndarray) -> TransferPlan:
    """Group the tokens ([T] arrays, one entry per token) by (source rank, destination rank); every token appears in
    exactly one pair, each pair's tokens in the order given (position order)."""
    arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (positions, src_ranks, src_slots, dst_ranks,
                                                                   dst_slots)]
    positions, src_ranks, src_slots, dst_ranks, dst_slots = arrays
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(f"transfer plan arrays differ in length: {[len(a) for a in arrays]}")
    pairs = []
    if len(positions):
        width = int(dst_ranks.max()) + 1
        key = src_ranks * width + dst_ranks
        order = np.argsort(key, kind="stable")  # stable: position order inside each pair
        bounds = np.flatnonzero(np.diff(key[order])) + 1
        for idx in np.split(order, bounds):
            pairs.append(PairSlots(int(src_ranks[idx[0]]), int(dst_ranks[idx[0]]), src_slots[idx], dst_slots[idx],
                                   positions[idx]))
    return TransferPlan(positions, dst_ranks, dst_slots, tuple(pairs))


def kv_transfer_bytes(num_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes a transfer of num_tokens moves: each token's stored K/V once (every layer, every KV head over its TP
    ranks; an FP8 cache's stored bytes, MLA's latent once per TP rank that caches it)."""
    return num_tokens * kv_bytes_per_token
