"""The OpenAI Agents SDK (`openai-agents`) runs a 2-tool agent loop against `cpinfer serve`, unmodified: through the
Responses API (the whole conversation each turn, and chained on `previous_response_id` so the server keeps it) and
through chat completions. The agent calls `get_weather`, then `get_time`, gets each result back (as a
`function_call_output` item, or a tool message), and finishes with a message.

A random model would not choose tools, so this one is built to (server_utils.write_chain_model): the next token
depends on the current token only, and the chat template ends the generation prompt with a character that picks the
chain — "\\n" while no tool has answered (a get_weather call), "\\t" once get_weather's result is in the prompt (a
get_time call), "\\r" once both results are (the final message), and "\\f" for anything else (a reply the test
rejects). So the run only finishes as asserted if the tool results really reached the server's prompt, in order.
Everything after the logits (sampling, detokenizing, the Hermes tool parser, the Responses items) is the server's
own path.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from server_utils import ServerProcess, write_chain_model

agents = pytest.importorskip("agents")  # the openai-agents package
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

NAME = "agent-sdk"
WEATHER, TIME = "sunny, 21 C", "12:00"
FINAL = "In Paris it is sunny, 21 C, at 12:00."
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
LOST = "The tool results did not come back as expected."
# the generation prompt's last character picks the chain: by the tool results in the conversation so far (written as
# an expression: HF renders templates with trim_blocks, which drops a newline written right after a block tag)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% set ns = namespace(results=[]) %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% if m['role'] == 'tool' %}{% set ns.results = ns.results + [m['content']] %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' if ns.results == [] else '\\t' if ns.results == ['"
    + WEATHER + "'] else '\\r' if ns.results == ['" + WEATHER + "', '" + TIME + "'] else '\\f' }}{% endif %}")
BRANCHES = {"\t": [TIME_CALL], "\r": [FINAL], "\f": [LOST]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents_sdk_model")
    write_chain_model(d, [WEATHER_CALL], TEMPLATE, BRANCHES)
    srv = ServerProcess(["--model", str(d), "--cp", "2", "--served-model-name", NAME, "--max-model-len", "1024",
                         "--threads-per-rank", "1", "--max-kv-tokens-per-rank", "8192", "--log-level", "warning"])
    yield srv
    srv.close()


def _agent(server, api: str, calls: list):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        calls.append(("get_weather", city))
        return WEATHER

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return TIME

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = (OpenAIResponsesModel(NAME, client) if api == "responses" else OpenAIChatCompletionsModel(NAME, client))
    return Agent(name="weather", instructions="Answer with the weather and the time.", model=model,
                 tools=[get_weather, get_time], model_settings=ModelSettings(temperature=0))


@pytest.mark.parametrize("api, chained", [("responses", False), ("responses", True), ("chat", False)],
                         ids=["responses", "responses-previous_response_id", "chat-completions"])
def test_agents_sdk_runs_a_two_tool_loop_to_a_final_message(server, api, chained):
    from agents import (MessageOutputItem, RunConfig, Runner, ToolCallItem, ToolCallOutputItem)

    calls: list = []
    agent = _agent(server, api, calls)
    result = asyncio.run(Runner.run(agent, "What is the weather and the time in Paris?", max_turns=5,
                                    auto_previous_response_id=chained, run_config=RunConfig(tracing_disabled=True)))
    assert result.final_output == FINAL, (result.final_output, result.new_items)
    assert calls == [("get_weather", "Paris"), ("get_time", "Paris")]
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    called = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert [c.name for c in called] == ["get_weather", "get_time"], called  # Responses-shaped, whichever API
    assert [json.loads(c.arguments) for c in called] == [{"city": "Paris"}] * 2
    assert [o.output for o in outputs] == [WEATHER, TIME]
    ids = [c.call_id for c in called]
    assert len(set(ids)) == 2 and all(ids), ids
    assert [o.raw_item["call_id"] for o in outputs] == ids  # each result went back under its call's id
    # three model calls: each turn's prompt holds the previous one's, so its K/V came from the prefix cache
    assert len(result.raw_responses) == 3
    usage = [r.usage for r in result.raw_responses]
    prompts = [u.input_tokens for u in usage]
    cached = [u.input_tokens_details.cached_tokens for u in usage]
    assert prompts[0] < prompts[1] < prompts[2], prompts
    assert all(prompts[k - 1] - 1 <= cached[k] < prompts[k] for k in (1, 2)), (prompts, cached)
    if api == "responses":
        ids = [r.response_id for r in result.raw_responses]
        assert all(i.startswith("resp_") for i in ids) and len(set(ids)) == 3, ids
        if chained:  # turns 2-3 named the turn before, so the server kept the conversation
            assert result.last_response_id == ids[-1]
