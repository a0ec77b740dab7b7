"""Predicted time of one layer of context-parallel attention: the ring's kernels and transfers, pass-Q's All2All and
the merge (paper §3.4, §3.5, App. B, App. C). The one cost model the pass-KV / pass-Q heuristic (`heuristics.py`),
the planner (`cpinfer/perf/`) and the engine share; pure Python, no torch, microseconds per call.

API for callers that decide per forward (the heuristic; the KV manager weighing "spread T new tokens over N ranks"
against "keep them on one rank"):

    predict_attention(hw, shape, new=T, cached=P, ranks=N, tp=1, layers=L, window=W, window_layers=Lw)
        -> AttentionPrediction(seconds, strategy, per_layer)   # best of pass-KV / pass-Q; ranks=1 is local

`hw` is any object with the hardware-profile fields of `Rates` (a `cpinfer.perf.HardwareProfile` is one); `shape`
is an `AttnShape` of the heads ONE device holds. The seconds cover attention and ring only: the GEMMs a spread
saves scale with the tokens per rank and are the planner's (`cpinfer.perf.simulator.gemm_layer`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from cpinfer.cp.ring_shape import RingShape

STRATEGIES = ("pass-kv", "pass-q")
LSE_BYTES = 4  # the log-sum-exp of a partial output is kept in fp32 (App. B; FA3 returns it in fp32)


class Rates(Protocol):
    """The hardware-profile fields this model reads (units in `cpinfer.perf.hardware_profile.UNITS`)."""
    attn_tflops: float
    attn_ref_tokens: float
    attn_overhead_tokens: float
    mem_tbps: float
    mem_efficiency: float
    devices_per_node: int
    intra_gbs: float
    intra_latency_us: float
    inter_gbs: float
    inter_gbs_peak: float
    inter_latency_us: float
    ring_step_us: float
    comm_overlap: float


class Link(NamedTuple):
    bandwidth: float  # bytes/s one peer-to-peer flow achieves (a ring SendRecv)
    latency: float    # s per message
    aggregate: float  # bytes/s all concurrent flows of one device share (its NIC / NVLink port)


def attention_rate(hw: Rates) -> float:
    """A_inf, flop/s on long blocks: with a fixed cost of L0 keys per query row, a causal square of L tokens runs at
    A_inf * (L/2) / (L/2 + L0); A_inf is chosen so that L = attn_ref_tokens gives attn_tflops."""
    half = hw.attn_ref_tokens / 2
    return hw.attn_tflops * 1e12 * (half + hw.attn_overhead_tokens) / half


def memory_rate(hw: Rates) -> float:
    return hw.mem_tbps * 1e12 * hw.mem_efficiency


def ring_link(hw: Rates, cp: int, tp: int = 1) -> Link:
    """The slowest hop of a CP ring of `cp` ranks, each a TP group of `tp` devices: NVLink when the whole ring
    fits one node, else the network (achieved SendRecv rate per flow; the NIC's line rate shared by all flows)."""
    if cp * tp > hw.devices_per_node:
        return Link(hw.inter_gbs * 1e9, hw.inter_latency_us * 1e-6, hw.inter_gbs_peak * 1e9)
    return Link(hw.intra_gbs * 1e9, hw.intra_latency_us * 1e-6, hw.intra_gbs * 1e9)


@dataclass(frozen=True)
class AttnShape:
    """Attention heads one device holds (after TP sharding) and the element sizes of Q/K/V/O and of the partial
    outputs pass-Q sends back (cpinfer sends fp32 out | lse; the paper's kernels bf16 out + fp32 lse)."""
    heads: int              # query heads per device
    kv_heads: int           # KV heads per device
    head_dim: int
    elem_bytes: int         # Q, K, V, O activations
    partial_bytes: int = 4  # partial outputs in pass-Q's All2All and the merge
    kv_parts: int = 2       # K and V per KV head; 1 when the values are the keys' first channels (MLA's latent)
    kv_row_bytes: int = 0   # one K or V row of one head as cached and sent (FP8 KV: D + 4); 0: D * elem_bytes
    pair_dim: int = 0       # FLOPs per visible (query, key) pair and head / 4; 0: head_dim. MLA's expanded prefill:
    # (qk_nope + qk_rope + v) / 2 over the latent rows it carries (head_dim stays the latent's width, for bytes)
    expand_flops: float = 0.0  # MLA's expanded prefill: FLOPs to up-project one latent row for this device's heads

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "elem_bytes", "partial_bytes", "kv_parts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"attention shape: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"attention shape: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}) for grouped-query attention")

    def q_bytes(self, tokens: float) -> float:       # Q (or O) of `tokens` queries
        return tokens * self.heads * self.head_dim * self.elem_bytes

    def kv_bytes(self, tokens: float) -> float:      # K and V of `tokens` keys (MLA: the latent rows alone)
        return self.kv_parts * tokens * self.kv_heads * (self.kv_row_bytes or self.head_dim * self.elem_bytes)

    def partial_out_bytes(self, tokens: float) -> float:  # a partial output plus its LSE (App. C: (D + 1) per head)
        return tokens * self.heads * (self.head_dim * self.partial_bytes + LSE_BYTES)


