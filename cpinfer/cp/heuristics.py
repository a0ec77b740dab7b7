"""Choose ring pass-KV or pass-Q for one batch (paper §3.4 Alg. 1, App. C Alg. 5, App. D empirical h(T, P)).

T = new tokens in the batch, P = cached tokens, N = CP ranks. Alg. 1 / Alg. 5 take C and BW as the rates the
hardware achieves, which is where the paper's footnote to Alg. 1 tunes them ("achieved BW and C are lower than the
theoretical hardware peaks; we start with these peak values and then fine-tune the thresholds"): C = the attention
kernel's rate on long blocks, BW = the ring's SendRecv bandwidth (both from the hardware profile, as the shared cost
model `cost_model.py` uses them). "simulator" compares that cost model's predicted times. Closed-form decisions are
made in exact rational arithmetic, so a batch sitting exactly on a threshold always goes the same way (pass-KV on
ties, as Alg. 1's ">=" says). This module reads hardware numbers but imports nothing from `cpinfer.perf`.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from cpinfer.cp import cost_model
from cpinfer.cp.ring_shape import RingShape
from cpinfer.utils import check_positive

STRATEGIES = ("pass-kv", "pass-q")
METHODS = ("alg1", "alg5", "empirical", "simulator", "decode", "pass-kv", "pass-q")  # accepted `method`
CHOICE_METHODS = ("alg1", "alg5", "empirical", "simulator", "forced", "full-prefill", "decode", "single-rank")
PAPER_EMPIRICAL = (-1.059, 1.145, 12.112)  # App. D: alpha, beta, gamma (natural log), fitted on the paper's data


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str          # "pass-kv" | "pass-q"
    method: str            # one of CHOICE_METHODS
    inputs: dict           # T, P, N, thresholds... (JSON-serialisable, for metrics and the debug log)
    reason: str            # one human sentence

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.method not in CHOICE_METHODS:
            raise ValueError(f"method must be one of {CHOICE_METHODS}, got {self.method!r}")


def kv_token_threshold(n: int, c: float, bw: float, n_heads: int, n_kv_heads: int, elem_bytes: int) -> Fraction:
    """Eq. 2: pass-KV SendRecv hides under attention when T >= N*C*N_KV*e / (2*N_H*BW). C flop/s, BW bytes/s."""
    return Fraction(n) * Fraction(c) * n_kv_heads * elem_bytes / (2 * n_heads * Fraction(bw))


def miss_rate_threshold(n_heads: int, n_kv_heads: int) -> Fraction:
    """Eq. 1: Q is smaller than K+V when T/(T+P) < 2*N_KV/N_H."""
    return Fraction(2 * n_kv_heads, n_heads)


def miss_rate_threshold_all2all(t: int, n: int, c: float, bw: float, n_heads: int, n_kv_heads: int,
                                elem_bytes: int) -> Fraction:
    """Eq. 5 (App. C): the pass-Q All2All lowers the threshold to 2*N_KV/N_H - 4*T*BW/(N*C*e)."""
    return miss_rate_threshold(n_heads, n_kv_heads) - 4 * t * Fraction(bw) / (n * Fraction(c) * elem_bytes)


def heuristic_rates(hardware, n: int, tp: int = 1) -> tuple[float, float]:
    """(C flop/s, BW bytes/s) that Alg. 1 / Alg. 5 use on `hardware`: the attention rate it achieves on long
    blocks and the SendRecv bandwidth of a ring of n ranks x tp devices (NVLink inside a node, else the network)."""
    return cost_model.attention_rate(hardware), cost_model.ring_link(hardware, n, tp).bandwidth


def empirical_h(t: int, p: int, coeffs: tuple[float, float, float]) -> float:
    """App. D: h = alpha*ln T + beta*ln(T/(T+P)) + gamma; pass-KV when h > 0."""
    alpha, beta, gamma = coeffs
    return alpha * math.log(t) + beta * math.log(t / (t + p)) + gamma


def choose_strategy(T: int, P: int, N: int, *, n_heads: int, n_kv_heads: int, head_dim: int, elem_bytes: int,
                    hardware, method: str = "alg5", empirical=None, tp: int = 1,
                    partial_bytes: int = 4) -> StrategyChoice:
    """Pick the ring variant for a batch of T new and P cached tokens on N CP ranks of tp devices each.

    n_heads / n_kv_heads are the heads ONE device holds. hardware: a hardware profile object (anything with the
    fields of `cost_model.Rates`; resolve a catalog name or JSON path with `cpinfer.perf.load_hardware_profile`).
    method: "alg1" | "alg5" | "empirical" | "simulator" (the cost model's predicted per-layer times; partial_bytes
    is the element size of pass-Q's partial outputs) | "decode" (always pass-Q, §3.6) | "pass-kv" / "pass-q"
    (forced). P == 0 is full prefill (pass-KV); N == 1 needs no communication.
    empirical: (alpha, beta, gamma) for "empirical"; default the profile's fit, else the paper's.
    """
    T, P, N = (_as_int(v, what) for v, what in ((T, "T (new tokens)"), (P, "P (cached tokens)"), (N, "N (CP ranks)")))
    _validate(T, P, N, n_heads, n_kv_heads, head_dim, elem_bytes, method)
    hw = _profile(hardware)
    check_positive(tp, "tp")
    base = dict(T=T, P=P, N=N, miss_rate=T / (T + P), hardware=getattr(hw, "name", type(hw).__name__),
                requested=method)
    if method in STRATEGIES:
        return StrategyChoice(method, "forced", base, f"{method} was requested explicitly.")
    if N == 1:
        return StrategyChoice("pass-kv", "single-rank", base, "A single CP rank sends nothing; attention is local.")
    if method == "decode":
        return StrategyChoice("pass-q", "decode", base, "Decode batches use ring pass-Q: one query per sequence "
                              "is far smaller than its cached K/V (paper §3.6).")
    if P == 0:
        return StrategyChoice("pass-kv", "full-prefill", base, "Full prefill (P=0) uses ring pass-KV (§3.4): "
                              "it needs no All2All and its transfer hides under causal attention.")
    if method == "empirical":
        return _empirical(T, P, hw, empirical, base)
    if method == "simulator":
        shape = cost_model.AttnShape(n_heads, n_kv_heads, head_dim, elem_bytes, partial_bytes)
        return _simulated(T, P, N, hw, shape, tp, base)
    return _analytical(T, P, N, hw, n_heads, n_kv_heads, elem_bytes, method, tp, base)


def _profile(hardware):
    if hardware is None or isinstance(hardware, (str, Path)):
        raise ValueError(f"hardware must be a hardware profile object, got {hardware!r}: resolve a catalog name "
                         f"or a JSON profile path with cpinfer.perf.load_hardware_profile(...) first")
    missing = [f for f in cost_model.Rates.__annotations__ if not hasattr(hardware, f)]
    if missing:
        raise ValueError(f"hardware {getattr(hardware, 'name', hardware)!r} lacks the profile fields {missing}")
    return hardware


def _as_int(value, what: str) -> int:
    """Accept any integer type (numpy, torch scalars via __index__); reject floats and bools."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _validate(T, P, N, n_heads, n_kv_heads, head_dim, elem_bytes, method) -> None:
    for value, what in ((T, "T (new tokens)"), (N, "N (CP ranks)"), (n_heads, "n_heads"),
                        (n_kv_heads, "n_kv_heads"), (head_dim, "head_dim"), (elem_bytes, "elem_bytes")):
        check_positive(value, what)
    if isinstance(P, bool) or not isinstance(P, int) or P < 0:
        raise ValueError(f"P (cached tokens) must be a non-negative integer, got {P!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: known methods are {', '.join(METHODS)}")


def _analytical(T, P, N, hw, n_heads, n_kv_heads, elem_bytes, method, tp, base) -> StrategyChoice:
    c, bw = heuristic_rates(hw, N, tp)
    t_min = kv_token_threshold(N, c, bw, n_heads, n_kv_heads, elem_bytes)
    if method == "alg1":
        r_min = miss_rate_threshold(n_heads, n_kv_heads)
    else:
        r_min = miss_rate_threshold_all2all(T, N, c, bw, n_heads, n_kv_heads, elem_bytes)
    miss = Fraction(T, T + P)
    inputs = base | dict(C_flops=c, BW_bytes_per_s=bw, elem_bytes=elem_bytes, n_heads=n_heads, tp=tp,
                         n_kv_heads=n_kv_heads, kv_token_threshold=float(t_min), miss_rate_threshold=float(r_min))
    eq = "Eq. 1" if method == "alg1" else "Eq. 5"
    if T >= t_min:
        reason = f"T={T} >= {float(t_min):.0f} new tokens (Eq. 2): pass-KV SendRecv hides under attention."
        return StrategyChoice("pass-kv", method, inputs, reason)
    if miss >= r_min:
        reason = (f"Miss rate T/(T+P)={float(miss):.2%} >= {float(r_min):.2%} ({eq}): "
                  f"K/V traffic is not worse than pass-Q's.")
        return StrategyChoice("pass-kv", method, inputs, reason)
    reason = (f"T={T} < {float(t_min):.0f} (Eq. 2) and miss rate {float(miss):.2%} < {float(r_min):.2%} ({eq}): "
              f"passing Q is cheaper.")
    return StrategyChoice("pass-q", method, inputs, reason)


def _empirical(T, P, hw, empirical, base) -> StrategyChoice:
    if empirical is not None:
        coeffs, source = _as_coeffs(empirical), "caller"
    elif getattr(hw, "empirical", None) is not None:
        coeffs, source = hw.empirical, f"profile {hw.name}"
    else:
        coeffs, source = PAPER_EMPIRICAL, "paper App. D"
    h = empirical_h(T, P, coeffs)
    inputs = base | dict(alpha=coeffs[0], beta=coeffs[1], gamma=coeffs[2], coeffs_from=source, h=h)
    strategy = "pass-kv" if h > 0 else "pass-q"
    return StrategyChoice(strategy, "empirical", inputs, f"h(T, P) = {h:.3f} (App. D, coefficients from "
                          f"{source}) is {'positive' if h > 0 else 'not positive'}: {strategy}.")


def _as_coeffs(value) -> tuple[float, float, float]:
    if isinstance(value, dict):
        value = (value["alpha"], value["beta"], value["gamma"])
    alpha, beta, gamma = (float(v) for v in value)
    return alpha, beta, gamma


def _simulated(T, P, N, hw, shape, tp, base) -> StrategyChoice:
    ring = RingShape(N, T, P)
    t = {s: cost_model.ring_cost(hw, shape, ring, s, tp=tp).total for s in STRATEGIES}
    strategy = "pass-kv" if t["pass-kv"] <= t["pass-q"] else "pass-q"
    inputs = base | dict(layer_us_pass_kv=t["pass-kv"] * 1e6, layer_us_pass_q=t["pass-q"] * 1e6, tp=tp)
    return StrategyChoice(strategy, "simulator", inputs, f"Cost model: {t['pass-kv'] * 1e6:.0f} us (pass-KV) vs "
                          f"{t['pass-q'] * 1e6:.0f} us (pass-Q) of attention per layer: {strategy}.")


def fit_empirical(points) -> tuple[float, float, float]:
    """Least-squares fit of h(T, P) to ln(t_passq / t_passkv) over measured (T, P, t_passkv, t_passq) points.

    h > 0 exactly where pass-KV was faster, and |h| estimates the log of the speed ratio. Needs at least three
    points that vary in both ln T and ln(T/(T+P)).
    """
    rows = [tuple(p) for p in points]
    if len(rows) < 3:
        raise ValueError(f"fit_empirical needs at least 3 points (T, P, t_passkv, t_passq), got {len(rows)}")
    feats, target = [], []
    for t, p, t_kv, t_q in rows:
        if t < 1 or p < 0 or t_kv <= 0 or t_q <= 0:
            raise ValueError(f"bad point {(t, p, t_kv, t_q)}: need T >= 1, P >= 0 and positive times")
        feats.append((math.log(t), math.log(t / (t + p)), 1.0))
        target.append(math.log(t_q / t_kv))
    x, y = np.asarray(feats), np.asarray(target)
    if np.linalg.matrix_rank(x) < 3:
        raise ValueError("fit_empirical: the points must vary in both T and the miss rate T/(T+P)")
    alpha, beta, gamma = np.linalg.lstsq(x, y, rcond=None)[0]
    return float(alpha), float(beta), float(gamma)
