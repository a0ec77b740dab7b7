"""pass-KV / pass-Q heuristics: Alg. 1, Alg. 5, App. D, the simulator method, and fitting h(T, P)."""
from __future__ import annotations

import inspect
import json
import math
import random
from fractions import Fraction

import pytest

from cpinfer.cp.heuristics import (StrategyChoice, choose_strategy, empirical_h, fit_empirical, kv_token_threshold,
                                   miss_rate_threshold, miss_rate_threshold_all2all)
from cpinfer.perf.catalog import HARDWARE, PAPER_EMPIRICAL

L405 = dict(n_heads=128, n_kv_heads=8, head_dim=128, elem_bytes=2, hardware="h100-gtt")
C, BW = 800e12, 50e9  # h100-gtt: bf16 peak per GPU (App. A), RDMA 400 Gb/s per GPU (§4.1)


def choose(t, p, n=4, method="alg5", **kw):
    return choose_strategy(t, p, n, **(L405 | kw), method=method)


# --- thresholds by hand for Llama3-405B on h100-gtt --------------------------------------------------------
def test_thresholds_by_hand():
    # Eq. 2: N*C*N_KV*e / (2*N_H*BW) = N * 800e12 * 8 * 2 / (2 * 128 * 50e9) = 1000 * N tokens
    for n in (1, 2, 4, 8, 16):
        assert kv_token_threshold(n, C, BW, 128, 8, 2) == 1000 * n
    assert miss_rate_threshold(128, 8) == Fraction(1, 8)          # Eq. 1: 2 * 8 / 128
    # Eq. 5: 1/8 - 4*T*BW/(N*C*e) = 1/8 - T/(8000*N); at T=3200, N=4: 1/8 - 1/10 = 1/40
    assert miss_rate_threshold_all2all(3200, 4, C, BW, 128, 8, 2) == Fraction(1, 40)
    c = choose(3200, 124800)
    assert c.inputs["kv_token_threshold"] == 4000 and c.inputs["miss_rate_threshold"] == pytest.approx(0.025)


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
    c = choose(3200, 124800, method="empirical")
    assert (c.strategy, c.inputs["coeffs_from"]) == ("pass-q", "profile h100-gtt")
    c = choose(3200, 124800, method="empirical", hardware="cpu-gloo")
    assert c.inputs["coeffs_from"] == "paper App. D"
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


# --- simulator method ----------------------------------------------------------------------------------------
def test_simulator_method_follows_the_paper_at_cp4_128k():
    per_gpu = dict(n_heads=16, n_kv_heads=1)  # TP8 shards of Llama3-405B
    assert choose(3200, 124800, method="simulator", **per_gpu).strategy == "pass-q"
    assert choose(12800, 115200, method="simulator", **per_gpu).strategy == "pass-kv"
    c = choose(12800, 115200, method="simulator", **per_gpu)
    assert c.inputs["layer_us_pass_kv"] < c.inputs["layer_us_pass_q"]


# --- API contract --------------------------------------------------------------------------------------------
def test_inputs_are_json_and_choice_validates():
    for method in ("alg1", "alg5", "empirical", "simulator", "decode", "pass-kv"):
        c = choose(2000, 50000, method=method)
        json.dumps(c.inputs)
        assert isinstance(c, StrategyChoice) and c.reason.endswith(".")
    with pytest.raises(ValueError):
        StrategyChoice("pass-x", "alg1", {}, "")


def test_hardware_as_object_name_or_path(tmp_path):
    path = tmp_path / "hw.json"
    HARDWARE["h100-gti"].to_json(path)
    for hw in (HARDWARE["h100-gti"], "H100-GTI", str(path)):
        assert choose(3000, 90000, hardware=hw).inputs["BW_bytes_per_s"] == 12.5e9


@pytest.mark.parametrize("t,p,n,kw,msg", [
    (0, 5, 2, {}, "T"), (5, -1, 2, {}, "P"), (5, 5, 0, {}, "N"), (5, 5, 2, {"method": "best"}, "method"),
    (5, 5, 2, {"n_kv_heads": 3}, "multiple"), (5, 5, 2, {"hardware": "abacus"}, "known profiles"),
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
    for name in ("n_heads", "n_kv_heads", "head_dim", "elem_bytes", "hardware", "method", "empirical"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["hardware"].default == "cpu-gloo" and params["method"].default == "alg5"
