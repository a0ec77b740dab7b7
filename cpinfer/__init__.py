"""cpinfer: context-parallel inference for long-context LLMs (MLSys 2025, "Context Parallelism for Scalable
Million-Token Inference"): ring pass-KV and pass-Q prefill, pass-Q decode, a sharded persistent KV cache."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):  # keep `import cpinfer` light: torch-heavy modules load on first use
    if name in ("LLM", "AsyncLLM", "RequestOutput", "SamplingParams"):
        import cpinfer.engine as engine
        return getattr(engine, name)
    raise AttributeError(f"module 'cpinfer' has no attribute {name!r}")
