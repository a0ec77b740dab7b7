"""`cpinfer bench prefill --family qwen3_5` on a tiny Qwen3.5-shaped hybrid at CP1 and CP2 (issue 47 must 7): the
report's structure, the recurrent exchanges counted on every rank, the three-way exchange probe and the doc section
(no timing is asserted: the machine is shared)."""
from __future__ import annotations

import json

import pytest

from cpinfer.cli import main
from cpinfer.engine import recurrent


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPINFER_CACHE", str(tmp_path / "cache"))


def test_hybrid_prefill_bench_reports_the_summary_exchange(tmp_path, capsys):
    doc = tmp_path / "bench.md"
    rc = main(["bench", "prefill", "--family", "qwen3_5", "--cp", "1,2", "--tokens", "256", "--layers", "4",
               "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "256",
               "--linear-head-dim", "16", "--json", "--write-doc", str(doc)])
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and res["family"] == "qwen3_5" and "hf" not in res
    assert set(res["efficiency"]) == {"1", "2"} and res["efficiency"]["1"] == pytest.approx(1.0)
    assert "3 Gated DeltaNet (2 key / 4 value heads x 16) + 1 gated attention" in res["model"]
    assert res["engine"]["1"]["exchange"] == [{"wait_s": 0.0, "exchange_s": 0.0, "bytes": 0, "calls": 0,
                                               "relays": 0}]
    assert "exchange_probe" not in res["engine"]["1"]  # one rank: nothing exchanged
    cp2 = res["engine"]["2"]
    assert cp2["strategy"] == "pass-kv" and len(cp2["exchange"]) == 2
    map_bytes = 4 * 16 * (16 + 16) * 4  # value heads x Dk x (Dk + Dv) fp32
    for rank in cp2["exchange"]:  # 3 recurrent layers, 2 all-reduces each in the prefill (rows, maps) + decode's
        # 3 shards (4 chunks, 2 adjacent): the first two ship their end states alone (half a map), the third a map
        assert rank["calls"] >= 3 * 2 and rank["bytes"] >= 3 * 2 * map_bytes
        assert rank["exchange_s"] > 0 and rank["wait_s"] >= 0
    # per recurrent layer, the first shard's owner (chunk 0) relays its end state to the second's (chunks 1-2)
    assert sorted(rank["relays"] for rank in cp2["exchange"]) == [0, 3]
    probe = cp2["exchange_probe"]
    assert probe["bytes"] == {"all_reduce": 2 * map_bytes, "all_gather": 2 * 2 * map_bytes, "relay": map_bytes // 2}
    assert all(probe[w + "_s"] > 0 for w in ("all_reduce", "all_gather", "relay"))
    assert "--family qwen3_5" in res["command"] and "--linear-head-dim 16" in res["command"]
    text = doc.read_text()
    assert "Engine prefill of a qwen3_5 hybrid, 256 tokens, CP 1, 2" in text and res["command"] in text
    assert "Recurrent summary exchange per prefill" in text and "| 2 | relay |" in text
    assert recurrent.EXCHANGE_TIMER is None  # (the in-process CP1 rank switched its timer off again)


def test_bad_hybrid_shape_is_one_clear_error(capsys):
    assert main(["bench", "prefill", "--family", "qwen3_5", "--linear-key-heads", "3", "--linear-value-heads", "4",
                 "--tokens", "64", "--cp", "1"]) == 2
    assert "--linear-value-heads (4) must be a multiple of --linear-key-heads (3)" in capsys.readouterr().err
