"""The recurrence inputs both delta rules take: Gated DeltaNet (`gdn.py`) and Kimi Delta Attention (`kda.py`)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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
