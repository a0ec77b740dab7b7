"""The form of a forward's multi-head latent attention (`model/mla.py`), chosen by FLOPs on the driver.

Per query head, with R = kv_lora_rank, r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim:

- absorbed: each (query, key) pair costs 2(R + r) FLOPs for the score and 2R for the value; each query costs 2nR to
  fold W_UK into it and 2Rv to up-project its output (W_UV after the merge).
- expanded: each pair costs 2(n + r) + 2v; each latent row that is up-projected costs 2R(n + v) (kv_b_proj). Rows
  are up-projected where they are read: pass-KV's every rank up-projects every ring block it attends (N times
  each row of a sequence in the ring), pass-Q and a local sequence's rank its own rows once.

DeepSeek-V3 (R 512, r 64, n 128, v 128): 2176 against 640 FLOPs per pair and head (3.4x), 262,144 per expanded
row: a prefill of T tokens over C cached ones is expanded when T ≳ 170 (at CP1), a decode step stays absorbed.
Both totals count every CP rank's work; the choice is one per forward (every rank sees the same batch, so every
rank takes the same form: pass-Q's queries travel in it).
"""
from __future__ import annotations

import dataclasses

FORMS = ("auto", "absorbed", "expanded")


@dataclasses.dataclass(frozen=True)
class FormChoice:
    form: str  # "absorbed" | "expanded"
    forced: bool  # given by the engine's `mla_form`, not by the FLOPs
    flops: dict  # {"absorbed": F, "expanded": F}: attention FLOPs of the forward in each form (every rank, head)

    def as_metrics(self) -> dict:
        return {"form": self.form, "forced": self.forced, "flops": dict(self.flops)}


def check_form(form: str) -> str:
    if form not in FORMS:
        raise ValueError(f"mla_form must be one of {', '.join(repr(f) for f in FORMS)}, got {form!r}")
    return form


def attention_flops(mla, heads: int, pairs: int, queries: int, expanded_rows: int) -> dict:
    """FLOPs of one layer's attention in each form: `pairs` visible (query, key) pairs, `queries` new tokens,
    `expanded_rows` latent rows the expanded form up-projects (over every rank); `mla`: the model's `MLAConfig`."""
    big, rope, nope, v = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    absorbed = heads * (pairs * 2 * (2 * big + rope) + queries * 2 * big * (nope + v))
    expanded = heads * (pairs * 2 * (nope + rope + v) + expanded_rows * 2 * big * (nope + v))
    return {"absorbed": absorbed, "expanded": expanded}


def forward_shape(seqs, world: int, strategy: str) -> tuple[int, int, int]:
    """(pairs, queries, expanded rows) of a forward: `seqs` [(start, new tokens, spread)]; a spread sequence's
    rows are up-projected on every rank under pass-KV, once under pass-Q; a local one's once."""
    pairs = queries = rows = 0
    for start, t, spread in seqs:
        pairs += t * start + t * (t + 1) // 2  # the cache, then causal among the new tokens
        queries += t
        rows += (start + t) * (world if spread and strategy == "pass-kv" else 1)
    return pairs, queries, rows


def choose_form(mla, heads: int, seqs, world: int, strategy: str, mode: str = "auto") -> FormChoice:
    """The forward's form: `mode` when forced, else the one with fewer attention FLOPs (ties: absorbed)."""
    flops = attention_flops(mla, heads, *forward_shape(seqs, world, strategy))
    if mode != "auto":
        return FormChoice(mode, True, flops)
    return FormChoice("expanded" if flops["expanded"] < flops["absorbed"] else "absorbed", False, flops)


__all__ = ["FORMS", "FormChoice", "attention_flops", "check_form", "choose_form", "forward_shape"]
