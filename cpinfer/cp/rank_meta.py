"""One rank's metadata in a `cp_attention` plan: its queries' and keys' labels and positions, and the K/V rows
that travel. Below both the plan (which builds them) and the routes (which read them)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RankMeta:
    """One rank's metadata. q_*: its queries; kv_*: its whole local K/V; send: rows of K/V that travel."""

    q_seq: np.ndarray
    q_pos: np.ndarray
    kv_seq: np.ndarray
    kv_pos: np.ndarray
    send: np.ndarray  # indices into the local K/V of rows that can matter to some query (packed for sending)
    kv_end: np.ndarray | None = None  # end of each key's interval [kv_seq, kv_end); None → kv_seq + 1

    def __post_init__(self):
        if self.kv_end is None:
            object.__setattr__(self, "kv_end", self.kv_seq + 1)
