"""`cpinfer serve --kv-disk-dir D` across restarts (tiny random Llama, tiny byte-level tokenizer, 127.0.0.1): a
conversation continued after a restart at another CP size reports its history as cached and answers as `LLM` offline
without any restart; the server killed (SIGKILL) in the middle of a disk write leaves a temporary file only, which the
next start removes, and its index agrees with the files; /metrics shows the tiers.
"""
from __future__ import annotations

import re
import time

import httpx
import pytest

from cpinfer.engine.kv.tier_store import WRITE_DELAY_ENV
from server_utils import ServerProcess, served_checkpoint

pytestmark = pytest.mark.timeout(600)
MAX_LEN = 512
ARGS = ["--served-model-name", "tiny", "--max-model-len", str(MAX_LEN), "--threads-per-rank", "1",
        "--max-kv-tokens-per-rank", "4096", "--log-level", "info"]
TURN = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(llama_checkpoint, tmp_path_factory):
    return served_checkpoint(llama_checkpoint, tmp_path_factory, "tier_model")


def _chat(srv: ServerProcess, messages: list) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={**TURN, "messages": messages}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(srv: ServerProcess, name: str, tier: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}(?:_total)?{{model_name="tiny",tier="{tier}"}} (\S+)$', text, re.M)
    assert m, f"{name} for {tier} missing from /metrics"
    return float(m.group(1))


def _entry_bytes(d) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def test_restart_continues_the_conversation_and_a_kill_mid_write_is_harmless(model_dir, tmp_path):
    from cpinfer import LLM, SamplingParams

    d = tmp_path / "kv"
    conv = [{"role": "user", "content": "Where does the KV cache of this conversation live after a restart? " * 3}]
    s1 = ServerProcess(["--model", str(model_dir), "--cp", "2", "--kv-disk-dir", str(d), "--kv-host-gib", "0.01",
                        *ARGS])
    try:
        r1 = _chat(s1, conv)
        assert _metric(s1, "cpinfer_kv_tier_capacity_bytes", "host") > 0
        assert s1.stop() == 0  # SIGTERM: the write-through entries are flushed
    finally:
        s1.close()
    assert _entry_bytes(d) > 0
    conv2 = conv + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And on which rank?"}]
    ref = LLM(str(model_dir), max_model_len=MAX_LEN, threads_per_rank=1)  # no restart, no tiers
    try:
        want = ref.chat(conv2, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    finally:
        ref.shutdown()

    # restart at CP3; every disk write then stalls 60 s before its rename, so the kill lands mid-write
    s2 = ServerProcess(["--model", str(model_dir), "--cp", "3", "--kv-disk-dir", str(d), *ARGS],
                       env={WRITE_DELAY_ENV: "60"})
    try:
        assert "another CP size" in s2.output()
        assert _metric(s2, "cpinfer_kv_tier_bytes", "disk") == _entry_bytes(d)  # the index is the files
        r2 = _chat(s2, conv2)
        assert r2["choices"][0]["message"]["content"] == want
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r1["usage"]["prompt_tokens"] <= cached < r2["usage"]["prompt_tokens"]
        assert _metric(s2, "cpinfer_kv_tier_hit_tokens", "disk") == cached
        assert _metric(s2, "cpinfer_kv_tier_restored_bytes", "disk") > 0
        assert _metric(s2, "cpinfer_kv_tier_restore_seconds", "disk") > 0
        deadline = time.monotonic() + 120  # polled (the write then stalls 60 s: the kill lands inside it)
        while not list(d.glob(".tmp-*")) and time.monotonic() < deadline:  # turn 2's write-through is under way
            time.sleep(0.2)
        before = sorted(p.name for p in d.glob("*.safetensors"))
        assert list(d.glob(".tmp-*")), "no write in progress"
        s2.kill()  # SIGKILL the server and its ranks mid-write
    finally:
        s2.close()
    assert sorted(p.name for p in d.glob("*.safetensors")) == before  # nothing half-written under an entry name

    s3 = ServerProcess(["--model", str(model_dir), "--cp", "1", "--kv-disk-dir", str(d), *ARGS])
    try:
        assert not list(d.glob(".tmp-*"))  # removed at start
        assert _metric(s3, "cpinfer_kv_tier_bytes", "disk") == _entry_bytes(d)
        r3 = _chat(s3, conv2)
        assert r3["choices"][0]["message"]["content"] == want
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
        assert s3.stop() == 0
    finally:
        s3.close()
