"""Sharded persistent KV cache (paper §3.3): each CP rank stores its shard of every sequence's K/V across turns.

`CacheLayout` is the metadata of one rank's cache — which slot holds which (sequence, position) — kept in
blocks of `BLOCK` slots so a sequence's tokens stay in long contiguous runs. Every process keeps the layout of
*every* rank (`ClusterLayout`) and applies the same operations in the same order, so all of them know where each
token lives without communicating; only rank r owns the tensors of layout r (`KVStore`).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpinfer.utils import ceil_div

BLOCK = 64  # slots per allocation block


class CacheFullError(ValueError):
    """A request cannot fit in the KV cache even after evicting every finished sequence."""


@dataclasses.dataclass
class _SeqShard:
    blocks: list[int]
    count: int = 0  # tokens stored; slot of token i = blocks[i // BLOCK] * BLOCK + i % BLOCK


class CacheLayout:
    """Slot metadata of one rank: seq[slot], pos[slot] (seq -1 = free)."""

    def __init__(self, capacity_tokens: int):
        self.num_blocks = capacity_tokens // BLOCK
        if self.num_blocks < 1:
            raise ValueError(f"KV capacity per rank must be at least {BLOCK} tokens, got {capacity_tokens}")
        self.seq = np.full(self.num_blocks * BLOCK, -1, dtype=np.int64)
        self.pos = np.zeros(self.num_blocks * BLOCK, dtype=np.int64)
        self._free = np.ones(self.num_blocks, dtype=bool)
        self._seqs: dict[int, _SeqShard] = {}

    @property
    def capacity(self) -> int:
        return self.num_blocks * BLOCK

    def free_blocks(self) -> int:
        return int(self._free.sum())

    def tokens_of(self, seq_id: int) -> int:
        sh = self._seqs.get(seq_id)
        return sh.count if sh else 0

    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        have = self._seqs.get(seq_id)
        count, nblocks = (have.count, len(have.blocks)) if have else (0, 0)
        return max(0, ceil_div(count + n_new, BLOCK) - nblocks)

    def high_water(self) -> int:
        used = np.nonzero(~self._free)[0]
        return int(used[-1] + 1) * BLOCK if len(used) else 0

    def append(self, seq_id: int, positions: np.ndarray) -> np.ndarray:
        """Store new tokens of a sequence (positions increasing, after all stored ones); returns their slots."""
        sh = self._seqs.setdefault(seq_id, _SeqShard([]))
        need = self.blocks_needed(seq_id, len(positions))
        if need > self.free_blocks():
            raise CacheFullError(f"rank cache full: need {need} more blocks of {BLOCK}, {self.free_blocks()} free")
        if need:
            new = np.nonzero(self._free)[0][:need]  # lowest free blocks: long contiguous runs
            self._free[new] = False
            sh.blocks.extend(int(b) for b in new)
        idx = np.arange(sh.count, sh.count + len(positions))
        slots = np.asarray(sh.blocks, dtype=np.int64)[idx // BLOCK] * BLOCK + idx % BLOCK
        self.seq[slots], self.pos[slots] = seq_id, positions
        sh.count += len(positions)
        return slots

    def truncate(self, seq_id: int, keep_below_pos: int) -> None:
        """Drop the sequence's tokens at positions >= keep_below_pos (stored in increasing position order)."""
        sh = self._seqs.get(seq_id)
        if sh is None:
            return
        slots = self.slots_of(seq_id)
        keep = int(np.searchsorted(self.pos[slots], keep_below_pos))
        self.seq[slots[keep:]] = -1
        sh.count = keep
        nkeep = ceil_div(keep, BLOCK)
        self._free[sh.blocks[nkeep:]] = True
        del sh.blocks[nkeep:]

    def free(self, seq_id: int) -> None:
        self.truncate(seq_id, -1)
        self._seqs.pop(seq_id, None)

    def slots_of(self, seq_id: int) -> np.ndarray:
        sh = self._seqs.get(seq_id)
        if sh is None:
            return np.zeros(0, dtype=np.int64)
        idx = np.arange(sh.count)
        return np.asarray(sh.blocks, dtype=np.int64)[idx // BLOCK] * BLOCK + idx % BLOCK


class ClusterLayout:
    """The layouts of all N ranks, updated identically on every process."""

    def __init__(self, num_ranks: int, capacity_tokens_per_rank: int):
        self.ranks = [CacheLayout(capacity_tokens_per_rank) for _ in range(num_ranks)]

    def tokens_per_rank(self, seq_id: int) -> list[int]:
        return [lay.tokens_of(seq_id) for lay in self.ranks]

    def fits(self, new_per_rank: dict[int, list[int]]) -> bool:
        """new_per_rank[seq] = tokens to add on each rank; True if every rank has the blocks."""
        for r, lay in enumerate(self.ranks):
            if sum(lay.blocks_needed(s, n[r]) for s, n in new_per_rank.items()) > lay.free_blocks():
                return False
        return True

    def free(self, seq_id: int) -> None:
        for lay in self.ranks:
            lay.free(seq_id)

    def truncate(self, seq_id: int, keep_below_pos: int) -> None:
        for lay in self.ranks:
            lay.truncate(seq_id, keep_below_pos)


class KVStore:
    """This rank's K/V tensors: k, v [layers, capacity, Hkv, D], indexed by the slots of its CacheLayout."""

    def __init__(self, num_layers: int, capacity: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (num_layers, capacity, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        return 2 * num_layers * n_kv_heads * head_dim * elem_bytes
