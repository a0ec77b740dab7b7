"""Tile tables: a ring step's kernel calls (`AttnItem`s) regrouped for a kernel that owns its query rows.

A one-launch kernel (Triton) gives program t the query rows [row0[t], row1[t]) and key ranges
k0/k1[off[t]:off[t+1]], each for rows [r0, r1) and keys with key - row <= diag. `tile_table` (vector mode) gives
the disjoint union of the key ranges any item pairs with the block's rows: visibility is then decided inside the
kernel from the metadata vectors, so a range may hold invisible keys but never misses a visible one.
`item_table` (item mode, no vectors) keeps each FULL / CAUSAL item's own rectangle and diagonal, which is exact
by itself; `vector_table` (what the Triton backend launches with vectors) adds the MASK items as ranges flagged
`VEC_DIAG`, so the kernel runs every fully visible key block of a FULL / CAUSAL range without a mask and reads the
vectors only on MASK tiles. Either way blocks no item touches (invisible tiles) are never visited; `longest_first`
orders programs by their work. Pure numpy: built on the host once per forward (per step and query-row blocking),
copied to the device once.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cpinfer.attention.items import CAUSAL, FULL, MASK

NO_DIAG = 2 ** 30  # diag of a range without a causal edge: every key - row is below it (kernels use int32)
VEC_DIAG = NO_DIAG + 1  # diag of a range whose visibility the kernel decides per (row, key) from the metadata vectors
TABLE_FIELDS = ("row0", "row1", "off", "k0", "k1", "r0", "r1", "diag")  # a table's arrays, in kernel order


@dataclasses.dataclass(frozen=True)
class TileTable:
    """Programs of one launch: query-row blocks and, per block, its key ranges (CSR)."""

    rows_per_prog: int
    row0: np.ndarray  # [T] int64 first query row of program t
    row1: np.ndarray  # [T] int64 one past its last row
    off: np.ndarray  # [T + 1] int64: program t visits key ranges off[t] .. off[t+1]-1
    k0: np.ndarray  # [R] int64 key range starts
    k1: np.ndarray  # [R] int64 key range ends (exclusive)
    r0: np.ndarray  # [R] int64 the range applies to rows [r0, r1) of its program
    r1: np.ndarray
    diag: np.ndarray  # [R] int64 key j is in the range for row i only if j - i <= diag (causal squares);
    # VEC_DIAG: the range may hold invisible keys, the metadata vectors decide (vector mode only)

    @property
    def num_programs(self) -> int:
        return len(self.row0)

    def key_ranges(self, t: int) -> list[tuple[int, int]]:
        return list(zip(self.k0[self.off[t]:self.off[t + 1]].tolist(), self.k1[self.off[t]:self.off[t + 1]].tolist()))


def _item_arrays(items, allow_mask: bool = True, kinds: bool = False):
    """(q0, q1, k0, k1, causal) int64 / bool arrays of the non-empty items (kinds: the int64 kinds, not causal)."""
    if not allow_mask and any(getattr(it, "kind", FULL) == MASK for it in items):
        raise ValueError("item_table takes FULL and CAUSAL items only; run MASK tiles another way")
    q0, q1, k0, k1 = (np.fromiter((getattr(it, f) for it in items), dtype=np.int64, count=len(items))
                      for f in ("q0", "q1", "k0", "k1"))
    kind = np.fromiter((getattr(it, "kind", FULL) for it in items), dtype=np.int64, count=len(items))
    keep = (q1 > q0) & (k1 > k0)
    return q0[keep], q1[keep], k0[keep], k1[keep], (kind if kinds else kind == CAUSAL)[keep]


def _programs(q0, q1, rows_per_prog: int):
    """Row blocks of at most rows_per_prog rows, cut at every item boundary, over rows some item covers.

    Every program's rows then share one set of items: a decode batch gets one program per sequence (each visits
    only its own context), a long prefill gets full blocks. Returns (row0 [T], row1 [T]).
    """
    if rows_per_prog < 1:
        raise ValueError(f"rows_per_prog must be >= 1, got {rows_per_prog}")
    cuts = np.unique(np.concatenate((q0, q1)))
    depth = np.zeros(len(cuts) + 1, dtype=np.int64)
    np.add.at(depth, np.searchsorted(cuts, q0), 1)
    np.add.at(depth, np.searchsorted(cuts, q1), -1)
    covered = np.cumsum(depth)[:max(len(cuts) - 1, 0)] > 0  # segment [cuts[i], cuts[i+1]) lies inside some item
    a, b = cuts[:-1][covered], cuts[1:][covered]
    n = -(-(b - a) // rows_per_prog)
    row0 = np.repeat(a, n) + rows_per_prog * (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    return row0.astype(np.int64), np.minimum(row0 + rows_per_prog, np.repeat(b, n)).astype(np.int64)


def _entries(q0, q1, k0, k1, causal, row0, row1):
    """One entry per (item, program inside it): (program, key lo, key hi, diag, item index); causal ranges are cut
    at the program's last row (a long causal square costs half a square), diag = k0 - q0 for top-left squares."""
    first, last = np.searchsorted(row0, q0), np.searchsorted(row0, q1)  # programs with q0 <= row0 < q1
    count = last - first
    which = np.repeat(np.arange(len(q0)), count)
    prog = np.repeat(first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    lo, hi = k0[which], k1[which]
    hi = np.where(causal[which], np.minimum(hi, lo + row1[prog] - q0[which]), hi)
    diag = np.where(causal[which], k0[which] - q0[which], NO_DIAG)  # top-left: key - k0 <= row - q0
    return prog, lo, hi, diag, which


def _csr(prog, n_programs):
    return np.concatenate(([0], np.cumsum(np.bincount(prog, minlength=n_programs)))).astype(np.int64)


def tile_table(items, n_rows: int, rows_per_prog: int) -> TileTable:
    """Vector mode: per program, the disjoint union of the key ranges any item (objects with q0, q1, k0, k1,
    kind) gives its rows; visibility inside a range is left to the kernel's metadata vectors."""
    q0, q1, k0, k1, causal = _item_arrays(items)
    row0, row1 = _programs(q0, q1, rows_per_prog)
    prog, lo, hi, _, _ = _entries(q0, q1, k0, k1, causal, row0, row1)
    # union per program: sort by (program, start); a range opens a new piece when it starts past the running end
    # of the program's earlier ranges (offsetting by program keeps one running maximum valid)
    big = int(k1.max(initial=0)) + 1
    lo_g, hi_g = prog * big + lo, prog * big + hi
    order = np.lexsort((lo_g, prog))
    prog, lo_g, hi_g = prog[order], lo_g[order], hi_g[order]
    run_end = np.maximum.accumulate(hi_g) if len(hi_g) else hi_g
    new = np.ones(len(lo_g), dtype=bool)
    new[1:] = lo_g[1:] > run_end[:-1]
    starts = np.nonzero(new)[0]
    piece_prog = prog[starts]
    piece_lo = lo_g[starts] - piece_prog * big
    piece_hi = (np.maximum.reduceat(hi_g, starts) if len(starts) else hi_g[:0]) - piece_prog * big
    return TileTable(rows_per_prog, row0, row1, _csr(piece_prog, len(row0)), piece_lo.astype(np.int64),
                     piece_hi.astype(np.int64), row0[piece_prog], row1[piece_prog],
                     np.full(len(piece_lo), VEC_DIAG, np.int64))


def item_table(items, n_rows: int, rows_per_prog: int) -> TileTable:
    """Item mode: every FULL / CAUSAL item's rectangle per program, with its causal diagonal (exact without
    metadata vectors). Items are disjoint rectangles, so no (row, key) pair is visited twice."""
    q0, q1, k0, k1, causal = _item_arrays(items, allow_mask=False)
    row0, row1 = _programs(q0, q1, rows_per_prog)
    prog, lo, hi, diag, _ = _entries(q0, q1, k0, k1, causal, row0, row1)
    order = np.argsort(prog, kind="stable")
    prog, lo, hi, diag = prog[order], lo[order], hi[order], diag[order]
    return TileTable(rows_per_prog, row0, row1, _csr(prog, len(row0)), lo.astype(np.int64), hi.astype(np.int64),
                     row0[prog], row1[prog], diag.astype(np.int64))


def vector_table(items, n_rows: int, rows_per_prog: int) -> TileTable:
    """Vector mode, masks only where needed: every item's rectangle per program (items are disjoint and exact for
    the vectors they were planned from), FULL ranges with NO_DIAG and CAUSAL ones with their diagonal (exact
    without the vectors: the kernel runs their fully visible key blocks unmasked), MASK tiles with VEC_DIAG (the
    kernel reads the vectors there). Touching ranges of one program that are both FULL, or both MASK, are joined."""
    q0, q1, k0, k1, kind = _item_arrays(items, kinds=True)
    row0, row1 = _programs(q0, q1, rows_per_prog)
    prog, lo, hi, diag, which = _entries(q0, q1, k0, k1, kind == CAUSAL, row0, row1)
    diag = np.where(kind[which] == MASK, VEC_DIAG, diag)
    order = np.lexsort((lo, prog))
    prog, lo, hi, diag = prog[order], lo[order], hi[order], diag[order]
    join = np.zeros(len(lo), dtype=bool)  # range i continues range i - 1
    join[1:] = (prog[1:] == prog[:-1]) & (lo[1:] == hi[:-1]) & (diag[1:] == diag[:-1]) & (diag[1:] >= NO_DIAG)
    starts = np.nonzero(~join)[0]
    ends = np.concatenate((starts[1:], [len(lo)])).astype(np.int64)[:len(starts)] - 1  # no items: no ranges
    prog, lo, hi, diag = prog[starts], lo[starts], hi[ends], diag[starts]
    return TileTable(rows_per_prog, row0, row1, _csr(prog, len(row0)), lo.astype(np.int64), hi.astype(np.int64),
                     row0[prog], row1[prog], diag.astype(np.int64))


def program_keys(table: TileTable) -> np.ndarray:
    """[T] int64 keys each program visits (causal ranges are already cut at the program's last row)."""
    cum = np.concatenate(([0], np.cumsum(table.k1 - table.k0)))
    return cum[table.off[1:]] - cum[table.off[:-1]]


def mask_free_keys(table: TileTable, block_n: int) -> np.ndarray:
    """[T] int64 keys each program runs without any mask, as the step kernel splits its ranges: from a range's
    start, the whole key blocks every row of the program sees (a FULL range up to its last whole block, a causal
    range up to its first row's diagonal); none of a VEC_DIAG range or of one covering only part of the rows."""
    count = table.off[1:] - table.off[:-1]
    prog = np.repeat(np.arange(table.num_programs), count)
    row0, row1 = table.row0[prog], table.row1[prog]
    clean = (table.r0 <= row0) & (table.r1 >= row1) & (table.diag <= NO_DIAG)
    reach = np.minimum(table.k1 - table.k0, row0 - table.k0 + table.diag + 1)
    free = np.where(clean, np.maximum(reach, 0) // block_n * block_n, 0)
    return np.bincount(prog, weights=free, minlength=table.num_programs).astype(np.int64)


def longest_first(table: TileTable, slot: np.ndarray | None = None):
    """The programs reordered by descending key count (stable): the longest causal rows (and the biggest split-KV
    pieces) start first and the short ones fill the tail of the launch. Returns (table, slot or None)."""
    order = np.argsort(-program_keys(table), kind="stable")
    count = table.off[1:] - table.off[:-1]
    off = np.concatenate(([0], np.cumsum(count[order]))).astype(np.int64)
    idx = np.repeat(table.off[:-1][order] - off[:-1], count[order]) + np.arange(int(off[-1]))
    new = TileTable(table.rows_per_prog, table.row0[order], table.row1[order], off, table.k0[idx], table.k1[idx],
                    table.r0[idx], table.r1[idx], table.diag[idx])
    return new, None if slot is None else np.asarray(slot)[order]


def split_table(table: TileTable, split_keys: int) -> tuple[TileTable, np.ndarray, int]:
    """Split-KV: cut every program whose ranges hold more than `split_keys` keys into programs of at most that
    many (same rows, ranges cut where needed). Returns (table, slot [T'] int64, slots): a cut program's pieces get
    slots 0, 1, ... (their partials go to scratch and are merged afterwards); an uncut program gets -1."""
    if split_keys < 1:
        raise ValueError(f"split_keys must be >= 1, got {split_keys}")
    cols = ("k0", "k1", "r0", "r1", "diag")
    row0, row1, off, slot = [], [], [0], []
    out = {c: [] for c in cols}
    n_slots = 0
    for t in range(table.num_programs):
        a, b = int(table.off[t]), int(table.off[t + 1])
        ranges = [tuple(int(getattr(table, c)[r]) for c in cols) for r in range(a, b)]
        pieces, cur, used = [], [], 0  # pieces of at most split_keys keys, in range order
        for k0, k1, r0, r1, diag in ranges:
            while k0 < k1:
                take = min(k1 - k0, split_keys - used)
                cur.append((k0, k0 + take, r0, r1, diag))
                k0, used = k0 + take, used + take
                if used == split_keys:
                    pieces.append(cur)
                    cur, used = [], 0
        if cur:
            pieces.append(cur)
        for i, piece in enumerate(pieces):
            row0.append(int(table.row0[t]))
            row1.append(int(table.row1[t]))
            slot.append(i if len(pieces) > 1 else -1)
            for entry in piece:
                for c, val in zip(cols, entry):
                    out[c].append(val)
            off.append(off[-1] + len(piece))
        n_slots = max(n_slots, len(pieces) if len(pieces) > 1 else 0)
    arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    new = TileTable(table.rows_per_prog, arr(row0), arr(row1), arr(off), *(arr(out[c]) for c in cols))
    return new, arr(slot), n_slots
