"""The benchmark clients' own requests, replayed against `cpinfer serve` (CP2, a tiny model) and read back the way
each client reads its stream, to find the chunk it times as the first token.

The clients themselves (vLLM's `vllm bench serve`, GuideLLM, AIPerf) are too heavy to install in the test run (a CPU
vLLM with its torch, GuideLLM's CUDA torch: GBs), so scripts/bench_clients.sh runs them for real, and with
`--record` keeps every request they sent and every stream they got (scripts/record_proxy.py): those are
tests/data/bench_clients/*.jsonl (the proxy leaves out the /metrics scrapes AIPerf and vLLM make). Here each
recorded request is sent again unchanged (body, path, method) and must get the status it got then; each stream is
parsed by a re-statement of that client's rule for TTFT and output length:

- vLLM (`vllm/benchmarks/lib/endpoint_request_func.py`): the first `data:` chunk whose `choices` is non-empty is the
  first token, whatever it holds; output tokens from the `usage` of a chunk without choices.
- GuideLLM (`backends/openai/request_handlers.py` + `http.py`): the first line that adds text (delta content /
  text) is the first token; usage from any chunk that has it.
- AIPerf (`endpoints/openai_chat.py`, `metrics/types/ttft_metric.py`): the first response with content; on
  `--endpoint-type messages` / `responses` (the agent APIs) the first text delta.

What must hold for their TTFT to be the real one: the stream has no chunk with choices before the one that carries
the first token — so vLLM's rule (the weakest: any chunk with choices) meets as many such chunks as tokens were
generated, never one more (a role-only chunk sent before prefill would be that one more) — and every rule finds its
first token and the output length the request asked for.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server_utils import ServerProcess, served_checkpoint

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data" / "bench_clients"
CLIENTS = ["vllm-completions", "vllm-chat", "guidellm", "aiperf", "aiperf-messages", "aiperf-responses"]
NAME = "bench-model"  # the --served-model-name scripts/bench_clients.sh gives: the recorded bodies name it


@pytest.fixture(scope="module")
def server(llama_checkpoint, tmp_path_factory):
    d = served_checkpoint(llama_checkpoint, tmp_path_factory, "bench_clients_model", max_position_embeddings=8192)
    srv = ServerProcess(["--model", str(d), "--cp", "2", "--served-model-name", NAME, "--max-model-len", "8192",
                         "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "16384", "--log-level", "warning"])
    yield srv
    srv.close()


def _recorded(client: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{client}.jsonl").read_text().splitlines() if line.strip()]


def _replay(server, entry: dict) -> tuple[int, list[str]]:
    """Send a recorded request again; its status and `data:` payloads (a whole reply: its body as one)."""
    method, path, body = entry["method"], entry["path"], entry["body"]
    kwargs = {"json": body} if isinstance(body, (dict, list)) else {}
    with httpx.stream(method, server.url + path, timeout=120, **kwargs) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code, [r.read().decode()]


def _text(choice: dict) -> str | None:
    return choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")


def _vllm(chunks: list[dict]) -> tuple[int, int | None, int]:
    """(index of the TTFT chunk, output tokens, chunks with choices), as vLLM's bench serve reads a stream."""
    first, tokens, seen = None, None, 0
    for i, data in enumerate(chunks):
        if data.get("choices"):
            seen += 1
            first = i if first is None else first
        elif data.get("usage"):
            tokens = data["usage"].get("completion_tokens")
    return first, tokens, seen


def _first_content(chunks: list[dict]) -> tuple[int | None, int | None]:
    """(index of the first chunk that adds text, output tokens from usage): GuideLLM's and AIPerf's reading."""
    first, tokens = None, None
    for i, data in enumerate(chunks):
        choices = data.get("choices") or []
        if first is None and choices and _text(choices[0]):
            first = i
        if data.get("usage"):
            tokens = data["usage"].get("completion_tokens")
    return first, tokens


