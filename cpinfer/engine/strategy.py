"""Per-forward choice of the ring variant (paper §3.4): full prefill → pass-KV, decode → pass-Q, partial prefill →
the empirical h(T, P) of App. D when the hardware profile carries coefficients fitted by `cpinfer calibrate`
(it scored best on measured grids, docs/benchmarks.md), else the All2All-aware analytical rule (Alg. 5)."""
from __future__ import annotations

from cpinfer.cp.heuristics import StrategyChoice, choose_strategy


def choose_for_batch(llm, works, phase: str) -> StrategyChoice:
    t = sum(len(w.token_ids) for w in works)
    p = sum(w.num_cached for w in works)
    inputs = {"T": t, "P": p, "N": llm.n}
    if llm.strategy != "auto":
        return StrategyChoice(llm.strategy, "forced", inputs, f"strategy forced to {llm.strategy}")
    if phase == "decode":
        return StrategyChoice("pass-q", "decode", inputs, "decode passes the single query per sequence (Alg. 4)")
    c = llm.config
    method = "empirical" if llm.hardware.empirical is not None else "alg5"
    tp = llm.parallel.tp  # the heads one device holds
    return choose_strategy(t, p, llm.n, n_heads=c.num_attention_heads // tp,
                           n_kv_heads=max(1, c.num_key_value_heads // tp), head_dim=c.head_dim,
                           elem_bytes=llm.elem_bytes, hardware=llm.hardware, method=method)
