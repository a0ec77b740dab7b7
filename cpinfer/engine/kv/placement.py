"""Adaptive placement: over how many CP ranks a sequence's new tokens go (1 or N), per sequence and per forward.

Spreading a prefill over the N ranks (2N-chunk sharding, §3.5.1) divides its compute but makes every forward of
that sequence run the ring (per-layer SendRecv / All2All latency, which dominates on gloo); one rank costs no
communication. The choice compares both predicted costs from the shared cost model (`cp.cost_model`, GEMMs from
`perf.simulator`, the engine's hardware profile); `shard` and `local` force one side. The KV manager asks.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from cpinfer.cp.cost_model import AttnShape, predict_attention, ring_link
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.model_spec import ModelSpec
from cpinfer.perf.models import load_weight_format
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

    @functools.cached_property
    def shape(self) -> AttnShape:
        return AttnShape(self.spec.n_heads // self.tp, self.spec.kv_heads_per_gpu(self.tp), self.spec.head_dim,
                         self.elem_bytes, kv_parts=self.spec.kv_parts)

    @functools.cached_property
    def deployment(self) -> Deployment:
        weights = load_weight_format({4: "fp32", 2: "bf16"}.get(self.elem_bytes, "bf16"))
        return Deployment(self.spec, self.hardware, 1, self.tp, weights, self.elem_bytes, self.elem_bytes)


@functools.lru_cache(maxsize=8192)  # a burst of like requests, a decode step's context: asked again and again
def sequence_cost(m: CostModel, t: int, p: int, span: int, p_max: int | None = None) -> Cost:
    """Predicted cost of t new tokens of one sequence after p cached keys, the new tokens over `span` ranks.

    span 1: everything on one rank, no ring. span N: the new tokens 2N-sharded; `p_max` (default p / span) is the
    most cached keys on one rank (all p when they sit on one rank): the busiest rank is priced as if every rank
    held that many. Attention and ring come from the shared cost model (the faster of pass-KV and pass-Q, what the
    strategy heuristic aims at), the GEMMs from the planner's; compute runs at the rank's share of the machine.
    """
    if t <= 0:
        return Cost(0.0)
    spec, share = m.spec, m.compute_share
    cached = p if span == 1 else span * (ceil_div(p, span) if p_max is None else p_max)
    pred = predict_attention(m.hardware, m.shape, new=t, cached=cached, ranks=span, tp=m.tp, layers=spec.n_layers,
                             window=spec.window, window_layers=spec.window_layers)
    layers = pred.per_layer[pred.strategy if span > 1 else "pass-kv"]
    latency = ring_link(m.hardware, span, m.tp).latency if span > 1 else 0.0
    compute, ring_latency, ring_bytes = spec.n_layers * gemm_layer(m.deployment, ceil_div(t, span)), 0.0, 0.0
    for cost, count in ((layers["full"], spec.full_layers), (layers["window"], spec.window_layers)):
        if cost is None or not count:
            continue
        messages = (cost.steps_run - 1) + (span - 1 if cost.strategy == "pass-q" else 0)
        compute += count * (cost.attention + cost.merge)
        ring_latency += count * (cost.ring_steps + messages * latency)
        ring_bytes += count * max(0.0, cost.sendrecv_exposed + cost.all2all - messages * latency)
    return Cost(compute / share, ring_latency, ring_bytes)


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
    method: str          # "auto" (the cost model) | "forced" (placement shard / local) | "capacity" (no rank had room)
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
        if self.model is None:
            return Cost(float(t))
        return sequence_cost(self.model, int(t), int(p), span, None if p_max is None else int(p_max))

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

    def crossover(self, decode: int, limit: int = 1 << 22) -> int | None:
        """The shortest new prompt (no cached keys, an idle engine) that `auto` spreads when up to `decode` tokens
        will follow, or None when none up to `limit` would; shorter ones stay on one rank. Bisection: spreading's
        advantage grows with the prompt (its compute saved grows faster than its ring)."""
        if not self.needs_costs:
            return None

        def spreads(t: int) -> bool:
            local, spread = self.predict(Work(t, 0, 0, decode), UNPLACED, 0, None)
            return spread < local

        if not spreads(limit):
            return None
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if spreads(mid) else (mid + 1, hi)
        return lo

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
