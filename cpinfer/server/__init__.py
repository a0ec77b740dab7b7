"""`cpinfer serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`, which also speaks
Anthropic's Messages API and OpenAI's Responses API.

Multi-turn chats reuse their sharded KV cache across turns (persistent KV, paper §3.3); `usage` reports the reuse
as `prompt_tokens_details.cached_tokens` (`cache_read_input_tokens` on /v1/messages). pipeline = the one request
pipeline every API runs, completions / chat / messages / responses = each API's translation, protocol = the OpenAI
request/response models, app = the FastAPI app, routes = its routes, metrics = Prometheus.
"""
