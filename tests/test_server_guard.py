"""The server's outer layer without an engine (a stub behind the app): the API key before the body, the body
limit on declared and on streamed (chunked) bodies, the request id header, and the OpenAPI schema only on demand.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from cpinfer.server.app import ServerConfig, build_app

LIMIT = 4096


@pytest.fixture(scope="module")
def stub():
    return SimpleNamespace(tokenizer=None, max_model_len=128, stats=lambda: {}, errored=False, dead_error=None,
                           config=SimpleNamespace(vocab_size=16))


def _client(stub, **kw) -> TestClient:
    return TestClient(build_app(stub, ServerConfig("m", max_request_bytes=LIMIT, **kw)))


def test_key_is_checked_before_the_body_and_the_limit_holds_for_chunked_bodies(stub):
    c = _client(stub, api_key="k")
    r = c.post("/v1/completions", content=b"{broken")
    assert r.status_code == 401 and r.headers["x-request-id"]
    ok = {"Authorization": "Bearer k"}
    r = c.post("/v1/completions", content=b"x" * (LIMIT + 1), headers=ok)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        for _ in range(8):
            yield b"y" * 1024

    r = c.post("/v1/completions", content=chunks(), headers=ok)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]
    r = c.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": "5"}', headers=ok)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # open without the key


def test_openapi_only_with_enable_docs_and_never_a_docs_ui(stub):
    assert _client(stub).get("/openapi.json").status_code == 404
    c = _client(stub, enable_docs=True)
    schema = c.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest") and "ChatCompletionRequest" in schema["components"]["schemas"]
    assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404


def test_a_dead_engine_is_503_without_internals(stub):
    dead = SimpleNamespace(**{**vars(stub), "errored": True,
                              "dead_error": 'RemoteError: Traceback File "/x/cpinfer/launch.py", line 94'})
    c = _client(dead)
    for r in (c.get("/health"), c.post("/v1/completions", json={"prompt": "hi"})):
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "Traceback" not in r.text and ".py" not in r.text and "/x/" not in r.text
