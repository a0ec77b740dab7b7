"""Small-batch GEMMs on the CPU: a decode step's few rows times every weight.

A decode step multiplies every weight by a few rows (one per running sequence): a stream of the weight from memory.
MKL's matrix-vector and short-M kernels (what `F.linear` calls there) stream it at a fraction of the memory's rate
on some CPUs (7-10 GB/s of ~26 on the AMD EPYC of docs/benchmarks.md), so:
- **1 to 16 rows** (`SMALL_ROWS`; 1 row on a CPU without AVX-512): cpinfer's kernel (`attention/cpu_linear.cpp`, `torch.ops.cpinfer.small_linear`):
  each thread streams its share of the weight's rows once against the rows of x held in cache (the 30 layers of
  SmolLM2-135M plus its LM head at 1 row: 54 -> 29 ms; at 4 rows: 78 -> 34 ms; at 16: 80 -> 60 ms, on 2 threads).
  A row's result does not depend on the batch it is in (the same sum in the same order whatever the rows beside
  it); it differs from `F.linear`'s by float32 rounding (another order of the same products).
- **17 to 32 rows** (up to `max_rows`): MKL's packed weights (`torch.ops.mkl._mkl_linear`): with the weight packed
  once into MKL's internal layout (`cblas_sgemm_pack`, via `torch.ops.mkl._mkl_reorder_linear_weight`) the same
  products take 0.6-0.8x the time of `F.linear`, bit-identical to it from 16 rows on (the same sgemm kernel).
Outside those, for a weight neither can take (not float32 on the CPU, not contiguous), where a gradient is wanted,
or without a compiled kernel library (`CPINFER_CPU_KERNELS=0`, no compiler: MKL's packed weights from `min_rows`),
`F.linear` runs as before.

A packed copy costs ~1.3x its weight's memory, made on the first call in range and bounded in all to
`CPINFER_PACKED_GEMM_GIB` (default: an eighth of the machine's memory; 0 turns packing off). A weight changed in
place or given new storage afterwards is packed again (its version counter and address are checked every call).
"""
from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.attention.cpu_kernels import small_linear_op, small_linear_rows

MIN_ROWS, MAX_ROWS = 4, 32  # rows of x where MKL's packed weight wins over F.linear (measured: 3 rows and 48 lose)
SMALL_ROWS = 16  # up to this many rows: cpinfer's kernel (`cpu_linear.cpp`), faster than both at every count
_lock = threading.Lock()
_budget: list[int] = []  # bytes of packed copies still allowed (set on first use)


def _packing_allowed(nbytes: int) -> bool:
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
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedWeight:
    """A weight's few-row product: cpinfer's kernel for 1 to `SMALL_ROWS` rows, MKL's packed copy of the [out, in]
    weight (made on first use) from there to `max_rows`; `linear` falls back to `F.linear`."""

    def __init__(self, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS):
        self.min_rows, self.max_rows = min_rows, max_rows
        self.packed: Tensor | None = None
        self.key: tuple | None = None  # (address, version, shape) of the weight packed
        self.refused = not _available()

    def small(self, rows: int) -> bool:
        """Whether `rows` rows go to cpinfer's kernel (up to `SMALL_ROWS`, `max_rows` and what the build is best at)."""
        return 1 <= rows <= min(SMALL_ROWS, self.max_rows, small_linear_rows())

    def takes(self, rows: int) -> bool:
        """Whether `linear` of `rows` rows (of a float32 CPU weight) runs one of the two kernels."""
        return self.small(rows) or (not self.refused and self.min_rows <= rows <= self.max_rows)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not rows or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
                or weight.device.type != "cpu" or (weight.requires_grad and torch.is_grad_enabled()) \
                or (bias is not None and bias.dtype != torch.float32):
            return F.linear(x, weight, bias)
        if self.small(rows) and weight.is_contiguous() and x.stride(-1) == 1 and (bias is None or bias.is_contiguous()):
            out = small_linear_op()(x.reshape(rows, x.shape[-1]), weight, bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        if self.refused or not self.min_rows <= rows <= self.max_rows:
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self.key:
            if self.packed is None and not _packing_allowed(int(weight.numel() * 4 * 1.3)):
                self.refused = True
                return F.linear(x, weight, bias)
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), 16)
            self.key = key
        x2 = x.reshape(rows, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(x2, self.packed, weight, bias, rows)
        return out.reshape(*x.shape[:-1], weight.shape[0])


def pack_linear(module: nn.Linear, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS) -> None:
    """`module` (a plain nn.Linear, kept as one: its type, parameters and state dict do not change) multiplies 1 to
    max_rows rows through `PackedWeight` from now on: cpinfer's kernel up to `SMALL_ROWS`, MKL's packed copy of its
    weight from there (or from min_rows without the kernel)."""
    packed = PackedWeight(min_rows, max_rows)
    module._packed = packed
    module.forward = lambda x: packed.linear(x, module.weight, module.bias)


__all__ = ["PackedWeight", "pack_linear", "MIN_ROWS", "MAX_ROWS", "SMALL_ROWS"]
