"""Per-forward choice of the ring variant (paper §3.4) for the sequences that spread over ranks: full prefill →
pass-KV, decode → pass-Q, partial prefill (and mixed prefill + decode forwards) → the empirical h(T, P) of App. D
when the hardware profile carries coefficients fitted by `cpinfer calibrate` (it scored best on measured grids,
docs/benchmarks.md), else the All2All-aware analytical rule (Alg. 5). No sequence spread: no ring ("local")."""
from __future__ import annotations

import dataclasses

from cpinfer.cp.heuristics import StrategyChoice, choose_strategy


@dataclasses.dataclass(frozen=True)
class NoRing:
    """The choice for a forward in which no query needs another rank's keys: no ring, no collective."""

    inputs: dict
    strategy: str = "local"
    method: str = "no-ring"
    reason: str = "every sequence of the forward has all its keys on one rank"


def choose_for_batch(engine, t: int, p: int, phase: str, ring: bool = True) -> StrategyChoice | NoRing:
    """t new tokens, p cached tokens they attend to (of the sequences in the ring), phase "prefill" | "decode" |
    "mixed"; ring False when no sequence spreads over ranks."""
    inputs = {"T": t, "P": p, "N": engine.n}
    if not ring:
        return NoRing(inputs)
    if engine.strategy != "auto":
        return StrategyChoice(engine.strategy, "forced", inputs, f"strategy forced to {engine.strategy}")
    if phase == "decode":
        return StrategyChoice("pass-q", "decode", inputs, "decode passes the single query per sequence (Alg. 4)")
    c = engine.config
    method = "empirical" if engine.hardware.empirical is not None else "alg5"
    tp = engine.parallel.tp  # the heads one device holds
    kv_heads = c.cached_kv_heads if c.mla is not None else max(1, c.num_key_value_heads // tp)  # MLA: the latent
    return choose_strategy(t, p, engine.n, n_heads=c.num_attention_heads // tp,
                           n_kv_heads=kv_heads, head_dim=c.kv_key_width,
                           elem_bytes=engine.elem_bytes, hardware=engine.hardware, method=method, tp=tp)
