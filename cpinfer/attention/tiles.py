"""Tile tables: a ring step's kernel calls (`AttnItem`s) regrouped for a kernel that owns its query rows.

A one-launch kernel (Triton) gives program t the query rows [row0[t], row1[t]) and key ranges
k0/k1[off[t]:off[t+1]], each for rows [r0, r1) and keys with key - row <= diag. `tile_table` (vector mode) gives
the disjoint union of the key ranges any item pairs with the block's rows: visibility is then decided inside the
kernel from the metadata vectors, so a range may hold invisible keys but never misses a visible one.
`item_table` (item mode, no vectors) keeps each FULL / CAUSAL item's own rectangle and diagonal, which is exact
by itself. Either way blocks no item touches (invisible tiles) are never visited. Pure numpy: built on the host
once per forward (per step and query-row blocking), copied to the device once.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cpinfer.attention.local import CAUSAL, FULL, MASK

NO_DIAG = 2 ** 62  # diag of a range without a causal edge: every key - row is below it


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Programs of one launch: query-row blocks and, per block, its disjoint key ranges (CSR)."""

    rows_per_prog: int
    row0: np.ndarray  # [T] int64 first query row of program t
    row1: np.ndarray  # [T] int64 one past its last row
    off: np.ndarray  # [T + 1] int64: program t visits key ranges off[t] .. off[t+1]-1
    k0: np.ndarray  # [R] int64 key range starts
    k1: np.ndarray  # [R] int64 key range ends (exclusive)
    r0: np.ndarray  # [R] int64 the range applies to rows [r0, r1) of its program
    r1: np.ndarray
    diag: np.ndarray  # [R] int64 key j is in the range for row i only if j - i <= diag (causal squares)

    @property
    def num_programs(self) -> int:
        return len(self.row0)

    def key_ranges(self, t: int) -> list[tuple[int, int]]:
        return list(zip(self.k0[self.off[t]:self.off[t + 1]].tolist(), self.k1[self.off[t]:self.off[t + 1]].tolist()))


def tile_table(items, n_rows: int, rows_per_prog: int) -> TileTable:
    """Regroup a step's items (objects with q0, q1, k0, k1, kind) into blocks of `rows_per_prog` query rows.

    A CAUSAL item's key range is cut per block at the block's last row, so a long causal square costs half a square.
    """
    if rows_per_prog < 1:
        raise ValueError(f"rows_per_prog must be >= 1, got {rows_per_prog}")
    causal = np.fromiter((getattr(it, "kind", FULL) == CAUSAL for it in items), dtype=bool, count=len(items))
    q0 = np.fromiter((it.q0 for it in items), dtype=np.int64, count=len(items))
    q1 = np.fromiter((it.q1 for it in items), dtype=np.int64, count=len(items))
    k0 = np.fromiter((it.k0 for it in items), dtype=np.int64, count=len(items))
    k1 = np.fromiter((it.k1 for it in items), dtype=np.int64, count=len(items))
    keep = (q1 > q0) & (k1 > k0)
    q0, q1, k0, k1, causal = q0[keep], q1[keep], k0[keep], k1[keep], causal[keep]
    b_first, b_last = q0 // rows_per_prog, (q1 - 1) // rows_per_prog
    count = b_last - b_first + 1  # row blocks each item touches
    which = np.repeat(np.arange(len(q0)), count)
    blk = np.repeat(b_first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    lo, hi = k0[which], k1[which]
    # a top-left causal square: the block's last row r sees keys up to k0 + (r - q0), not the whole square
    last = np.minimum(q1[which], (blk + 1) * rows_per_prog)
    hi = np.where(causal[which], np.minimum(hi, lo + last - q0[which]), hi)
    # union of the key ranges per block: sort by (block, start); a range starts a new piece when it begins past
    # the running end of the block's earlier ranges (offsetting by block keeps one running maximum valid)
    big = int(k1.max(initial=0)) + 1
    lo_g, hi_g = blk * big + lo, blk * big + hi
    order = np.lexsort((lo_g, blk))
    blk, lo_g, hi_g = blk[order], lo_g[order], hi_g[order]
    run_end = np.maximum.accumulate(hi_g) if len(hi_g) else hi_g
    new = np.ones(len(lo_g), dtype=bool)
    new[1:] = lo_g[1:] > run_end[:-1]
    starts = np.nonzero(new)[0]
    piece_blk = blk[starts]
    piece_lo = lo_g[starts] - piece_blk * big
    piece_hi = (np.maximum.reduceat(hi_g, starts) if len(starts) else hi_g[:0]) - piece_blk * big
    blocks, first_piece = np.unique(piece_blk, return_index=True)
    off = np.append(first_piece, len(piece_blk)).astype(np.int64)
    row0 = blocks * rows_per_prog
    row1 = np.minimum(row0 + rows_per_prog, n_rows)
    row0, row1 = row0.astype(np.int64), row1.astype(np.int64)
    per_prog = np.diff(off)
    return TileTable(rows_per_prog, row0, row1, off, piece_lo.astype(np.int64), piece_hi.astype(np.int64),
                     np.repeat(row0, per_prog), np.repeat(row1, per_prog), np.full(len(piece_lo), NO_DIAG, np.int64))


def item_table(items, n_rows: int, rows_per_prog: int) -> TileTable:
    """Item mode: every FULL / CAUSAL item cut into row blocks, keeping its rows and causal diagonal (exact
    without metadata vectors). Items are disjoint rectangles, so no (row, key) pair is visited twice."""
    if any(getattr(it, "kind", FULL) == MASK for it in items):
        raise ValueError("item_table takes FULL and CAUSAL items only; run MASK tiles another way")
    q0, q1, k0, k1 = (np.fromiter((getattr(it, f) for it in items), dtype=np.int64, count=len(items))
                      for f in ("q0", "q1", "k0", "k1"))
    causal = np.fromiter((getattr(it, "kind", FULL) == CAUSAL for it in items), dtype=bool, count=len(items))
    keep = (q1 > q0) & (k1 > k0)
    q0, q1, k0, k1, causal = q0[keep], q1[keep], k0[keep], k1[keep], causal[keep]
    b_first, b_last = q0 // rows_per_prog, (q1 - 1) // rows_per_prog
    count = b_last - b_first + 1
    which = np.repeat(np.arange(len(q0)), count)
    blk = np.repeat(b_first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    r0 = np.maximum(q0[which], blk * rows_per_prog)
    r1 = np.minimum(q1[which], (blk + 1) * rows_per_prog)
    lo, hi = k0[which], k1[which]
    hi = np.where(causal[which], np.minimum(hi, lo + r1 - q0[which]), hi)  # cut at the block's last row
    diag = np.where(causal[which], k0[which] - q0[which], NO_DIAG)  # top-left: key - k0 <= row - q0
    order = np.argsort(blk, kind="stable")
    blk, r0, r1, lo, hi, diag = blk[order], r0[order], r1[order], lo[order], hi[order], diag[order]
    blocks, first = np.unique(blk, return_index=True)
    off = np.append(first, len(blk)).astype(np.int64)
    row0 = (blocks * rows_per_prog).astype(np.int64)
    row1 = np.minimum(row0 + rows_per_prog, n_rows).astype(np.int64)
    return TileTable(rows_per_prog, row0, row1, off, lo, hi, r0, r1, diag.astype(np.int64))
