"""The `cpinfer` command line: help, `bench attention --json`, the attention demo, and clear errors on bad input."""
import json
import subprocess
import sys

import pytest

from cpinfer.bench.attention import write_doc_section
from cpinfer.cli import main
from cpinfer.commands.demo import run_attention_demo


def _cpinfer(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "cpinfer", *argv], capture_output=True, text=True, timeout=timeout)


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors exit directly
        return exc.code


def test_help_lists_commands():
    res = _cpinfer("--help")
    assert res.returncode == 0
    for command in ("bench", "demo"):
        assert command in res.stdout
    res = _cpinfer("bench", "--help")
    assert res.returncode == 0 and "attention" in res.stdout


def test_bench_attention_json_last_line():
    res = _cpinfer("bench", "attention", "--cp", "1,2", "--tokens", "256", "--repeat", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert "efficiency" in res.stdout  # the table comes first
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(data["efficiency"]) == {"1", "2"}
    assert data["efficiency"]["1"] == pytest.approx(1.0)
    assert data["efficiency"]["2"] > 0
    assert [len(data["steps"][n]) for n in ("1", "2")] == [1, 2]  # one ring step per rank of the ring
    assert [(p["new"], p["cached"]) for p in data["partial"]] == [(16, 240), (64, 192), (256, 0), (1, 255)]
    assert all(p[s] > 0 for p in data["partial"] for s in ("pass-kv", "pass-q", "all-gather"))


def test_attention_demo_matches_single_device():
    turns = (("full", (70, 33, 5), (0, 0, 0)), ("partial", (9, 1, 16), (70, 33, 5)))
    rows = run_attention_demo(2, turns=turns, head_dim=16)
    assert [(r.case.split()[0], r.strategy) for r in rows] == [
        (c, s) for c in ("full", "partial") for s in ("pass-kv", "pass-q", "all-gather")]
    assert all(r.ok and r.max_abs_err < 1e-5 for r in rows), rows


@pytest.mark.parametrize("argv,fragment", [
    (["bench", "attention", "--cp", "0"], "--cp"),
    (["bench", "attention", "--cp", "1,x"], "--cp"),
    (["bench", "attention", "--tokens", "-5"], "--tokens"),
    (["bench", "attention", "--heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
    (["bench", "no-such-bench"], "invalid choice"),
    (["demo", "--cp", "0"], "--cp"),
])
def test_bad_arguments_exit_2_with_a_clear_message(capsys, argv, fragment):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and fragment in err


def test_bench_without_a_benchmark_prints_help(capsys):
    assert _exit_code(["bench"]) == 2
    assert "attention" in capsys.readouterr().out


def test_write_doc_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro stays.\n")
    write_doc_section(doc, "attention-256", "first\n")
    write_doc_section(doc, "attention-512", "other\n")
    write_doc_section(doc, "attention-256", "second\n")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nIntro stays.\n")
    assert "second" in text and "first" not in text and "other" in text
    assert text.count("<!-- bench:attention-256 begin -->") == 1
    assert text.index("second") < text.index("other")  # replaced in place, not moved to the end
