"""vLLM's names on the server, without an engine (a stub behind the app): GET /version, an unknown model is a 404,
CORS for --allowed-origins, --root-path, chat_template_kwargs and --chat-template reaching the template, the
model's generation_config defaults when a request sets none, the vllm:* series, and the periodic stats line.
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

import cpinfer
from cpinfer.commands.serve import chat_template, served_name
from cpinfer.server import protocol as P
from cpinfer.server.app import OpenAIServer, ServerConfig, build_app
from cpinfer.server.metrics import StatsLogger
from cpinfer.server.prompts import PromptEncoder
from server_utils import write_tiny_tokenizer

STATS = {"num_running": 2, "num_waiting": 1, "kv_tokens_per_rank": [64, 32], "kv_capacity_per_rank": 128,
         "prefix_cache_queries": 100, "prefix_cache_hits": 40, "request_prompt_tokens": 500, "prompt_tokens": 60,
         "generation_tokens": 70,
         "preemptions": 3, "requests_finished": {"stop": 4, "length": 1}, "forwards": {}}


@pytest.fixture(scope="module")
def stub():
    return SimpleNamespace(tokenizer=None, max_model_len=128, max_logprobs=20, stats=lambda: dict(STATS), errored=False,
                           dead_error=None, config=SimpleNamespace(vocab_size=16),
                           generation_defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20})


def test_version_and_unknown_model_is_404(stub):
    c = TestClient(build_app(stub, ServerConfig("m", api_key="k")))
    r = c.get("/version")  # open, as /health: no key needed
    assert r.status_code == 200 and r.json() == {"version": cpinfer.__version__}
    r = c.post("/v1/completions", json={"model": "other", "prompt": "hi"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'other' does not exist" in r.json()["error"]["message"]


def test_cors_only_for_the_allowed_origins(stub):
    plain = TestClient(build_app(stub, ServerConfig("m")))
    assert "access-control-allow-origin" not in plain.get("/version", headers={"Origin": "https://a.example"}).headers
    c = TestClient(build_app(stub, ServerConfig("m", api_key="k", allowed_origins=["https://a.example"])))
    pre = c.options("/v1/chat/completions", headers={"Origin": "https://a.example",
                                                     "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://a.example"
    other = c.options("/v1/chat/completions", headers={"Origin": "https://b.example",
                                                       "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with pytest.raises(ValueError, match="allowed_origins must be a list"):
        ServerConfig("m", allowed_origins="*")


def test_root_path_keeps_the_open_routes_open(stub):
    c = TestClient(build_app(stub, ServerConfig("m", api_key="k")), root_path="/llm")
    assert c.get("/llm/version").status_code == 200 and c.get("/llm/health").status_code == 200
    assert c.get("/llm/v1/models").status_code == 401
    assert c.get("/llm/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "m"


def test_generation_config_defaults_apply_only_where_the_request_sets_none(stub):
    server = OpenAIServer(stub, ServerConfig("m"))
    unset = P.CompletionRequest.model_validate({"prompt": "hi"})
    p = server.sampling_params(unset, 8, 0, False, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    own = P.CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.0, "top_k": 5})
    p = server.sampling_params(own, 8, 0, False, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.95, 5)


def test_chat_template_kwargs_and_chat_template_reach_the_template(tmp_path):
    write_tiny_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}")
    enc = PromptEncoder(tok, 256, chat_template=template)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.decode(enc.encode_chat(msgs)) == "hi"
    assert tok.decode(enc.encode_chat(msgs, template_kwargs={"enable_thinking": False})) == "hi<nothink>"
    req = P.ChatCompletionRequest.model_validate({"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    assert req.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="'messages' cannot be set"):
        P.ChatCompletionRequest.model_validate({"messages": msgs, "chat_template_kwargs": {"messages": []}})
    from cpinfer.engine.llm import encode_chat  # the offline API: LLM.chat(..., chat_template_kwargs=...)

    tok.chat_template = template
    assert tok.decode(encode_chat(tok, msgs, {"enable_thinking": False})) == "hi<nothink>"
    (tmp_path / "t.jinja").write_text(template)
    assert chat_template(str(tmp_path / "t.jinja")) == template and chat_template(template) == template
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        chat_template(str(tmp_path / "missing.jinja"))


def test_served_name_is_the_hub_id_as_given(tmp_path):
    args = argparse.Namespace(served_model_name=None)
    assert served_name(args, "org/name") == "org/name"
    assert served_name(args, str(tmp_path / "my-model")) == "my-model"
    assert served_name(argparse.Namespace(served_model_name="x"), "org/name") == "x"


VLLM_SERIES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
               "vllm:request_success_total"]


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_vllm_series_by_name_from_the_engine_stats(stub):
    values = _samples(TestClient(build_app(stub, ServerConfig("m"))).get("/metrics").text)
    labels = '{engine="0",model_name="m"}'
    for name in VLLM_SERIES[:-1]:
        assert name + labels in values, name
    assert values["vllm:num_requests_running" + labels] == 2 and values["vllm:num_requests_waiting" + labels] == 1
    assert values["vllm:kv_cache_usage_perc" + labels] == pytest.approx(96 / 256)
    assert values["vllm:prompt_tokens_total" + labels] == 500 and values["vllm:prefix_cache_hits_total" + labels] == 40
    assert values['vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"}'] == 4
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert name + "_count" + labels in values, name


def test_stats_line_reports_rates_queues_kv_per_rank_and_hit_rate():
    now, stats = [100.0], [dict(STATS, num_running=0, num_waiting=0)]
    logger = StatsLogger(lambda: stats[0], 10.0, clock=lambda: now[0])
    assert logger.line() is None  # the first call only takes the baseline
    now[0] += 10.0
    assert logger.line() is None  # nothing happened: no line
    stats[0] = dict(STATS, request_prompt_tokens=1500, generation_tokens=270, prefix_cache_queries=300,
                    prefix_cache_hits=190)
    now[0] += 10.0
    line = logger.line()
    assert line == ("prompt throughput 100.0 tokens/s, generation throughput 20.0 tokens/s, running 2 reqs, "
                    "waiting 1 reqs, KV cache usage per rank [50.0%, 25.0%], prefix cache hit rate 75.0%")
    with pytest.raises(ValueError, match="must be > 0"):
        StatsLogger(lambda: STATS, 0)
