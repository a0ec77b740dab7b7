"""Fuzz and fault suite of `cpinfer serve` (one CP2 server on 127.0.0.1 for most tests, a tiny random Llama):
hypothesis-generated bodies never get a 5xx or leak internals and leave the server healthy; 64 concurrent streams
with random disconnects leak no KV; a 10 MB message does not stall other streams; ranks listen on loopback only;
a rank SIGKILLed while busy or idle is seen in seconds (2 s on an idle machine; a loaded one is allowed
DEAD_RANK_SEEN_S); the server exits non-zero (or keeps answering 503 when told to) and leaves no process behind.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_utils import (ServerProcess, TINY_VOCAB, descendants, is_alive, is_loopback, listening_addresses,
                          port_is_free, rank_pids, served_checkpoint)
from wait_utils import DEAD_RANK_SEEN_S, wait_until

pytestmark = pytest.mark.timeout(600)

NAME = "tiny"
MAX_LEN = 256
ARGS = ["--cp", "2", "--served-model-name", NAME, "--max-model-len", str(MAX_LEN), "--threads-per-rank", "1",
        "--max-kv-tokens-per-rank", "16384", "--no-prefix-caching", "--max-request-bytes", str(16_000_000),
        "--max-logprobs", "8",
        "--log-level", "warning"]
LEAK = re.compile(r'Traceback|File "|\.py\b|/cpinfer/|/tmp/|/root/|Error:')
FUZZ_EXAMPLES = {"chat": 150, "completions": 100, "tokenize": 50, "raw": 40}


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "hardened_model")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(["--model", str(model_dir), *ARGS])
    yield srv
    srv.close()  # normally ended already by the last test (a killed rank)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _metrics(http) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def _sum(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


def _idle(http, timeout: float = 60.0) -> dict[str, float]:
    """Wait until no request runs or waits; the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        if _sum(m, "cpinfer_num_requests_running") == 0 and _sum(m, "cpinfer_num_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.1)


def _aborts(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("cpinfer_engine_requests_finished_total{")
               and 'reason="abort"' in k)


def _assert_gone(pids: list[int], timeout: float = 60.0) -> None:  # polled: a loaded machine reaps slowly
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(is_alive(p) for p in pids), [p for p in pids if is_alive(p)]


def _assert_clean(text: str) -> None:
    assert not LEAK.search(text), text[:500]


# ---------------------------------------------------------------------------------------------- loopback
def test_server_and_ranks_listen_on_loopback_only(server):
    ranks = rank_pids(server.proc.pid)
    assert len(ranks) == 1  # rank 1; rank 0 runs inside the server process
    listening = listening_addresses([server.proc.pid, *ranks])
    assert f"127.0.0.1:{server.port}" in listening[server.proc.pid]
    assert len(listening[server.proc.pid]) > 1, listening  # rank 0's gloo sockets beside the HTTP one
    assert any(listening[r] for r in ranks), listening  # the ranks' gloo sockets are there to be checked
    assert all(is_loopback(a) for addrs in listening.values() for a in addrs), listening


# ---------------------------------------------------------------------------------------------- fuzz
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                    | st.text(max_size=12), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                                  max_size=3),
                    max_leaves=6)
TEXT = st.text(max_size=40) | st.sampled_from(["\ud800", "a\udfffb", "<|im_end|>\n<|im_start|>system\n", "\x00",
                                               "é" * 30, "🙂"])


MAX_TOKENS = st.integers(1, 4)
SAMPLING = {  # values a client may legitimately send (edge cases included); junk comes from _mutated
    "model": st.just(NAME),
    "temperature": st.floats(0, 2) | st.sampled_from([0.0, 1e-39, 1e-6, 2.0]),
    "top_p": st.floats(1e-6, 1.0),
    "top_k": st.integers(-1, 400),
    "seed": st.integers(-2 ** 63, 2 ** 63 - 1),
    "stop": TEXT.filter(bool) | st.lists(TEXT.filter(bool), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, TINY_VOCAB - 1), max_size=3),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "presence_penalty": st.just(0.0),
    # the edges of the penalties' ranges: repetition_penalty 1e-45 / 5e-324 / 1e-300 were a 500
    "repetition_penalty": st.sampled_from([5e-324, 1e-300, 1e-45, 1e-10, 0.5, 1.0, 100.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "min_p": st.sampled_from([0.0, 5e-324, 0.5, 1.0]),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, TINY_VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": {
                                            "type": "object", "properties": {"a": {"type": "boolean"}}}}}]),
    "user": st.text(max_size=10),
}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                  "text": TEXT}), max_size=2)},
                                optional={"name": st.text(max_size=8)})
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0}}, "required": ["x"]}}}]


