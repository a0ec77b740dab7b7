"""pass-KV / pass-Q heuristics: Alg. 1, Alg. 5 (with achieved C and BW), App. D, the simulator method, fitting
h(T, P), and the picks §4.2.4 states for the paper's CP4 128K setup."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
from fractions import Fraction

import pytest

from cpinfer.cp.heuristics import (PAPER_EMPIRICAL, StrategyChoice, choose_strategy, empirical_h, fit_empirical,
                                   heuristic_rates, kv_token_threshold, miss_rate_threshold,
                                   miss_rate_threshold_all2all)
from cpinfer.perf.catalog import HARDWARE

GTT = HARDWARE["h100-gtt"]
C, BW = 800e12, 50e9  # the paper's peaks: bf16 per GPU (App. A), RDMA 400 Gb/s per GPU (§4.1)
# A profile whose achieved rates ARE those peaks (no short-block slowdown): Alg. 1 / 5 by hand
PEAKS = dataclasses.replace(GTT, name="peaks", attn_tflops=800.0, attn_overhead_tokens=0.0, inter_gbs=50.0)
L405 = dict(n_heads=128, n_kv_heads=8, head_dim=128, elem_bytes=2, hardware=PEAKS, tp=8)  # N_KV/N_H as per GPU


def choose(t, p, n=4, method="alg5", **kw):
    return choose_strategy(t, p, n, **(L405 | kw), method=method)


# --- thresholds by hand for Llama3-405B ------------------------------------------------------------------
def test_thresholds_by_hand():
    # Eq. 2: N*C*N_KV*e / (2*N_H*BW) = N * 800e12 * 8 * 2 / (2 * 128 * 50e9) = 1000 * N tokens
    for n in (1, 2, 4, 8, 16):
        assert kv_token_threshold(n, C, BW, 128, 8, 2) == 1000 * n
    assert miss_rate_threshold(128, 8) == Fraction(1, 8)          # Eq. 1: 2 * 8 / 128
    # Eq. 5: 1/8 - 4*T*BW/(N*C*e) = 1/8 - T/(8000*N); at T=3200, N=4: 1/8 - 1/10 = 1/40
    assert miss_rate_threshold_all2all(3200, 4, C, BW, 128, 8, 2) == Fraction(1, 40)
    c = choose(3200, 124800)
    assert c.inputs["kv_token_threshold"] == 4000 and c.inputs["miss_rate_threshold"] == pytest.approx(0.025)


def test_alg1_alg5_take_the_achieved_rates_of_the_ring_link():
    """C = the attention rate on long blocks, BW = one SendRecv flow of the ring's link (§3.4's footnote)."""
    c, bw = heuristic_rates(GTT, 4, 8)  # 32 GPUs: across nodes
    assert c == pytest.approx(GTT.attn_tflops * 1e12 * (4096 + GTT.attn_overhead_tokens) / 4096)
    assert bw == GTT.inter_gbs * 1e9
    assert heuristic_rates(GTT, 4, 2)[1] == GTT.intra_gbs * 1e9  # 8 GPUs: one NVLink node
    got = choose(3200, 124800, hardware=GTT, n_heads=16, n_kv_heads=1)
    assert got.inputs["C_flops"] == c and got.inputs["BW_bytes_per_s"] == bw
    assert got.inputs["kv_token_threshold"] == pytest.approx(float(kv_token_threshold(4, c, bw, 16, 1, 2)))


def test_alg1_boundaries():
    assert choose(4000, 10**6, method="alg1").strategy == "pass-kv"          # T == N*... exactly: pass-KV
    assert choose(3999, 10**6, method="alg1").strategy == "pass-q"
    assert choose(1000, 7000, method="alg1").strategy == "pass-kv"           # miss rate exactly 1/8
    assert choose(1000, 7001, method="alg1").strategy == "pass-q"
    assert choose(3200, 124800, method="alg1").strategy == "pass-q"          # paper §4.2.4, 2.5% miss
    assert choose(12800, 115200, method="alg1").strategy == "pass-kv"        # 10% miss


def test_alg5_moves_the_miss_rate_threshold_down_with_all2all():
    assert choose(3200, 124800).strategy == "pass-kv"       # exactly on Eq. 5's threshold (1/40): pass-KV
    assert choose(3200, 124801).strategy == "pass-q"
    # at miss rate 10% with T < 4000 (P large), Alg. 1 says pass-Q but Alg. 5 says pass-KV once T*BW is large
    t, p = 3000, 27000
    assert choose(t, p, method="alg1").strategy == "pass-q"
    assert choose(t, p, method="alg5").strategy == "pass-kv"   # 1/8 - 3000/32000 = 0.03125 <= 0.1


def test_decode_like_single_token():
    for method in ("alg1", "alg5"):
        c = choose(1, 128000, method=method)
        assert c.strategy == "pass-q" and c.method == method
    c = choose(1, 128000, method="decode")
    assert (c.strategy, c.method) == ("pass-q", "decode")
    assert choose(1, 0).method == "full-prefill"


def test_full_prefill_and_single_rank_and_forced():
    c = choose(10, 0, n=8, method="alg1")
    assert (c.strategy, c.method) == ("pass-kv", "full-prefill")
    c = choose(1, 10**6, n=1)
    assert (c.strategy, c.method) == ("pass-kv", "single-rank")
    c = choose(10**5, 0, method="pass-q")
    assert (c.strategy, c.method) == ("pass-q", "forced")


# --- App. D empirical heuristic ------------------------------------------------------------------------------
def test_empirical_h_by_hand():
    h = empirical_h(3200, 124800, PAPER_EMPIRICAL)
    assert h == pytest.approx(-1.059 * math.log(3200) + 1.145 * math.log(0.025) + 12.112)
    c = choose(3200, 124800, method="empirical", hardware=GTT)
    assert (c.strategy, c.inputs["coeffs_from"]) == ("pass-q", "paper App. D")  # no profile carries them
    mine = dataclasses.replace(GTT, name="mine", empirical=(0.0, 0.0, 1.0))
    c = choose(3200, 124800, method="empirical", hardware=mine)
    assert (c.strategy, c.inputs["coeffs_from"]) == ("pass-kv", "profile mine")
    c = choose(3200, 124800, method="empirical", empirical=(0.0, 0.0, 1.0))
    assert (c.strategy, c.inputs["coeffs_from"]) == ("pass-kv", "caller")
    c = choose(3200, 124800, method="empirical", empirical={"alpha": 0, "beta": 0, "gamma": -1})
    assert c.strategy == "pass-q"


def _synthetic(coeffs, noise=0.0, seed=0):
    rng = random.Random(seed)
    points = []
    for t in (500, 1000, 2000, 4000, 8000, 16000, 32000):
        for miss in (0.01, 0.025, 0.05, 0.1, 0.2, 0.5):
            p = round(t / miss) - t
            h = empirical_h(t, p, coeffs) + rng.gauss(0.0, noise)
            t_kv = 1.0 + rng.random()
            points.append((t, p, t_kv, t_kv * math.exp(h)))   # h = ln(t_passq / t_passkv)
    return points


def test_fit_recovers_known_coefficients():
    got = fit_empirical(_synthetic(PAPER_EMPIRICAL))
    assert got == pytest.approx(PAPER_EMPIRICAL, rel=1e-3)  # (t, p) rounding only
    noisy = fit_empirical(_synthetic(PAPER_EMPIRICAL, noise=0.05, seed=3))
    assert noisy == pytest.approx(PAPER_EMPIRICAL, rel=0.05)


def test_fit_classifies_the_points_it_was_fitted_on():
    points = _synthetic((-0.5, 0.8, 4.0), noise=0.01, seed=1)
    coeffs = fit_empirical(points)
    decisive = [pt for pt in points if abs(math.log(pt[3] / pt[2])) > 0.05]
    assert all((empirical_h(t, p, coeffs) > 0) == (t_q > t_kv) for t, p, t_kv, t_q in decisive)


def test_fit_rejects_bad_points():
    with pytest.raises(ValueError, match="at least 3"):
        fit_empirical([(1, 1, 1.0, 1.0)])
    with pytest.raises(ValueError, match="vary"):
        fit_empirical([(t, t, 1.0, 2.0) for t in (10, 20, 40)])   # one miss rate only
    with pytest.raises(ValueError, match="positive times"):
        fit_empirical([(10, 0, 1.0, 0.0), (20, 5, 1.0, 1.0), (40, 9, 1.0, 1.0)])


# --- the picks §4.2.4 states on h100-gtt (CP4 x TP8, Llama3-405B, P + T = 128000) -------------------------------
GTT_405B = dict(n_heads=16, n_kv_heads=1, hardware=GTT, partial_bytes=2)  # one GPU's heads under TP8


@pytest.mark.parametrize("method", ["alg1", "alg5", "simulator"])
def test_every_pick_the_paper_states_on_h100_gtt(method):
    """§4.2.4's four bullets: > 12.5% miss: pass-KV; 10%: pass-KV (Eq. 2 holds); 5%: either; < 3.25%: pass-Q."""
    pick = {t: choose(t, 128000 - t, method=method, **GTT_405B) for t in (1280, 2560, 3200, 4000, 12800, 19200,
                                                                          32000, 64000)}
    assert all(pick[t].strategy == "pass-q" for t in (1280, 2560, 3200, 4000))
    assert all(pick[t].strategy == "pass-kv" for t in (12800, 19200, 32000, 64000))
    if method != "simulator":  # at 10% it is Eq. 2 that holds: T is "sufficiently large"
        assert 12800 >= pick[12800].inputs["kv_token_threshold"] > 4000


