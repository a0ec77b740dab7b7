"""The affine map a run of tokens applies to a recurrent state, S_out = M · S_in + B (fp32), and its algebra.

Two shapes of M, told apart by its rank:
* a matrix per head, M [H, Dk, Dk] acting on the left of S [H, Dk, Dv] (the delta rules: GDN, KDA);
* a decay per head, M [H] scaling S [H, ...] (Mamba-2).
B always has the state's shape. The identity map is (I, 0) (or (1, 0)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Affine:
    """S -> M · S + B, fp32."""

    M: Tensor  # [H, Dk, Dk] or [H]
    B: Tensor  # the state's shape, [H, ...]

    def __iter__(self):
        """`m, b = affine` unpacks (M, B)."""
        return iter((self.M, self.B))

    @property
    def scalar(self) -> bool:
        """Whether M is a per-head decay (Mamba-2) rather than a matrix."""
        return self.M.dim() == 1

    @staticmethod
    def identity_like(state: Tensor, scalar: bool = False) -> "Affine":
        """The identity map on states shaped like `state` [H, Dk, ...] (scalar: M a per-head 1)."""
        h = state.shape[0]
        if scalar:
            m = torch.ones(h, dtype=torch.float32, device=state.device)
        else:
            dk = state.shape[1]
            m = torch.eye(dk, dtype=torch.float32, device=state.device).expand(h, dk, dk).clone()
        return Affine(m, torch.zeros(state.shape, dtype=torch.float32, device=state.device))

    def apply(self, state: Tensor) -> Tensor:
        """S [H, ...] -> M · S + B (fp32)."""
        s = state.float()
        if self.scalar:
            return self.M.view(-1, *([1] * (s.dim() - 1))) * s + self.B
        return torch.baddbmm(self.B, self.M, s) if s.dim() == 3 else self.M @ s + self.B

    def then(self, later: "Affine") -> "Affine":
        """The map of this run followed by `later`'s: S -> later(self(S)) = (Ml Ms) S + (Ml Bs + Bl)."""
        if self.scalar != later.scalar:
            raise ValueError("cannot compose a per-head decay map with a matrix map")
        if later.scalar:
            return Affine(later.M * self.M, later.apply(self.B))
        return Affine(later.M @ self.M, later.apply(self.B))

    def to_tensor(self) -> Tensor:
        """M and B flattened into one fp32 vector (what an all-gather ships)."""
        return torch.cat((self.M.reshape(-1), self.B.reshape(-1)))

    @staticmethod
    def from_tensor(flat: Tensor, m_shape: tuple, b_shape: tuple) -> "Affine":
        n = 1
        for d in m_shape:
            n *= d
        return Affine(flat[:n].view(m_shape), flat[n:].view(b_shape))


def compose(maps: Iterable[Affine]) -> Affine | None:
    """The maps of consecutive runs, in sequence order, as one map (None for no runs)."""
    out = None
    for m in maps:
        out = m if out is None else out.then(m)
    return out
