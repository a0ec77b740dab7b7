"""The CPU's Linears in float32: a decode step's few rows through cpinfer's kernel, everything else through
oneDNN's packed weights.

torch's `F.linear` calls MKL's sgemm, which on the AMD EPYC of docs/benchmarks.md runs a prefill's GEMMs at 120-195
GFLOP/s (2 threads) and streams a decode step's weights at 7-10 GB/s of the ~26 the memory gives. So a plain
`nn.Linear` given `pack_linear` (the engine does it for every one on the CPU, `CausalLM.pack_linears`) multiplies:
- **1-4 rows** (`ONEDNN_FROM` - 1): cpinfer's kernel (`attention/cpu_linear.cpp`, `torch.ops.cpinfer.small_linear`):
  each thread streams its share of the weight's rows once against the rows of x held in registers. It reads a copy
  of the weight interleaved by tiles of four rows (`small_linear_tiles`, made on first use, in 2 MB pages where the
  kernel gives them): one stream from memory a thread where the weight's own rows are four, which a core pulls at
  about half the rate (the 30 layers of SmolLM2-135M plus its LM head, 2 threads, alternating: 1 row 28-36 ms from
  the weight -> 23-31 from the copy; the engine's batch-4 decode step 40-50 -> 37-40 ms, batch 1 at 3K tokens 40-56
  -> 35-44). The same bits either way. A row's result does not depend on the batch it is in; it differs from
  `F.linear`'s by float32 rounding (another order of the same products).
- **from 5 rows on** (a decode batch, a prefill chunk): oneDNN's GEMM over a copy of the weight packed once into
  its blocked layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what torch's own CPU
  inference passes use): prefill shapes 200-222 GFLOP/s, a decode step of 8 rows 30 ms (cpinfer's kernel 33-36), of
  16 rows 33-41 ms (43-44, MKL 71). Results within float32 rounding of `F.linear`'s.
- a weight that cannot be packed (past the memory budget below, or no oneDNN in this torch): cpinfer's kernel up to
  16 rows (`SMALL_ROWS`, 1 on a CPU without AVX-512), `F.linear` above.
Not float32, not on the CPU, a gradient wanted, or without the compiled kernels (`CPINFER_CPU_KERNELS=0`, no
compiler: oneDNN from 1 row): `F.linear` or oneDNN as above, never a wrong shape.

Each copy (oneDNN's, the interleaved one) costs about its weight's memory (bounded, oneDNN's as 1.3x, to
`CPINFER_PACKED_GEMM_GIB` in all; default an eighth of the machine's memory; 0 turns both off: the kernel then reads
the weight itself), made on the first call that needs it and given back when its module goes; past the budget a
weight goes without. A weight changed in place or given new storage afterwards is copied again (its version counter
and address are checked every call); an inference tensor (no version counter) is never copied.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.attention.cpu_kernels import small_linear_op, small_linear_rows, small_linear_tiled_ops

SMALL_ROWS = 16  # cpinfer's kernel takes up to this many rows (`cpu_linear.cpp`)
ONEDNN_FROM = 5  # from this many rows oneDNN's packed GEMM beats cpinfer's kernel (measured: 1-4 rows it does not)
_F32 = torch.float32
_lock = threading.Lock()
_budget: list[int] = []  # bytes of packed copies still allowed (set on first use)


def _charge(nbytes: int) -> bool:
    """Take nbytes from the packing budget; False (nothing taken) when they do not fit. Negative: give back."""
    with _lock:
        if not _budget:
            gib = os.environ.get("CPINFER_PACKED_GEMM_GIB")
            if gib is not None:
                total = int(float(gib) * 2**30)
            else:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
            _budget.append(total)
        if nbytes > _budget[0]:
            return False
        _budget[0] -= nbytes
        return True


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class _Copy:
    """A weight's copy in another layout (`make(weight)`, `nbytes(weight)` bytes of the budget), made on the first
    call that needs it when its bytes fit the budget (else refused for good), made again when the weight is changed in
    place or given new storage (its address, version counter and shape are checked every call), its bytes given back
    when this goes."""

    def __init__(self, make, nbytes):
        self.make, self.nbytes = make, nbytes
        self.tensor: Tensor | None = None
        self.key: tuple | None = None  # (address, version, shape) of the weight copied
        self.charged = 0  # bytes of the budget this copy holds
        self.refused = False

    def of(self, weight: Tensor) -> Tensor | None:
        """The copy of `weight`, or None: refused, or an inference tensor (one made under `torch.inference_mode`,
        whose in-place changes no version counter tells)."""
        if weight.is_inference():
            return None
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            if self.tensor is None:
                nbytes = int(self.nbytes(weight))
                if self.refused or not _charge(nbytes):
                    self.refused = True
                    return None
                self.charged = nbytes
                weakref.finalize(self, _charge, -nbytes)  # given back when this goes (or at exit: no teardown race)
            self.tensor = self.make(weight.detach().contiguous())
            self.key = key
        return self.tensor


def _tiles_bytes(weight: Tensor) -> int:  # the interleaved copy: rows rounded up to 4, columns to 16
    n, k = weight.shape
    return (n + 3) // 4 * 4 * ((k + 15) // 16 * 16) * 4


class PackedWeight:
    """One [out, in] weight's products on the CPU (see the module's docstring): cpinfer's kernel for 1-4 rows (over
    the weight's interleaved copy when it fits the budget, else the weight itself), oneDNN over a packed copy of the
    weight (made on first use) from 5 rows up to `max_rows` (None: any), else `F.linear`.

    `linear` runs once per Linear per step: a decode step's 1-4 rows take the shortest path (each test once, no
    reshape of a 2-D x; its Python had cost more than the kernel on the embedded model's smaller weights: 22 us a call
    around a 5-8 us op, now 8)."""

    def __init__(self, max_rows: int | None = None):
        self.max_rows = max_rows
        self.refused = not _available()  # no oneDNN copy (none in this torch, or past the budget)
        self.onednn = _Copy(torch.ops.mkldnn._reorder_linear_weight if not self.refused else None,
                            lambda w: w.numel() * 4 * 1.3)  # (its blocked layout)
        tiled = small_linear_tiled_ops()
        self.tiles = _Copy(tiled[0], _tiles_bytes) if tiled is not None else None  # the kernel's one-stream layout
        self._tiled = tiled[1].default if tiled is not None else None
        self._plain = small_linear_op()
        rows = small_linear_rows()  # the kernel's rows: with oneDNN's copy, without (refused)
        caps = [min(rows, ONEDNN_FROM - 1), min(rows, SMALL_ROWS)]
        self._caps = [c if max_rows is None else min(c, max_rows) for c in caps]

    @property
    def packed(self) -> Tensor | None:
        """oneDNN's packed copy, once made."""
        return self.onednn.tensor

    @property
    def charged(self) -> int:
        """Bytes of the budget oneDNN's copy holds."""
        return self.onednn.charged

    def small(self, rows: int) -> bool:
        """Whether `rows` rows go to cpinfer's kernel: up to 4 rows, or up to 16 when there is no packed copy."""
        return 1 <= rows <= self._caps[self.refused]

    def _packs(self, rows: int) -> bool:
        """Whether `rows` rows may go to oneDNN's packed copy (none refused, within max_rows)."""
        return not self.refused and 1 <= rows and (self.max_rows is None or rows <= self.max_rows)

    def takes(self, rows: int) -> bool:
        """Whether `linear` of `rows` rows (of a float32 CPU weight) runs one of the two kernels."""
        return self.small(rows) or self._packs(rows)

    def _pack(self, weight: Tensor) -> Tensor | None:
        packed = self.onednn.of(weight)
        self.refused = packed is None
        return packed

    def _small(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """cpinfer's kernel: x [rows, in] -> [rows, out], from the interleaved copy (one stream a thread; the same
        bits) when there is one."""
        tiles = None if self.tiles is None else self.tiles.of(weight)
        if tiles is None:
            return self._plain(x, weight, bias)
        return self._tiled(x, tiles, weight.shape[0], bias)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not rows or x.dtype is not _F32 or weight.dtype is not _F32 or not (x.is_cpu and weight.is_cpu) \
                or (bias is not None and bias.dtype is not _F32) \
                or (torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))):
            return F.linear(x, weight, bias)
        flat = x.dim() == 2
        if self.small(rows) and x.stride(-1) == 1 and weight.is_contiguous() \
                and (bias is None or bias.is_contiguous()):  # a decode step's rows: cpinfer's kernel
            if flat:
                return self._small(x, weight, bias)
            return self._small(x.reshape(rows, k), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
        if self._packs(rows):
            packed = self._pack(weight)
            if packed is not None:
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, k).contiguous(), packed, bias, "none", [], "")
                return out if flat else out.reshape(*x.shape[:-1], weight.shape[0])
            return self.linear(x, weight, bias)  # refused just now: the kernel takes up to 16 rows
        return F.linear(x, weight, bias)


def pack_linear(module: nn.Linear, max_rows: int | None = None) -> None:
    """`module` (a plain nn.Linear, kept as one: its type, parameters and state dict do not change) multiplies its
    rows through `PackedWeight` from now on (up to max_rows; None: any)."""
    packed = PackedWeight(max_rows)
    module._packed = packed
    params = module._parameters  # (the module's own dict: a parameter set later is seen; no __getattr__ a call)
    module.forward = lambda x: packed.linear(x, params["weight"], params["bias"])


__all__ = ["PackedWeight", "pack_linear", "ONEDNN_FROM", "SMALL_ROWS"]
