"""What differs between the paper's implementation and cpinfer's where the cost model can see it (§3.5.3, §4.3).

The planner predicts cpinfer by default; the paper's statements are checked against the paper's implementation.
Each field carries its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field


FIELDS = ("partial_bytes", "pad_decode_batch", "overlap_decode_ring", "vocab_parallel", "fp8_experts", "fp8_kv_mla",
          "fp8_kv_graphs", "mla_graphs")


@dataclass(frozen=True)
class Implementation:
    name: str
    partial_bytes: int        # element size of pass-Q's partial outputs (All2All, permute, merge); LSE is fp32
    pad_decode_batch: bool    # decode batch padded to a multiple of N, every rank computing padding queries
    overlap_decode_ring: bool  # decode's Q SendRecv overlaps the step's flash-decoding (else: one after the other)
    vocab_parallel: bool = False  # embedding and LM head split over the TP ranks (else whole on every rank)
    fp8_experts: bool = True      # routed experts of an FP8 checkpoint stay FP8 (else dequantized at load)
    fp8_kv_mla: bool = True       # an FP8 KV cache for multi-head latent attention models
    fp8_kv_graphs: bool = True    # decode under CUDA graphs with an FP8 KV cache (else eager)
    mla_graphs: bool = True       # decode under CUDA graphs for multi-head latent attention (else eager)
    sources: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.partial_bytes not in (2, 4):
            raise ValueError(f"implementation {self.name!r}: partial_bytes must be 2 or 4, got {self.partial_bytes}")
        missing = [f for f in FIELDS if f not in self.sources]
        if missing:
            raise ValueError(f"implementation {self.name!r}: no source for {missing}")


PAPER = Implementation(
    "paper", partial_bytes=2, pad_decode_batch=True, overlap_decode_ring=False, vocab_parallel=True,
    fp8_experts=True, fp8_kv_mla=True, fp8_kv_graphs=True, mla_graphs=True, sources=dict(
        partial_bytes="App. C: the All2All moves (D + 1) * T * e bytes, bf16 outputs (FA3) with their LSE",
        pad_decode_batch="§4.3 (1): 'pads the number of queries to make it divisible by the number of ranks'",
        overlap_decode_ring="§4.3: 'better overlap of computation and communication can help to minimize this "
                            "regression' (decode's Q SendRecv is not overlapped)",
        vocab_parallel="assumption: Megatron-style vocabulary-parallel embedding and LM head (not stated)",
        fp8_experts="not applicable: the paper serves a dense model (§4.1); FP8 weights run FP8",
        fp8_kv_mla="not applicable: the paper's model has no latent attention",
        fp8_kv_graphs="not applicable: the paper's KV cache is bf16 and decode runs under CUDA graphs (§4.3)",
        mla_graphs="not applicable: the paper's model has no latent attention"))

CPINFER = Implementation(
    "cpinfer", partial_bytes=4, pad_decode_batch=False, overlap_decode_ring=True, vocab_parallel=False,
    fp8_experts=False, fp8_kv_mla=True, fp8_kv_graphs=False, mla_graphs=True, sources=dict(
        partial_bytes="cpinfer/engine/attention.py: partials are fp32 [out | lse] (DESIGN.md, Numerics)",
        pad_decode_batch="cpinfer/engine/attention.py: a ring step with no query of its source computes nothing; "
                         "only messages are padded to the fullest rank",
        overlap_decode_ring="cpinfer/cp/ring.py: the next block's send/recv is posted before the step computes",
        vocab_parallel="cpinfer/tensor_parallel.py: the embedding and LM head are whole on every TP rank",
        fp8_experts="cpinfer/model/loader.py: only nn.Linear weights stay FP8; the stacked routed experts are "
                    "dequantized to the compute dtype at load",
        fp8_kv_mla="cpinfer/engine/kv/fp8.py: MLA's latent row in e4m3 with static scales (kv_cache_dtype 'fp8'; "
                   "the per-token format is refused for MLA)",
        fp8_kv_graphs="cpinfer/engine/startup.py decode_config: with an FP8 KV cache decode runs the dynamic "
                      "eager path, no CUDA graphs",
        mla_graphs="cpinfer/engine/decode_graph.py: the static decode path (CUDA graphs) runs MLA with the latent "
                   "keys as values and keeps the output's first kv_lora_rank channels"))

IMPLEMENTATIONS = {"cpinfer": CPINFER, "paper": PAPER}


def load_implementation(name) -> Implementation:
    if isinstance(name, Implementation):
        return name
    key = str(name).strip().lower()
    if key not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}: known are {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[key]
