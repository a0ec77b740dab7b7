"""Operators' bad days against `cpinfer serve` (a tiny random Llama on 127.0.0.1): SIGTERM to the whole process
group mid-stream (systemd's default stop) lets in-flight requests finish and exits 0 with no process left; a client
that stops reading a stream is cut off after the stall timeout, its request aborted, and the server's memory stays
flat meanwhile; the queue gauges count a request as running during its (held) step; streams still running at the
graceful timeout end with an "abort" chunk and [DONE]; a storm of disconnecting clients logs no traceback.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess, descendants, in_thread, is_alive, metric_values, served_checkpoint
from wait_utils import DEAD_RANK_SEEN_S, SETTLE_S, wait_until

pytestmark = pytest.mark.timeout(300)

ARGS = ["--served-model-name", "tiny", "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "16384",
        "--log-level", "warning"]


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "faults_model", max_position_embeddings=16384)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _stream(url: str, max_tokens: int) -> dict:
    """A streamed completion read to its end: chunks, finish reason, whether [DONE] came."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    chunks, finish, done = 0, None, False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert "error" not in data, data
                chunks += 1
                finish = data["choices"][0].get("finish_reason") or finish
    return {"chunks": chunks, "finish": finish, "done": done}


def test_sigterm_to_the_process_group_finishes_requests_and_exits_0(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--cp", "2", *ARGS], new_session=True)
    try:
        pids = [srv.proc.pid, *descendants(srv.proc.pid)]
        assert len(pids) >= 2  # the server and its rank process(es)
        streaming, s_box = in_thread(_stream, srv.url, 400)
        plain, p_box = in_thread(lambda: httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "abc", "max_tokens": 300, "ignore_eos": True}), )

        def both_in():  # both are in the engine (a fixed pause would guess the machine's speed)
            m = metric_values(srv.url)
            return sum(v for k, v in m.items() if k.startswith(("cpinfer_num_requests_running",
                                                                  "cpinfer_num_requests_waiting"))) == 2

        wait_until(both_in, 60, 0.05, "both requests running")
        os.killpg(srv.proc.pid, signal.SIGTERM)  # what systemd's KillMode=control-group sends
        streaming.join(120)
        plain.join(120)
        assert srv.proc.wait(timeout=120) == 0, srv.output()[-3000:]
        assert s_box and not isinstance(s_box[0], BaseException), s_box
        assert s_box[0] == {"chunks": s_box[0]["chunks"], "finish": "length", "done": True}
        assert not isinstance(p_box[0], BaseException) and p_box[0].status_code == 200, p_box
        assert p_box[0].json()["usage"]["completion_tokens"] == 300
        deadline = time.monotonic() + 60  # a loaded machine reaps slowly; polled, so no cost when quick
        while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_alive(p) for p in pids), "a process of the group outlived the server"
    finally:
        if srv.proc.poll() is None:
            srv.kill()
        srv.close()


