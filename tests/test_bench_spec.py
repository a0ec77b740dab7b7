"""`cpinfer bench spec`: its arguments, its workloads (passages of the demo document), the table it computes and
writes into the benchmarks doc, with a fake engine runner (no ranks started)."""
from __future__ import annotations

import json

import pytest

from cpinfer.bench import spec as bench_spec
from cpinfer.cli import build_parser
from cpinfer.cli import main as cli_main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def test_arguments_and_defaults():
    args = build_parser().parse_args(["bench", "spec"])
    assert (args.cp, args.k, args.lookup_min, args.lookup_max) == ([1, 2], 4, 2, 4)
    assert args.func is bench_spec.run
    args = build_parser().parse_args(["bench", "spec", "--cp", "2,1", "--k", "3", "--lookup-min", "1",
                                      "--lookup-max", "5", "--tokens", "8", "--requests", "2"])
    assert args.cp == [1, 2] and bench_spec.spec_config(args) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 1}


def test_bad_lookup_bounds_are_one_clear_line(capsys):
    assert cli_main(["bench", "spec", "--lookup-min", "5", "--lookup-max", "2"]) == 2
    assert "--lookup-min (5) must be <= --lookup-max (2)" in capsys.readouterr().err


def test_quoting_prompts_hold_the_passage_they_ask_for():
    doc = "\n\n".join(["# Title", "```", "code line " * 40, "```",
                       " ".join(f"alpha{i}" for i in range(40)), "- a list item " * 10,
                       " ".join(f"beta{i}" for i in range(35))])
    assert bench_spec.passages(doc) == [" ".join(f"alpha{i}" for i in range(40)),
                                        " ".join(f"beta{i}" for i in range(35))]
    msgs = [m[0]["content"] for m in bench_spec.quoting_messages(doc, 6)]
    assert "Quote, word for word" in msgs[0] and doc in msgs[0] and 'begins with "alpha0 alpha1' in msgs[0]
    assert msgs[1].startswith("Repeat the following passage exactly") and msgs[1].endswith("beta34")
    assert msgs[2].startswith("Repeat the following") and msgs[2].endswith("alpha39")
    assert "replaced by" in msgs[3] and "beta34" in msgs[3]
    assert len(set(msgs)) == 6  # every (passage, task) pair once
    with pytest.raises(ValueError, match="no prose paragraph"):
        bench_spec.passages("# only a heading")


def fake_runner(calls):
    """An engine stand-in: 'plain' decodes at 0.1 s per token; with speculation, quoting 2.5x faster with 3 of 4
    drafts accepted, chat 0.9x with 1 of 4."""
    def run(model, cp, speculative, workloads, max_tokens, hw):
        calls.append((cp, speculative, {n: len(p) for n, p in workloads.items()}, max_tokens, hw["device"]))
        out = {}
        for name, prompts in workloads.items():
            rows = []
            for _ in prompts:
                tokens = list(range(max_tokens))
                if speculative is None:
                    rows.append({"tokens": tokens, "decode_s": 0.1 * (max_tokens - 1), "spec": {}})
                    continue
                speed, acc = (2.5, 3) if name == "quoting" else (0.9, 1)
                rows.append({"tokens": tokens, "decode_s": 0.1 * (max_tokens - 1) / speed,
                             "spec": {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 2 * acc}})
            out[name] = rows
        return out
    return run


