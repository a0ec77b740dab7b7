"""`cpinfer calibrate --quick` at CP2 (one run, shared): the profile loads where the engine loads it, the App. D
fit runs, the heuristic-quality bench scores its grid, and bad arguments fail with exit code 2."""
import json
import math

import pytest

from cpinfer.bench import heuristic_quality as hq
from cpinfer.cli import main
from cpinfer.cp.heuristics import choose_strategy, fit_empirical
from cpinfer.perf import calibrate as cal
from cpinfer.perf.hardware import load_hardware_profile


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors exit directly
        return exc.code


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "profile.json"
    assert main(["calibrate", "--cp", "2", "--quick", "--out", str(path), "--name", "test-cpu"]) == 0
    return path


def test_quick_profile_loads_with_measured_numbers(calibrated):
    hw = load_hardware_profile(str(calibrated))
    assert hw.name == "test-cpu" and hw.kind == "calibrated"
    for field in ("peak_tflops", "attn_tflops", "inter_gbs", "inter_gbs_peak", "mem_tbps"):
        assert getattr(hw, field) > 0
        assert "cpinfer calibrate" in hw.sources[field]
    assert "not measured" in hw.sources["peak_tflops_fp8"]  # kept from the base profile, and says so
    record, again = cal.load_calibration(calibrated)
    assert again == hw
    assert [(c["T"], c["P"]) for c in record["grid"]] == cal.CalibrationConfig.quick(2).cells()
    assert all(c["pass-kv_s"] > 0 and c["pass-q_s"] > 0 for c in record["grid"])
    assert record["sendrecv"]["latency_us"] >= 0 and record["all2all"]["gbs"] > 0
    assert record["hosts"][0]["attention_backend"] == "cpu-flash"  # the engine's CPU kernel was measured


def test_fit_runs_and_is_stored(calibrated):
    record, hw = cal.load_calibration(calibrated)
    points = [(c["T"], c["P"], c["pass-kv_s"], c["pass-q_s"]) for c in record["grid"]]
    assert hw.empirical == pytest.approx(fit_empirical(points))
    assert all(math.isfinite(x) for x in hw.empirical)
    assert 0 <= record["empirical"]["in_sample_agreement"] <= 1


def test_engine_uses_the_profile_by_path(calibrated, random_checkpoint):
    """LLM(hardware_profile=PATH) loads the calibrated profile and decides partial prefills with it."""
    from cpinfer import LLM, SamplingParams

    with LLM(str(random_checkpoint(seed=1)), context_parallel_size=2, hardware_profile=str(calibrated),
             threads_per_rank=1, placement="shard") as llm:
        prompt = list(range(1, 65))
        first = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
        out = llm.generate([prompt + first.token_ids + [7] * 8], SamplingParams(max_tokens=1))[0]
    step = out.metrics["steps"][0]
    assert out.num_cached_tokens > 0 and step["phase"] == "prefill"
    assert step["inputs"]["hardware"] == "test-cpu"
    assert step["method"] in ("alg5", "empirical") and step["inputs"].get("coeffs_from", "profile test-cpu") == \
        "profile test-cpu"
    for method in ("alg5", "empirical"):  # both rules read this profile by path
        choice = choose_strategy(8, 72, 2, n_heads=8, n_kv_heads=2, head_dim=16, elem_bytes=4,
                                 hardware=load_hardware_profile(str(calibrated)), method=method)
        assert choice.inputs["hardware"] == "test-cpu"


def test_heuristic_quality_scores_the_grid(calibrated, tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nsomeone else's section\n")
    args = ["--profile", str(calibrated), "--json", "--write-doc", str(doc)]
    assert hq.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cells = len(cal.CalibrationConfig.quick(2).cells())
    for rule in result["rules"].values():
        assert rule["total"] == cells and 0 <= rule["correct"] <= cells
    rules = result["rules"]
    assert rules["always pass-KV"]["correct"] + rules["always pass-Q"]["correct"] >= cells  # one is the faster
    bound, alg5 = rules["Alg. 5, best C/BW (in-sample bound)"], rules["Alg. 5 (Eq. 5) [engine default]"]
    assert bound["correct"] >= alg5["correct"]
    sim = result["simulated"]  # the planner's cost model on the calibrated profile, one prediction per cell
    assert len(sim) == cells and all(c["pass-kv_s"] > 0 and c["pass-q_s"] > 0 for c in sim)
    picks = ["pass-kv" if c["pass-kv_s"] <= c["pass-q_s"] else "pass-q" for c in sim]
    full = [i for i, c in enumerate(result["grid"]) if c["P"] == 0]
    assert all(picks[i] == "pass-kv" for i in full)  # pass-Q's All2All makes it slower on full prefill
    assert hq.main(args) == 0  # rewriting replaces the section between the markers, nothing else
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nsomeone else's section\n")
    assert text.count(hq.BEGIN) == 1 and text.count(hq.END) == 1


def test_leave_one_out_never_sees_the_scored_cell():
    grid = [dict(T=t, P=p, **{"pass-kv_s": kv, "pass-q_s": q})
            for t, p, kv, q in [(64, 0, 1, 2), (64, 3000, 2, 1), (256, 256, 1, 2), (256, 12000, 3, 2), (1024, 0, 1, 3)]]
    loo = hq.leave_one_out(grid)
    for i, coeffs in enumerate(loo):
        rest = [(c["T"], c["P"], c["pass-kv_s"], c["pass-q_s"]) for j, c in enumerate(grid) if j != i]
        assert coeffs == pytest.approx(fit_empirical(rest))


def test_attention_curve_fit_recovers_l0():
    rates = [(n, 2.0 * (n / 2) / (n / 2 + 300)) for n in (256, 1024, 4096)]  # A_inf = 2, L0 = 300
    assert cal.attention_overhead_tokens(rates) == pytest.approx(300, rel=1e-6)
    assert cal.attention_overhead_tokens([(1024, 1.0), (4096, 0.9)]) == 0.0  # faster on short blocks: no curve


def test_profile_uses_the_measured_attention_curve(calibrated):
    hw = load_hardware_profile(str(calibrated))
    record, _ = cal.load_calibration(calibrated)
    causal = [a for a in record["compute"]["attention"] if a["causal"]]
    assert hw.attn_ref_tokens == max(a["length"] for a in causal) and hw.attn_overhead_tokens >= 0
    assert "cpinfer calibrate" in hw.sources["attn_overhead_tokens"]
    assert hw.ring_step_us == pytest.approx(record["ring_step_us"])


def test_fit_link_recovers_latency_and_bandwidth():
    points = [(b, 50e-6 + b / 2e9) for b in (4096, 65536, 1 << 20, 16 << 20)]
    lat, bw = cal.fit_link(points)
    assert lat == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(2e9, rel=1e-6)


@pytest.mark.parametrize("argv,fragment", [
    (["--cp", "0"], "--cp must be an integer >= 2"),
    (["--cp", "1"], "--cp must be an integer >= 2"),
    (["--cp", "2", "--heads", "6", "--kv-heads", "4"], "multiple of kv-heads"),
    (["--cp", "2", "--base", "no-such-profile"], "unknown hardware"),
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, fragment, capsys):
    assert _exit_code(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert "cpinfer calibrate: error:" in err and fragment in err
