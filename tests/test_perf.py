"""Performance model: the paper's public headline numbers, the fit, catalogs, ring shapes and `cpinfer plan`."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpinfer.cli import main as cli_main
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.fit import ANCHORS, K128, M1, anchor_predictions, fit_h100_gtt
from cpinfer.perf.hardware import HardwareProfile, load_hardware_profile
from cpinfer.perf.models import MODELS, WEIGHT_FORMATS, load_model_spec
from cpinfer.perf.ring import RingShape
from cpinfer.perf.simulator import Deployment, memory_per_gpu, paper_flops, simulate_decode, simulate_prefill

GTT = HARDWARE["h100-gtt"]
L405 = MODELS["llama3-405b"]
FP8_FFN = WEIGHT_FORMATS["fp8-ffn"]


def dep405(cp: int, hw: HardwareProfile = GTT, tp: int = 8) -> Deployment:
    return Deployment(L405, hw, cp, tp, FP8_FFN)


# --- the paper's headline numbers (Llama3-405B, FP8 FFN, TP8 per node, GTT, full prefill) -------------------
@pytest.mark.parametrize("cp,tokens,paper_s", [(8, K128, 5.85), (16, K128, 3.8), (16, M1, 77.0)])
def test_headline_ttft_within_10_percent(cp, tokens, paper_s):
    predicted = simulate_prefill(dep405(cp), tokens).seconds
    assert predicted == pytest.approx(paper_s, rel=0.10)


def test_1m_flops_per_gpu_and_parallel_efficiency():
    est = simulate_prefill(dep405(16), M1)
    tflops = est.detail["tflops_per_gpu"]
    assert tflops == pytest.approx(502, rel=0.10)                    # App. A: 502 TF/s per H100
    assert tflops / GTT.attn_tflops == pytest.approx(0.93, rel=0.10)  # vs FA3's 540 TF/s: 93%
    assert est.breakdown["sendrecv_exposed"] == 0.0                   # pass-KV fully overlapped


def test_paper_flop_count_matches_appendix_a():
    gemm = paper_flops(L405, M1) - 4.0 * M1 * (M1 / 2) * 16384 * 126
    assert gemm == pytest.approx(8.1e17, rel=0.01)
    assert paper_flops(L405, M1) == pytest.approx(4.9e18, rel=0.02)


def test_latency_halves_with_doubled_cp_at_long_context():
    t8, t16 = (simulate_prefill(dep405(cp), M1).seconds for cp in (8, 16))
    assert t8 / t16 == pytest.approx(2.0, rel=0.05)


def test_fitted_constants_are_reproduced_by_the_fit():
    fitted = fit_h100_gtt(rounds=4)
    for name, value in fitted.items():
        assert getattr(GTT, name) == pytest.approx(value, rel=0.03), name
    preds = anchor_predictions(GTT)
    for quantity, target in ANCHORS.values():
        if target:
            assert preds[quantity] == pytest.approx(target, rel=0.03), quantity


# --- pass-KV vs pass-Q (paper §4.2.4, CP4, T+P = 128000) ---------------------------------------------------
def _gap(t: int) -> float:
    d = dep405(4)
    return simulate_prefill(d, t, K128 - t, strategy="pass-kv").seconds - \
        simulate_prefill(d, t, K128 - t, strategy="pass-q").seconds


def test_pass_q_wins_at_low_miss_rate_and_pass_kv_above():
    assert _gap(3200) > 0           # 2.5% miss: pass-KV's SendRecv is exposed, pass-Q faster
    for t in (12800, 16000, 32000, 64000, K128):  # >= 10% miss: pass-KV
        assert _gap(t) < 0, t
    d = dep405(4)
    kv10 = simulate_prefill(d, 12800, K128 - 12800, strategy="pass-kv")
    assert kv10.breakdown["sendrecv_exposed"] < 0.02 * kv10.seconds  # 10%: SendRecv (almost) hidden
    kv2 = simulate_prefill(d, 3200, K128 - 3200, strategy="pass-kv")
    assert kv2.breakdown["sendrecv_exposed"] > 0.2 * kv2.seconds      # 2.5%: exposed


def test_pass_q_pays_all2all_only():
    d = dep405(4)
    kv, q = (simulate_prefill(d, 64000, 64000, strategy=s) for s in ("pass-kv", "pass-q"))
    assert kv.breakdown["all2all"] == 0.0 and q.breakdown["all2all"] > 0
    assert kv.breakdown["gemm"] == q.breakdown["gemm"]
    assert kv.breakdown["attention"] == pytest.approx(q.breakdown["attention"], rel=1e-9)


# --- decode --------------------------------------------------------------------------------------------------
def test_decode_ttit_grows_with_cp_because_of_padding_and_ring_latency():
    ttit = [simulate_decode(dep405(cp), K128).seconds for cp in (1, 2, 4)]
    assert ttit[0] < ttit[1] < ttit[2]
    est = simulate_decode(dep405(4), K128, batch=1)
    assert est.detail == dict(queries_per_rank=1, padded_batch=4, padding_queries=3)
    assert est.seconds == pytest.approx(0.071, rel=0.05)  # anchor of the latency fit (§4.3)


def test_decode_is_weight_read_bound_at_batch_1():
    est = simulate_decode(dep405(1), 1024)
    weights = FP8_FFN.weight_bytes_per_gpu(L405, 8)
    assert est.breakdown["gemm"] >= weights * 0.95 / GTT.mem_bytes_per_s


# --- memory --------------------------------------------------------------------------------------------------
def test_memory_per_gpu():
    mem = memory_per_gpu(dep405(16), M1)
    assert mem.weights_gb == pytest.approx(405.85 * (0.19 * 2 + 0.81 * 1) / 8, rel=0.03)
    kv_gb = M1 / 16 * 126 * 2 * 1 * 128 * 2 / 1e9  # tokens per rank x layers x K,V x 1 KV head x D_H x bf16
    assert mem.kv_gb == pytest.approx(kv_gb, rel=1e-6)
    assert mem.fits
    bf16 = memory_per_gpu(Deployment(L405, GTT, 1, 8, WEIGHT_FORMATS["bf16"]), 1024)
    assert bf16.weights_gb > 96 * 0.9 and not bf16.fits


# --- ring shapes ---------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), t=st.integers(1, 500), p=st.integers(0, 300))
def test_ring_pairs_cover_the_padded_causal_matrix(n, t, p):
    ring = RingShape(n, t, p)
    padded = 2 * n * ring.chunk
    assert ring.padding == padded - t
    assert ring.total_pairs() == padded * (padded + 1) // 2 + padded * p
    assert sum(ring.cached_on(r) for r in range(n)) == p


def test_load_balanced_full_prefill_gives_every_rank_equal_work_per_step():
    ring = RingShape(4, 8 * 100, 0)
    c = ring.chunk
    for q in range(4):
        for k in range(4):
            expected = 2 * c * c if q != k else c * c + c * (c + 1)
            assert ring.visible_pairs(q, k) == expected


# --- catalogs ------------------------------------------------------------------------------------------------
def test_llama3_catalog_shapes():
    assert load_model_spec("Llama3-405B").params == pytest.approx(405e9, rel=0.01)
    assert load_model_spec("llama3-70b").params == pytest.approx(70.6e9, rel=0.01)
    assert load_model_spec("llama3-8b").params == pytest.approx(8.03e9, rel=0.01)


def test_model_from_hf_config(tmp_path):
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               intermediate_size=128, vocab_size=100, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json"):
        spec = load_model_spec(str(where))
        assert (spec.head_dim, spec.n_kv_heads, spec.tie_embeddings) == (16, 2, True)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_spec(str(tmp_path))


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="llama3-405b"):
        load_model_spec("gpt-9")
    with pytest.raises(ValueError, match="h100-gtt"):
        load_hardware_profile("tpu-v9")


def test_every_profile_states_its_sources_and_round_trips_json(tmp_path):
    for name, hw in HARDWARE.items():
        assert hw.sources and all(hw.sources.values()), name
        again = HardwareProfile.from_json(hw.to_json())
        assert again == hw and again.sources == hw.sources
    path = tmp_path / "mine.json"
    GTT.to_json(path)
    assert load_hardware_profile(str(path)) == GTT
    assert HARDWARE["h200"].kind == "spec" and HARDWARE["cpu-gloo"].kind == "estimate"


def test_profiles_validate_themselves():
    with pytest.raises(ValueError, match="gemm_efficiency"):
        dataclasses.replace(GTT, gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="mem_tbps"):
        dataclasses.replace(GTT, mem_tbps=-1.0)
    with pytest.raises(ValueError, match="inter_gbs"):
        dataclasses.replace(GTT, inter_gbs=80.0)
    data = GTT.to_dict()
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_dict(data | {"typo": 1})
    del data["mem_gb"]
    with pytest.raises(ValueError, match="missing keys"):
        HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match="no source"):
        dataclasses.replace(GTT, sources={})


def test_deployment_rejects_bad_tp():
    with pytest.raises(ValueError, match="tp"):
        Deployment(L405, GTT, 2, 3, FP8_FFN)
    with pytest.raises(ValueError, match="cp"):
        Deployment(L405, GTT, 0, 8, FP8_FFN)


# --- the CLI -------------------------------------------------------------------------------------------------
BASE = ["plan", "--model", "llama3-405b", "--hardware", "h100-gtt", "--weights", "fp8-ffn", "--tp", "8"]


def _json(capsys, argv) -> tuple[int, dict]:
    rc = cli_main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_plan_json(capsys):
    rc, out = _json(capsys, BASE + ["--cp", "8", "--prompt-tokens", str(K128)])
    assert rc == 0
    assert out["pass_kv"]["ttft_s"] == pytest.approx(5.85, rel=0.10)
    assert out["pass_q"]["ttft_s"] > out["pass_kv"]["ttft_s"]
    assert out["choice"] == "pass-kv" and out["ttit_s"] > 0 and out["memory_gb_per_gpu"] > 60
    rc, out = _json(capsys, BASE + ["--cp", "4", "--prompt-tokens", "1600", "--cached-tokens", "126400"])
    assert out["choice"] == "pass-q" and out["fastest_simulated"] == "pass-q"


def test_cli_plan_text(capsys):
    assert cli_main(BASE + ["--cp", "2", "--prompt-tokens", "1000", "--cached-tokens", "9000"]) == 0
    text = capsys.readouterr().out
    for label in ("exposed SendRecv", "All2All", "TP all-reduce", "choice", "TTIT", "memory"):
        assert label in text


def test_cli_sweep_finds_the_smallest_cp(capsys):
    rc, out = _json(capsys, BASE + ["--prompt-tokens", str(K128), "--sweep", "--ttft-target", "10"])
    assert rc == 0
    cp = out["smallest_cp"]
    assert out["ttft_s"] <= 10 and out["cp"] == cp
    assert [r["cp"] for r in out["sweep"]] == list(range(1, cp + 1))
    assert all(r["ttft_s"] > 10 for r in out["sweep"][:-1])


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    text = capsys.readouterr().out
    for opt in ("--model", "--hardware", "--cp", "--tp", "--prompt-tokens", "--cached-tokens", "--batch",
                "--weights", "--kv-dtype", "--method", "--json", "--sweep", "--ttft-target", "--max-cp"):
        assert opt in text


@pytest.mark.parametrize("argv,msg", [
    (["--model", "nope", "--hardware", "h100-gtt", "--cp", "2", "--prompt-tokens", "8"], "llama3-8b"),
    (["--model", "llama3-8b", "--hardware", "nope", "--cp", "2", "--prompt-tokens", "8"], "cpu-gloo"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--cp", "0", "--prompt-tokens", "8"], "cp"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--cp", "2", "--prompt-tokens", "-5"], "prompt"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--prompt-tokens", "8"], "--cp"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--prompt-tokens", "8", "--sweep"], "ttft-target"),
])
def test_cli_bad_input_is_one_clear_line(capsys, argv, msg):
    assert cli_main(["plan"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