def test_alg5_on_the_peaks_ties_at_2_5pct_and_so_disagrees_with_the_paper():
    """With the peak C and BW, Eq. 5's threshold at T=3200 is exactly the 2.5% miss rate (1/8 - 1/10), and Alg. 5's
    '>=' picks pass-KV there: the reason the heuristic takes the achieved rates instead."""
    assert choose(3200, 124800).strategy == "pass-kv"
    assert choose(3200, 124800, hardware=GTT, n_heads=16, n_kv_heads=1).strategy == "pass-q"


def test_app_d_h_disagrees_with_the_papers_cp4_picks():
    """App. D's h (the paper's coefficients) picks pass-Q at 10% and above 12.5% on the CP4 128K grid, where
    §4.2.4 states pass-KV: why no catalog profile makes it the engine's rule."""
    for t in (12800, 19200, 32000, 64000):
        assert empirical_h(t, 128000 - t, PAPER_EMPIRICAL) < 0


def test_simulator_method_reports_both_times():
    c = choose(12800, 115200, method="simulator", **GTT_405B)
    assert c.inputs["layer_us_pass_kv"] < c.inputs["layer_us_pass_q"]


# --- API contract --------------------------------------------------------------------------------------------
def test_inputs_are_json_and_choice_validates():
    for method in ("alg1", "alg5", "empirical", "simulator", "decode", "pass-kv"):
        c = choose(2000, 50000, method=method)
        json.dumps(c.inputs)
        assert isinstance(c, StrategyChoice) and c.reason.endswith(".")
    with pytest.raises(ValueError):
        StrategyChoice("pass-x", "alg1", {}, "")


