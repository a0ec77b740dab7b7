"""The engine-facing commands on a tiny random checkpoint: `cpinfer generate`, `cpinfer bench prefill` (the demo on
the real model is tested in test_cli.py).

Each runs in-process through `cpinfer.cli.main` (ranks are spawned by the engine); sizes are tiny to stay fast.
"""
from __future__ import annotations

import json

import pytest

from cpinfer.cli import main
from cpinfer.model import write_random_checkpoint

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0, **TINY)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPINFER_CACHE", str(tmp_path / "cache"))


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.parametrize("placement", ["auto", "shard"])
def test_generate_cp2_json(ckpt, capsys, placement):
    rc = main(["generate", "--model", str(ckpt), "--cp", "2", "--prompt-ids", "1,2,3", "--max-tokens", "3",
               "--placement", placement, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = _last_json(out)
    assert len(res["token_ids"]) == 3 and res["prompt_tokens"] == 3 and res["cp"] == 2
    assert res["ttft_s"] > 0 and len(res["ttit_s"]) == 2
    if placement == "shard":  # spread over both ranks: ring pass-KV prefill, pass-Q decode
        assert res["strategy"]["prefill"].startswith("pass-kv") and res["strategy"]["decode"].startswith("pass-q")
        assert res["placement"]["placement"] == "spread" and res["placement"]["method"] == "forced"
    else:  # three tokens: one rank, no ring; the prediction is printed
        assert res["strategy"] == {"prefill": "local (no-ring)", "decode": "local (no-ring)"}
        assert res["placement"]["placement"] == "local" and res["placement"]["local_s"] < res["placement"]["spread_s"]
        assert "placement: one rank (predicted" in out


def test_generate_reports_speculation_and_prefill_decode_groups(ckpt, capsys):
    """--speculative-config: the drafted / accepted counts are printed (and in --json); --pd-decode-cp: the
    prefill time and the K/V moved to the decode group."""
    ids = ",".join(["7", "8", "9", "10"] * 6)  # a repeating prompt: prompt lookup has something to draft
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", ids, "--max-tokens", "8", "--ignore-eos",
                 "--speculative-config", spec, "--json"]) == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert "speculation: " in out and res["spec"]["num_drafts"] > 0, out
    assert res["spec"]["num_draft_tokens"] >= res["spec"]["num_accepted_tokens"] >= 0
    assert main(["generate", "--model", str(ckpt), "--cp", "1", "--pd-decode-cp", "1", "--prompt-ids", "1,2,3",
                 "--max-tokens", "3", "--json"]) == 0
    out = capsys.readouterr().out
    res = _last_json(out)
    assert "prefill/decode: prefill CP 1 in" in out and res["pd"]["transfer_tokens"] == 3, out
    assert res["pd"]["transfer_bytes"] > 0 and res["token_ids"] and len(res["token_ids"]) == 3


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,x"], "comma-separated token ids"),
    (["--prompt-ids", "1,2", "--cp", "0"], "positive integer"),
    (["--prompt", "hello"], "no tokenizer"),
    (["--prompt-ids", "1,99999"], "outside"),
    (["--prompt-ids", "1", "--hardware-profile", "no-such"], "unknown hardware"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "must be in (0, 1]"),
])
def test_generate_bad_input_exits_2(ckpt, capsys, argv, message):
    try:
        rc = main(["generate", "--model", str(ckpt), *argv])
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_generate_missing_model_exits_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "no such folder or .gguf file" in capsys.readouterr().err


def test_bench_prefill_small_json(capsys):
    rc = main(["bench", "prefill", "--cp", "1,2", "--tokens", "256", "--json", "--hidden", "64", "--heads", "4",
               "--kv-heads", "2", "--ffn", "128", "--vocab", "256"])
    res = _last_json(capsys.readouterr().out)
    assert rc == 0
    assert set(res["efficiency"]) == {"1", "2"} and res["efficiency"]["1"] == pytest.approx(1.0)
    assert res["efficiency"]["2"] > 0 and res["hf"]["ttft_s"] > 0
    assert res["engine"]["2"]["strategy"] == "pass-kv"
