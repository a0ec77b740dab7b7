"""The host side of the static-shape decode path (`decode_graph.py`): batch-size buckets, the fixed-size Triton tile
tables of decode groups (a plain decode row, or a verify sequence's k + 1 rows read in one program; each group's
keys split into equal parts), and static device buffers with a pinned host mirror that one non-blocking copy per
step moves.
"""
from __future__ import annotations

import numpy as np
import torch

from cpinfer.attention.tiles import NO_DIAG

_ALIGN = 8


def bucket_sizes(max_rows: int) -> list[int]:
    """Rows per rank a decode graph is made for: 1, 2, 4, 8, 16, 24, ... (multiples of 8), the last max_rows."""
    return sorted({min(b, max_rows) for b in [1, 2, 4] + list(range(8, max_rows + 8, 8))})


class StaticBuffers:
    """Device tensors at fixed addresses (a captured graph reads them) and their pinned host mirror.

    fields: (key, numpy dtype, length); `host(key)` is the writable numpy view, `[key]` the device view, and
    `upload()` moves the whole mirror with one non-blocking copy (on CPU the mirror is the buffer)."""

    def __init__(self, fields, device):
        self.device = torch.device(device)
        offsets, total = {}, 0
        for key, dtype, length in fields:
            offsets[key] = (total, np.dtype(dtype), length)
            total += -(-np.dtype(dtype).itemsize * length // _ALIGN) * _ALIGN
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(max(total, _ALIGN), dtype=torch.uint8, pin_memory=cuda)  # [bytes]
        self._dev = self._host if not cuda else torch.zeros_like(self._host, device=self.device)
        flat = self._host.numpy()
        torch_dtype = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
        self._views, self._hosts = {}, {}
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of the mirror
        for key, (off, dtype, length) in offsets.items():
            nbytes = dtype.itemsize * length
            self._hosts[key] = flat[off:off + nbytes].view(dtype)
            self._views[key] = self._dev[off:off + nbytes].view(torch_dtype[dtype])

    def host(self, key) -> np.ndarray:
        """The writable mirror of `key` (call `wait()` first: the previous step's copy may still be reading it)."""
        return self._hosts[key]

    def wait(self) -> None:
        """Until the previous upload has left the mirror (a rank that does not sample never syncs otherwise)."""
        if self._copied is not None:
            self._copied.synchronize()

    def __getitem__(self, key) -> torch.Tensor:
        return self._views[key]

    def upload(self) -> None:
        if self._dev is not self._host:
            self._dev.copy_(self._host, non_blocking=True)  # the step's one host→device transfer
            self._copied.record()


def split_rows(row_runs: list[np.ndarray], rows: int, pieces: int, width: int = 1,
               used: list[int] | None = None, rows_per_prog: int | None = None) -> dict[str, np.ndarray]:
    """One item-mode tile table for decode groups: group i owns query rows [i * width, i * width + used[i]) (a plain
    decode row: used 1; a verify sequence: its k + 1 rows, each with its own causal bound) and sees the key runs
    row_runs[i] ([R_i, 2] slot ranges seen in full by all its rows, or [R_i, 3] with a third column `diag`: key j of
    the run is seen by row r only if j - r <= diag, `tiles.NO_DIAG` for none). Each group's keys are cut into
    `pieces` parts of equal size, and its rows into blocks of `rows_per_prog` (default: width, one block): program
    t = (group * blocks + block) * pieces + part reads its part of the keys once for the rows of its block (parts of
    a split group write scratch slot `part`). Groups past len(row_runs), and blocks past a group's rows, get
    programs that do nothing. Returns the TABLE_FIELDS arrays and "slot" (int64; lengths: programs, programs + 1
    and ranges)."""
    rpp = width if rows_per_prog is None else rows_per_prog
    nblk = -(-width // rpp)
    n_real, programs = len(row_runs), rows * nblk * pieces
    used = np.ones(n_real, dtype=np.int64) if used is None else np.asarray(used, dtype=np.int64)
    lens = np.asarray([len(r) for r in row_runs], dtype=np.int64)
    cols = [np.asarray(r, dtype=np.int64) for r in row_runs]
    cols = [c if c.ndim == 2 and c.shape[1] == 3 else
            np.concatenate((c.reshape(-1, 2), np.full((len(c), 1), NO_DIAG, dtype=np.int64)), axis=1) for c in cols]
    runs = np.concatenate(cols) if lens.sum() else np.zeros((0, 3), dtype=np.int64)
    row_of = np.repeat(np.arange(n_real), lens)
    size = runs[:, 1] - runs[:, 0]
    totals = np.bincount(row_of, weights=size, minlength=n_real).astype(np.int64)  # [n_real] keys per group
    start = np.cumsum(size) - size - (np.cumsum(totals) - totals)[row_of]  # run start within its group's keys
    end = start + size
    bounds = (np.arange(pieces + 1)[None, :] * totals[:, None]) // pieces  # [n_real, pieces + 1]
    tot = np.maximum(totals[row_of], 1)
    first = np.clip(((start + 1) * pieces + tot - 1) // tot - 1, 0, pieces - 1)  # part holding the run's first key
    last = np.clip((end * pieces + tot - 1) // tot - 1, 0, pieces - 1)  # ... and its last key
    count = last - first + 1
    run = np.repeat(np.arange(len(runs)), count)
    part = np.repeat(first, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    row = row_of[run]
    lo = np.maximum(start[run], bounds[row, part])
    hi = np.minimum(end[run], bounds[row, part + 1])
    keep = hi > lo
    run, part, row, lo, hi = run[keep], part[keep], row[keep], lo[keep], hi[keep]
    reps = (-(-used // rpp))[row]  # each entry once per row block its group uses
    e = np.repeat(np.arange(len(row)), reps)
    blk = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    run, part, row, lo, hi = run[e], part[e], row[e], lo[e], hi[e]
    prog = (row * nblk + blk) * pieces + part
    order = np.argsort(prog, kind="stable")  # by program; a program's ranges stay in their runs' order
    run, part, row, lo, hi, prog = run[order], part[order], row[order], lo[order], hi[order], prog[order]
    k0 = runs[run, 0] + lo - start[run]
    owner = np.repeat(np.arange(rows), nblk * pieces)  # [programs] group
    first = np.tile(np.repeat(np.arange(nblk) * rpp, pieces), rows)  # [programs] block's first row in its group
    rows_used = np.zeros(rows, dtype=np.int64)
    rows_used[:n_real] = used
    real = first < rows_used[owner]  # padding groups use no row
    row0 = owner * width + first
    return {"row0": np.where(real, row0, 0),
            "row1": np.where(real, np.minimum(row0 + rpp, owner * width + rows_used[owner]), 0),
            "off": np.concatenate(([0], np.cumsum(np.bincount(prog, minlength=programs)))),
            "k0": k0, "k1": k0 + (hi - lo), "r0": row * width, "r1": row * width + used[row], "diag": runs[run, 2],
            "slot": np.tile(np.arange(pieces), rows * nblk) if pieces > 1 else np.full(programs, -1)}


def verify_runs(ctx: np.ndarray, slots: np.ndarray, base: int) -> np.ndarray:
    """The key runs of a verify group on the rank holding its tokens: its cached runs ctx ([R, 2], seen in full) and
    its new tokens' slots ([w]; token u at row base + u sees tokens 0 .. u), as [R', 3] (k0, k1, diag) runs for
    `split_rows`: a run of consecutive slots [a, a + n) holding tokens u0 .. u0 + n - 1 has diag a - u0 - base."""
    slots = np.asarray(slots, dtype=np.int64)
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    u0 = np.concatenate(([0], cut))  # first token of each run of consecutive slots
    u1 = np.append(cut, len(slots))
    new = np.stack((slots[u0], slots[u0] + u1 - u0, slots[u0] - u0 - base), axis=1)
    full = np.concatenate((np.asarray(ctx, dtype=np.int64).reshape(-1, 2),
                           np.full((len(ctx), 1), NO_DIAG, dtype=np.int64)), axis=1)
    return np.concatenate((full, new))
