"""The `triton` backend: a whole ring step in one launch of the Triton step kernel (`triton_attention.py`) from the
step's tile table (`tiles.py`, longest programs first) and, when the plan gives them, its metadata vectors; tiles,
warps and pipeline depth per shape class (`triton_tuning.py`); split-KV for launches too small to fill the
device; the Triton merge for pass-Q. Its int32 tables are planned on the host and put into the forward's
`ForwardTables` (one upload), so a ring step only launches kernels.
"""
from __future__ import annotations

import numpy as np
import torch

from cpinfer.attention import triton_attention, triton_tuning
from cpinfer.attention.items import CAUSAL, MASK, AttnItem, run_items
from cpinfer.attention.kernels import sdpa_math_backend
from cpinfer.attention.kv_pack import attend_same_head_size
from cpinfer.attention.step import HeadLayout, StepBackend, ensure_prepared, no_key_map, with_device_masks
from cpinfer.attention.tables import ForwardTables
from cpinfer.attention.tiles import TABLE_FIELDS, VEC_DIAG, item_table, longest_first, split_table, vector_table

_INT32_LIMIT = 2 ** 30  # labels, positions, rows and keys below this; NO_DIAG sits at it


class TritonBackend(StepBackend):
    """One Triton launch per ring step (tile table + in-kernel visibility) and a Triton merge for pass-Q."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None, min_programs: int | None = None,
                 split_keys: int | None = None, tuned: bool | None = None, sms: int | None = None):
        """block_m / block_n: force the tiles (default: `triton_tuning.select` per step); min_programs: split-KV
        when a launch has fewer programs than this (default: 2 per GPU multiprocessor; never in the interpreter);
        split_keys: keys per split program (default: `triton_tuning.decode_splits`); tuned: use the GPU table
        (default: when compiled; the interpreter gets small tiles unless tuned=True, as the tests ask); sms: the
        multiprocessors to plan for (default: the device's; 132, an H100's, where it cannot be asked)."""
        if sms is not None and sms < 1:
            raise ValueError(f"sms must be a positive count of multiprocessors, got {sms}")
        self.block_m, self.block_n, self.sms = block_m, block_n, sms
        self.min_programs, self.split_keys = min_programs, split_keys
        self.tuned = (not triton_attention.interpreting()) if tuned is None else tuned

    def multiprocessors(self, device) -> int:
        if self.sms is not None:
            return self.sms
        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).multi_processor_count
        return triton_tuning.H100_SMS

    def target_programs(self, device) -> int:
        """Programs (x KV heads) a launch should have before it is not split: 2 per multiprocessor on CUDA."""
        if self.min_programs is not None:
            return self.min_programs
        return 0 if torch.device(device).type != "cuda" else 2 * self.multiprocessors(device)

    def _split_keys(self, table, hkv: int, device, block_n: int) -> int:
        """0 (no split) unless the launch is too small to fill the device; else keys per split program: as many
        pieces as fill the multiprocessors, from batch x KV heads x context (`triton_tuning.decode_splits`)."""
        target = self.target_programs(device)
        if table.num_programs * hkv >= target:
            return 0
        if self.split_keys:
            return self.split_keys
        keys = int((table.k1 - table.k0).sum())
        return triton_tuning.decode_splits(table.num_programs, hkv, keys, block_n, max(target // 2, 1))

    def config(self, items, layout: HeadLayout, n_rows: int, device) -> triton_tuning.StepConfig:
        """The step's launch configuration: the tuned class of its shape (or the interpreter's small tiles),
        with block_m / block_n forced when the backend was built with them."""
        g = layout.heads // layout.kv_heads
        if self.tuned:
            item_rows = max((it.q1 - it.q0 for it in items), default=1)
            cfg = triton_tuning.select(16 if layout.dtype.itemsize == 2 else 32, layout.head_dim, g,
                                       any(it.kind == CAUSAL for it in items), item_rows, n_rows, layout.kv_heads,
                                       self.multiprocessors(device))
        else:
            cfg = triton_tuning.INTERPRETER
        bm = triton_attention.block_m_for(g, self.block_m or cfg.block_m)
        if (bm, self.block_n or cfg.block_n) == (cfg.block_m, cfg.block_n):
            return cfg
        return triton_tuning.StepConfig(bm, self.block_n or cfg.block_n, 8 if bm >= 128 else 4, cfg.num_stages,
                                        "forced tiles")

    def prepare_items(self, items, vectors, tables: ForwardTables, key, layout: HeadLayout, key_map=None) -> None:
        no_key_map(self, key_map)
        n_rows = max((it.q1 for it in items), default=0)
        cfg = self.config(items, layout, n_rows, tables.device)
        g = layout.heads // layout.kv_heads
        tables.meta[key] = put_step_tables(
            tables, key, items, None if vectors is None else vectors(), cfg.block_m // g,
            lambda tab: self._split_keys(tab, layout.kv_heads, tables.device, cfg.block_n))
        tables.meta[key]["config"] = cfg

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
        cfg = meta["config"]
        triton_attention.launch_step(q, k, v, acc_out, acc_lse, vec, table, scale, cfg.block_m, cfg.block_n,
                                     num_warps=cfg.num_warps, slots=slots, n_slots=meta["n_slots"], window=window,
                                     num_stages=cfg.num_stages)
        if meta["masked"]:  # item mode: irregular MASK tiles through the portable kernel, merged (never stored)
            if meta["masked_items"] is None:
                meta["masked_items"] = with_device_masks(meta["masked"], range(len(meta["masked"])), tables, key)
            run_items(meta["masked_items"], q, k, v, acc_out, acc_lse, scale, sdpa_math_backend)

    def merge(self, outs, lses, out_dtype):
        from cpinfer.attention.triton_merge import triton_merge

        return triton_merge(outs, lses, out_dtype)


def put_step_tables(tables: ForwardTables, key, items, vectors, rows_per_prog: int, split=None) -> dict:
    """Put the Triton kernel's int32 inputs for one step into `tables` under `key`; returns the host facts.

    With vectors (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos): `vector_table`, every item in-kernel (MASK tiles by
    the vectors). Without (item mode): `item_table` of the FULL / CAUSAL items; the MASK items (`first` cleared so
    they merge) are run by the portable kernel, their masks put as device tables too. `split(table)` → keys per
    split-KV program (0: none). Programs go longest first (`longest_first`).
    """
    masked = []
    if vectors is not None:
        tab = vector_table(items, len(vectors[0]), rows_per_prog)
        for i, x in enumerate(vectors):
            tables.put(key + ("vec", i), int32_checked(x, "metadata"))
    else:
        n_rows = max((it.q1 for it in items), default=0)
        tab = item_table([it for it in items if it.kind != MASK], n_rows, rows_per_prog)
        masked = [AttnItem(it.q0, it.q1, it.k0, it.k1, it.kind, it.mask) for it in items if it.kind == MASK]
        for i, it in enumerate(masked):
            tables.put(key + ("mask", i), it.mask.numpy())
    split_keys = split(tab) if split is not None else 0
    n_slots, slot = 0, None
    if split_keys:  # split-KV for launches too small to fill the device (decode)
        tab, slot, n_slots = split_table(tab, split_keys)
    tab, slot = longest_first(tab, slot if n_slots else None)
    if n_slots:
        tables.put(key + ("slot",), int32_checked(slot, "split slots"))
    for f in TABLE_FIELDS:
        tables.put(key + (f,), int32_checked(getattr(tab, f), "tile table", VEC_DIAG if f == "diag" else _INT32_LIMIT))
    return {"vectors": vectors is not None, "n_slots": n_slots, "masked": masked, "masked_items": None,
            "programs": tab.num_programs}


def int32_checked(x, what: str, limit: int = _INT32_LIMIT) -> np.ndarray:
    """int32 copy (the kernel's registers hold int32 metadata); values must stay within +-2^30 (diag: VEC_DIAG)."""
    a = np.asarray(x, dtype=np.int64)
    if a.size and (a.max() > limit or a.min() < -_INT32_LIMIT):
        raise ValueError(f"{what} values must lie within +-2^30 for the Triton kernel, got [{a.min()}, {a.max()}]")
    return a.astype(np.int32)
