"""`scripts/gpu_check.sh` where there is no GPU (one line, exit 0, after importing its parts), and the pieces of
`cpinfer.bench.gpu_check` that need no GPU: the parts' order and limits within the budget, skipping what would not
fit, rows saved as they come, failures that keep the other rows, and the report merged from two calls."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cpinfer.bench import gpu_check, gpu_driver
from cpinfer.bench import gpu_results as R

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run every part")
def test_script_without_a_gpu_says_so_in_one_line_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_DEVICE"}
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=300, env=dict(env, PYTHON=sys.executable))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "the parts" in lines[0], res.stdout
    bad = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: bash scripts/gpu_check.sh OUT_DIR" in bad.stderr


def test_most_valuable_first_and_both_calls_fit_the_budget():
    """b, c, d, f first (their limits fit 450 s with the report's reserve), then a and e (which fit a second call)."""
    names = [p.name for p in gpu_check.PARTS]
    assert names == ["b", "c", "d", "f", "a", "e"] and gpu_check.BUDGET_S == 450
    limit = {p.name: p.limit_s for p in gpu_check.PARTS}
    reserve = gpu_driver.REPORT_RESERVE_S
    assert sum(limit[n] for n in "bcdf") + reserve <= gpu_check.BUDGET_S
    assert sum(limit[n] for n in "ae") + reserve <= gpu_check.BUDGET_S
    assert gpu_check.BUDGET_S + 30 <= 8 * 60  # the budget plus the start and the report: within 8 minutes


def test_parts_that_do_not_fit_are_skipped_with_the_command_that_runs_them(tmp_path, capsys):
    """A budget too small for c, d: they are skipped (no process starts), the report says so, and the last line
    names the follow-up call that runs exactly them."""
    parts = [gpu_check.Part("c", 160, "prefill", None), gpu_check.Part("d", 90, "decode", None)]
    ok = gpu_driver.run_all(parts, tmp_path / "out", 60, ["c", "d"], "bash scripts/gpu_check.sh", dict(os.environ),
                            "a GPU", "Versions: none.")
    lines = capsys.readouterr().out.strip().splitlines()
    assert not ok
    assert [ln for ln in lines if "SKIPPED" in ln] == ["== (c) prefill: SKIPPED (needs up to 160 s, 50 s left)",
                                                       "== (d) decode: SKIPPED (needs up to 90 s, 50 s left)"]
    assert f"run them with: bash scripts/gpu_check.sh {tmp_path / 'out'}-2 --only c,d" in lines[-2]
    assert sorted(os.listdir(tmp_path / "out")) == [R.REPORT, R.LOGS, R.RESULTS]
    report = (tmp_path / "out" / R.REPORT).read_text()
    assert "#### (c) prefill: SKIPPED" in report and "skipped: needs up to 160 s" in report
    with pytest.raises(ValueError, match="unknown part"):
        gpu_driver.plan(parts, ["z"])


def test_a_part_killed_at_its_limit_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """The driver kills a part's process group at its limit; the rows it wrote before stay, in the report too."""
    hang = ("import sys, time\nfrom pathlib import Path\nfrom cpinfer.bench.gpu_results import Recorder\n"
            "Recorder(Path(sys.argv[1]), 'c').row('cpinfer prefill', ['tokens', 'TTFT (s)'], [32768, 1.9])\n"
            "time.sleep(120)\n")
    monkeypatch.setattr(gpu_driver, "part_command", lambda name, out, logs: [sys.executable, "-c", hang, str(out)])
    out, said = tmp_path / "out", []
    out.mkdir()
    t0 = time.monotonic()
    status, seconds = gpu_driver.run_part_process(gpu_check.Part("c", 4, "prefill", None), out, tmp_path, {
        **os.environ, "PYTHONPATH": str(REPO)}, said.append)
    assert status == "timeout" and 4 <= seconds < 30 and time.monotonic() - t0 < 30
    assert said == ["   (c) cpinfer prefill: 32768 | 1.9"]  # its progress line, relayed
    part = R.load(out)["parts"]["c"]
    assert part["status"] == "timeout" and part["tables"][0]["rows"] == [["32768", "1.9"]]
    ok, text = R.render(R.load(out), [("c", "prefill")])
    assert not ok and "#### (c) prefill: FAIL, timed out" in text and "| 32768 | 1.9 |" in text


def test_rows_are_saved_as_they_come_and_a_failure_keeps_the_others(tmp_path, monkeypatch, capsys):
    def part(rec, setup):
        rec.row("t", ["what", "value"], ["first", 1])
        assert json.loads((tmp_path / R.RESULTS).read_text())["parts"]["x"]["tables"][0]["rows"] == [["first", "1"]]
        rec.check(False, "token 3 differs from HF's")
        rec.row("t", ["what", "value"], ["after the failure", 2])
        return {"markdown": "notes"}

    monkeypatch.setattr(gpu_check, "PARTS", [gpu_check.Part("x", 10, "a part with a failed comparison", part)])
    assert gpu_check.run_part("x", tmp_path, setup=gpu_check.Setup.toy()) is False
    assert capsys.readouterr().out.splitlines()[:3] == ["(x) t: first | 1", "(x) FAIL: token 3 differs from HF's",
                                                       "(x) t: after the failure | 2"]
    res = R.load(tmp_path)["parts"]["x"]
    assert res["status"] == "fail" and res["failures"] == ["token 3 differs from HF's"]
    assert res["tables"][0]["rows"] == [["first", "1"], ["after the failure", "2"]] and res["markdown"] == "notes"


def test_a_crashing_part_keeps_its_rows_and_traceback(tmp_path, monkeypatch):
    def boom(rec, setup):
        rec.row("kernels", ["check", "result"], ["small shapes", "ok"])
        raise RuntimeError("kernel off by 1.0")

    monkeypatch.setattr(gpu_check, "PARTS", [gpu_check.Part("x", 10, "a check that crashes", boom)])
    assert gpu_check.run_part("x", tmp_path, setup=gpu_check.Setup.toy()) is False
    res = R.load(tmp_path)["parts"]["x"]
    assert res["status"] == "fail" and "kernel off by 1.0" in res["error"] and res["tables"][0]["rows"]


def test_report_merges_two_calls_and_writes_the_doc_section(tmp_path):
    """The first call's parts and the --only follow-up's become one report (a part skipped in the first call is
    taken from the second); a timed-out part shows the rows it measured; the doc keeps its other sections."""
    first, second = tmp_path / "out", tmp_path / "out-2"
    for d in (first, second):
        d.mkdir()
    R.save(first, {"format": R.FORMAT, "device": "NVIDIA H100 80GB HBM3 x 1", "versions": "Versions: torch.",
                   "runs": [{"command": "bash scripts/gpu_check.sh out", "seconds": 431.0, "date": "2026-11-28"}],
                   "parts": {"b": {"status": "pass", "seconds": 40.0, "limit_s": 90, "markdown": "GEMM 780 TFLOP/s",
                                   "tables": [{"name": "attention", "header": ["tokens", "TFLOP/s"],
                                               "rows": [["8192", "612.0"]]}], "failures": []},
                             "c": {"status": "timeout", "seconds": 160.0, "limit_s": 160, "error": "killed",
                                   "tables": [{"name": "cpinfer prefill", "header": ["tokens", "TTFT (s)"],
                                               "rows": [["32768", "1.9"]]}], "failures": []},
                             "a": {"status": "skipped", "reason": "skipped: needs up to 150 s"}}})
    R.save(second, {"format": R.FORMAT, "runs": [{"command": "bash scripts/gpu_check.sh out-2 --only a",
                                                  "seconds": 120.0, "date": "2026-11-28"}],
                    "parts": {"a": {"status": "pass", "seconds": 100.0, "tables": [], "failures": [],
                                    "markdown": "max diff 1e-3 (a | b)"}}})
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    order = [(p.name, p.title) for p in gpu_check.PARTS]
    ok, text = R.write_report([first, second], order, doc)
    assert not ok and "Overall: FAIL" in text
    assert "bash scripts/gpu_check.sh out    # 2026-11-28, 431 s" in text and "--only a    # 2026-11-28, 120 s" in text
    assert "| 8192 | 612.0 |" in text and ": PASS, 40 s (limit 90 s)" in text
    assert ": FAIL, timed out, 160 s" in text and "| 32768 | 1.9 |" in text
    assert "#### (a) " in text and "max diff 1e-3" in text and "SKIPPED" not in text
    assert "#### (e) " in text and ": NOT RUN" in text
    assert (second / R.REPORT).read_text() == text
    assert "kept" in doc.read_text() and "<!-- bench:gpu begin -->" in doc.read_text()
    assert R.table_md(["a"], [["x | y"]]).splitlines()[-1] == "| x \\| y |"


def test_decode_part_compares_up_to_a_near_tie():
    """Part d's check of graphs vs eager decode: tokens equal until a bf16 near tie, log-probs within the tolerance
    up to and at the first difference; a real disagreement fails."""
    from types import SimpleNamespace as Out

    a = Out(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.2, -0.69, -0.3])
    assert gpu_check._same_decode(a, Out(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.21, -0.7, -0.3])) == 4
    assert gpu_check._same_decode(a, Out(token_ids=[5, 6, 9, 1], logprobs=[-0.1, -0.2, -0.70, -5.0])) == 2
    with pytest.raises(AssertionError, match="log-probs 2.000 apart"):
        gpu_check._same_decode(a, Out(token_ids=[5, 6, 9, 1], logprobs=[-0.1, -0.2, -2.69, -5.0]))
