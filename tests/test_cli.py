"""The `cpinfer` command line: help, `bench attention --json`, the real-model demo (short), the attention demo,
`generate` on the default model and on a .gguf file, and clear errors on bad input."""
import json
import re
import subprocess
import sys

import pytest

from checkpoints import write_tiny_gguf
from cpinfer.bench.attention import write_doc_section
from cpinfer.cli import main
from cpinfer.commands import demo
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


def test_serve_and_generate_help_list_every_family():
    from cpinfer.model.families import FAMILIES

    for command in ("serve", "generate"):
        res = _cpinfer(command, "--help")
        text = " ".join(res.stdout.split())  # argparse wraps lines
        assert res.returncode == 0 and "Families (config.json model_type, docs/models.md):" in text
        assert all(name in text for name in FAMILIES) and {"minimax_m2", "gemma4_text", "gemma4"} <= set(
            text.replace(",", " ").split())


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


def test_bench_attention_chunk_counts_what_the_plans_skip():
    """`bench attention --chunk`: the skipped shares come from the plans (no ranks): 1024 tokens at CP4 with chunk
    256 pair the ranks (0, 1) and (2, 3), so step 2 and 8 of 12 messages go, 5/6 of the bytes and 3/4 of the tiles;
    the command line records --chunk; all-gather is refused before any rank starts."""
    import argparse

    from cpinfer.bench.attention import add_arguments, command_line, prefill_layout, run, window_stats

    st = window_stats(prefill_layout([1024], [0], 4), None, "pass-kv", 2, 1, 16, chunk=256)
    assert (st["steps_skipped"], st["messages_skipped"], st["messages"]) == (1, 8, 12)
    assert st["bytes_skipped_share"] == pytest.approx(5 / 6)
    assert st["tiles_skipped_share"] == pytest.approx(0.75, abs=2e-3)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--cp", "2,4", "--tokens", "1024", "--chunk", "256", "--window", "64"])
    assert command_line(args).endswith("--tokens 1024 --heads 8 --kv-heads 2 --head-dim 128 --repeat 3 --chunk 256 "
                                       "--window 64")
    with pytest.raises(ValueError, match="--window / --chunk compare the ring strategies"):
        run(parser.parse_args(["--chunk", "256", "--strategy", "all-gather"]))


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
    (["bench", "agent", "--apis", "chat,completions"], "--apis: comma-separated names from chat, messages, responses"),
    (["bench", "agent", "--tokens-per-turn", "3000-1000"], "LO <= HI"),
    (["demo", "--cp", "0"], "--cp"),
    (["demo", "--document", "/no/such/file.md"], "no such file"),
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "x"], "no such GGUF file"),
    (["generate", "--chat", "--prompt-ids", "1,2"], "--chat needs --prompt"),
    (["serve", "--tensor-paralel-size", "2"], "--tensor-paralel-size (did you mean --tensor-parallel-size?)"),
    (["serve", "--enable-prefix-cache"], "(did you mean --enable-prefix-caching?)"),
    (["generate", "--prompt", "x", "--max-token", "3", "--tempreature", "0"],
     "--tempreature (did you mean --temperature?)"),
    (["serve", "--no-such-flag-at-all"], "unrecognized arguments: --no-such-flag-at-all"),
    (["serve", "some/model", "--model", "other/model"], "the model is given twice"),
    (["serve", "--ssl-keyfile", "/no/key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["serve", "--allowed-origins", "*"], "expected a JSON list of strings"),
    (["serve", "--generation-config", "/no/such/dir"], "expected auto, vllm or a folder"),
])
def test_bad_arguments_exit_2_with_a_clear_message(capsys, argv, fragment):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and fragment in err


