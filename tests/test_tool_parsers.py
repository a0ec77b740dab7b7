"""Tool-call and reasoning parsers (server/tool_parsers.py, server/reasoning.py): each format's calls and content,
and the streaming rule — fed the output in every split (character by character and in random pieces), the deltas
add up to exactly the final parse, content never holds a partial marker, and a call is sent once, whole.
"""
from __future__ import annotations

import json
import random

import pytest

from cpinfer.server.chat import ReplyParser
from cpinfer.server.reasoning import REASONING_PARSERS, reasoning_parser_for
from cpinfer.server.tool_parsers import (TOOL_PARSERS, HermesParser, Llama3JsonParser, MistralParser, held_back,
                                         tool_parser_for)

WEATHER = {"city": "Paris", "unit": "C"}
HERMES = [
    ("plain answer", "plain answer", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>', "",
     [("get_weather", WEATHER)]),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>', "Let me look.\n\n", [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', "", [("a", {"k": 1})]),  # args as text
    ('<tool_call>not json</tool_call> after', "<tool_call>not json</tool_call> after", []),  # stays content
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', "", [("a", {"k": 1})]),  # unclosed at the end: parsed
    ("a < b and <tool", "a < b and <tool", []),  # a partial marker at the end is content once final
]
LLAMA = [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', "", [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', "",
     [("a", {}), ("b", {"y": 2})]),
    ('{"name": "a", "arguments": {"z": true}}', "", [("a", {"z": True})]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "a", "parameters": {"k": 1', '{"name": "a", "parameters": {"k": 1', []),  # truncated: content
]
MISTRAL = [
    ("Hello there", "Hello there", []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', "",
     [("get_weather", WEATHER)]),
    ('Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "x"}}]', "Sure. ",
     [("a", {}), ("b", {"q": "x"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]b[ARGS]{}', "",
     [("get_weather", WEATHER), ("b", {})]),
    ("[TOOL_CALLS] oops", "[TOOL_CALLS]oops", []),
]
CASES = [(HermesParser, c) for c in HERMES] + [(Llama3JsonParser, c) for c in LLAMA] + \
        [(MistralParser, c) for c in MISTRAL]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser,case", CASES, ids=[f"{p.name}-{i}" for i, (p, _) in enumerate(CASES)])
def test_final_parse(parser, case):
    text, content, calls = case
    got_content, got_calls = parser().extract(text, final=True)
    assert got_content == content and _calls(got_calls) == calls


def _splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    pieces = [list(text)]  # one character at a time
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        pieces.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return pieces


def _stream(reply: ReplyParser, pieces: list[str]):
    text, reasoning, content, calls = "", "", "", []
    for k, piece in enumerate(pieces):
        text += piece
        r, c, new = reply.delta(text, final=k == len(pieces) - 1)
        reasoning, content, calls = reasoning + r, content + c, calls + new
    return reasoning, content, calls


@pytest.mark.parametrize("parser,case", CASES, ids=[f"{p.name}-{i}" for i, (p, _) in enumerate(CASES)])
def test_stream_deltas_add_up_to_the_final_parse(parser, case):
    text, content, calls = case
    for i, pieces in enumerate(_splits(text, hash(text) % 1000)):
        reply = ReplyParser(None, parser())
        r, c, got = _stream(reply, pieces)
        assert r == "" and c == content, (pieces, c)
        assert _calls(got) == calls
        assert len({x.id for x in got}) == len(got)  # each call once, with its own id


def test_content_never_shows_a_partial_marker_while_streaming():
    reply = ReplyParser(None, HermesParser())
    _, content, _ = reply.delta("Checking <tool_", final=False)
    assert content == "Checking "
    _, content, calls = reply.delta('Checking <tool_call>{"name": "a", "arguments": {}}', final=False)
    assert content == "" and calls == []  # the call is not closed yet
    _, content, calls = reply.delta('Checking <tool_call>{"name": "a", "arguments": {}}</tool_call>', final=False)
    assert _calls(calls) == [("a", {})]
    assert held_back("abc<too", "<tool_call>") == 3 and held_back("abc", "<tool_call>") == 3


REASONING = [
    ("qwen3", "<think>\nweigh options\n</think>\n\nThe answer.", "\nweigh options\n", "The answer."),
    ("qwen3", "No thought here.", "", "No thought here."),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("deepseek_r1", "weigh options</think>The answer.", "weigh options", "The answer."),
    ("deepseek_r1", "<think>a</think>b", "a", "b"),
    ("deepseek_r1", "all thought, no end", "all thought, no end", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_split_final_and_streamed(name, text, reasoning, content):
    parser = reasoning_parser_for(name)
    assert parser.split(text, final=True) == (reasoning, content)
    for pieces in _splits(text, 7):
        r, c, calls = _stream(ReplyParser(parser, None), pieces)
        assert (r, c, calls) == (reasoning, content, [])


def test_reasoning_then_tool_call_streamed():
    text = '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris", "unit": "C"}}\n</tool_call>'
    for pieces in _splits(text, 3):
        r, c, calls = _stream(ReplyParser(reasoning_parser_for("qwen3"), HermesParser()), pieces)
        assert r == "I need the weather." and c == "" and _calls(calls) == [("get_weather", WEATHER)]


def test_registry_flag_and_template_detection():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"} and set(REASONING_PARSERS) == {"deepseek_r1",
                                                                                                    "qwen3"}
    assert tool_parser_for(None, "{% for t in tools %}<tool_call>{% endfor %}") is HermesParser
    assert tool_parser_for(None, "... <|python_tag|> ...") is Llama3JsonParser
    assert tool_parser_for(None, "[AVAILABLE_TOOLS] ... [TOOL_CALLS]") is MistralParser
    assert tool_parser_for(None, "{{ messages }}") is None and tool_parser_for(None, None) is None
    assert tool_parser_for("mistral", "<tool_call>") is MistralParser  # the flag wins
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_for("pythonic", None)
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser_for("gpt_oss")
    ids = [MistralParser().new_id() for _ in range(20)]
    assert all(len(i) == 9 and i.isalnum() for i in ids)


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = HERMES[2][0]  # two calls
    reply = ReplyParser(None, HermesParser(), max_calls=1)
    assert _calls(reply.parse(text, final=True)[2]) == [("a", {})]
    for pieces in _splits(text, 5):
        assert _calls(_stream(ReplyParser(None, HermesParser(), max_calls=1), pieces)[2]) == [("a", {})]
