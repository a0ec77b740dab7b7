"""What agents and benchmark clients send to `cpinfer serve`, through their own SDKs (CP2, a tiny chain model that
writes a thought and a Hermes tool call after every generation prompt; `--reasoning-parser qwen3`, one server for the
module): the chat stream's first chunk goes out with the first token (benchmark clients time TTFT by it).
"""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import ServerProcess, write_chain_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

NAME = "agent"
API_KEY = "agents-key"
THOUGHT = "Let me check the file."
CALL_ARGS = {"path": "src/main.py"}
PIECES = ["<think>", THOUGHT, "</think>", "\n\n", "<tool_call>", '\n{"name": "read_file", "arguments": ',
          json.dumps(CALL_ARGS) + "}", "\n</tool_call>"]
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "a file's text",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents_model")
    write_chain_model(d, PIECES, TEMPLATE)
    srv = ServerProcess(["--model", str(d), "--cp", "2", "--served-model-name", NAME, "--max-model-len", "1024",
                         "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "8192", "--log-level", "warning",
                         "--reasoning-parser", "qwen3"], api_key=API_KEY)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _events(server, path: str, body: dict) -> list[str]:
    """A stream's `data:` payloads, in order."""
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers(), timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------------------------------------- benchmark clients
def test_the_chat_streams_first_chunk_carries_the_first_token(server):
    """No role-only chunk before prefill: a choice's first chunk has the role and the first token (its log-prob)."""
    events = _events(server, "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
        "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks, events
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and len(first["logprobs"]["content"]) >= 1, first
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    tokens = [t["token"] for c in chunks for t in c["choices"][0]["logprobs"]["content"]]
    assert tokens == PIECES[:3]
