"""Adaptive placement: over how many CP ranks a sequence's new tokens go (1 or N), per sequence and per forward.

Spreading a prefill over the N ranks (2N-chunk sharding, §3.5.1) divides its compute but makes every forward of
that sequence run the ring (per-layer SendRecv / All2All latency, which dominates on gloo); one rank costs no
communication. The choice compares both predicted costs from the performance model (`perf.costs`, the engine's
hardware profile); `shard` and `local` force one side. The KV manager asks, then places the tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from cpinfer.perf import costs
from cpinfer.perf.costs import AttnShape
from cpinfer.perf.hardware import HardwareProfile
from cpinfer.perf.models import ModelSpec, load_weight_format, model_spec_from_hf_config
from cpinfer.perf.simulator import Deployment, gemm_layer
from cpinfer.utils import ceil_div

PLACEMENTS = ("auto", "shard", "local")
UNPLACED, SPREAD = -1, -2  # a sequence's home besides a rank: no keys yet / keys on more than one rank


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted seconds of one sequence's share of a forward: compute on its busiest rank, and the ring."""

    compute_s: float
    ring_latency_s: float = 0.0  # paid once per forward that runs a ring (shared by every spread sequence)
    ring_bytes_s: float = 0.0    # this sequence's own message bytes

    @property
    def total_s(self) -> float:
        return self.compute_s + self.ring_latency_s + self.ring_bytes_s


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The model shape, hardware profile and CP size the costs are predicted for.

    compute_share: the fraction of the profile's compute one rank gets (CPU ranks share the machine's cores: a
    rank with 1 of 2 cores runs at half the profile's rate); 1 on GPUs.
    """

    spec: ModelSpec
    hardware: HardwareProfile
    n: int
    tp: int = 1
    elem_bytes: int = 4
    compute_share: float = 1.0

    def __post_init__(self):
        if not 0 < self.compute_share <= 1:
            raise ValueError(f"compute_share must be in (0, 1], got {self.compute_share}")

    @classmethod
    def for_model(cls, config, hardware: HardwareProfile, n: int, tp: int = 1, elem_bytes: int = 4,
                  compute_share: float = 1.0) -> "CostModel":
        """From a `ModelConfig` (the engine's model)."""
        spec = model_spec_from_hf_config(dict(
            hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
            num_hidden_layers=config.num_hidden_layers, intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings), "engine model", "config")
        return cls(spec, hardware, n, tp, elem_bytes, compute_share)

    @functools.cached_property
    def shape(self) -> AttnShape:
        return AttnShape(self.spec.n_heads // self.tp, self.spec.kv_heads_per_gpu(self.tp), self.spec.head_dim,
                         self.elem_bytes)

    @functools.cached_property
    def deployment(self) -> Deployment:
        weights = load_weight_format({4: "fp32", 2: "bf16"}.get(self.elem_bytes, "bf16"))
        return Deployment(self.spec, self.hardware, 1, self.tp, weights, self.elem_bytes, self.elem_bytes)

    @functools.cached_property
    def link(self) -> tuple[float, float]:
        """(bytes/s, latency s) of one ring hop."""
        return self.hardware.ring_link(self.n, self.tp)


def sequence_cost(m: CostModel, t: int, p: int, span: int, p_max: int | None = None) -> Cost:
    """Predicted cost of t new tokens of one sequence after p cached keys, the new tokens over `span` ranks.

    span 1: everything on one rank, no ring. span N: the new tokens 2N-sharded; `p_max` (default p / span) is the
    most cached keys on one rank. A prefill takes the cheaper of pass-KV (keys travel; each rank attends its queries
    to every key) and pass-Q (queries travel to the keys; partial outputs come back by one All2All), as the strategy
    heuristic would; a decode token (t == 1) takes pass-Q decode. This is the one function the placement asks
    (re-point it to the shared cost model); the rest is arithmetic on its answers.
    """
    if t <= 0:
        return Cost(0.0)
    hw, shape, layers, share = m.hardware, m.shape, m.spec.n_layers, m.compute_share
    rows = ceil_div(t, span)  # the busiest rank's new tokens
    gemm = gemm_layer(m.deployment, rows) / share
    if span == 1:
        return Cost(layers * (gemm + _attention(hw, shape, t, p, p + t) / share))
    p_max = ceil_div(p, span) if p_max is None else p_max
    (bandwidth, latency), steps = m.link, span * hw.ring_step_us * 1e-6
    latency_q = steps + 2 * (span - 1) * latency  # Q around the ring, then the All2All of the partials
    bytes_q = (span - 1) * shape.q_bytes(rows) / bandwidth + \
        max(0.0, costs.all2all_time(shape.partial_out_bytes(rows), span, m.link) - (span - 1) * latency)
    if t == 1:  # decode: one query visits every rank; the busiest holds p_max + 1 keys
        attn = costs.decode_attention_time(hw, shape, 1, p_max + 1) / share
        return Cost(layers * (gemm + attn), layers * latency_q, layers * bytes_q)
    attn_kv = _attention(hw, shape, rows, p, p_max + rows, pairs=(t * (t + 1) / 2 + t * p) / span) / share
    exposed_kv = max(0.0, shape.kv_bytes(p_max + rows) / bandwidth - hw.comm_overlap * attn_kv / span)
    kv = Cost(layers * (gemm + attn_kv), layers * (steps + (span - 1) * latency), layers * (span - 1) * exposed_kv)
    attn_q = _attention(hw, shape, t, p_max, p_max + rows, pairs=t * (t + 1) / 2 / span + t * p_max) / share
    q = Cost(layers * (gemm + attn_q), layers * latency_q, layers * bytes_q)
    return min(kv, q, key=lambda c: c.total_s)


def _attention(hw, shape: AttnShape, lq: int, p: int, keys: int, pairs: float | None = None) -> float:
    """One layer's attention of lq queries (causal among themselves) after p cached keys."""
    if lq == 1 and pairs is None:
        return costs.decode_attention_time(hw, shape, 1, keys)
    pairs = lq * (lq + 1) / 2 + lq * p if pairs is None else pairs
    return costs.attention_time(hw, shape, pairs, lq, keys)


# ---------------------------------------------------------------- the decision

@dataclasses.dataclass(frozen=True)
class Work:
    """What the placement knows of one sequence's part of a forward."""

    new: int             # T: tokens placed in this forward
    cached: int          # P: keys before them on the sequence's path
    later: int = 0       # prompt tokens still to prefill in later forwards (chunked prefill)
    decode: int = 0      # tokens the request may still generate


@dataclasses.dataclass
class ForwardLoad:
    """This forward's predicted compute per rank so far, its total work spread evenly (the floor) and its ring."""

    compute_s: np.ndarray  # [N]
    floor_s: float = 0.0
    ring: bool = False

    def makespan(self) -> float:
        return max(self.floor_s, float(self.compute_s.max()))


@dataclasses.dataclass(frozen=True)
class Decision:
    spread: bool
    rank: int            # the rank of a local placement, -1 when spread
    method: str          # "auto" | "forced" | "context" (the keys already span ranks) | "home" | "capacity"
    local_s: float = math.nan   # predicted seconds of the rest of the request, local vs spread ("auto" only)
    spread_s: float = math.nan

    def as_metrics(self) -> dict:
        out = {"placement": "spread" if self.spread else "local", "method": self.method}
        if not math.isnan(self.local_s):
            out.update(local_s=round(self.local_s, 6), spread_s=round(self.spread_s, 6))
        return out


class Placer:
    """The placement policy: `shard` (always 2N-chunk sharding, today's rule), `local` (one rank whenever the
    blocks fit there) or `auto` (whichever the cost model predicts to finish the request sooner)."""

    def __init__(self, mode: str, n: int, model: CostModel | None = None):
        if mode not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {mode!r}")
        if mode == "auto" and n > 1 and model is None:
            raise ValueError("placement 'auto' needs a cost model (model shape and hardware profile)")
        self.mode, self.n, self.model = mode, n, model

    @property
    def needs_costs(self) -> bool:
        return self.mode == "auto" and self.n > 1

    def cost(self, t: int, p: int, span: int = 1, p_max: int | None = None) -> Cost:
        return sequence_cost(self.model, t, p, span, p_max) if self.model is not None else Cost(float(t))

    def decide(self, work: Work, home: int, rank: int, load: ForwardLoad | None) -> Decision:
        """A prefill chunk of a sequence whose keys sit on `home` (a rank or UNPLACED): stay on one rank (`rank`,
        the home or the least-loaded rank with room) or spread over all N."""
        if self.n == 1:
            return Decision(False, 0, "forced")
        if self.mode != "auto":
            return Decision(self.mode == "shard", -1 if self.mode == "shard" else rank, "forced")
        local_s, spread_s = self.predict(work, home, rank, load)
        spread = spread_s < local_s
        return Decision(spread, -1 if spread else rank, "auto", local_s, spread_s)

    def predict(self, w: Work, home: int, rank: int, load: ForwardLoad | None) -> tuple[float, float]:
        """Predicted seconds until the request ends (this forward's makespan increase, later chunks alone, then
        its decode steps) when its new tokens stay on `rank` vs when they spread over the N ranks."""
        load = load or ForwardLoad(np.zeros(self.n))
        before = load.makespan()
        p_max = w.cached if home >= 0 else 0  # cached keys on the busiest rank after spreading
        ctx = w.cached + w.new + w.later

        here = self.cost(w.new, w.cached)
        local = max(before, float(load.compute_s[rank]) + here.compute_s) - before
        local += self.cost(w.later, w.cached + w.new).total_s + w.decode * self.cost(1, ctx).total_s

        there = self.cost(w.new, w.cached, self.n, p_max)
        spread = max(before, float(load.compute_s.max()) + there.compute_s) - before
        spread += there.ring_bytes_s + (0.0 if load.ring else there.ring_latency_s)
        later_max = p_max + ceil_div(w.new, self.n)
        spread += self.cost(w.later, w.cached + w.new, self.n, later_max).total_s
        spread += w.decode * self.cost(1, ctx, self.n, later_max + ceil_div(w.later, self.n)).total_s
        return local, spread