def test_hardware_is_an_object_with_the_profile_fields(tmp_path):
    """The heuristic reads a profile object (cp/ does not import perf/): names and paths are the caller's to
    resolve, and say so."""
    gti = HARDWARE["h100-gti"]
    assert choose(3000, 90000, hardware=gti).inputs["BW_bytes_per_s"] == gti.inter_gbs * 1e9
    path = tmp_path / "hw.json"
    gti.to_json(path)
    for bad in ("h100-gti", str(path), path, None):
        with pytest.raises(ValueError, match="load_hardware_profile"):
            choose(3000, 90000, hardware=bad)
    with pytest.raises(ValueError, match="lacks the profile fields"):
        choose(3000, 90000, hardware=object())


@pytest.mark.parametrize("t,p,n,kw,msg", [
    (0, 5, 2, {}, "T"), (5, -1, 2, {}, "P"), (5, 5, 0, {}, "N"), (5, 5, 2, {"method": "best"}, "method"),
    (5, 5, 2, {"n_kv_heads": 3}, "multiple"), (5, 5, 2, {"tp": 0}, "tp"),
])
def test_bad_input(t, p, n, kw, msg):
    with pytest.raises(ValueError, match=msg):
        choose(t, p, n, **kw)


def test_numpy_integers_are_accepted_and_floats_rejected():
    import numpy as np
    c = choose(np.int64(3000), np.int64(90000), np.int32(4))
    assert c.inputs["T"] == 3000 and type(c.inputs["T"]) is int
    with pytest.raises(ValueError, match="integer"):
        choose(3000.0, 90000)


def test_signature_is_the_engine_contract():
    params = inspect.signature(choose_strategy).parameters
    assert list(params)[:3] == ["T", "P", "N"]
    for name in ("n_heads", "n_kv_heads", "head_dim", "elem_bytes", "hardware", "method", "empirical", "tp",
                 "partial_bytes"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["hardware"].default is inspect.Parameter.empty and params["method"].default == "alg5"
    assert params["tp"].default == 1 and params["partial_bytes"].default == 4
