"""Linears of one input as one GEMM (issue 51): a layer's q / k / v projections, an MLP's gate / up projections.

`FusedLinears` concatenates the weights (and biases) of plain `nn.Linear`s that read the same input into one tensor
and makes each module's parameters views of it, so the modules, their names and the state dict stay as they were
(a `copy_` into a parameter writes the fused tensor) and no memory is doubled. One `F.linear` then gives every
output side by side ([L, sum of out_features]); `split` hands each module's columns as views. Each column of a GEMM
is the same dot products as in the separate GEMMs. On the CPU this is one call instead of two or three per layer
(fewer thread fork/joins and dispatches, and a wider GEMM: a 192-column k / v projection runs far below the GEMM
rate alone).

A module replaced afterwards, or a parameter given new storage (`module.to(...)`, a new `Parameter`, `.data = ...`),
ends the fusion: `valid()` checks the owner's modules and every parameter's address against the fused tensor's
pieces, and the layer falls back to its separate Linears.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from cpinfer.model.cpu_gemm import PackedWeight


class FusedLinears:
    def __init__(self, owner: nn.Module, names: list[str]):
        self.owner, self.names = owner, list(names)
        self.linears = [getattr(owner, n) for n in self.names]
        self.sizes = [m.out_features for m in self.linears]
        self.weight = torch.cat([m.weight.detach() for m in self.linears])  # [sum out, in]
        has_bias = self.linears[0].bias is not None
        self.bias = torch.cat([m.bias.detach() for m in self.linears]) if has_bias else None
        for m, w in zip(self.linears, self.weight.split(self.sizes)):
            m.weight.data = w
        if self.bias is not None:
            for m, b in zip(self.linears, self.bias.split(self.sizes)):
                m.bias.data = b
        self._ptrs = self._addresses()
        self.packed = PackedWeight()  # the CPU's product (`cpu_gemm.py`): our kernel or oneDNN's

    @staticmethod
    def fusable(linears: list[nn.Module | None]) -> bool:
        """Plain Linears (not a TP-sliced or quantized subclass) of one input size, dtype and device, all with a
        bias or none."""
        if any(type(m) is not nn.Linear for m in linears):
            return False
        w0 = linears[0].weight
        return all(m.in_features == linears[0].in_features and m.weight.dtype == w0.dtype
                   and m.weight.device == w0.device and (m.bias is None) == (linears[0].bias is None)
                   and (m.bias is None or m.bias.dtype == w0.dtype) for m in linears)

    def _addresses(self) -> list[int]:
        params = [m._parameters for m in self.linears]  # (not through nn.Module's __getattr__: once a step a layer)
        return [p["weight"].data_ptr() for p in params] + \
            ([] if self.bias is None else [p["bias"].data_ptr() for p in params])

    def valid(self) -> bool:
        """The owner still holds the same modules, and their parameters are still views of the fused tensors."""
        modules = self.owner._modules
        try:
            return all(modules.get(n) is m for n, m in zip(self.names, self.linears)) \
                and self._addresses() == self._ptrs
        except (KeyError, AttributeError):  # a parameter deleted or set to None
            return False

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x [L, in] -> each Linear's output [L, out_i], views of one [L, sum out] GEMM result."""
        return self.packed.linear(x, self.weight, self.bias).split_with_sizes(self.sizes, dim=-1)
