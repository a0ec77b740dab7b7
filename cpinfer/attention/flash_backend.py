"""The `flash-attn` backend: a ring step as ONE varlen call of FlashAttention 3 (`flash_attn_interface`, preferred)
or FlashAttention 2 (`flash_attn`), packed from the step's items on the host, merged into the running partial.

Packing: the step's query rows are cut at every item edge; each piece with its FULL key ranges and at most one
CAUSAL square becomes one varlen sequence whose keys are the FULL ranges followed by the square's keys up to the
piece's last row — flash-attn's bottom-right causal alignment is then exactly the square's diagonal, and a
one-row piece sees all its keys. Pieces of several rows with FULL blocks only cannot share that call (they need
causal=False): they form a second call. fp32 (which flash-attn lacks) and head sizes it lacks run the Triton
kernel; MASK tiles (a window's edge, irregular positions) run the Triton kernel in vector mode over those tiles.
flash-attn is detected by importing it: a broken install falls back to Triton with a warning naming the error.
Without flash-attn the same backend runs PyTorch's own FA2 varlen op (`torch_flash.py`, backend "torch-flash").
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys
import warnings

import numpy as np
import torch

from cpinfer.attention.items import CAUSAL, MASK, run_items
from cpinfer.attention.kernels import sdpa_math_backend
from cpinfer.attention.kv_pack import attend_same_head_size
from cpinfer.attention.merge import merge_rows_into
from cpinfer.attention.step import HeadLayout, StepBackend, ensure_prepared, with_device_masks
from cpinfer.attention.tables import ForwardTables

DEVICES = ("cuda",)  # where flash-attn runs (the CPU tests add "cpu" with a fake module that checks every call)
DTYPES = (torch.float16, torch.bfloat16)
MIN_FA2 = (2, 1)  # bottom-right causal alignment (2.0 aligned top-left)


@dataclasses.dataclass(frozen=True)
class FlashAPI:
    """An imported flash-attn: `varlen(...)` → (out [P, H, D] in q's dtype, lse [P, H] fp32, -inf where empty)."""

    name: str  # "flash-attn 3" / "flash-attn 2.x.y"
    module: object
    fa3: bool

    def varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
        kw = dict(softmax_scale=scale, causal=causal, return_attn_probs=True)
        if not self.fa3:
            kw["dropout_p"] = 0.0
        res = self.module.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        out, lse = res[0], res[1]
        if lse.dim() != 2 or lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"{self.name} returned a log-sum-exp of shape {tuple(lse.shape)}; expected "
                               f"[heads, total_q] = {[q.shape[1], q.shape[0]]} (flash-attn >= 2.4 or 3)")
        lse = lse.transpose(0, 1).float()  # [P, H]
        return out, torch.where(torch.isposinf(lse) | torch.isnan(lse), -torch.inf, lse)  # empty rows: -inf


@functools.lru_cache(maxsize=None)
def detect() -> FlashAPI | None:
    """The flash-attn to use, found by importing it (FA3 first); None when absent or broken (with a warning)."""
    for module, fa3 in (("flash_attn_interface", True), ("flash_attn", False)):
        if not _present(module):
            continue
        try:
            mod = importlib.import_module(module)
            if not fa3:
                from flash_attn import flash_attn_varlen_func  # noqa: F401 (the entry point exists)
        except Exception as exc:  # noqa: BLE001 - a wheel built for another torch / CUDA fails in many ways
            warnings.warn(f"{module} is installed but cannot be imported ({type(exc).__name__}: {exc}); the "
                          f"attention backend falls back to triton", RuntimeWarning, stacklevel=2)
            continue
        version = str(getattr(mod, "__version__", "3" if fa3 else "0"))
        if not fa3 and _version(version) < MIN_FA2:
            warnings.warn(f"flash-attn {version} aligns causal masks top-left; cpinfer needs >= "
                          f"{'.'.join(map(str, MIN_FA2))}; using triton", RuntimeWarning, stacklevel=2)
            continue
        return FlashAPI("flash-attn 3" if fa3 else f"flash-attn {version}", mod, fa3)
    return None