def test_a_client_that_stops_reading_is_cut_off_and_memory_stays_flat(model_dir):
    srv = ServerProcess(["--model", str(model_dir), "--cp", "1", "--stream-stall-timeout", "3", *ARGS])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            _stream(srv.url, 8)  # warm up
            base = _rss_mb(srv.proc.pid)
            # chat chunks with 20 top log-probs are ~1.3 kB a token: ~15 MB of events, far more than the kernel's
            # socket buffers (up to 4 MB here) hold for a client that does not read
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12000,
                               "stream": True, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                               "temperature": 1.0}).encode()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
            sock.connect(("127.0.0.1", srv.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            sock.recv(1024)  # the headers (and a first chunk), then never read again
            curve, cut = [], None
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120 and (cut is None or time.monotonic() - t0 < cut + 3):
                curve.append((round(time.monotonic() - t0, 1), round(_rss_mb(srv.proc.pid) - base, 1)))
                m = http.get("/metrics").text
                aborted = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
                              if line.startswith("cpinfer_engine_requests_finished_total{") and 'reason="abort"' in line)
                if cut is None and aborted:
                    cut = time.monotonic() - t0
                time.sleep(0.5)
            print("server RSS growth (s, MB):", curve)
            assert cut is not None, f"the stalled stream was not aborted ({curve})"
            assert max(mb for _, mb in curve) < 40, curve
            try:  # the server closed the connection: reading drains what was buffered, then EOF
                sock.settimeout(5)
                while sock.recv(65536):
                    pass
            except (ConnectionResetError, socket.timeout) as exc:
                assert not isinstance(exc, socket.timeout), "the connection was left open"
            sock.close()
            assert "took no data for 3 s" in srv.output()
            assert http.get("/health").status_code == 200
            assert _stream(srv.url, 8)["finish"] == "length"  # the server goes on
    finally:
        srv.close()


def _chat(srv: ServerProcess, messages: list) -> str:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _damage_kv(f) -> None:
    raw = bytearray(f.read_bytes())
    mid = len(raw) - 1024
    raw[mid:mid + 64] = bytes(b ^ 0x5A for b in raw[mid:mid + 64])
    f.write_bytes(bytes(raw))


def test_a_damaged_disk_tier_never_takes_the_server_down(model_dir, tmp_path):
    """The reported crash loop, at CP2 through the HTTP API: a chat's entry damaged between two runs, then (live) a
    chat pushed to disk whose file is damaged and then deleted, with a junk file in the directory. Every answer
    equals the first, tier-less answer to the same messages, no 5xx, /health 200, the server exits 0 and junk is
    quarantined (tests/test_tier_faults.py: the next start meets no entry found bad)."""
    d = tmp_path / "kv"
    args = ["--model", str(model_dir), "--cp", "2", "--kv-disk-dir", str(d), *ARGS, "--max-kv-tokens-per-rank",
            "1024", "--log-level", "info"]
    chats = [[{"role": "user", "content": f"chat {i}: " + "tell me about the sharded cache. " * 8}] for i in range(4)]
    s1 = ServerProcess(args)
    try:
        first = [_chat(s1, c) for c in chats]  # chats 0.. are pushed to disk by the later ones
    finally:
        assert s1.stop() == 0
        s1.close()
    entries = sorted(d.glob("*.safetensors"))
    assert entries
    for f in entries[:2]:
        _damage_kv(f)
    (d / "notes.txt").write_text("not an entry")
    s2 = ServerProcess(args)
    try:
        assert [_chat(s2, c) for c in chats] == first  # damaged ones recomputed, the others restored
        assert httpx.get(s2.url + "/health", timeout=30).status_code == 200
        for f in sorted(d.glob("*.safetensors")):  # live: damage every entry now on disk, delete one
            _damage_kv(f)
        next(iter(sorted(d.glob("*.safetensors"))), d / "none").unlink(missing_ok=True)
        assert [_chat(s2, c) for c in chats[::-1]] == first[::-1]
        assert httpx.get(s2.url + "/health", timeout=30).status_code == 200
        text = s2.output()
        assert "is recomputed" in text
        assert "scheduler stalled" not in text and "engine loop stopped" not in text and "Traceback" not in text
    finally:
        assert s2.stop() == 0
        s2.close()
    assert not (d / "notes.txt").exists() and (d / ".quarantine" / "notes.txt").exists()


def _queue(values: dict, prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix + "{"))


@contextlib.contextmanager
def _held_prefill_server(model_dir, monkeypatch):
    """An in-process server over a CP1 `AsyncLLM` whose prefill forwards wait for `release` (set it to let them
    run): yields (engine, url, entered, release), `entered` set once a prefill's forward is held."""
    from cpinfer import AsyncLLM
    from cpinfer.engine.llm_engine import LLMEngine

    entered, release = threading.Event(), threading.Event()
    forward = LLMEngine._run

    def held(self, batch):
        if batch.phase == "prefill" and not release.is_set():
            entered.set()
            release.wait(SETTLE_S)
        return forward(self, batch)

    monkeypatch.setattr(LLMEngine, "_run", held)
    allm = AsyncLLM(str(model_dir), context_parallel_size=1, threads_per_rank=1, max_kv_tokens_per_rank=4096)
    with _serving(allm, release) as url:
        yield allm, url, entered, release


