"""`scripts/gpu_check.sh` where there is no GPU (one line, exit 0, after importing its parts), and the pieces of
`cpinfer.bench.gpu_check` that need no GPU: the part list and its time budget, and the report of failed parts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpinfer.bench import gpu_check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run every part")
def test_script_without_a_gpu_says_so_in_one_line_and_exits_0():
    res = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "the parts import" in lines[0], res.stdout


def test_parts_fit_the_25_minute_budget_and_report_failures(tmp_path):
    names = [p.name for p in gpu_check.PARTS]
    assert names[-1] == "report" and {"a", "b", "c", "d", "e"} <= set(names)
    assert sum(p.limit_s for p in gpu_check.PARTS) <= 24 * 60
    (tmp_path / "a.json").write_text(json.dumps({"part": "a", "ok": True, "seconds": 12.0, "error": None,
                                                 "markdown": "| check | result |"}))
    (tmp_path / "b.json").write_text(json.dumps({"part": "b", "ok": False, "seconds": 3.0,
                                                 "error": "AssertionError: implausible rate"}))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    ok, text = gpu_check.write_report(tmp_path, doc)
    assert not ok and "Overall: FAIL" in text
    assert "(a) " in text and ": PASS, 12 s" in text and "| check | result |" in text
    assert "implausible rate" in text
    assert "(c) " in text and "no result (timed out or crashed" in text  # c and e never wrote a result
    assert (tmp_path / "gpu_check.md").read_text() == text
    assert "kept" in doc.read_text() and "<!-- bench:gpu begin -->" in doc.read_text()


def test_a_failing_part_writes_its_error(tmp_path, monkeypatch):
    def boom(out):
        raise AssertionError("kernel off by 1.0")
    monkeypatch.setattr(gpu_check, "PARTS", [gpu_check.Part("x", 10, "a check that fails", boom)])
    assert gpu_check.run_part("x", tmp_path) is False
    res = json.loads((tmp_path / "x.json").read_text())
    assert res["ok"] is False and "kernel off by 1.0" in res["error"]


def test_decode_part_compares_up_to_a_near_tie():
    """Part d's check of graphs vs eager decode: tokens equal until a bf16 near tie, log-probs within the tolerance
    up to and at the first difference; a real disagreement fails."""
    from types import SimpleNamespace as Out

    a = Out(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.2, -0.69, -0.3])
    assert gpu_check._same_decode(a, Out(token_ids=[5, 6, 7, 8], logprobs=[-0.1, -0.21, -0.7, -0.3])) == 4
    assert gpu_check._same_decode(a, Out(token_ids=[5, 6, 9, 1], logprobs=[-0.1, -0.2, -0.70, -5.0])) == 2
    with pytest.raises(AssertionError, match="log-probs 2.000 apart"):
        gpu_check._same_decode(a, Out(token_ids=[5, 6, 9, 1], logprobs=[-0.1, -0.2, -2.69, -5.0]))
