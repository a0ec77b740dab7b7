"""What differs between the paper's implementation and cpinfer's where the cost model can see it (§3.5.3, §4.3).

The planner predicts cpinfer by default; the paper's statements are checked against the paper's implementation.
Each field carries its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Implementation:
    name: str
    partial_bytes: int        # element size of pass-Q's partial outputs (All2All, permute, merge); LSE is fp32
    pad_decode_batch: bool    # decode batch padded to a multiple of N, every rank computing padding queries
    overlap_decode_ring: bool  # decode's Q SendRecv overlaps the step's flash-decoding (else: one after the other)
    sources: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.partial_bytes not in (2, 4):
            raise ValueError(f"implementation {self.name!r}: partial_bytes must be 2 or 4, got {self.partial_bytes}")
        missing = [f for f in ("partial_bytes", "pad_decode_batch", "overlap_decode_ring") if f not in self.sources]
        if missing:
            raise ValueError(f"implementation {self.name!r}: no source for {missing}")


PAPER = Implementation(
    "paper", partial_bytes=2, pad_decode_batch=True, overlap_decode_ring=False, sources=dict(
        partial_bytes="App. C: the All2All moves (D + 1) * T * e bytes, bf16 outputs (FA3) with their LSE",
        pad_decode_batch="§4.3 (1): 'pads the number of queries to make it divisible by the number of ranks'",
        overlap_decode_ring="§4.3: 'better overlap of computation and communication can help to minimize this "
                            "regression' (decode's Q SendRecv is not overlapped)"))

CPINFER = Implementation(
    "cpinfer", partial_bytes=4, pad_decode_batch=False, overlap_decode_ring=True, sources=dict(
        partial_bytes="cpinfer/engine/attention.py: partials are fp32 [out | lse] (DESIGN.md, Numerics)",
        pad_decode_batch="cpinfer/engine/attention.py: a ring step with no query of its source computes nothing; "
                         "only messages are padded to the fullest rank",
        overlap_decode_ring="cpinfer/cp/ring.py: the next block's send/recv is posted before the step computes"))

IMPLEMENTATIONS = {"cpinfer": CPINFER, "paper": PAPER}


def load_implementation(name) -> Implementation:
    if isinstance(name, Implementation):
        return name
    key = str(name).strip().lower()
    if key not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}: known are {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[key]
