"""`cpinfer bench agent` on a tiny random checkpoint at CP1 (3 short turns per API, a server with prefix caching on
and one with it off): the report's structure, cached prompt tokens that grow turn by turn with caching on (each turn
reads at least the previous turn's whole prompt) and are 0 with it off, and the plot. Never timing.
"""
from __future__ import annotations

import argparse

import pytest

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
