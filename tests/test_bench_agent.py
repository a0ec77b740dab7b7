"""`cpinfer bench agent` on a tiny random checkpoint at CP1 (3 short turns per API, a server with prefix caching on
and one with it off): the report's structure, cached prompt tokens that grow turn by turn with caching on (each turn
reads at least the previous turn's whole prompt) and are 0 with it off, and the plot. Never timing.

`--random-layers` (a random model of Llama-3-8B's width with the embedded tokenizer): its flags' errors before any
checkpoint is built or server started, the checkpoint builder at a tiny width (transformers and cpinfer load it and
agree; its tokenizer and chat template are the embedded model's), and the turn N / turn 1 columns of the report.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from server_utils import served_checkpoint

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def result(llama_checkpoint, tmp_path_factory):
    from cpinfer.bench.agent import add_arguments, format_report, measure

    model = served_checkpoint(llama_checkpoint, tmp_path_factory, "agent_bench")
    png = tmp_path_factory.mktemp("agent_plot") / "agent.png"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--cp", "1", "--turns", "3", "--tokens-per-turn", "90-150", "--output-tokens", "4",
                              "--model", str(model), "--max-model-len", "1024", "--max-kv-tokens-per-rank", "4096",
                              "--plot", str(png)])
    res = measure(args)
    return res, format_report(res), png


def test_every_api_replays_the_conversation_with_caching_on_and_off(result):
    res, _, _ = result
    assert res["cp"] == [1] and res["apis"] == ["chat", "messages", "responses"]
    assert sorted((r["api"], r["prefix_caching"]) for r in res["runs"]) == sorted(
        (api, on) for api in res["apis"] for on in (True, False))
    for run in res["runs"]:
        rows = run["turns"]
        assert [r["turn"] for r in rows] == [1, 2, 3]
        prompts = [r["prompt_tokens"] for r in rows]
        assert all(later > earlier + 90 for earlier, later in zip(prompts, prompts[1:])), (run["api"], prompts)
        assert all(r["ttft_s"] > 0 for r in rows)
        cached = [r["cached_tokens"] for r in rows]
        if run["prefix_caching"]:
            # a fresh conversation: at most the chat template's opening (shared with the warm-up) was seen before
            assert cached[0] < 32, (run["api"], cached)
            for k in (1, 2):  # turn k+1 reads at least turn k's whole prompt from the tree
                assert prompts[k - 1] <= cached[k] < prompts[k], (run["api"], prompts, cached)
            assert cached[1] < cached[2], (run["api"], cached)
        else:
            assert cached == [0, 0, 0], (run["api"], cached)
    # the same conversation on both servers (the tool outputs are seeded): turn 1's prompt is the same length
    for api in res["apis"]:
        firsts = {r["turns"][0]["prompt_tokens"] for r in res["runs"] if r["api"] == api}
        assert len(firsts) == 1, (api, firsts)


def test_report_and_plot(result):
    res, report, png = result
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert f"CP1, {path}" in report
    assert "TTFT on ms" in report and "cached (off)" in report and "caching on" in report
    assert res["command"].startswith("cpinfer bench agent --cp 1 --turns 3 --tokens-per-turn 90-150")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and res["plot"] == str(png)


def test_bench_agent_arguments():
    from cpinfer.bench.agent import _apis, _token_range

    assert _token_range("1000-3000") == (1000, 3000) and _token_range("64") == (64, 64)
    for bad in ("0", "3-1", "a-b", "-5"):
        with pytest.raises(argparse.ArgumentTypeError, match="LO <= HI"):
            _token_range(bad)
    assert _apis("responses,chat,chat") == ["responses", "chat"]
    with pytest.raises(argparse.ArgumentTypeError, match="--apis"):
        _apis("chat,completions")


# ---------------------------------------------------------------------------------------------- --random-layers
def _args(argv):
    from cpinfer.bench.agent import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["--random-layers", "--model", "x"], "mutually exclusive"),
    (["--hidden", "64"], "--hidden: only with --random-layers"),
    (["--ffn", "64", "--random-dir", "/tmp"], "--ffn, --random-dir: only with --random-layers"),
    (["--random-layers", "--hidden", "60", "--heads", "8"], r"--heads \(8\) must divide --hidden \(60\)"),
    (["--random-layers", "--hidden", "96", "--heads", "32"], "even size"),  # head_dim 3
    (["--random-layers", "--heads", "8", "--kv-heads", "3"], r"--kv-heads \(3\) must divide --heads \(8\)"),
])
def test_random_model_flags_fail_before_anything_starts(monkeypatch, capsys, argv, message):
    from cpinfer.bench import agent, serve
    from cpinfer.cli import main as cli_main

    def never(*a, **k):
        raise AssertionError("built a checkpoint or started a server on bad flags")

    monkeypatch.setattr(agent, "build_random_model", never)
    monkeypatch.setattr(serve._Server, "__init__", never)
    with pytest.raises(ValueError, match=message):
        agent.check_arguments(_args(argv))
    assert cli_main(["bench", "agent", *argv]) == 2
    err = capsys.readouterr().err
    assert "cpinfer bench: error:" in err and "Traceback" not in err


def test_random_model_flag_parsing():
    from cpinfer.bench.agent import WIDTH, command_line, resolve_width

    args = _args(["--random-layers"])
    assert args.random_layers == 2 and resolve_width(args) == WIDTH == {"hidden": 4096, "heads": 32, "kv_heads": 8,
                                                                         "ffn": 14336}
    assert " --random-layers 2" in command_line(args) and "--hidden" not in command_line(args)
    args = _args(["--random-layers", "3", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512"])
    assert resolve_width(args) == {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512}
    assert "--random-layers 3 --hidden 256 --heads 4 --kv-heads 2 --ffn 512" in command_line(args)
    with pytest.raises(SystemExit):  # argparse: positive integers only
        _args(["--random-layers", "0"])
    assert _args([]).random_layers is None


def test_random_model_builder_at_a_tiny_width(tmp_path, capsys):
    """The checkpoint --random-layers serves, at hidden 64: transformers and cpinfer's loader open it and agree on
    the log-probs; config as asked (Llama-3's rope, tied embeddings, the embedded vocabulary); the embedded model's
    tokenizer and chat template; built once, then reused."""
    transformers = pytest.importorskip("transformers")
    from cpinfer.bench.agent import build_random_model
    from cpinfer.model import ReferenceAttention, load_model
    from cpinfer.model.resolve import resolve_model

    path = build_random_model(2, hidden=64, heads=4, kv_heads=2, ffn=96, root=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("bench-agent-")
    built = capsys.readouterr().err
    assert "built a random 2-layer checkpoint (hidden 64, 2 layers, 4 heads x 16, 2 KV heads, ffn 96" in built
    assert str(path) in built
    cfg = json.loads((path / "config.json").read_text())
    embedded = resolve_model(None)
    ref = json.loads((embedded / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"]) == (64, 2, 4, 2, 16, 96)
    assert cfg["rope_theta"] == 500000.0 and cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert [cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")] == [
        ref[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")]

    # the tokenizer and chat template are the embedded model's: the same workload tokenizes identically
    ours, theirs = (transformers.AutoTokenizer.from_pretrained(str(p)) for p in (path, embedded))
    text = "Tool grep (call 2) returned:\nsrc/cache_17.py:412: def prefill(self, query) -> None  # ring shard\n"
    assert ours.encode(text) == theirs.encode(text) and len(ours) == len(theirs)
    chat = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    # transformers and cpinfer's loader open it and compute the same log-probs
    ids = torch.tensor(ours.encode(text)[:24])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_lp = hf(ids[None]).logits[0].float().log_softmax(-1)
        _, model = load_model(path)
        positions = torch.arange(len(ids))
        hidden = model(ids, positions, ReferenceAttention(torch.zeros_like(ids), positions, config=model.config))
        got_lp = model.compute_logits(hidden).log_softmax(-1)
    torch.testing.assert_close(got_lp, ref_lp, atol=1e-4, rtol=0)

    # built once: the same shape is found again, not rewritten
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_random_model(2, hidden=64, heads=4, kv_heads=2, ffn=96, root=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp and "using the cached" in capsys.readouterr().err
    assert build_random_model(3, hidden=64, heads=4, kv_heads=2, ffn=96, root=tmp_path) != path  # another shape


def _synthetic_result():
    def run(cp, api, caching, ttfts):
        return {"cp": cp, "api": api, "prefix_caching": caching,
                "turns": [{"turn": k + 1, "ttft_s": t, "prompt_tokens": 1000 * (k + 1),
                           "cached_tokens": 1000 * k if caching else 0} for k, t in enumerate(ttfts)]}

    return {"model": "a random 2-layer model of Llama-3-8B's width", "shape": "hidden 4096, 2 layers, 32 heads x 128",
            "hardware": "cpu, float32", "turns": 3, "tokens_per_turn": [1000, 2000], "output_tokens": 64,
            "cp": [1], "apis": ["chat"],
            "runs": [run(1, "chat", True, [2.0, 2.2, 2.5]), run(1, "chat", False, [2.0, 4.1, 6.0])]}


def test_report_turn_ratio_columns():
    from cpinfer.bench.agent import TABLE_HEADER, format_report, turn_rows

    res = _synthetic_result()
    on, off = res["runs"]
    rows = turn_rows(on, off)
    header = TABLE_HEADER
    col = {name: [r[header.index(name)] for r in rows] for name in header}
    assert col["on: turn N / turn 1"] == ["1.00", "1.10", "1.25"]   # 2.2 / 2.0, 2.5 / 2.0
    assert col["off: turn N / turn 1"] == ["1.00", "2.05", "3.00"]  # 4.1 / 2.0, 6.0 / 2.0
    assert col["off / on"] == ["1.00", "1.86", "2.40"] and col["TTFT on ms"] == ["2000", "2200", "2500"]
    assert col["cached (on)"] == ["0", "1000", "2000"] and col["cached (off)"] == ["0", "0", "0"]

    report = format_report(res)
    # the heading names the random model and its shape
    assert report.startswith("Agent conversations, a random 2-layer model of Llama-3-8B's width (hidden 4096, "
                             "2 layers, 32 heads x 128), cpu, float32: 3 turns")
    assert "| " + " | ".join(header) + " |" in report
    assert "| 3 | 3000 | 2000 | 2500 | 0 | 6000 | 2.40 | 1.25 | 3.00 |" in report
    assert "last turn's TTFT / first turn's: caching on 1.25, off 3.00" in report