def test_version_and_serve_help_in_groups_with_each_default_once():
    res = _cpinfer("--version")
    assert res.returncode == 0 and res.stdout.strip().startswith("cpinfer ")
    res = _cpinfer("serve", "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: cpinfer serve [MODEL] [options]")
    groups = re.findall(r"^(\w[\w ]*):$", res.stdout, flags=re.M)
    assert groups[:2] == ["positional arguments", "options"]
    assert {"model", "frontend", "parallel", "cache", "scheduler", "observability", "hardware"} <= set(groups)
    flags = re.split(r"\n  (?=-)", res.stdout)
    twice = [f.split()[0] for f in flags if f.count("(default") > 1]
    assert not twice, twice
    for flag in ("-tp TP, --tensor-parallel-size TP", "--enable-prefix-caching, --no-enable-prefix-caching",
                 "--enable-auto-tool-choice", "--chat-template", "--allowed-origins", "--root-path", "--ssl-keyfile",
                 "--ssl-certfile", "--seed", "--revision", "--download-dir", "--tokenizer", "--generation-config",
                 "--enable-log-requests"):
        assert flag in res.stdout, flag
    assert "(default: 8000)" in res.stdout and "(default: None)" not in res.stdout
    assert "--no-prefix-caching   the same as --no-enable-prefix-caching\n" in res.stdout  # a switch: no default


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


def _table(out: str) -> list[list[str]]:
    """Rows of the demo's turn table: CP, turn, prompt, cached, prefill strategy, ..."""
    return [line.split("  ") for line in out.splitlines() if line[:1].isdigit() and "[" in line]