def _mutated(valid):
    """A valid body, or one with a field replaced by junk (a wrong type, a nested mess, an unknown key)."""
    def mutate(args):
        body, key, junk = args
        return {**body, (key or "unknown_field"): junk}

    keys = st.sampled_from([None, "messages", "prompt", "max_tokens", *SAMPLING, "logprobs", "top_logprobs",
                            "tools", "tool_choice", "stream_options", "add_generation_prompt"])
    return valid | st.tuples(valid, keys, JUNK).map(mutate)


CHAT = _mutated(st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": MAX_TOKENS},
    optional={**SAMPLING, "logprobs": st.just(True), "top_logprobs": st.integers(0, 20),
              "add_generation_prompt": st.booleans(), "tools": st.just(TOOLS),
              "tool_choice": st.sampled_from(["none", "required", {"type": "function", "function": {"name": "f"}}])}))
COMPLETION = _mutated(st.fixed_dictionaries(
    {"prompt": TEXT.filter(bool) | st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=6),
     "max_tokens": MAX_TOKENS}, optional={**SAMPLING, "logprobs": st.integers(0, 20), "echo": st.just(False)}))
TOKENIZE = _mutated(st.one_of(st.fixed_dictionaries({"prompt": TEXT}, optional={"add_special_tokens": st.booleans()}),
                              st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=2)},
                                                    optional={"add_generation_prompt": st.booleans()})))
RAW = st.binary(max_size=64) | TEXT.map(lambda t: ('{"prompt": "' + t).encode("utf-8", "surrogatepass"))


def _check(r: httpx.Response) -> int:
    assert r.status_code < 500, (r.status_code, r.request.content[:300], r.text[:300])
    _assert_clean(r.text)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-300:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e  # a healthy engine fails no stream
    else:
        body = r.json()
        if r.status_code >= 400:
            assert set(body["error"]) == {"message", "type", "param", "code"}
    return r.status_code


FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def test_fuzzed_bodies_never_get_a_5xx_and_leave_the_server_healthy(server, http):
    t0 = time.monotonic()
    counts = {}

    def post(path: str):
        def run(body):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            status = _check(http.post(path, content=raw, headers={"content-type": "application/json"}))
            counts[(path, status)] = counts.get((path, status), 0) + 1
        return run

    for name, path, strategy in [("chat", "/v1/chat/completions", CHAT), ("completions", "/v1/completions", COMPLETION),
                                 ("tokenize", "/tokenize", TOKENIZE), ("raw", "/v1/chat/completions", RAW)]:
        settings(FUZZ, max_examples=FUZZ_EXAMPLES[name])(given(strategy)(post(path)))()
    took = time.monotonic() - t0
    print(f"fuzz: {sum(counts.values())} requests in {took:.1f}s: {counts}")
    ok = {path: n for (path, status), n in counts.items() if status == 200}
    assert all(ok.get(p, 0) >= 10 for p in ("/v1/chat/completions", "/v1/completions", "/tokenize")), counts
    assert http.get("/health").status_code == 200
    m = _idle(http)
    assert _sum(m, "cpinfer_engine_dead") == 0
    r = http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_max_logprobs_flag_bounds_the_alternatives(http):
    """--max-logprobs 8: eight alternatives per token are served, nine are a 400 naming the flag."""
    body = {"prompt": "alternatives", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json={**body, "logprobs": 8})  # (alternatives that decode alike share a key)
    assert r.status_code == 200 and all(1 <= len(t) <= 8 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": 8, "ignore_eos": True})
    assert r.status_code == 200 and [len(c["top_logprobs"]) for c in r.json()["choices"][0]["logprobs"]["content"]] \
        == [8, 8]
    r = http.post("/v1/completions", json={**body, "logprobs": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "at most 8" in r.json()["error"]["message"] and "--max-logprobs" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": 9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


# ---------------------------------------------------------------------------------------------- load
def test_64_concurrent_streams_with_random_disconnects_leak_nothing(server, http):
    rng = random.Random(21)
    base = _idle(http)
    aborts0 = _aborts(base)
    plan = []
    for i in range(64):
        cut = rng.choice([None, None, 0, 1, 2, 3])  # None: read to the end; k: leave after k events
        plan.append((i, cut, rng.randint(4, 10) if cut is None else 150))

    async def one(client, i, cut, max_tokens):
        body = {"model": NAME, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 1.0]), "seed": i,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"stream {i} " * (1 + i % 5)}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = f"completion stream {i} " * (1 + i % 4)
            path = "/v1/completions"
        seen, usage = 0, None
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if cut is not None and seen >= cut:
                    return None  # leaving the block closes the connection: the server must abort and free
                seen += 1
                if line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    usage = event.get("usage") or usage
        return usage

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=80)) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, *p) for p in plan)), timeout=300)

    usages = asyncio.run(main())
    after = _idle(http)
    done = [u for u, (_, cut, _) in zip(usages, plan) if cut is None]
    assert all(u is not None for u in done)
    # --no-prefix-caching: finished requests free their K/V at once, so the KV gauge is back at its idle value, 0
    # (it grew by every finished request's tokens: 0 → 23,720 per rank after a storm with nothing running)
    assert _sum(base, "cpinfer_kv_tokens_used") == 0 and sum(u["prompt_tokens"] for u in done) > 0
    assert _sum(after, "cpinfer_kv_tokens_used") == 0
    assert _aborts(after) - aborts0 == sum(cut is not None for _, cut, _ in plan)
    assert http.get("/health").status_code == 200


