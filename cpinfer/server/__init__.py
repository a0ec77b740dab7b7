"""`cpinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

Multi-turn chats reuse their sharded KV cache across turns (persistent KV, paper §3.3); `usage` reports the reuse
as `prompt_tokens_details.cached_tokens`. protocol = request/response models, app = routes, metrics = Prometheus.
"""
