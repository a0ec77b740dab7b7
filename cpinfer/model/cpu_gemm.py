"""Small-batch GEMMs on the CPU through MKL's packed weights (`torch.ops.mkl._mkl_linear`).

A decode step multiplies every weight by a few rows (one per running sequence). For 4 to 32 rows MKL's plain sgemm
(what `F.linear` calls) runs far below both the memory and the compute limit; with the weight packed once into
MKL's internal layout (`cblas_sgemm_pack`, via `torch.ops.mkl._mkl_reorder_linear_weight`) the same products take
0.6-0.8x the time (the 30 layers of SmolLM2-135M at 4 rows: 35 -> 21 ms; at 16 rows: 48 -> 37 ms, on 2 threads).
From 16 rows on the result is bit-identical to `F.linear` (the same sgemm kernel); below, it differs from the
few-row kernel `F.linear` picks there by float32 rounding, as two batch sizes already do. Outside that range, and
for a weight MKL cannot take (not float32 on the CPU), `F.linear` runs as before.

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

MIN_ROWS, MAX_ROWS = 4, 32  # rows of x where the packed weight wins (measured: 3 rows and 48 lose)
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
    """MKL's packed copy of one [out, in] weight, made on first use; `linear` falls back to `F.linear`."""

    def __init__(self, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS):
        self.min_rows, self.max_rows = min_rows, max_rows
        self.packed: Tensor | None = None
        self.key: tuple | None = None  # (address, version, shape) of the weight packed
        self.refused = not _available()

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.refused or not self.min_rows <= rows <= self.max_rows or x.dtype != torch.float32 \
                or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu" \
                or (weight.requires_grad and torch.is_grad_enabled()) \
                or (bias is not None and bias.dtype != torch.float32):
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
    """`module` (a plain nn.Linear, kept as one: its type, parameters and state dict do not change) multiplies
    min_rows to max_rows rows through a packed copy of its weight from now on."""
    packed = PackedWeight(min_rows, max_rows)
    module._packed = packed
    module.forward = lambda x: packed.linear(x, module.weight, module.bias)


__all__ = ["PackedWeight", "pack_linear", "MIN_ROWS", "MAX_ROWS"]
