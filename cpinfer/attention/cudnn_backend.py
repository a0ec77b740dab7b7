"""The `torch-cudnn` backend: a ring step's items mapped onto PyTorch's cuDNN attention ops (`torch_cudnn.py`) —
causal squares (top-left, exact) as dense causal calls batched by side, FULL blocks as dense calls grouped by shape
(GQA folded into rows) or one ragged call, blocks of one key computed directly, blocks of few rows through
torch-flash when it is usable — planned on the host once per forward and merged into the fp32 partial (stored
where the rows are fresh); fp32, head sizes over 128 and MASK tiles through Triton as in `flash_backend.py`.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import defaultdict

import numpy as np
import torch

from cpinfer.attention.flash_backend import DTYPES, FlashAttnBackend
from cpinfer.attention.items import CAUSAL, MASK
from cpinfer.attention.merge import merge_into, merge_rows_into
from cpinfer.attention.step import HeadLayout, ensure_prepared
from cpinfer.attention.tables import ForwardTables
from cpinfer.attention.torch_cudnn import CudnnAPI

DENSE_GROUPS_MAX = 4  # FULL blocks of more distinct shapes than this run as one ragged call (when it passed)
SMALL_ROWS = 128  # blocks of at most this many query rows go to torch-flash when usable (PyTorch's own varlen front
# end gives cuDNN only max_q > 128; decode rows would otherwise build a cuDNN graph for every new context length)
MAX_HEAD_DIM = 128  # cuDNN's fused attention on Hopper (256 needs cuDNN >= 9.10: not relied on)


# ---------------------------------------------------------------- planning a step (host, once per forward)

@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """One op call: `batch` items of one shape (dense) or packed sequences (ragged); rows in item order."""

    ragged: bool
    causal: bool
    q_rows: np.ndarray  # [P] int64: the step's query row of each packed row (its accumulator row)
    k_rows: np.ndarray  # [K] int64: the key row of each packed key
    batch: int  # dense: items; ragged: sequences
    lq: int  # dense: rows per item; ragged: max_q
    lk: int  # dense: keys per item; ragged: max_k
    cu_q: np.ndarray | None = None  # ragged: [G + 1] int32
    cu_k: np.ndarray | None = None
    first: bool = False  # every item is its rows' first (`AttnItem.first`): nothing in the accumulator yet
    one_key: bool = False  # blocks of one key each (k_rows: one per packed row), computed without the op


def mark_stores(calls: list[CudnnCall], n_rows: int) -> list[bool]:
    """Per call in execution order: whether its result may be stored into the accumulator instead of merged — its
    items are their rows' first in the plan, its rows are distinct, and no earlier call touched them."""
    covered = np.zeros(n_rows, dtype=bool)
    stores = []
    for call in calls:
        rows = call.q_rows
        stores.append(bool(call.first and len(np.unique(rows)) == len(rows) and not covered[rows].any()))
        covered[rows] = True
    return stores


def cudnn_calls(items, ragged: bool) -> list[CudnnCall]:
    """The FULL / CAUSAL items of a step as op calls: causal squares grouped by side (one-row squares are FULL),
    FULL blocks grouped by shape — or, past `DENSE_GROUPS_MAX` shapes with `ragged`, one ragged call. Blocks of
    ONE key (cuDNN refuses a key length of 1) form one call computed without the op (`one_key`)."""
    regular = [it for it in items if it.kind != MASK and it.q1 > it.q0 and it.k1 > it.k0]
    squares: dict[int, list] = defaultdict(list)
    fulls: dict[tuple, list] = defaultdict(list)
    single = []
    for it in regular:
        n = it.q1 - it.q0
        if it.kind == CAUSAL and n > 1:
            if it.k1 - it.k0 != n:
                raise ValueError(f"a CAUSAL item must be a top-left square, got {n} rows x {it.k1 - it.k0} keys")
            squares[n].append(it)
        elif it.k1 - it.k0 == 1:  # FULL over one key, or a one-row square (the same thing)
            single.append(it)
        else:
            fulls[(n, it.k1 - it.k0)].append(it)
    calls = [_dense_call(group, True) for _, group in sorted(squares.items())]
    if ragged and len(fulls) > DENSE_GROUPS_MAX:
        calls.append(_ragged_call([it for group in fulls.values() for it in group]))
    else:
        calls += [_dense_call(group, False) for _, group in sorted(fulls.items())]
    if single:  # k_rows: the one key of each packed row
        calls.append(CudnnCall(False, False, _rows((i.q0, i.q1) for i in single),
                               np.concatenate([np.full(i.q1 - i.q0, i.k0, dtype=np.int64) for i in single]),
                               len(single), 0, 1, first=all(i.first for i in single), one_key=True))
    return calls


