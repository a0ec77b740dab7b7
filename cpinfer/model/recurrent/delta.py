"""The recurrence inputs both delta rules take: Gated DeltaNet (`gdn.py`) and Kimi Delta Attention (`kda.py`)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

TINY = 2.0 ** -64  # an augmented state's entries below this (5e-20) are set to 0 (`drop_tiny_`)


def drop_tiny_(s: Tensor) -> Tensor:
    """s with its entries below 2^-64 set to 0, in place: a delta rule's summary state (augmented by an identity
    block that decays as exp(sum g)) would otherwise fall into float32's denormals (below 2^-126), where every
    multiply is ~100x slower. The margin is for the next chunk's products, which scale an entry by that chunk's
    decays: with 2^-100 they still reached the denormals (an augmented pass 1.7x a plain run at 8 heads x 64, 2.5x
    at 16 x 128; with 2^-64 1.1x and 1.5x). What the dropped entries would add to a state is below 1e-17 of it."""
    return s.masked_fill_(s.abs() < TINY, 0.0)


@dataclass(frozen=True)
class DeltaInputs:
    """One run's recurrence inputs, fp32: q [T, H, Dk] (L2-normalised, scaled by Dk^-1/2), k [T, H, Dk]
    (L2-normalised), v [T, H, Dv], g the log decay (<= 0; Gated DeltaNet [T, H], one per head, its key heads
    repeated to the value heads; KDA [T, H, Dk], one per key channel), beta [T, H]."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor

    def __len__(self) -> int:
        return self.q.shape[0]

    def __getitem__(self, s: slice) -> "DeltaInputs":
        return DeltaInputs(self.q[s], self.k[s], self.v[s], self.g[s], self.beta[s])