def _present(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def unusable(device: torch.device) -> str:
    """Why flash-attn cannot run on `device` ('' when it can)."""
    if device.type not in DEVICES:
        return "flash-attn needs a CUDA device"
    if detect() is None:
        return "the flash-attn package is not installed (or cannot be imported: see the warning)"
    return ""


# ---------------------------------------------------------------- packing (host, once per forward)

@dataclasses.dataclass(frozen=True)
class VarlenCall:
    """One varlen call: sequences g take packed query rows [cu_q[g], cu_q[g+1]) and keys [cu_k[g], cu_k[g+1])."""

    causal: bool
    q_rows: np.ndarray  # [P] int64: the step's query row of each packed row (its accumulator row)
    k_rows: np.ndarray  # [K] int64: the key row of each packed key
    cu_q: np.ndarray  # [G + 1] int32
    cu_k: np.ndarray  # [G + 1] int32
    max_q: int
    max_k: int


def varlen_calls(items) -> list[VarlenCall]:
    """The FULL / CAUSAL items of a step as at most two varlen calls (see the module docstring); MASK items are
    not included. Usually one: every piece with a diagonal, or of one row, goes into the causal call."""
    regular = [it for it in items if it.kind != MASK and it.q1 > it.q0 and it.k1 > it.k0]
    if not regular:
        return []
    cuts = np.unique(np.asarray([it.q0 for it in regular] + [it.q1 for it in regular], dtype=np.int64))
    fulls: dict[int, list] = {}
    causals: dict[int, list] = {}
    for it in regular:
        for piece in range(int(np.searchsorted(cuts, it.q0)), int(np.searchsorted(cuts, it.q1))):
            (causals if it.kind == CAUSAL else fulls).setdefault(piece, []).append(it)
    aligned, square = [], []  # (row0, row1, key ranges): causal-call pieces; causal=False pieces
    for piece in sorted(set(fulls) | set(causals)):
        x, y = int(cuts[piece]), int(cuts[piece + 1])
        keys = [(it.k0, it.k1) for it in fulls.get(piece, [])]
        cs = causals.get(piece, [])
        if cs:  # the square's keys up to row y - 1: bottom-right alignment puts its diagonal in place
            aligned.append((x, y, keys + [(cs[0].k0, cs[0].k0 + y - cs[0].q0)]))
            aligned += [(x, y, [(c.k0, c.k0 + y - c.q0)]) for c in cs[1:]]  # rare: merged as extra partials
        else:
            (aligned if y - x == 1 else square).append((x, y, keys))
    if square:  # that call is made anyway: one-row FULL pieces join it
        moved = [p for p in aligned if p[1] - p[0] == 1 and not causals.get(int(np.searchsorted(cuts, p[0])))]
        aligned = [p for p in aligned if p not in moved]
        square += moved
    return [_pack(pieces, causal) for pieces, causal in ((aligned, True), (square, False)) if pieces]


def _pack(pieces, causal: bool) -> VarlenCall:
    q_rows = np.concatenate([np.arange(x, y, dtype=np.int64) for x, y, _ in pieces])
    k_rows = np.concatenate([np.arange(a, b, dtype=np.int64) for _, _, keys in pieces for a, b in keys])
    lq = np.asarray([y - x for x, y, _ in pieces], dtype=np.int64)
    lk = np.asarray([sum(b - a for a, b in keys) for _, _, keys in pieces], dtype=np.int64)
    cu = (lambda n: np.concatenate(([0], np.cumsum(n))).astype(np.int32))  # noqa: E731
    return VarlenCall(causal, q_rows, k_rows, cu(lq), cu(lk), int(lq.max()), int(lk.max()))


# ---------------------------------------------------------------- the backend

class FlashAttnBackend(StepBackend):
    """flash-attn varlen, one call per ring step (two when FULL blocks of several rows meet causal squares). `api`:
    an imported flash-attn (`FlashAPI`, backend "flash-attn") or PyTorch's own FA2 op (`torch_flash.TorchFlashAPI`,
    backend "torch-flash"); both take the same packed arguments."""

    def __init__(self, api, tiled: StepBackend | None = None, name: str = "flash-attn"):
        self.api, self.name = api, name
        self._tiled = tiled  # the Triton backend: fp32, head sizes flash-attn lacks, MASK tiles (made on first use)

    @property
    def tiled(self) -> StepBackend:
        if self._tiled is None:
            from cpinfer.attention.triton_backend import TritonBackend

            self._tiled = TritonBackend()
        return self._tiled

    @staticmethod
    def handles(layout: HeadLayout) -> bool:
        return layout.dtype in DTYPES and layout.head_dim <= 256 and layout.head_dim % 8 == 0

    def maps_keys(self, layout: HeadLayout) -> bool:
        return self.handles(layout)  # keys are gathered through an index anyway: several K sources read as one

    def prepare_items(self, items, vectors, tables: ForwardTables, key, layout: HeadLayout, key_map=None) -> None:
        if not self.handles(layout):  # fp32 and odd head sizes: the whole step through the tiled Triton kernel
            if key_map is not None:
                raise ValueError(f"{layout.dtype} / head_dim {layout.head_dim} runs the Triton kernel, which takes "
                                 "no key_map")
            self.tiled.prepare_items(items, vectors, tables, key + ("tiled",), layout)
            tables.meta[key] = {"delegate": True}
            return
        calls = varlen_calls(items)
        if key_map is not None:
            if any(it.kind == MASK for it in items):
                raise ValueError("a key_map cannot be used with MASK tiles (they read contiguous key ranges)")
            calls = [dataclasses.replace(c, k_rows=np.asarray(key_map(c.k_rows), dtype=np.int64)) for c in calls]
        for c, call in enumerate(calls):
            for field in ("q_rows", "k_rows", "cu_q", "cu_k"):
                tables.put(key + (c, field), getattr(call, field))
        rows = np.concatenate([call.q_rows for call in calls]) if calls else np.zeros(0, np.int64)
        if len(calls) > 1:
            tables.put(key + ("rows",), rows)
        masked = [it for it in items if it.kind == MASK]
        if masked and vectors is not None:  # window edges / irregular tiles: Triton in vector mode, exact
            self.tiled.prepare_items(masked, vectors, tables, key + ("masked",), layout)
        elif masked:  # no metadata vectors: the masks themselves (small tiles) through the portable kernel
            for i, it in enumerate(masked):
                tables.put(key + ("mask", i), it.mask.numpy())
        tables.meta[key] = {"delegate": False, "calls": [(c.causal, c.max_q, c.max_k, len(c.q_rows), len(c.k_rows),
                                                          _is_arange(c.q_rows), _is_arange(c.k_rows)) for c in calls],
                            "unique": len(np.unique(rows)) == len(rows), "masked": masked,
                            "masked_mode": "tiled" if masked and vectors is not None else "math", "masked_items": None}

    def attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        """The kernel takes one head size: a value head size Dv != Dk runs padded (`kv_pack`, exact)."""
        attend_same_head_size(lambda q_, k_, v_, out_, lse_: self._attend_items(
            items, vectors, q_, k_, v_, out_, lse_, scale, tables, key, window), q, k, v, acc_out, acc_lse)

    def _attend_items(self, items, vectors, q, k, v, acc_out, acc_lse, scale, tables=None, key=None, window=None):
        tables, key = ensure_prepared(self, items, vectors, q, k, tables, key)
        meta = tables.meta[key]
        if meta["delegate"]:
            self.tiled.attend_items(items, vectors, q, k, v, acc_out, acc_lse, scale, tables, key + ("tiled",), window)
            return
        parts = [self._call(c, spec, q, k, v, scale, tables, key) for c, spec in enumerate(meta["calls"])]
        if len(parts) == 1 and meta["calls"][0][5] and meta["calls"][0][3] == acc_out.shape[0]:
            from cpinfer.attention.merge import merge_into

            merge_into(acc_out, acc_lse, *parts[0])  # the call covered every row, in order
        elif parts:
            out, lse = (parts[0] if len(parts) == 1 else
                        (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
            rows = tables[key + (0, "q_rows")] if len(parts) == 1 else tables[key + ("rows",)]
            merge_rows_into(acc_out, acc_lse, out, lse, rows, meta["unique"])
        if meta["masked"]:
            self._masked(meta, vectors, q, k, v, acc_out, acc_lse, scale, tables, key, window)

    def _call(self, c: int, spec, q, k, v, scale, tables, key):
        """One varlen call → (out [P, H, D], lse [P, H] fp32) in its packed row order."""
        causal, max_q, max_k, n_q, n_k, q_identity, k_identity = spec
        if not (q_identity and q.shape[0] == n_q):
            q = q.index_select(0, tables[key + (c, "q_rows")])  # [P, H, D]
        if not (k_identity and k.shape[0] == n_k):
            idx = tables[key + (c, "k_rows")]
            k, v = k.index_select(0, idx), v.index_select(0, idx)  # [K, Hkv, D]
        return self.api.varlen(q, k, v, tables[key + (c, "cu_q")], tables[key + (c, "cu_k")], max_q, max_k, scale,
                               causal)

    def _masked(self, meta, vectors, q, k, v, acc_out, acc_lse, scale, tables, key, window) -> None:
        if meta["masked_mode"] == "tiled":
            self.tiled.attend_items(meta["masked"], vectors, q, k, v, acc_out, acc_lse, scale, tables,
                                    key + ("masked",), window)
            return
        if meta["masked_items"] is None:
            meta["masked_items"] = [dataclasses.replace(it, first=False) for it in
                                    with_device_masks(meta["masked"], range(len(meta["masked"])), tables, key)]
        run_items(meta["masked_items"], q, k, v, acc_out, acc_lse, scale, sdpa_math_backend)

    def merge(self, outs, lses, out_dtype):
        if outs.device.type == "cuda":
            return self.tiled.merge(outs, lses, out_dtype)
        return super().merge(outs, lses, out_dtype)


def _is_arange(rows: np.ndarray) -> bool:
    return bool(len(rows) == 0 or (rows[0] == 0 and np.array_equal(rows, np.arange(len(rows)))))