def test_run_writes_the_table_with_a_fake_engine(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(bench_spec, "run_engine", fake_runner(calls))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:spec begin -->\nold\n<!-- bench:spec end -->\n\ntail\n")
    assert cli_main(["bench", "spec", "--cp", "1,2", "--tokens", "10", "--requests", "2", "--doc-tokens", "1500",
                     "--write-doc", str(doc), "--json"]) == 0
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert calls == [(cp, s, {"quoting": 2, "chat": 2}, 10, "cpu") for cp in (1, 2) for s in (None, cfg)]
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {(r["cp"], r["workload"]): r for r in res["rows"]}
    assert set(rows) == {(1, "quoting"), (1, "chat"), (2, "quoting"), (2, "chat")}
    q, c = rows[(2, "quoting")], rows[(2, "chat")]
    assert q["plain_tokens_per_s"] == pytest.approx(10.0) and q["spec_tokens_per_s"] == pytest.approx(25.0)
    assert q["speedup"] == pytest.approx(2.5) and q["acceptance"] == pytest.approx(0.75)
    assert q["accepted_per_step"] == pytest.approx(3.0) and q["identical"] and q["k"] == 4
    assert c["speedup"] == pytest.approx(0.9) and c["acceptance"] == pytest.approx(0.25)
    text = doc.read_text()
    assert "old" not in text and text.startswith("# Benchmarks") and text.endswith("tail\n")
    assert "### Speculative decoding with prompt lookup" in text and "cpinfer bench spec --cp 1,2 --k 4" in text
    assert "| CP2 | quoting | decode | 2 | 20 | 10.0 | 25.0 | 2.50x | 16 | 0.75 | 3.00 | 4 | yes | met (>= 2x) |" \
        in text
    assert "| CP1 | chat | decode | 2 | 20 | 10.0 | 9.0 | 0.90x | 16 | 0.25 | 1.00 | 4 | yes | NOT met (>= 1x) |" \
        in text


def test_both_verify_paths_side_by_side(capsys, monkeypatch):
    """--verify decode,prefill: one plain run per CP size, one speculative run per path (the prefill path's engine
    given spec_verify='prefill'), a row per (CP, workload, path); a bad path is one clear argument error;
    --placement shard reaches every engine."""
    calls = []
    monkeypatch.setattr(bench_spec, "run_engine", lambda *a: calls.append(a[5].get("spec_verify")) or
                        fake_runner([])(*a))
    assert cli_main(["bench", "spec", "--cp", "2", "--tokens", "10", "--requests", "2", "--doc-tokens", "1500",
                     "--verify", "decode,prefill", "--json"]) == 0
    assert calls == [None, None, "prefill"]
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["workload"], r["verify"]) for r in res["rows"]] == [("quoting", "decode"), ("chat", "decode"),
                                                                    ("quoting", "prefill"), ("chat", "prefill")]
    assert "--verify decode,prefill" in res["command"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "spec", "--verify", "decode,eager"])
    placements = []
    monkeypatch.setattr(bench_spec, "run_engine", lambda *a: placements.append(a[5].get("placement")) or
                        fake_runner([])(*a))
    assert cli_main(["bench", "spec", "--cp", "2", "--tokens", "10", "--requests", "2", "--placement", "shard",
                     "--json"]) == 0
    assert placements == ["shard", "shard"] and "--placement shard" in capsys.readouterr().out


def test_runs_end_to_end_on_a_tiny_checkpoint_and_keeps_the_greedy_tokens(tmp_path, capsys):
    """The real engine at CP1 and CP2, with and without n-gram speculation, on a 2-layer random model that wears the
    embedded model's tokenizer: every output identical, the counters consistent, the table written."""
    import shutil

    from cpinfer.model.random_checkpoint import write_random_checkpoint
    from cpinfer.model.resolve import resolve_model

    model = write_random_checkpoint(tmp_path / "tiny", vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                    tie_word_embeddings=True)  # small layers + tied head: it repeats its input
    embedded = resolve_model(None)
    for name in TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, model / name)
    doc = tmp_path / "benchmarks.md"
    assert cli_main(["bench", "spec", "--model", str(model), "--cp", "1,2", "--k", "3", "--lookup-min", "1",
                     "--lookup-max", "3", "--tokens", "12", "--requests", "2", "--doc-tokens", "300",
                     "--write-doc", str(doc), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["cp"], r["workload"]) for r in res["rows"]] == [(1, "quoting"), (1, "chat"), (2, "quoting"),
                                                                (2, "chat")]
    for r in res["rows"]:
        assert r["identical"], r            # speculation never changes a greedy output
        assert r["output_tokens"] == 2 * 12 and r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
        assert 0 <= r["accepted"] <= r["drafted"] <= 3 * r["verify_steps"]
    # the tied random model repeats its last token, so prompt lookup drafts and the drafts are accepted
    assert all(r["drafted"] > 0 and r["accepted"] > 0 for r in res["rows"])
    assert "| CP2 | chat | decode | 2 | 24 |" in doc.read_text()
