"""Kernel calls of a local attention plan (`AttnItem`: FULL blocks, top-left CAUSAL squares, small MASK tiles) and
their execution one call each into a running fp32 partial (paper App. B merge). The bottom of the attention
package: it imports only `merge.py`, so planning (`local.py`), tile tables and backends all build on it.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cpinfer.attention.merge import merge_into

FULL, CAUSAL, MASK = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class AttnItem:
    """One kernel call: queries [q0, q1) against keys [k0, k1); `mask` [q1-q0, k1-k0] bool only for MASK."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: int
    mask: Tensor | None = None
    first: bool = False  # no earlier item of this plan touched these query rows: store instead of merge


class AttentionBackend(Protocol):
    """A per-item kernel (`kernels.py`): one FULL / CAUSAL / MASK block → its partial."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None,
                 scale: float) -> tuple[Tensor, Tensor]:
        """q [Lq, H, D], k/v [Lk, Hkv, D] → out [Lq, H, D], lse [Lq, H] (natural log, fp32)."""


def mark_first(items: list[AttnItem], n_rows: int, covered: np.ndarray | None = None) -> list[AttnItem]:
    """Flag items whose query rows no earlier item touched (`covered` carries coverage across plans)."""
    covered = np.zeros(n_rows, dtype=bool) if covered is None else covered
    out = []
    for it in items:
        first = not covered[it.q0:it.q1].any()
        covered[it.q0:it.q1] = True
        out.append(dataclasses.replace(it, first=first))
    return out


def new_accumulator(lq: int, h: int, d: int, device) -> tuple[Tensor, Tensor]:
    """Empty partial: out zeros [Lq, H, D] fp32, lse -inf [Lq, H] fp32."""
    return (torch.zeros(lq, h, d, dtype=torch.float32, device=device),
            torch.full((lq, h), -torch.inf, dtype=torch.float32, device=device))


def run_items(items: list[AttnItem], q: Tensor, k: Tensor, v: Tensor, acc_out: Tensor, acc_lse: Tensor,
              scale: float, backend: AttentionBackend) -> None:
    """Accumulate the plan's partial attention into (acc_out [Lq, H, D] fp32, acc_lse [Lq, H] fp32) in place."""
    for it in items:
        out, lse = backend(q[it.q0:it.q1], k[it.k0:it.k1], v[it.k0:it.k1], it.kind == CAUSAL, it.mask, scale)
        if it.first:
            acc_out[it.q0:it.q1] = out
            acc_lse[it.q0:it.q1] = lse
        else:
            merge_into(acc_out[it.q0:it.q1], acc_lse[it.q0:it.q1], out, lse)