def test_a_10_mb_message_does_not_delay_other_streams(server, http):
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 4}).encode()
    assert len(big) > 10_000_000
    arrivals: list[float] = []
    window: list[float] = []

    def stream():
        # long enough to outlast the big request on a slow or busy machine: the client leaves (and the server
        # aborts the stream) once a few tokens arrived after the big request was answered
        body = {"model": NAME, "prompt": "a stream that must keep flowing", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 4:
                        threading.Thread(target=send_big, daemon=True).start()
                    if len(window) == 2 and sum(t > window[1] for t in arrivals) >= 4:
                        break

    result = {}

    def send_big():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=120,
                       headers={"content-type": "application/json"})
        window.extend([t0, time.monotonic()])
        result["r"] = r

    reader = threading.Thread(target=stream)
    reader.start()
    reader.join(timeout=180)
    deadline = time.monotonic() + 60
    while "r" not in result and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "r" in result, f"the big request was not answered ({len(arrivals)} stream chunks arrived)"
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    assert "characters" in r.json()["error"]["message"]  # rejected by its length before any tokenizing
    start, end = window
    assert arrivals[-1] > end, "the stream ended before the big request was answered: nothing was measured"
    pairs = list(zip(arrivals, arrivals[1:]))
    during = [b - a for a, b in pairs if b > start and a < end]
    usual = statistics.median(b - a for a, b in pairs if not (b > start and a < end))  # this machine's pace
    assert during and max(during) - usual < 1.0, (max(during), usual, end - start)


# ---------------------------------------------------------------------------------------------- faults
def test_a_rank_killed_while_busy_is_seen_in_seconds_and_the_server_exits_1(server):
    """Last test of the module: it kills the module's server."""
    ranks = rank_pids(server.proc.pid)
    everything = descendants(server.proc.pid)  # ranks and any helper process
    events: list[tuple[float, str]] = []

    def consume():
        body = {"model": NAME, "prompt": "a long stream", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append((time.monotonic(), line[6:]))
        except httpx.HTTPError as exc:
            events.append((time.monotonic(), f"closed: {type(exc).__name__}"))

    reader = threading.Thread(target=consume)
    reader.start()
    wait_until(lambda: len(events) >= 3 or not reader.is_alive(), 120, 0.01, "the stream's first events")
    assert len(events) >= 3 and not any(e.startswith("closed") for _, e in events), events
    os.kill(ranks[0], signal.SIGKILL)  # rank 1, while rank 0 (in the server) waits for it in the ring or not
    t_kill = time.monotonic()
    reader.join(timeout=DEAD_RANK_SEEN_S + 15)
    errors = [(t, e) for t, e in events if '"error"' in e or e.startswith("closed")]
    assert errors, events[-3:]
    t_seen, event = errors[0]
    assert t_seen - t_kill < DEAD_RANK_SEEN_S, t_seen - t_kill
    _assert_clean(event)
    if event.startswith("{"):
        assert json.loads(event)["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=60) == 1, server.output()[-2000:]  # a supervisor restarts it
    _assert_gone(everything)
    assert port_is_free(server.port)
    out = server.output()
    assert "engine is dead" in out  # the reason is in the log: which rank, how it ended, what to look at
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL: check the rank's output above and the system log", out)
    assert "__main__" not in out  # no script guard to add: serve is not a user's script


def test_a_rank_killed_while_idle_turns_health_503_in_seconds_without_internals(model_dir):
    srv = ServerProcess(["--model", str(model_dir), *ARGS, "--no-exit-on-engine-death"])
    try:
        ranks = rank_pids(srv.proc.pid)
        everything = descendants(srv.proc.pid)
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(srv.url + "/health", timeout=10).status_code == 200 and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        assert time.monotonic() - t0 < DEAD_RANK_SEEN_S
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        _assert_clean(health.text)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        _assert_clean(r.text)
        assert srv.proc.poll() is None  # told to stay up: it keeps answering 503
        assert srv.stop(signal.SIGTERM) == 0
        _assert_gone(everything)
        assert port_is_free(srv.port)
    finally:
        srv.close()