def test_demo_short_real_conversation_passes(capsys):
    rc = main(["demo", "--doc-tokens", "300", "--max-tokens", "6", "--skip-attention", "--threads-per-rank", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS: turn 1" in out and "PASS: turn 2" in out and out.rstrip().endswith("demo: PASS")
    assert out.count("answer 1:") == 2 and out.count("answer 2:") == 2
    rows = [[c.strip() for c in r if c.strip()] for r in _table(out)]
    assert [(r[0], r[1]) for r in rows] == [("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")]
    for cp, turn, prompt, cached, prefill, decode, placement, *_, kv in rows:
        if turn == "1":
            first_prompt = int(prompt)
            assert cached == "0"
        else:
            assert int(cached) >= first_prompt  # the document's K/V from turn 1 is reused
        assert len(json.loads(kv)) == int(cp)
        if placement == "spread":  # ring pass-KV for the document, pass-Q decode
            assert cp == "2" and (turn == "2" or prefill.startswith("pass-kv")) and decode.startswith("pass-q")
        else:  # one rank holds the conversation: no ring at all
            assert placement == "local" and prefill.startswith("local") and decode.startswith("local")
    why = re.findall(r"^\[CP=2\] turn \d: (spread over the ranks|one rank) — (.+)$", out, re.M)
    assert len(why) == 2 and "predicted" in why[0][1]  # why each turn was spread or kept on one rank
    rule = re.search(r"^\[CP=2\] placement auto: with up to 6 answer tokens, a new prompt of (\d+) tokens or more "
                     r"spreads", out, re.M)  # when a prompt spreads at all, from the engine's cost model
    assert rule and (int(rule.group(1)) <= first_prompt) == (rows[2][6] == "spread")


def test_demo_document_keeps_whole_paragraphs(tmp_path):
    from transformers import AutoTokenizer

    from cpinfer.model.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    doc = tmp_path / "d.md"
    doc.write_text("alpha beta gamma\n\ndelta epsilon\n\n" + "zeta " * 500)
    text, n = demo.build_document(tok, 20, [doc])
    assert text == "alpha beta gamma\n\ndelta epsilon" and n == len(tok(text)["input_ids"])


def test_compare_turns_flags_a_mismatch():
    def turn(cp, tokens, lps):
        return demo.TurnResult(cp, 1, 10, 0, tokens, lps, "", 0.1, [], "pass-kv", "pass-q", [10])

    ok, lines = demo.compare_turns([turn(1, [1, 2], [-1.0, -2.0]), turn(2, [1, 2], [-1.0, -2.00005])])
    assert ok and lines[0].startswith("PASS")
    ok, lines = demo.compare_turns([turn(1, [1, 2], [-1.0, -2.0]), turn(2, [1, 2], [-1.0, -2.01])])
    assert not ok and lines[0].startswith("FAIL")
    ok, _ = demo.compare_turns([turn(1, [1, 2], [-1.0, -2.0]), turn(2, [1, 3], [-1.0, -2.0])])
    assert not ok


def test_demo_states_when_a_prompt_spreads():
    from cpinfer.engine.kv.placement import CostModel, Placer, Work
    from cpinfer.perf.hardware import load_hardware_profile
    from cpinfer.perf.model_spec import ModelSpec

    smol = ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True)
    placer = Placer("auto", 2, CostModel(smol, load_hardware_profile("cpu-gloo"), 2, compute_share=0.5))
    t = placer.crossover(48)
    assert f"a new prompt of {t} tokens or more spreads" in demo.placement_rule(placer, 48)
    assert placer.decide(Work(t, 0, 0, 48), -1, 0, None).spread
    assert not placer.decide(Work(t - 1, 0, 0, 48), -1, 0, None).spread
    assert "every request spreads" in demo.placement_rule(Placer("shard", 2), 48)
    assert "stays on one rank" in demo.placement_rule(Placer("local", 2), 48)


def test_generate_default_model_chat(capsys):
    rc = main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--json",
               "--threads-per-rank", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    assert "Paris" in res["text"] and res["cp"] == 1


def test_generate_gguf_file_and_max_model_len(tmp_path, monkeypatch, capsys, cpinfer_warnings):
    monkeypatch.setenv("CPINFER_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")          # context length 256
    rc = main(["generate", "--model", str(gguf), "--prompt", "the theme", "--max-tokens", "3", "--ignore-eos",
               "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 3
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1   # converted once, into the cache
    long = ["--prompt-ids", ",".join(["5"] * 250), "--max-tokens", "10", "--ignore-eos"]
    assert main(["generate", "--model", str(gguf), *long]) == 2
    err = capsys.readouterr().err
    assert "260" in err and "256" in err                     # refused with the numbers
    assert main(["generate", "--model", str(gguf), "--max-model-len", "300", *long, "--json"]) == 0
    assert any("300" in m and "256" in m and "not guaranteed" in m for m in cpinfer_warnings)
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]) == 10


def test_serve_fits_max_model_len_to_the_kv_cache(capsys):
    """2048 KV tokens per rank at CP 1 hold 1982 tokens for one request, less than the embedded model's 8192: a
    --max-model-len 8192 is refused before any rank starts; left to the model, the served max_model_len is lowered
    (one warning with both numbers), /v1/models says so, and a chat request without max_tokens is accepted."""
    import httpx

    from server_utils import ServerProcess

    assert _exit_code(["serve", "--max-kv-tokens-per-rank", "2048", "--max-model-len", "8192", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert ("cpinfer serve: error: max_model_len 8192 does not fit the KV cache: 2048 KV tokens per rank x CP 1 hold "
            "at most 1982 tokens for one request (prompt + output); lower max_model_len to 1982 or less") in err, err
    server = ServerProcess(["--max-kv-tokens-per-rank", "2048", "--threads-per-rank", "1", "--log-level", "warning"])
    try:
        assert httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"] == 1982
        body = {"messages": [{"role": "user", "content": "Hello"}], "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            assert next(r.iter_lines()).startswith("data: ")  # accepted and streaming: enough (then disconnect)
        assert server.stop() == 0
        warned = [line for line in server.output().splitlines() if "max_model_len lowered" in line]
        assert len(warned) == 1 and "from 8192 (the model's max_position_embeddings) to 1982" in warned[0], warned
    finally:
        server.close()
