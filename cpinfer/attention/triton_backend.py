"""The `triton` backend: a whole ring step in one launch of the Triton step kernel (`triton_attention.py`) from the
step's tile table (`tiles.py`) and, when the plan gives them, its metadata vectors; split-KV for launches too small
to fill the device; the Triton merge for pass-Q. Its int32 tables are planned on the host and put into the
forward's `ForwardTables` (one upload), so a ring step only launches kernels.
"""
from __future__ import annotations

import numpy as np
import torch

from cpinfer.attention import triton_attention
from cpinfer.attention.items import MASK, AttnItem, run_items
from cpinfer.attention.kernels import sdpa_math_backend
from cpinfer.attention.kv_pack import attend_same_head_size
from cpinfer.attention.step import HeadLayout, StepBackend, ensure_prepared, no_key_map, with_device_masks
from cpinfer.attention.tables import ForwardTables
from cpinfer.attention.tiles import TABLE_FIELDS, item_table, split_table, tile_table

_INT32_LIMIT = 2 ** 30  # labels, positions, rows and keys below this; NO_DIAG sits at it


class TritonBackend(StepBackend):
    """One Triton launch per ring step (tile table + in-kernel visibility) and a Triton merge for pass-Q."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None, min_programs: int | None = None,
                 split_keys: int | None = None):
        """min_programs: split-KV when a launch has fewer programs than this (default: 2 per GPU multiprocessor;
        never in the interpreter); split_keys: keys per split program (default: sized to reach min_programs)."""
        small = triton_attention.interpreting()  # the interpreter is fastest on small blocks
        self.block_m = block_m or (16 if small else 64)
        self.block_n = block_n or (16 if small else 64)
        self.min_programs, self.split_keys = min_programs, split_keys

    def target_programs(self, device) -> int:
        """Programs (x KV heads) a launch should have before it is not split: 2 per multiprocessor on CUDA."""
        if self.min_programs is not None:
            return self.min_programs
        device = torch.device(device)
        return 0 if device.type != "cuda" else 2 * torch.cuda.get_device_properties(device).multi_processor_count

    def _split_keys(self, table, hkv: int, device) -> int:
        """0 (no split) unless the launch is too small to fill the device; else keys per split program."""
        target = self.target_programs(device)
        if table.num_programs * hkv >= target:
            return 0
        if self.split_keys:
            return self.split_keys
        work = int((table.k1 - table.k0).sum()) * hkv
        per = max(4 * self.block_n, -(-work // target))
        return -(-per // self.block_n) * self.block_n

    def block_m_for(self, layout: HeadLayout) -> int:
        return triton_attention.block_m_for(layout.heads // layout.kv_heads, self.block_m)

    def prepare_items(self, items, vectors, tables: ForwardTables, key, layout: HeadLayout, key_map=None) -> None:
        no_key_map(self, key_map)
        block_m = self.block_m_for(layout)
        tables.meta[key] = put_step_tables(
            tables, key, items, None if vectors is None else vectors(), block_m // (layout.heads // layout.kv_heads),
            lambda tab: self._split_keys(tab, layout.kv_heads, tables.device))
        tables.meta[key]["block_m"] = block_m

    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        """The kernel takes one head size: a value head size Dv != Dk runs padded (`kv_pack`, exact)."""
        attend_same_head_size(lambda q_, k_, v_, out_, lse_: self._attend_items(
            items, vectors, q_, k_, v_, out_, lse_, scale, tables, key, window), q, k, v, acc_out, acc_lse)

    def _attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        tables, key = ensure_prepared(self, items, vectors, q, k, tables, key)
        meta = tables.meta[key]
        table = tuple(tables[key + (f,)] for f in TABLE_FIELDS)
        vec = tuple(tables[key + ("vec", i)] for i in range(5)) if meta["vectors"] else None
        slots = tables[key + ("slot",)] if meta["n_slots"] else None
        triton_attention.launch_step(q, k, v, acc_out, acc_lse, vec, table, scale, meta["block_m"], self.block_n,
                                     slots=slots, n_slots=meta["n_slots"], window=window)
        if meta["masked"]:  # item mode: irregular MASK tiles through the portable kernel, merged (never stored)
            if meta["masked_items"] is None:
                meta["masked_items"] = with_device_masks(meta["masked"], range(len(meta["masked"])), tables, key)
            run_items(meta["masked_items"], q, k, v, acc_out, acc_lse, scale, sdpa_math_backend)

    def merge(self, outs, lses, out_dtype):
        from cpinfer.attention.triton_merge import triton_merge

        return triton_merge(outs, lses, out_dtype)


def put_step_tables(tables: ForwardTables, key, items, vectors, rows_per_prog: int, split=None) -> dict:
    """Put the Triton kernel's int32 inputs for one step into `tables` under `key`; returns the host facts.

    With vectors (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos): the union `tile_table`, every item in-kernel. Without
    (item mode): `item_table` of the FULL / CAUSAL items; the MASK items (`first` cleared so they merge) are run by
    the portable kernel, their masks put as device tables too. `split(table)` → keys per split-KV program (0: none).
    """
    masked = []
    if vectors is not None:
        tab = tile_table(items, len(vectors[0]), rows_per_prog)
        for i, x in enumerate(vectors):
            tables.put(key + ("vec", i), int32_checked(x, "metadata"))
    else:
        n_rows = max((it.q1 for it in items), default=0)
        tab = item_table([it for it in items if it.kind != MASK], n_rows, rows_per_prog)
        masked = [AttnItem(it.q0, it.q1, it.k0, it.k1, it.kind, it.mask) for it in items if it.kind == MASK]
        for i, it in enumerate(masked):
            tables.put(key + ("mask", i), it.mask.numpy())
    split_keys = split(tab) if split is not None else 0
    n_slots = 0
    if split_keys:  # split-KV for launches too small to fill the device (decode)
        tab, slot, n_slots = split_table(tab, split_keys)
        if n_slots:
            tables.put(key + ("slot",), int32_checked(slot, "split slots"))
    for f in TABLE_FIELDS:
        tables.put(key + (f,), int32_checked(getattr(tab, f), "tile table"))
    return {"vectors": vectors is not None, "n_slots": n_slots, "masked": masked, "masked_items": None,
            "programs": tab.num_programs}


def int32_checked(x, what: str) -> np.ndarray:
    """int32 copy (the kernel's registers hold int32 metadata); values must stay within +-2^30."""
    a = np.asarray(x, dtype=np.int64)
    if a.size and (a.max() > _INT32_LIMIT or a.min() < -_INT32_LIMIT):
        raise ValueError(f"{what} values must lie within +-2^30 for the Triton kernel, got [{a.min()}, {a.max()}]")
    return a.astype(np.int32)
