"""What agents and benchmark clients send to `cpinfer serve`, through their own SDKs (CP2, a tiny chain model that
writes a thought and a Hermes tool call after every generation prompt; `--reasoning-parser qwen3`, one server for the
module): the chat stream's first chunk goes out with the first token (benchmark clients time TTFT by it); the
Anthropic Messages API through the `anthropic` SDK (whole and streamed equal to the chat route's reply, a tool round
trip over 3 turns whose later turns read the earlier ones from the prefix cache, tool_choice, stop sequences,
count_tokens and the thinking switch, Anthropic-shaped errors); OpenAI's Responses API through the `openai` SDK's
`client.responses` (whole and streamed, a tool loop on `previous_response_id` whose turns read the stored
conversation's K/V from the prefix cache, GET / DELETE, eviction, errors).
"""
from __future__ import annotations

import json

import httpx
import pytest

from server_utils import ServerProcess, write_chain_model

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.timeout(300)

NAME = "agent"
API_KEY = "agents-key"
MAX_STORED = 8
GREEDY = {"temperature": 0}  # a server extra on /v1/messages (the anthropic SDK has no argument for it)
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
CLAUDE_TOOLS = [{"name": "read_file", "description": "a file's text", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
CALL_TEXT = PIECES[4] + PIECES[5] + PIECES[6] + PIECES[7]  # the call as text (when no tool parser reads it)
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "a file's text",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents_model")
    write_chain_model(d, PIECES, TEMPLATE)
    srv = ServerProcess(["--model", str(d), "--cp", "2", "--served-model-name", NAME, "--max-model-len", "1024",
                         "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "8192", "--log-level", "warning",
                         "--reasoning-parser", "qwen3", "--responses-max-stored", str(MAX_STORED)],
                        api_key=API_KEY)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    """The `anthropic` SDK (it sends the key as `x-api-key`)."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


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


def test_what_benchmark_clients_send_chat_and_completions(server):
    """vLLM's `bench serve` (openai-chat: content as parts, max_completion_tokens; openai: a prompt, max_tokens),
    GuideLLM's and AIPerf's fields: stop null, ignore_eos, usage on the last chunk, continuous usage stats; the
    model list's root and /health."""
    models = httpx.get(server.url + "/v1/models", headers=server.headers(), timeout=30).json()
    assert models["data"][0]["id"] == models["data"][0]["root"] == NAME
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    chat = {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "bench " * 20}]}],
            "temperature": 0.0, "max_completion_tokens": 5, "stop": None, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    plain = {"model": NAME, "prompt": "bench " * 20, "temperature": 0.0, "max_tokens": 5, "stop": None,
             "ignore_eos": True, "stream": True, "logprobs": None, "best_of": 1, "stream_options": {"include_usage": True}}
    for path, body, text_of in (("/v1/chat/completions", chat, lambda c: c["delta"].get("content") or ""),
                                ("/v1/completions", plain, lambda c: c["text"])):
        for continuous in (False, True):
            events = _events(server, path, {**body, "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": continuous}})
            chunks = [json.loads(e) for e in events[:-1]]
            assert events[-1] == "[DONE]" and chunks[-1]["choices"] == [], events
            total = chunks[-1]["usage"]
            assert total["completion_tokens"] == 5 and total["prompt_tokens"] > 20, total
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            if continuous:  # every chunk: its usage so far, growing to the total
                done = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
                assert done == sorted(done) and done[-1] == 5 and done[0] >= 1, done
                assert all(c["usage"]["prompt_tokens"] == total["prompt_tokens"] for c in chunks[:-1])
            else:
                assert all(c["usage"] is None for c in chunks[:-1])
            text = "".join(text_of(c["choices"][0]) for c in chunks[:-1])
            whole = httpx.post(server.url + path, json={**body, "stream": False, "stream_options": None},
                               headers=server.headers(), timeout=120).json()
            got = whole["choices"][0]
            assert text == (got["text"] if "text" in got else got["message"]["content"])


