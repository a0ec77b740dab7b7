"""Speculative decoding: draft k tokens, verify them as k+1 decode rows over the sharded KV (or, `spec_verify`
"prefill", as one partial prefill), keep exactly what the target model would produce.

config (`SpeculativeConfig`, vLLM's keys) → proposer (`Proposer` interface, registry; ngram.py: prompt lookup) →
the scheduler places [last, drafts] on one rank → the rank's rejection.py keeps the target's distribution →
the KV manager truncates the rejected tail; adaptive.py sets each request's k.
"""
from cpinfer.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
