"""An agent session through the `openai` SDK against `cpinfer serve` with `tool_choice: "auto"`: the tool parser
(recognised from the Hermes-style chat template) and the reasoning parser (`--reasoning-parser qwen3`) fed by the
real server's output, over several turns whose `cached_tokens` grow (persistent KV reused turn after turn).

A random model would not write a tool call, so this one is built to: its attention and MLP outputs are zero, so the
next token depends on the current token only, and its embeddings and LM head make a chain — after the generation
prompt's last "\\n" it writes `<think>`, a thought, `</think>`, a Hermes `<tool_call>` block in pieces, then EOS.
Everything after the logits (sampling, detokenizing, parsing, streaming) is the server's ordinary path.
"""
from __future__ import annotations

import json

import pytest

from server_utils import ServerProcess, write_chain_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

NAME = "agent"
THOUGHT = "I should look up the weather."
CALL_ARGS = {"city": "Paris"}
PIECES = ["<think>", THOUGHT, "</think>", "\n\n", "<tool_call>", '\n{"name": "get_weather", "arguments": ',
          json.dumps(CALL_ARGS) + "}", "\n</tool_call>"]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("chain_model")
    write_chain_model(d, PIECES, TEMPLATE)
    srv = ServerProcess(["--model", str(d), "--cp", "2", "--served-model-name", NAME, "--max-model-len", "1024",
                         "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "8192", "--log-level", "warning",
                         "--reasoning-parser", "qwen3"])
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(client, messages):
    """One streamed turn, accumulated as an SDK user does: content, reasoning, and tool calls by index."""
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for c in d.tool_calls or []:
                assert c.index not in calls, "a call arrives whole, once"
                calls[c.index] = c
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, usage


def test_multi_turn_agent_session_with_auto_tool_calls(client):
    messages = [{"role": "system", "content": "You are a weather agent."},
                {"role": "user", "content": "Should I take an umbrella in Paris today?"}]
    cached, turns = [], []
    for turn in range(4):
        if turn % 2 == 0:
            r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, temperature=0)
            msg, finish, usage = r.choices[0].message, r.choices[0].finish_reason, r.usage
            calls, reasoning, content = msg.tool_calls, msg.model_extra["reasoning_content"], msg.content
        else:
            content, reasoning, calls, finish, usage = _streamed(client, messages)
        assert finish == "tool_calls" and reasoning == THOUGHT and not content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", CALL_ARGS)]
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        cached.append(usage.prompt_tokens_details.cached_tokens)
        turns.append((usage.prompt_tokens, usage.completion_tokens))
        if turn % 2 == 0:  # the reply object itself, as SDK agent loops append it (with its extra fields)
            messages.append(msg)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": calls[0].id, "type": "function",
                 "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": f"turn {turn}: light rain, 14 C"})
    assert all(b > a for a, b in zip(cached, cached[1:])), cached  # each turn reuses the one before
    assert all(c >= prev_prompt - 1 for c, (prev_prompt, _) in zip(cached[1:], turns)), (cached, turns)
    # tool_choice "none": the same output as plain content (nothing parsed), thought still split out
    r = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    print(f"agent session: {len(turns)} turns, (prompt, completion) tokens {turns}, cached {cached}")