# ------------------------------------------------------------------------------------------- primitives
def attention_time(hw: Rates, shape: AttnShape, pairs: float, lq: float, lkv: float) -> float:
    """One prefill attention kernel: `pairs` visible (query, key) pairs of lq queries against lkv keys.

    FLOPs = 4 * pairs * head_dim * heads (QK^T and PV, paper Table 3, App. A; `pair_dim` instead of head_dim when
    set). Each query row pays L0 keys' worth of fixed work (attn_overhead_tokens), so short blocks run slower; or
    the Q/K/V/O traffic, if longer.
    """
    if pairs <= 0:
        return 0.0
    work = 4.0 * (pairs + lq * hw.attn_overhead_tokens) * (shape.pair_dim or shape.head_dim) * shape.heads
    traffic = 2 * shape.q_bytes(lq) + shape.kv_bytes(lkv)  # read Q, K, V; write O
    return max(work / attention_rate(hw), traffic / memory_rate(hw))


def p2p_time(nbytes: float, link: Link) -> float:
    """One SendRecv of nbytes (both directions at once): latency + bytes / bandwidth."""
    return link.latency + nbytes / link.bandwidth if nbytes > 0 else 0.0


def all2all_time(bytes_per_peer: float, n: int, link: Link) -> float:
    """All2All over n ranks as NCCL runs it, every peer's send and receive posted at once (App. C's All2All): the
    n-1 messages' latencies one after another (one proxy posts them), their bytes concurrently, each flow at most
    the SendRecv rate and all of them within the device's aggregate link rate."""
    if n <= 1 or bytes_per_peer <= 0:
        return 0.0
    streaming = max(bytes_per_peer / link.bandwidth, (n - 1) * bytes_per_peer / link.aggregate)
    return (n - 1) * link.latency + streaming


def merge_time(hw: Rates, shape: AttnShape, lq: float, parts: int) -> float:
    """Merge `parts` partial outputs (App. B): read each and its LSE, write the output once; memory-bound."""
    if parts <= 1:
        return 0.0
    return (parts * shape.partial_out_bytes(lq) + shape.q_bytes(lq)) / memory_rate(hw)


def permute_time(hw: Rates, shape: AttnShape, lq: float, parts: int) -> float:
    """Alg. 3/4's "permute" before the All2All: the parts-1 outgoing partial outputs copied into the send buffer."""
    if parts <= 1:
        return 0.0
    return 2 * (parts - 1) * shape.partial_out_bytes(lq) / memory_rate(hw)


# ------------------------------------------------------------------------------------------- one layer
@dataclass(frozen=True)
class RingCost:
    """Seconds of one layer's ring attention on the slowest rank, by component."""
    strategy: str
    attention: float           # the kernels of every ring step (each step: its slowest rank)
    sendrecv_exposed: float    # transfer time not hidden under the step's attention
    ring_steps: float          # fixed cost per ring step that runs
    all2all: float             # pass-Q: partial outputs back to their queries' ranks
    merge: float               # merge of the N partials (and pass-Q's permute)
    step_sendrecv: float       # one step's transfer
    step_attention_max: float  # the longest step's attention
    message_bytes: float       # one step's message
    steps_run: int             # ring steps with work (a windowed layer skips trailing empty ones)

    @property
    def total(self) -> float:
        return self.attention + self.sendrecv_exposed + self.ring_steps + self.all2all + self.merge