# ---------------------------------------------------------------------------------------------- Anthropic messages
def test_messages_whole_and_streamed_equal_the_chat_reply(client, claude):
    """Thought → a thinking block, the rest → a text block; usage splits the prompt into computed and cached."""
    convo = [{"role": "user", "content": "Summarise src/main.py, please."}]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "Be brief."}, *convo],
                                          extra_body=GREEDY)
    want = chat.choices[0].message
    assert want.model_extra["reasoning_content"] == THOUGHT and want.content == CALL_TEXT
    r = claude.messages.create(model=NAME, max_tokens=64, system="Be brief.", messages=convo, extra_body=GREEDY)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.role == "assistant" and r.model == NAME
    assert r.content[0].thinking == THOUGHT and r.content[1].text == CALL_TEXT
    assert r.stop_reason == "end_turn" and r.stop_sequence is None and r.id.startswith("msg_")
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0  # the chat request cached it
    assert u.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(model=NAME, max_tokens=64, system="Be brief.", messages=convo,
                                extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                        "message_delta", "message_stop")]
        final = stream.get_final_message()
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "message_delta", "message_stop"], kinds
    assert final.model_dump(exclude={"id"}) == r.model_dump(exclude={"id"})


def test_messages_tool_round_trip_over_three_turns_reads_earlier_turns_from_cache(claude):
    messages = [{"role": "user", "content": "What does src/main.py do?"}]
    totals, cached = [], []
    for turn in range(3):
        if turn == 1:  # one turn streams
            with claude.messages.stream(model=NAME, max_tokens=128, messages=messages, tools=CLAUDE_TOOLS,
                                        extra_body=GREEDY) as stream:
                partial = [e.partial_json for e in stream if e.type == "input_json"]
                r = stream.get_final_message()
            assert json.loads("".join(partial)) == CALL_ARGS
        else:
            r = claude.messages.create(model=NAME, max_tokens=128, messages=messages, tools=CLAUDE_TOOLS,
                                       extra_body=GREEDY)
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["thinking", "tool_use"], r
        call = r.content[1]
        assert call.name == "read_file" and call.input == CALL_ARGS and call.id.startswith("toolu_")
        totals.append(r.usage.input_tokens + r.usage.cache_read_input_tokens)
        cached.append(r.usage.cache_read_input_tokens)
        messages.append({"role": "assistant", "content": r.content})  # the SDK's blocks, sent back as they are
        result = {"type": "tool_result", "tool_use_id": call.id, "content": f"turn {turn}: prints hello"}
        messages.append({"role": "user", "content": [result, {"type": "text", "text": "And then?"}]})
    assert totals[0] < totals[1] < totals[2], totals
    for k in (1, 2):  # turns 2-3 read every earlier turn's prompt from the prefix cache
        assert totals[k - 1] - 1 <= cached[k] < totals[k], (totals, cached)
    # tool_choice none: the same output, the call left as text
    r = claude.messages.create(model=NAME, max_tokens=128, messages=messages, tools=CLAUDE_TOOLS,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert r.stop_reason == "end_turn" and r.content[1].text == CALL_TEXT


def test_messages_tool_choice_forces_a_call_that_follows_the_schema(claude):
    """tool → that tool's arguments, any (one call) → one call of a tool: constrained to the schemas (an enum here,
    so the random part of the chain model cannot write a long string)."""
    opener = {"name": "open", "input_schema": {"type": "object", "additionalProperties": False, "required": ["path"],
                                               "properties": {"path": {"enum": ["a.py", "b.py"]}}}}
    for tools, choice in (([opener, *CLAUDE_TOOLS], {"type": "tool", "name": "open"}),
                          ([opener], {"type": "any", "disable_parallel_tool_use": True})):
        r = claude.messages.create(model=NAME, max_tokens=200, messages=[{"role": "user", "content": "open one"}],
                                   tools=tools, tool_choice=choice, extra_body=GREEDY)
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r
        assert r.content[0].name == "open" and r.content[0].input["path"] in ("a.py", "b.py"), r


def test_messages_stop_sequences_and_max_tokens(claude):
    convo = [{"role": "user", "content": "go"}]
    r = claude.messages.create(model=NAME, max_tokens=64, messages=convo, stop_sequences=["read_file"],
                               extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "read_file"
    assert r.content[-1].text == PIECES[4] + '\n{"name": "'
    r = claude.messages.create(model=NAME, max_tokens=2, messages=convo, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_count_tokens_is_the_prompt_and_thinking_flips_the_templates_switch(server, claude):
    convo = [{"role": "user", "content": "Count me."}]
    plain = claude.messages.count_tokens(model=NAME, messages=convo, system="sys").input_tokens
    chat = [{"role": "system", "content": "sys"}, *convo]
    want = httpx.post(server.url + "/tokenize", json={"messages": chat}, headers=server.headers(), timeout=60).json()
    assert plain == want["count"]
    on = claude.messages.count_tokens(model=NAME, messages=convo, system="sys",
                                      thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
    off = claude.messages.count_tokens(model=NAME, messages=convo, system="sys",
                                       thinking={"type": "disabled"}).input_tokens
    assert on == plain and off == plain + len("/no_think\n")  # one byte-level token per character
    with_tools = claude.messages.count_tokens(model=NAME, messages=convo, tools=CLAUDE_TOOLS).input_tokens
    assert with_tools > plain
    r = claude.messages.create(model=NAME, max_tokens=64, messages=convo, system="sys", thinking={"type": "disabled"},
                               extra_body=GREEDY)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == off


def _anthropic_error(server, body: dict, headers: dict | None = None, path: str = "/v1/messages") -> tuple[int, dict]:
    r = httpx.post(server.url + path, json=body, headers=headers or server.headers(), timeout=60)
    return r.status_code, r.json()


def test_messages_errors_have_anthropics_shape_and_no_internals(server, claude):
    ok = {"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "'image'"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                            "content": "x"}]}]}, 400, "no tool_use block"),
        ({**ok, "frobnicate": 1}, 400, "frobnicate"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools"),
        ({**ok, "tool_choice": {"type": "tool"}}, 400, "name is required"),
        ({**ok, "model": "claude-opus-4"}, 404, "does not exist"),
        ({**ok, "messages": [{"role": "user", "content": "x" * 40_000}]}, 400, "maximum model length"),
    ]
    for body, status, needle in cases:
        code, err = _anthropic_error(server, body)
        assert code == status and err["type"] == "error", (body, code, err)
        assert set(err["error"]) == {"type", "message"} and needle in err["error"]["message"], (needle, err)
        assert "Traceback" not in err["error"]["message"] and 'File "' not in err["error"]["message"]
    for raw in (b"{", b"[]", b'{"model": 1}', b"\xff\xfe"):  # not JSON, not an object, wrong types
        r = httpx.post(server.url + "/v1/messages", content=raw, timeout=60,
                       headers={**server.headers(), "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and "Traceback" not in r.text
    code, err = _anthropic_error(server, ok, headers={"x-api-key": "wrong"})
    assert code == 401 and err["error"]["type"] == "authentication_error"
    code, err = _anthropic_error(server, {"model": NAME, "messages": [{"role": "user", "content": []}]},
                                 path="/v1/messages/count_tokens")
    assert code == 400 and err["type"] == "error"
    big = httpx.post(server.url + "/v1/messages", content=b"x" * (2 << 20), timeout=60,
                     headers={**server.headers(), "content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.BadRequestError) as exc:  # what an SDK user sees
        claude.messages.create(model=NAME, max_tokens=8, messages=[{"role": "assistant", "content": "prefill"}])
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "last message" in str(exc.value)
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [], "model": NAME},
                   headers=server.headers(), timeout=60)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------- OpenAI responses
def test_responses_whole_and_streamed_equal_the_chat_reply(client):
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Read main.py"}],
                                          temperature=0)
    r = client.responses.create(model=NAME, instructions="Be brief.", input="Read main.py", temperature=0)
    assert r.status == "completed" and r.id.startswith("resp_") and r.model == NAME
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output_text == CALL_TEXT
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 1  # the chat request's prompt
    with client.responses.stream(model=NAME, instructions="Be brief.", input="Read main.py",
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.reasoning_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CALL_TEXT
    assert final.output_text == CALL_TEXT and [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens == r.usage.output_tokens
    short = client.responses.create(model=NAME, input="x", max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_tool_loop_on_previous_response_id_reuses_the_stored_conversations_kv(server, client):
    """Each turn sends only its new items; its prompt is the whole conversation (the same tokens as sending it all)
    and its cached tokens cover the turns before."""
    tools = [{"type": "function", "name": "read_file", "description": "a file's text",
              "parameters": TOOLS[0]["function"]["parameters"]}]
    first = client.responses.create(model=NAME, input="What does src/main.py do?", tools=tools, temperature=0)
    turns, prev, items = [first], first, [{"role": "user", "content": "What does src/main.py do?"}]
    for turn in (1, 2):
        call = prev.output[-1]
        assert [o.type for o in prev.output] == ["reasoning", "function_call"], prev.output
        assert call.name == "read_file" and json.loads(call.arguments) == CALL_ARGS and call.call_id.startswith("call")
        new = [{"type": "function_call_output", "call_id": call.call_id, "output": f"turn {turn}: prints hello"}]
        items += [o.model_dump(exclude_none=True) for o in prev.output] + new
        if turn == 2:  # streamed: the call's arguments arrive as their own events
            with client.responses.stream(model=NAME, input=new, tools=tools, previous_response_id=prev.id,
                                         temperature=0) as stream:
                args = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
                prev = stream.get_final_response()
            assert json.loads("".join(args)) == CALL_ARGS
        else:
            prev = client.responses.create(model=NAME, input=new, tools=tools, previous_response_id=prev.id,
                                           temperature=0)
        turns.append(prev)
        # the same conversation sent whole, not stored: the same prompt
        whole = client.responses.create(model=NAME, input=items, tools=tools, store=False, temperature=0)
        assert whole.usage.input_tokens == prev.usage.input_tokens
    inputs = [t.usage.input_tokens for t in turns]
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert inputs[0] < inputs[1] < inputs[2], inputs
    for k in (1, 2):
        assert inputs[k - 1] - 1 <= cached[k] < inputs[k], (inputs, cached)
    # GET gives the stored response back; DELETE forgets it, and a turn on it is a 404 that says so
    got = httpx.get(f"{server.url}/v1/responses/{turns[1].id}", headers=server.headers(), timeout=30)
    assert got.status_code == 200 and got.json()["id"] == turns[1].id
    assert [o["id"] for o in got.json()["output"]] == [o.id for o in turns[1].output]
    assert client.responses.retrieve(turns[1].id).output_text == turns[1].output_text
    client.responses.delete(turns[1].id)
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.retrieve(turns[1].id)
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.create(model=NAME, input="more", previous_response_id=turns[1].id)
    unstored = client.responses.create(model=NAME, input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_are_evicted_oldest_first_and_a_turn_on_one_says_so(client):
    ids = [client.responses.create(model=NAME, input=f"r{i}", max_output_tokens=1).id for i in range(MAX_STORED + 2)]
    for gone in ids[:2]:
        with pytest.raises(openai.NotFoundError, match="was evicted"):
            client.responses.create(model=NAME, input="again", previous_response_id=gone)
    assert client.responses.retrieve(ids[-1]).id == ids[-1] and client.responses.retrieve(ids[2]).id == ids[2]


def test_response_store_bounds_count_and_bytes_oldest_first():
    from cpinfer.server.response_store import ResponseStore

    store = ResponseStore(max_count=3, max_bytes=10_000)
    for i in range(4):
        assert store.put(f"r{i}", {"i": i}, [{"role": "user", "content": "x" * 100}])
    assert store.get("r0") is None and store.was_evicted("r0") and [store.get(f"r{i}") is not None
                                                                   for i in (1, 2, 3)] == [True] * 3
    assert store.put("big", {}, [{"role": "user", "content": "y" * 4000}]) and len(store) == 3
    assert store.put("bigger", {}, [{"role": "user", "content": "z" * 6000}])  # 4000 + 6000 > 10000
    assert store.get("big") is None and store.was_evicted("big") and store.nbytes <= 10_000
    assert not store.put("huge", {}, [{"role": "user", "content": "w" * 20_000}]) and store.get("huge") is None
    assert store.delete("bigger") and not store.delete("bigger") and not store.was_evicted("bigger")
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(-1, 10)


def test_responses_bad_input_is_a_4xx_in_openai_shape(server):
    cases = [({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "unsupported item type"),
             ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
              "no function_call"),
             ({"input": "x", "previous_response_id": "resp_nope"}, 404, "no response"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
             ({"input": "x", "background": True}, 400, "background"),
             ({"input": []}, 400, "at least one item"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
              "input.0")]
    for raw in (b"{", b"[]", b'{"input": 1}', b"\xff\xfe"):
        r = httpx.post(server.url + "/v1/responses", content=raw, timeout=60,
                       headers={**server.headers(), "content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    for body, status, needle in cases:
        r = httpx.post(server.url + "/v1/responses", json={"model": NAME, **body}, headers=server.headers(),
                       timeout=60)
        err = r.json().get("error") or {}
        assert r.status_code == status and needle in err.get("message", ""), (body, r.status_code, r.text)
        assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