def _check_agent_stream(path: str, events: list[dict]) -> None:
    """AIPerf on /v1/messages and /v1/responses: the first text delta is its first token; the opening events go out
    with it (the server sends none before the first token); the text deltas never outnumber the output tokens."""
    kinds = [e["type"] for e in events]
    if path == "/v1/messages":
        delta, opening, last = "content_block_delta", {"message_start", "content_block_start"}, "message_stop"
        tokens = next(e["usage"]["output_tokens"] for e in events if e["type"] == "message_delta")
    else:
        delta, last = "response.output_text.delta", ("response.completed", "response.incomplete")
        opening = {"response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added"}
        tokens = events[-1]["response"]["usage"]["output_tokens"]
    assert delta in kinds and kinds[-1] in last, kinds
    first = kinds.index(delta)
    assert set(kinds[:first]) <= opening, kinds[:first]
    assert 1 <= kinds.count(delta) <= tokens, (kinds.count(delta), tokens)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_benchmark_clients_recorded_requests_replay_and_time_the_first_token(server, client):
    entries = _recorded(client)
    streams = [e for e in entries if e["method"] == "POST" and isinstance(e["body"], dict)
               and e["body"].get("stream")]
    assert streams, f"no streamed request recorded for {client}"
    for entry in entries:
        if entry["path"] == "/metrics":  # Prometheus text, scraped around the run
            continue
        status, events = _replay(server, entry)
        assert status == entry["status"] == 200, (client, entry["path"], status, events[:1])
        if entry not in streams:
            continue
        if entry["path"] in ("/v1/messages", "/v1/responses"):
            for got in (events, entry["events"]):  # replayed, then as the real client got it
                _check_agent_stream(entry["path"], [json.loads(e) for e in got])
            continue
        assert events[-1] == "[DONE]" and entry["events"][-1] == "[DONE]", events[-3:]
        body = entry["body"]
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if body.get("ignore_eos") is not True:  # a client that does not send ignore_eos may stop early (EOS)
            asked = None
        _check_openai_stream([json.loads(e) for e in events[:-1]], asked)
        # the recorded stream (the real model, the real client) had the same shape
        _check_openai_stream([json.loads(e) for e in entry["events"][:-1]], asked)


def _check_openai_stream(chunks: list[dict], asked: int | None) -> None:
    first, tokens, with_choices = _vllm(chunks)
    assert first == 0 and tokens is not None and 1 <= tokens, chunks[:2]
    assert with_choices <= tokens, f"{with_choices} chunks with choices for {tokens} tokens: one came early"
    assert asked is None or tokens == asked, (tokens, asked)
    start, usage_tokens = _first_content(chunks)
    assert start is not None and usage_tokens == tokens, chunks[:3]
    assert all(not _text(c["choices"][0]) for c in chunks[:start] if c.get("choices"))


def test_the_check_catches_a_chunk_sent_before_the_first_token():
    """A role-only chunk ahead of the first token (what vLLM's client took as the first token, timing a prefill of
    seconds as milliseconds) fails the check; so does a usage that disagrees with the request."""
    entry = next(e for e in _recorded("vllm-chat") if e["path"] == "/v1/chat/completions")
    chunks = [json.loads(e) for e in entry["events"][:-1]]
    _check_openai_stream(chunks, 8)
    early = {**chunks[0], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}
    later = [{**chunks[0], "choices": [{**chunks[0]["choices"][0], "delta": {"content": "The"}}]}, *chunks[1:]]
    with pytest.raises(AssertionError, match="one came early"):
        _check_openai_stream([early, *later], 8)
    with pytest.raises(AssertionError):
        _check_openai_stream(chunks, 9)


def test_the_recordings_hold_each_clients_request_shape():
    """What each client sent, as recorded (so a new client version that sends something else shows up here)."""
    shapes = {}
    for client in CLIENTS:
        streams = [e["body"] for e in _recorded(client) if isinstance(e["body"], dict) and e["body"].get("stream")]
        shapes[client] = streams[0]
        assert all(b["model"] == NAME for b in streams)
    assert {"prompt", "max_tokens", "ignore_eos", "stream_options"} <= set(shapes["vllm-completions"])
    assert {"messages", "max_completion_tokens", "ignore_eos"} <= set(shapes["vllm-chat"])
    assert shapes["vllm-chat"]["stream_options"] == {"include_usage": True}
    assert {"messages", "stream_options"} <= set(shapes["aiperf"]) and "messages" in shapes["guidellm"]