def ring_cost(hw: Rates, shape: AttnShape, ring: RingShape, strategy: str, *, batch: int = 1,
              tp: int = 1) -> RingCost:
    """One layer of ring attention (eager prefill) for `batch` sequences shaped like `ring`, on the slowest rank.

    Step j: every rank computes its block while the next block travels; the transfer progresses during
    comm_overlap of the step's compute, so exposed = max(0, transfer - comm_overlap * compute); each step that
    runs adds ring_step_us. Steps after the last one with a visible key (windowed layers) are skipped, no
    message either. pass-KV sends the longest rank's K/V (Alg. 2 pads to it), pass-Q the Q block, then All2All's
    the partial outputs of the other ranks' queries back and permutes / merges them (Alg. 3).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    n, lq = ring.n, batch * ring.q_tokens
    lkv = batch * ring.max_kv_tokens
    compute = [attention_time(hw, shape, batch * ring.step_pairs(j), lq, lkv) for j in range(n)]
    last = max((j for j in range(n) if compute[j] > 0), default=0)
    if shape.expand_flops:  # MLA expanded: pass-KV up-projects each block it attends, pass-Q its own rows once
        up = shape.expand_flops * lkv / attention_rate(hw)
        compute = [c + up if c > 0 and (strategy == "pass-kv" or j == 0) else c for j, c in enumerate(compute)]
    link = ring_link(hw, n, tp)
    msg = (shape.kv_bytes(lkv) if strategy == "pass-kv" else shape.q_bytes(lq)) if last > 0 else 0.0
    comm = p2p_time(msg, link)
    exposed = sum(max(0.0, comm - hw.comm_overlap * compute[j]) for j in range(last))
    parts = last + 1 if strategy == "pass-kv" else n  # pass-Q returns every rank's partial (zeros if empty)
    merge = merge_time(hw, shape, lq, parts)
    a2a = 0.0
    if strategy == "pass-q" and n > 1:
        a2a = all2all_time(shape.partial_out_bytes(lq), n, link)
        merge += permute_time(hw, shape, lq, n)
    steps = (last + 1) * hw.ring_step_us * 1e-6 if n > 1 else 0.0
    return RingCost(strategy, sum(compute), exposed, steps, a2a, merge, comm, max(compute), msg, last + 1)


# ------------------------------------------------------------------------------------------- a forward
@dataclass(frozen=True)
class AttentionPrediction:
    seconds: float   # attention + ring of the whole forward (every layer), the chosen strategy
    strategy: str    # "pass-kv" | "pass-q" (ranks == 1: "local")
    per_layer: dict  # strategy -> {"full": RingCost, "window": RingCost | None, "chunk": RingCost | None}


def predict_attention(hw: Rates, shape: AttnShape, *, new: int, cached: int, ranks: int, tp: int = 1,
                      layers: int = 1, window: int = 0, window_layers: int = 0, batch: int = 1,
                      strategy: str = "best", chunk: int = 0, chunk_layers: int = 0) -> AttentionPrediction:
    """Attention + ring time of one forward: `batch` sequences of `new` tokens after `cached` ones, spread over
    `ranks` CP ranks (load-balanced, §3.5.1), `layers` layers of which `window_layers` use a sliding `window` and
    `chunk_layers` chunked attention of `chunk` positions (Llama 4). strategy "best" takes the faster of pass-KV /
    pass-Q (what an ideal heuristic would pick)."""
    if not 0 <= window_layers + chunk_layers <= layers or min(window_layers, chunk_layers) < 0:
        raise ValueError(f"window_layers + chunk_layers must be in [0, layers={layers}], got {window_layers} + "
                         f"{chunk_layers}")
    if window_layers and window <= 0:
        raise ValueError("window_layers > 0 needs a positive window")
    if chunk_layers and chunk <= 0:
        raise ValueError("chunk_layers > 0 needs a positive chunk")
    choices = STRATEGIES if strategy == "best" else (strategy,)
    per_layer, totals = {}, {}
    for s in choices:
        full = ring_cost(hw, shape, RingShape(ranks, new, cached), s, batch=batch, tp=tp)
        win = ring_cost(hw, shape, RingShape(ranks, new, cached, window), s, batch=batch, tp=tp) \
            if window_layers else None
        chk = ring_cost(hw, shape, RingShape(ranks, new, cached, attention_chunk=chunk), s, batch=batch, tp=tp) \
            if chunk_layers else None
        per_layer[s] = {"full": full, "window": win, "chunk": chk}
        totals[s] = ((layers - window_layers - chunk_layers) * full.total + (window_layers * win.total if win else 0.0)
                     + (chunk_layers * chk.total if chk else 0.0))
    best = min(choices, key=lambda s: (totals[s], s != "pass-kv"))  # pass-KV on ties
    return AttentionPrediction(totals[best], "local" if ranks == 1 else best, per_layer)
