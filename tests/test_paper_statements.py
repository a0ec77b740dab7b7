"""Every quantitative statement of the paper's public text (cpinfer/perf/statements.py, one row each with its
source) checked against the performance model on h100-gtt; the fitted parameters reproduced by the fit."""
import pytest

from cpinfer.perf import fit
from cpinfer.perf.catalog import FIT, HARDWARE
from cpinfer.perf.statements import BY_KEY, STATEMENTS, evaluate, profile_for

GTT = HARDWARE["h100-gtt"]
# The model misses these by more than 10%; docs/planning.md says why ("What the model misses"). They are checked
# at a bound just above today's error, so a change that makes them worse fails.
KNOWN_MISSES = {
    "tp64_vs_cp8": 0.20,       # +18%: would need an inter-node all-reduce faster than the 50 GB/s NIC
    "single_host_128k": 0.27,  # -25%: §1's "60 s" contradicts §4.2.1's 5.85 s on CP8 with halving per doubling
}


@pytest.mark.parametrize("statement", STATEMENTS, ids=lambda s: s.key)
def test_statement(statement):
    hw = profile_for(statement, GTT)
    value = statement.model(hw)
    if statement.kind == "value":
        tol = KNOWN_MISSES.get(statement.key, statement.tol)
        assert value == pytest.approx(statement.paper, rel=tol), statement.source
    else:
        assert value > 0, f"{statement.quote} does not hold (margin {value:.4g}); {statement.source}"


def test_table_is_complete_and_sourced():
    keys = [s.key for s in STATEMENTS]
    assert len(keys) == len(set(keys)) >= 40
    for s in STATEMENTS:
        assert s.source and s.quote and s.kind in ("value", "holds")
        assert s.kind == "holds" or s.paper != 0
    for key in ("ttft_cp16_1m", "tflops_1m", "parallel_efficiency_1m", "halving_cp4_cp8", "gti_cp2_cp4",
                "tipping_5pct", "pass_kv_wins_16000", "ttit_flat_cp2", "decode_pass_q_total_grows",
                "choice_above_12_5pct", "choice_10pct", "choice_5pct", "choice_below_3_25pct"):
        assert key in BY_KEY


def test_catalog_holds_the_fitted_values():
    values = fit.fit()
    for name, value in values.items():
        assert getattr(GTT, name) == pytest.approx(value, rel=0.05), name
        assert FIT[name] == getattr(GTT, name) and GTT.sources[name].startswith("fitted")


def test_fit_recovers_parameters_from_a_perturbed_start():
    """From another start the fit lands on the same values. (Start inter_gbs where pass-KV's SendRecv is still
    exposed at the tipping point: above ~22 GB/s it hides and the statement no longer moves with it.)"""
    import dataclasses
    start = dataclasses.replace(GTT, gemm_efficiency=0.5, inter_gbs=18.0, ring_step_us=60.0)
    values = fit.fit(start=start)
    for name in ("inter_gbs", "inter_latency_us"):  # pinned by one statement each: recovered
        assert values[name] == pytest.approx(getattr(GTT, name), rel=0.10), name
    # gemm_efficiency and ring_step_us trade off along a shallow valley (docs/planning.md): the fit's quality,
    # not the point, is what a new start must reproduce
    assert fit.cost(values) == pytest.approx(fit.cost({k: getattr(GTT, k) for k in fit.FITTED}), rel=0.05)


def test_held_out_prediction_of_the_1m_prefill():
    """Leave-one-out for the headline: fitted without the 77 s statement, the model still predicts it."""
    rest = [s for s in fit.fitted_statements() if s.key != "ttft_cp16_1m"]
    hw = fit.fitted_profile(fit.fit(rest))
    assert BY_KEY["ttft_cp16_1m"].model(hw) == pytest.approx(77.0, rel=0.10)


def test_evaluate_reports_every_row():
    rows = evaluate()
    assert len(rows) == len(STATEMENTS)
    misses = {r["key"] for r in rows if not r["passes"]}
    assert misses <= set(KNOWN_MISSES)


def test_the_heuristic_statements_fail_when_the_pick_is_wrong():
    """The §4.2.4 pick statements can fail: on the peak rates Alg. 5 ties at 2.5% and picks pass-KV there."""
    import dataclasses
    peaks = dataclasses.replace(GTT, attn_tflops=800.0, attn_overhead_tokens=0.0, inter_gbs=50.0)
    assert BY_KEY["choice_below_3_25pct"].model(peaks) < 0
    assert BY_KEY["choice_below_3_25pct"].model(GTT) > 0


def test_fit_command_prints_every_statement(capsys):
    assert fit.main(["--no-loo"]) == 0
    out = capsys.readouterr().out
    for s in STATEMENTS:
        assert f"`{s.key}`" in out
    assert out.count("| NO |") == len(KNOWN_MISSES)


def test_write_doc_fills_the_marked_sections(tmp_path):
    from cpinfer.perf import planning_doc
    doc = tmp_path / "plan.md"
    args = "--model llama3-8b --hardware h200 --cp 2 --prompt-tokens 4096"
    doc.write_text("intro\n<!-- begin:parameters -->\nOLD-TABLE\n<!-- end:parameters -->\n"
                   "<!-- begin:statements -->\n<!-- end:statements -->\n<!-- begin:leave-one-out -->\n"
                   "<!-- end:leave-one-out -->\n<!-- begin:miss-rate-grid -->\n<!-- end:miss-rate-grid -->\n"
                   "<!-- begin:pd-table -->\n<!-- end:pd-table -->\n<!-- begin:spec-table -->\n<!-- end:spec-table -->\n"
                   "<!-- begin:hybrid-table -->\n<!-- end:hybrid-table -->\n"
                   f"<!-- plan: {args} -->\n```\nSTALE-OUTPUT\n```\ntail\n")
    done = planning_doc.write_doc(doc)
    text = doc.read_text()
    assert "OLD-TABLE" not in text and "STALE-OUTPUT" not in text
    assert text.startswith("intro") and text.endswith("tail\n")
    assert "| `gemm_efficiency` |" in text and "`tipping_5pct`" in text and "Median held-out error" in text
    assert "| 1000000 | fp8 | CP2 x TP8 |" in text and "| paper | 4 |" in text  # the P/D and speculation tables
    assert "| 1000000 | CP16 x TP8 |" in text  # the hybrid (Qwen3.5) table
    assert f"$ cpinfer plan {args}\nmodel     llama3-8b" in text and len(done) == 8
    (tmp_path / "bad.md").write_text("no markers")
    with pytest.raises(ValueError, match="begin:parameters"):
        planning_doc.write_doc(tmp_path / "bad.md")
