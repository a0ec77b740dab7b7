"""The online engine (paper §3.3 persistent KV served step by step).

request (state) → scheduler (queues, token budget, preemption) → kv_manager (radix tree over the sharded cache,
the one owner of every rank's blocks) → batch (typed driver↔rank messages) → model_runner + attention (SPMD ranks)
→ llm_engine (step loop; config: its arguments, startup: its start-up) → llm (offline `LLM`) / async_llm
(`AsyncLLM` for the server).
"""
from cpinfer.engine.async_llm import AsyncLLM, RequestFailedError, RequestStream
from cpinfer.engine.llm import LLM
from cpinfer.engine.config import EngineConfig
from cpinfer.engine.llm_engine import EngineDeadError, LLMEngine
from cpinfer.engine.request import EngineStats, RequestOutput
from cpinfer.engine.sampling import SamplingParams

__all__ = ["AsyncLLM", "RequestFailedError", "RequestStream", "LLM", "LLMEngine", "EngineConfig", "EngineDeadError", "EngineStats",
           "RequestOutput", "SamplingParams"]
