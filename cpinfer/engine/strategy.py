"""Per-forward choice of the ring variant (paper §3.4): full prefill → pass-KV, decode → pass-Q, partial prefill →
the All2All-aware analytical rule (Alg. 5) on the hardware profile, unless the user forced one."""
from __future__ import annotations

from cpinfer.cp.heuristics import StrategyChoice, choose_strategy


def choose_for_batch(llm, works, phase: str) -> StrategyChoice:
    t = sum(len(w.token_ids) for w in works)
    p = sum(w.num_cached for w in works) if phase == "prefill" else sum(w.num_cached for w in works)
    inputs = {"T": t, "P": p, "N": llm.n}
    if llm.strategy != "auto":
        return StrategyChoice(llm.strategy, "forced", inputs, f"strategy forced to {llm.strategy}")
    if phase == "decode":
        return StrategyChoice("pass-q", "decode", inputs, "decode passes the single query per sequence (Alg. 4)")
    c = llm.config
    return choose_strategy(t, p, llm.n, n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
                           head_dim=c.head_dim, elem_bytes=llm.elem_bytes, hardware=llm.hardware, method="alg5")
