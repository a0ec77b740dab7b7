"""Speculative decoding on the sharded KV: the TTIT gain of verifying k drafted tokens in one ring step.

Under CP every decode step pays the ring's latency (Q SendRecv per step, All2All of the partial outputs; paper §4.3)
and reads the whole KV once. A verify step pays both once for k + 1 query rows (`simulate_decode(..., rows=k+1)`:
the same decode ring under the same CUDA graph, one Q block of k + 1 rows per sequence, GEMMs and LM head over
k + 1 rows) and emits E = (1 - a^(k+1)) / (1 - a) tokens on average when each drafted token is accepted with
probability a independently of the others. Gain = E x t_decode / t_verify. That is how cpinfer's engine verifies
(`spec_verify="decode"`, the default: each verify sequence one group of k + 1 rows on the static decode path, one
program reading the K/V once for them; docs/gpu.md, "Verify rows"). The same rows verified as a partial prefill
through the prefill ring (`spec_verify="prefill"`; pass-Q, eager: the per-step ring cost `ring_step_us` on every
step of every layer) are priced beside it, `simulate_prefill(k + 1 new, context cached)`. The drafter is prompt
lookup (n-gram): no model, its time on the host is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from cpinfer.perf.simulator import Deployment, Estimate, decode_kernels_time, simulate_decode, simulate_prefill
from cpinfer.utils import check_positive


def check_acceptance(alpha: float, what: str = "speculative acceptance rate") -> float:
    """The per-token acceptance rate a, a probability in [0, 1) (a = 1 would accept forever)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1:
        raise ValueError(f"{what} must be a number in [0, 1), got {alpha!r} (the chance that one drafted token is "
                         "accepted; 1 would accept every draft forever)")
    return float(alpha)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits on average: the accepted run of k drafted tokens (each accepted with
    probability a, stopping at the first rejection) plus the target's own next token = sum_{i=0..k} a^i."""
    check_positive(k, "speculative tokens k")
    alpha = check_acceptance(alpha)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def breakeven_acceptance(k: int, cost_ratio: float) -> float | None:
    """The acceptance rate at which speculation neither gains nor loses: E(a, k) = t_verify / t_decode; None when
    even a -> 1 (E -> k + 1) cannot pay for the verify step."""
    check_positive(k, "speculative tokens k")
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E is increasing in a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SpecPlan:
    k: int
    acceptance: float
    decode: Estimate         # one decode step (one token per sequence)
    verify: Estimate         # one verify step as a decode step (k + 1 rows per sequence)
    expected_tokens: float   # E, tokens emitted per verify step
    verify_partial: Estimate  # the same verify step as a partial prefill through the prefill ring (pass-Q, eager)

    @property
    def cost_ratio(self) -> float:
        return self.verify.seconds / self.decode.seconds

    @property
    def gain(self) -> float:
        """Decode tokens/s with speculation over without: E x t_decode / t_verify."""
        return self.expected_tokens / self.cost_ratio

    @property
    def ttit_s(self) -> float:
        """Mean time per emitted token with speculation."""
        return self.verify.seconds / self.expected_tokens

    @property
    def breakeven(self) -> float | None:
        return breakeven_acceptance(self.k, self.cost_ratio)

    @property
    def partial_ratio(self) -> float:
        return self.verify_partial.seconds / self.decode.seconds

    @property
    def gain_partial(self) -> float:
        """The gain when the verify step runs as a partial prefill (the prefill ring, eager)."""
        return self.expected_tokens / self.partial_ratio

    @property
    def breakeven_partial(self) -> float | None:
        return breakeven_acceptance(self.k, self.partial_ratio)

    def to_dict(self) -> dict:
        return dict(k=self.k, acceptance=self.acceptance, expected_tokens=self.expected_tokens,
                    decode_s=self.decode.seconds, verify_s=self.verify.seconds, cost_ratio=self.cost_ratio,
                    gain=self.gain, ttit_s=self.ttit_s, breakeven_acceptance=self.breakeven,
                    verify_breakdown_s=dict(self.verify.breakdown), verify_partial_s=self.verify_partial.seconds,
                    gain_partial=self.gain_partial, breakeven_acceptance_partial=self.breakeven_partial,
                    verify_partial_breakdown_s=dict(self.verify_partial.breakdown))


def _with_eager_launches(est: Estimate, dep: Deployment) -> Estimate:
    """A partial prefill of a few rows costed as the eager forward it is: the prefill model prices compute and the
    ring, not launches, so add one host launch per kernel of a decode-shaped forward (as eager decode pays)."""
    breakdown = dict(est.breakdown, kernels=est.breakdown.get("kernels", 0.0) + decode_kernels_time(dep, eager=True))
    return Estimate(est.strategy, sum(breakdown.values()), breakdown, est.detail)


def plan_spec(dep: Deployment, context_tokens: int, k: int, acceptance: float, batch: int = 1) -> SpecPlan:
    """Speculation with k drafted tokens at acceptance rate `acceptance` on `dep` (its CP ring decodes), each of
    `batch` sequences holding `context_tokens`."""
    e = expected_tokens(acceptance, k)
    partial = simulate_prefill(dep, k + 1, context_tokens - 1, batch, "pass-q" if dep.cp > 1 else "pass-kv")
    partial = _with_eager_launches(partial, dep)
    return SpecPlan(k, float(acceptance), simulate_decode(dep, context_tokens, batch),
                    simulate_decode(dep, context_tokens, batch, rows=k + 1), e, partial)


def _breakeven_words(be: float | None, k: int) -> str:
    return f"break-even acceptance {be:.3f}" if be is not None else \
        f"no acceptance pays: a verify step costs more than {k + 1} decode steps"


def format_spec(spec: SpecPlan, dep: Deployment, context_tokens: int) -> str:
    """The speculative part of `cpinfer plan --spec-tokens k --spec-acceptance a`."""
    parts = sorted(((key, spec.verify.breakdown[key] - spec.decode.breakdown[key]) for key in spec.verify.breakdown),
                   key=lambda kv: -kv[1])
    extra = ", ".join(f"{key} +{v * 1e3:.2f}" for key, v in parts[:3] if v > 5e-6)
    ring = spec.verify_partial.breakdown.get("ring_steps", 0.0)
    return "\n".join([
        f"spec      k = {spec.k} drafted tokens, acceptance {spec.acceptance:g}: E = (1 - a^(k+1)) / (1 - a) = "
        f"{spec.expected_tokens:.3f} tokens per verify step; decode step {spec.decode.seconds * 1e3:.2f} ms on "
        f"CP{dep.cp} x TP{dep.tp} at {context_tokens} context",
        f"          verified as a decode step ({spec.k + 1} rows per sequence in one Q block, one pass over the KV, "
        f"as decode runs; the engine's path, spec_verify='decode'): {spec.verify.seconds * 1e3:.2f} ms ({spec.cost_ratio:.3f}x; "
        f"{extra or 'no component grows'} ms): gain {spec.gain:.2f}x decode tokens/s "
        f"({spec.ttit_s * 1e3:.2f} ms per token), {_breakeven_words(spec.breakeven, spec.k)}",
        f"          verified as a partial prefill ({'the prefill ring, pass-Q' if dep.cp > 1 else 'no ring at CP1'}, "
        "eager; spec_verify='prefill'): "
        f"{spec.verify_partial.seconds * 1e3:.2f} ms ({spec.partial_ratio:.3f}x, of which per-step ring cost "
        f"{ring * 1e3:.2f} ms): gain {spec.gain_partial:.2f}x, {_breakeven_words(spec.breakeven_partial, spec.k)}",
    ])