@contextlib.contextmanager
def _serving(allm, release: threading.Event):
    """`allm` served in this process on a free port: yields its URL; on the way out `release` is set (a held step
    goes on), the server stops and the engine shuts down."""
    import uvicorn

    from cpinfer.server.app import ServerConfig, build_app
    from server_utils import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(allm, ServerConfig("tiny")), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    try:
        wait_until(lambda: server.started, what="the in-process server listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        release.set()
        server.should_exit = True
        serving.join(SETTLE_S)
        allm.shutdown()


def test_queue_gauges_count_a_request_while_its_step_runs(model_dir, monkeypatch):
    """The queue gauges (/metrics, both namings) and the stats line read the request as running during its step: the
    prefill's forward is held here until the gauges were read (no guess at how long a step takes)."""
    from cpinfer.server.metrics import StatsLogger

    with _held_prefill_server(model_dir, monkeypatch) as (allm, url, entered, release):
        stats = StatsLogger(allm.stats, 60)
        stats.line()  # the first call sets the interval's start
        request, box = in_thread(lambda: httpx.post(url + "/v1/completions", timeout=SETTLE_S, json={
            "model": "tiny", "prompt": "a long prompt " * 40, "max_tokens": 4, "ignore_eos": True}))
        wait_until(entered.is_set, what="the prefill's forward started")
        during = metric_values(url)
        line = stats.line()
        release.set()
        request.join(SETTLE_S)
        assert box and not isinstance(box[0], BaseException) and box[0].status_code == 200, box
        for name in ("cpinfer_num_requests", "vllm:num_requests"):
            assert (_queue(during, f"{name}_running"), _queue(during, f"{name}_waiting")) == (1, 0), during
        assert line is not None and "running 1 reqs, waiting 0 reqs" in line, line
        wait_until(lambda: _queue(metric_values(url), "cpinfer_num_requests_running") == 0, what="the request done")


def test_abort_all_ends_a_stream_whose_prefill_is_still_running(model_dir, monkeypatch):
    """What SIGTERM's cut relies on: `abort_all` ends a stream at once, last chunk "abort" and [DONE], even while
    its step's forward is still running (held here); the engine frees the request after that step."""
    with _held_prefill_server(model_dir, monkeypatch) as (allm, url, entered, release):
        lines: list = []
        reader, box = in_thread(_read_events, url, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
            "logprobs": True, "top_logprobs": 2}, lines)
        wait_until(entered.is_set, what="the prefill's forward started")
        assert allm.abort_all() == 1
        reader.join(SETTLE_S)
        assert not release.is_set() and box == [None], box  # ended while the forward was still held
        assert lines[-1] == "[DONE]", lines
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "abort", lines
        release.set()
        wait_until(lambda: (allm.stats().num_running, allm.stats().num_waiting) == (0, 0), what="the request freed")
        assert allm.stats().requests_finished.get("abort") == 1


def test_a_rank_killed_while_rank_0_drafts_is_seen_at_once(model_dir, monkeypatch):
    """A draft model at CP 2 under load (several long streams): rank 1 SIGKILLed while rank 0 is inside its share of
    the draft's k steps (held here: a long draft forward that sends rank 1 nothing) turns /health 503 and ends
    every stream with the engine_dead error within DEAD_RANK_SEEN_S, the held step still running: the liveness
    check never waits behind a forward."""
    from cpinfer import AsyncLLM
    from cpinfer.engine.spec_decode.draft_runner import DraftRunner

    entered, release = threading.Event(), threading.Event()
    propose = DraftRunner.propose

    def held(self, seqs):  # rank 0's share only: rank 0 runs in this process, rank 1 is a spawned process
        if not release.is_set():
            entered.set()
            release.wait(SETTLE_S)
        return propose(self, seqs)

    monkeypatch.setattr(DraftRunner, "propose", held)
    allm = AsyncLLM(str(model_dir), context_parallel_size=2, threads_per_rank=1, max_kv_tokens_per_rank=4096,
                    speculative_config={"model": str(model_dir), "num_speculative_tokens": 4})
    with _serving(allm, release) as url:
        assert allm.engine._pool.driver_rank  # the hold is in rank 0's share of the draft's steps
        streams = [(lines, *in_thread(_read_events, url, "/v1/completions", {
            "model": "tiny", "prompt": f"story {i}: once upon a time", "max_tokens": 300, "stream": True,
            "ignore_eos": True, "temperature": 0}, lines)) for i, lines in enumerate([[] for _ in range(4)])]
        wait_until(entered.is_set, what="rank 0 inside the draft's steps")
        os.kill(allm.rank_pids[1], signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until(lambda: httpx.get(url + "/health", timeout=SETTLE_S).status_code == 503, DEAD_RANK_SEEN_S,
                   what="/health 503 after rank 1 was killed")
        for _, reader, _ in streams:
            reader.join(DEAD_RANK_SEEN_S)
        seen = time.monotonic() - t_kill
        assert not release.is_set(), "the draft's step was released before the death was seen"
        assert seen < DEAD_RANK_SEEN_S, seen
        for lines, reader, box in streams:
            assert not reader.is_alive() and box == [None], box
            events = [json.loads(x) for x in lines if x != "[DONE]"]
            assert events and events[-1]["error"]["code"] == "engine_dead", lines[-3:]
        health = httpx.get(url + "/health", timeout=SETTLE_S)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", allm.dead_error), allm.dead_error


def _read_events(url: str, path: str, body: dict, lines: list) -> None:
    """A stream's `data:` lines, appended to `lines` as they come (read to the end of the body)."""
    with httpx.stream("POST", url + path, json=body, timeout=SETTLE_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])