def one_key(q, k, v, scale: float):
    """Rows that each see ONE key: q [P, H, D], k [P, Hkv, D] / v [P, Hkv, Dv] (row p's key) → (out [P, H, Dv] =
    its value exactly, lse [P, H] fp32 = its scaled score)."""
    p, h, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("pkgd,pkd->pkg", q.reshape(p, hkv, h // hkv, d).float(), k.float()) * scale  # [P, Hkv, G]
    out = v.unsqueeze(2).expand(p, hkv, h // hkv, v.shape[-1]).reshape(p, h, v.shape[-1])  # [P, H, Dv]
    return out.to(q.dtype), s.reshape(p, h)


def _rows(ranges) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])


def _dense_call(group, causal: bool) -> CudnnCall:
    it = group[0]
    return CudnnCall(False, causal, _rows((i.q0, i.q1) for i in group), _rows((i.k0, i.k1) for i in group),
                     len(group), it.q1 - it.q0, it.k1 - it.k0, first=all(i.first for i in group))


def _ragged_call(group) -> CudnnCall:
    lq = np.asarray([i.q1 - i.q0 for i in group], dtype=np.int64)
    lk = np.asarray([i.k1 - i.k0 for i in group], dtype=np.int64)
    cu = (lambda n: np.concatenate(([0], np.cumsum(n))).astype(np.int32))  # noqa: E731
    return CudnnCall(True, False, _rows((i.q0, i.q1) for i in group), _rows((i.k0, i.k1) for i in group),
                     len(group), int(lq.max()), int(lk.max()), cu(lq), cu(lk), all(i.first for i in group))


def _start(rows: np.ndarray) -> int:
    """The first row when `rows` is one contiguous increasing range (read as a slice, no gather), else -1."""
    if len(rows) and np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
        return int(rows[0])
    return -1


# ---------------------------------------------------------------- the backend

class CudnnBackend(FlashAttnBackend):
    """A ring step as a few cuDNN calls (dense per shape, or ragged), each merged into the partial; fp32, head
    sizes over 128 and MASK tiles as in `FlashAttnBackend` (Triton)."""

    def __init__(self, api_: CudnnAPI, tiled=None, name: str = "torch-cudnn"):
        super().__init__(api_, tiled, name)
        self._warned = False  # a step was refused at run time (`_refused`)
        self._small: dict = {}  # device key -> torch-flash's backend for few-row blocks, or None

    def small(self, device) -> FlashAttnBackend | None:
        """torch-flash (PyTorch's FA2 varlen op) for blocks of at most `SMALL_ROWS` rows, when its probe passed on
        `device`; else None (everything through cuDNN)."""
        from cpinfer.attention import torch_flash

        device = torch.device(device)
        if device not in self._small:
            usable = not torch_flash.unusable(device)
            self._small[device] = FlashAttnBackend(torch_flash.api(), self.tiled, "torch-flash") if usable else None
        return self._small[device]

    @staticmethod
    def handles(layout: HeadLayout) -> bool:
        return layout.dtype in DTYPES and layout.head_dim <= MAX_HEAD_DIM and layout.head_dim % 8 == 0

    def prepare_items(self, items, vectors, tables: ForwardTables, key, layout: HeadLayout, key_map=None) -> None:
        if not self.handles(layout):  # fp32 and odd head sizes: the whole step through Triton (flash's delegate)
            super().prepare_items(items, vectors, tables, key, layout, key_map)
            return
        if key_map is not None and any(it.kind == MASK for it in items):
            raise ValueError("a key_map cannot be used with MASK tiles (they read contiguous key ranges)")
        small = []
        if self.small(tables.device) is not None:  # few-row blocks: one FA2 varlen call, no per-shape graph
            small = [it for it in items if it.kind != MASK and it.q1 - it.q0 <= SMALL_ROWS]
            items = [it for it in items if it.kind == MASK or it.q1 - it.q0 > SMALL_ROWS]
            self.small(tables.device).prepare_items(small, vectors, tables, key + ("small",), layout, key_map)
        calls = cudnn_calls(items, self.api.ragged_op is not None)
        if key_map is not None:
            calls = [dataclasses.replace(c, k_rows=np.asarray(key_map(c.k_rows), dtype=np.int64)) for c in calls]
        specs = []
        n_rows = 1 + max([int(call.q_rows.max()) for call in calls] + [it.q1 - 1 for it in items] + [0])
        stores = mark_stores(calls, n_rows)
        for c, call in enumerate(calls):
            q_start, k_start = _start(call.q_rows), _start(call.k_rows)
            fields = ["cu_q", "cu_k"] if call.ragged else []
            fields += ["q_rows"] if q_start < 0 else []
            fields += ["k_rows"] if k_start < 0 else []
            for field in fields:
                tables.put(key + (c, field), getattr(call, field))
            specs.append((call.ragged, call.causal, call.batch, call.lq, call.lk, len(call.q_rows),
                          len(call.k_rows), q_start, k_start, len(np.unique(call.q_rows)) == len(call.q_rows),
                          stores[c], call.one_key))
        masked = [it for it in items if it.kind == MASK]
        if masked and vectors is not None:  # window edges / irregular tiles: Triton in vector mode, exact
            self.tiled.prepare_items(masked, vectors, tables, key + ("masked",), layout)
        elif masked:
            for i, it in enumerate(masked):
                tables.put(key + ("mask", i), it.mask.numpy())
        tables.meta[key] = {"delegate": False, "cudnn": specs, "masked": masked, "key_map": key_map is not None,
                            "small": small,
                            "masked_mode": "tiled" if masked and vectors is not None else "math", "masked_items": None}

    def _attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        tables, key = ensure_prepared(self, items, vectors, q, k, tables, key)
        meta = tables.meta[key]
        if meta["delegate"]:
            self.tiled.attend_items(items, vectors, q, k, v, acc_out, acc_lse, scale, tables, key + ("tiled",), window)
            return
        try:  # every call first: a shape cuDNN refuses leaves the accumulator untouched
            parts = [self._call(c, spec, q, k, v, scale, tables, key) for c, spec in enumerate(meta["cudnn"])]
        except RuntimeError as exc:
            if meta["key_map"]:  # keys addressed through the engine's index: Triton cannot read them so
                raise
            self._refused(exc, q.device)
            self.tiled.attend_items(items, vectors, q, k, v, acc_out, acc_lse, scale, None, None, window)
            return
        for c, (spec, (out, lse)) in enumerate(zip(meta["cudnn"], parts)):  # [P, H, Dv], [P, H]
            n_q, q_start, unique, store = spec[5], spec[7], spec[9], spec[10]
            if q_start >= 0 and store:  # fresh rows (zeros, -inf): the partial is stored, not merged
                acc_out[q_start:q_start + n_q].copy_(out)
                acc_lse[q_start:q_start + n_q].copy_(lse)
            elif q_start >= 0:  # one contiguous range of rows: merged in place through views
                merge_into(acc_out[q_start:q_start + n_q], acc_lse[q_start:q_start + n_q], out, lse)
            elif store:
                rows = tables[key + (c, "q_rows")]
                acc_out.index_copy_(0, rows, out.float())
                acc_lse.index_copy_(0, rows, lse)
            else:
                merge_rows_into(acc_out, acc_lse, out, lse, tables[key + (c, "q_rows")], unique)
        if meta["small"]:  # merged after the cuDNN calls' stores (always merged, never stored)
            self.small(q.device)._attend_items(meta["small"], vectors, q, k, v, acc_out, acc_lse, scale, tables,
                                               key + ("small",), window)
        if meta["masked"]:
            self._masked(meta, vectors, q, k, v, acc_out, acc_lse, scale, tables, key, window)

    def _refused(self, exc: Exception, device) -> None:
        """A call the probe did not cover failed (e.g. no cuDNN engine for a shape): warned once per backend; that
        step runs the Triton kernel (tables built now)."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"torch-cudnn refused a step on {device} ({type(exc).__name__}: {exc}); such steps run the "
                          f"Triton kernel", RuntimeWarning, stacklevel=4)

    def _call(self, c: int, spec, q, k, v, scale, tables, key):
        ragged, causal, batch, lq, lk, n_q, n_k, q_start, k_start = spec[:9]
        qq = q[q_start:q_start + n_q] if q_start >= 0 else q.index_select(0, tables[key + (c, "q_rows")])
        if k_start >= 0:
            kk, vv = k[k_start:k_start + n_k], v[k_start:k_start + n_k]
        else:
            idx = tables[key + (c, "k_rows")]
            kk, vv = k.index_select(0, idx), v.index_select(0, idx)  # [K, Hkv, D]
        if spec[11]:  # one key per row
            return one_key(qq, kk, vv, scale)
        if ragged:
            return self.api.ragged(qq, kk, vv, tables[key + (c, "cu_q")], tables[key + (c, "cu_k")], lq, lk, scale)
        h, hkv = q.shape[1], k.shape[1]
        out, lse = self.api.dense(qq.reshape(batch, lq, h, -1), kk.reshape(batch, lk, hkv, -1),
                                  vv.reshape(batch, lk, hkv, -1), scale, causal)
        return out.reshape(n_q, h, -1), lse.reshape(n_q, h)


__all__ = ["CudnnBackend", "CudnnCall", "cudnn_calls", "mark_stores", "one_key", "DENSE_GROUPS_MAX"]
