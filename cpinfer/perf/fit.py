"""How the fitted numbers of `h100-gtt` were obtained: four 1-D fits to public numbers of the paper.

Everything else in the profile is a paper or spec constant (or a stated assumption). Each parameter moves
one predicted number monotonically, so coordinate-wise bisection, repeated until stable, solves the system:

| parameter            | anchor (paper, public text)                                             |
|----------------------|-------------------------------------------------------------------------|
| gemm_efficiency      | CP8, 128K full prefill, Llama3-405B FP8-FFN, TP8: TTFT 5.85 s (§4.2.1)   |
| ring_step_floor_us   | CP16, 128K full prefill: TTFT 3.8 s (§4.2.3)                            |
| inter_gbs            | pass-KV = pass-Q at T=6400, T+P=128000 on CP4 (tipping point, §4.2.4)    |
| inter_latency_us     | CP4 decode TTIT at 128K context, batch 1: 71 ms (§4.3)                  |

The 1M-token CP16 TTFT (77 s) is not an anchor: it is predicted (tests/test_perf.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.hardware import HardwareProfile
from cpinfer.perf.models import MODELS, WEIGHT_FORMATS
from cpinfer.perf.simulator import Deployment, simulate_decode, simulate_prefill

K128 = 128_000    # the paper's "128K" (§4.2.4 uses P+T = 128000)
M1 = 1_000_000    # the paper's "1M" (App. A: GEMM FLOPS = 2 x 405B x 1M = 8.1e17)

ANCHORS = {  # parameter -> (what is predicted, paper value)
    "gemm_efficiency": ("ttft_cp8_128k_s", 5.85),
    "ring_step_floor_us": ("ttft_cp16_128k_s", 3.8),
    "inter_gbs": ("passkv_minus_passq_cp4_t6400_s", 0.0),
    "inter_latency_us": ("ttit_cp4_128k_s", 0.071),
}
BOUNDS = {"gemm_efficiency": (0.05, 1.0), "ring_step_floor_us": (0.0, 5000.0),
          "inter_gbs": (0.5, 50.0), "inter_latency_us": (0.0, 500.0)}


def _deployment(hw: HardwareProfile, cp: int) -> Deployment:
    return Deployment(MODELS["llama3-405b"], hw, cp, 8, WEIGHT_FORMATS["fp8-ffn"])


def anchor_predictions(hw: HardwareProfile) -> dict:
    """The four anchored quantities as the simulator predicts them on `hw`."""
    d4 = _deployment(hw, 4)
    t, p = 6400, K128 - 6400
    gap = simulate_prefill(d4, t, p, strategy="pass-kv").seconds - simulate_prefill(d4, t, p, strategy="pass-q").seconds
    return {
        "ttft_cp8_128k_s": simulate_prefill(_deployment(hw, 8), K128).seconds,
        "ttft_cp16_128k_s": simulate_prefill(_deployment(hw, 16), K128).seconds,
        "passkv_minus_passq_cp4_t6400_s": gap,
        "ttit_cp4_128k_s": simulate_decode(d4, K128).seconds,
    }


def _bisect(f: Callable[[float], float], lo: float, hi: float, iters: int = 50) -> float:
    """A root of f on [lo, hi] (f changes sign there); the nearer bound when it does not."""
    flo, fhi = f(lo), f(hi)
    if flo * fhi > 0:
        return lo if abs(flo) < abs(fhi) else hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        fmid = f(mid)
        if (fmid > 0) == (flo > 0):
            lo, flo = mid, fmid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_h100_gtt(start: HardwareProfile | None = None, rounds: int = 6) -> dict:
    """Re-derive the fitted parameters from the anchors; returns {parameter: value}."""
    hw = start or HARDWARE["h100-gtt"]
    for _ in range(rounds):
        for name, (quantity, target) in ANCHORS.items():
            def residual(x: float, name=name, quantity=quantity, target=target) -> float:
                trial = dataclasses.replace(hw, **{name: x})
                return anchor_predictions(trial)[quantity] - target
            hw = dataclasses.replace(hw, **{name: _bisect(residual, *BOUNDS[name])})
    return {name: getattr(hw, name) for name in ANCHORS}