def test_sigterm_past_the_graceful_timeout_ends_streams_with_abort_and_done(model_dir):
    """Streams that cannot finish within --graceful-timeout end whole: a last chunk with finish_reason "abort", then
    [DONE]; the log has no traceback and the server exits 0."""
    srv = ServerProcess(["--model", str(model_dir), "--cp", "1", "--graceful-timeout", "4", *ARGS])
    try:
        common = {"model": "tiny", "max_tokens": 8000, "stream": True, "ignore_eos": True, "temperature": 0}
        text, chat = [], []
        t1, b1 = in_thread(_read_events, srv.url, "/v1/completions", {**common, "prompt": "hello world"}, text)
        t2, b2 = in_thread(_read_events, srv.url, "/v1/chat/completions",
                           {**common, "messages": [{"role": "user", "content": "hi"}]}, chat)
        wait_until(lambda: len(text) >= 3 and len(chat) >= 3, what="both streams flowing")
        srv.proc.send_signal(signal.SIGTERM)
        t1.join(SETTLE_S)
        t2.join(SETTLE_S)
        assert srv.proc.wait(timeout=SETTLE_S) == 0, srv.output()[-3000:]
        assert b1 == [None] and b2 == [None], (b1, b2)  # read to the end: no incomplete body
        for lines in (text, chat):
            assert lines[-1] == "[DONE]", lines[-3:]
            last = json.loads(lines[-2])
            assert last["choices"][0]["finish_reason"] == "abort", last
        out = srv.output()
        assert "Traceback" not in out and "Exception in ASGI" not in out, out[-3000:]
    finally:
        if srv.proc.poll() is None:
            srv.kill()
        srv.close()


def test_a_storm_of_disconnecting_clients_logs_no_traceback(model_dir):
    """Non-streamed requests whose clients close the connection while they run: each is aborted, the log has no
    traceback (nor an unretrieved future), and the server goes on serving."""
    srv = ServerProcess(["--model", str(model_dir), "--cp", "1", *ARGS, "--log-level", "info"])
    n = 24
    socks = []
    try:
        body = json.dumps({"model": "tiny", "prompt": "storm", "max_tokens": 600, "ignore_eos": True}).encode()
        for _ in range(n):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=SETTLE_S)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(sock)

        def in_engine() -> float:
            m = metric_values(srv.url)
            return _queue(m, "cpinfer_num_requests_running") + _queue(m, "cpinfer_num_requests_waiting")

        wait_until(lambda: in_engine() == n, what="every request in the engine")
        for sock in socks:
            sock.close()
        wait_until(lambda: in_engine() == 0, what="every request ended")
        m = metric_values(srv.url)
        aborted = sum(v for k, v in m.items() if k.startswith("cpinfer_requests_total{") and 'outcome="abort"' in k)
        assert 1 <= aborted <= n, m
        assert _stream(srv.url, 8)["finish"] == "length"  # the server goes on
        out = srv.output()
        for bad in ("Traceback", "never retrieved", "Exception in ASGI", "CancelledError"):
            assert bad not in out, out[-3000:]
    finally:
        for sock in socks:
            sock.close()
        srv.close()
