"""What an attention backend is: one ring step (a list of `AttnItem`s) merged into a running fp32 partial, with the
device tables it reads prepared before the ring starts (`prepare_items` puts them into the forward's
`ForwardTables`, uploaded once), and the merge of pass-Q's partials. `ItemBackend` runs a per-item kernel.
"""
from __future__ import annotations

import abc
import dataclasses

import torch

from cpinfer.attention.items import AttnItem, run_items
from cpinfer.attention.merge import merge_partials
from cpinfer.attention.tables import ForwardTables


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """What a backend must know of the tensors a step will get, to plan its tables before they exist."""

    heads: int  # query heads of q [L, H, D]
    kv_heads: int  # heads of k / v [L, Hkv, D]
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> "HeadLayout":
        return cls(q.shape[1], k.shape[1], q.shape[2], q.dtype)


class StepBackend(abc.ABC):
    """Computes one ring step (a list of `AttnItem`s) into a running fp32 partial, and merges partials."""

    name: str

    def maps_keys(self, layout: HeadLayout) -> bool:
        """Whether prepare_items takes a `key_map` for this layout (the backend gathers keys through an index)."""
        return False

    def prepare_items(self, items, vectors, tables: ForwardTables, key, layout: HeadLayout, key_map=None) -> None:
        """Put into `tables` (under `key`) what `attend_items(items, ..., tables, key)` will read on the device, so
        that no host work or host→device copy happens inside a ring step. `vectors`: a callable returning the
        step's metadata (q_seq, q_pos, kv_seq, kv_seq_end, kv_pos) as int64 arrays in the items' row order, or
        None; `layout`: heads, head_dim and dtype of the q and k the step will get; `key_map` (when
        `maps_keys(layout)`): items' key indices (int64 array) → rows of the k the step gets."""

    @abc.abstractmethod
    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale: float,
                     tables: ForwardTables | None = None, key=None, window: int | None = None) -> None:
        """Merge q [Lq, H, D] against k/v [Lk, Hkv, D] under `items` into acc_out [Lq, H, D] fp32 and acc_lse
        [Lq, H] fp32 in place (rows no item touches stay as they are). `window`: the sliding window the items
        were planned with (items are exact by themselves; in-kernel backends apply it with the vectors).
        Without `tables` (or with a key never prepared) the tables are built now: fine for a one-off call."""

    def attend(self, plan, j: int, q, k, v, acc_out, acc_lse, scale: float) -> None:
        """Step j of a plan (`plan.steps[j]`, `plan.step_vectors(j)` if it has one); tables from `plan_tables`."""
        tables = plan_tables(plan, q.device)
        key = plan_key(plan, j)
        if key not in tables.meta:
            self.prepare_items(plan.steps[j], step_vectors(plan, j), tables, key, HeadLayout.of(q, k))
        self.attend_items(plan.steps[j], step_vectors(plan, j), q, k, v, acc_out, acc_lse, scale, tables, key,
                          getattr(plan, "window", None))

    def prepare_plan(self, plan, layout: HeadLayout, tables: ForwardTables) -> None:
        """Every step's tables of a plan (with `steps` and optionally `step_vectors(j)`), before the ring."""
        for j, items in enumerate(plan.steps):
            key = plan_key(plan, j)
            if key not in tables.meta:
                self.prepare_items(items, step_vectors(plan, j), tables, key, layout)

    def merge(self, outs, lses, out_dtype):
        """outs [S, L, H, D], lses [S, L, H] → (out [L, H, D] in out_dtype, lse [L, H] fp32)."""
        out, lse = merge_partials(list(outs), list(lses))
        return out.to(out_dtype), lse


class ItemBackend(StepBackend):
    """One kernel call per `AttnItem` (FULL / CAUSAL / MASK), merged into the accumulator in fp32. On an
    accelerator the MASK tiles' masks are device tables; on CPU they are used where they are."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def prepare_items(self, items, vectors, tables, key, layout, key_map=None) -> None:
        no_key_map(self, key_map)
        if tables.device.type == "cpu":
            return  # the items and their masks are used where they are
        masked = [i for i, it in enumerate(items) if it.mask is not None]
        tables.meta[key] = {"masked": masked, "items": None}
        for i in masked:
            tables.put(key + ("mask", i), items[i].mask.numpy())

    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        if q.device.type != "cpu" and any(it.mask is not None for it in items):
            tables, key = ensure_prepared(self, items, vectors, q, k, tables, key)
            meta = tables.meta[key]
            if meta["items"] is None:  # the items with their masks on the device (views of the upload)
                meta["items"] = with_device_masks(items, meta["masked"], tables, key)
            items = meta["items"]
        run_items(items, q, k, v, acc_out, acc_lse, scale, self.kernel)


def no_key_map(backend: StepBackend, key_map) -> None:
    if key_map is not None:
        raise ValueError(f"the {backend.name} backend reads keys as contiguous ranges: it takes no key_map")


def with_device_masks(items, masked, tables: ForwardTables, key) -> list[AttnItem]:
    """Items whose MASK tiles read their masks from `tables` (put as key + ("mask", i))."""
    items = list(items)
    for i in masked:
        it = items[i]
        items[i] = AttnItem(it.q0, it.q1, it.k0, it.k1, it.kind, tables[key + ("mask", i)], it.first)
    return items


def ensure_prepared(backend: StepBackend, items, vectors, q, k, tables, key):
    """(tables, key) with the items' tables prepared (made now when the caller prepared none)."""
    if tables is None:
        tables, key = ForwardTables(q.device), ("adhoc",)
    if key not in tables.meta:
        backend.prepare_items(items, vectors, tables, key, HeadLayout.of(q, k))
    return tables, key


def plan_tables(plan, device) -> ForwardTables:
    """The `ForwardTables` a plan's steps read: the one given to it (`plan.tables`, e.g. the engine's forward), or
    its own, made on first use (works for frozen dataclasses and plain objects alike)."""
    tables = getattr(plan, "tables", None)
    if tables is None:
        tables = plan.__dict__.setdefault("_own_tables", ForwardTables(device))
    return tables


def plan_key(plan, *parts) -> tuple:
    """A key in the plan's tables: its prefix (`plan.table_prefix`, default ()) + parts."""
    return tuple(getattr(plan, "table_prefix", ())) + parts


def step_vectors(plan, j: int):
    """Step j's metadata callable of a plan, or None when the plan has no `step_vectors` (item mode)."""
    sv = getattr(plan, "step_vectors", None)
    return None if sv is None else (lambda: sv(j))


__all__ = ["HeadLayout", "StepBackend", "ItemBackend", "plan_tables", "plan_key", "step_vectors", "with_device_masks",
           "ensure_prepared", "no_key_map"]
