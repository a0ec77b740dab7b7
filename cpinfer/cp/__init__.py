"""Context-parallel attention: sharding plans, ring pass-KV / pass-Q, and the `cp_attention` entry point.

`cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, *, group, strategy)` is the rank-local contract of
DESIGN.md: every rank calls it with its own tokens; query i sees every key j on any rank of `group` with
`kv_seq[j] <= q_seq[i] < kv_seq_end[j]` (default kv_seq + 1: the same sequence id; prefix-tree intervals for
shared prefixes), kv_pos[j] <= q_pos[i], with a sliding `window` q_pos[i] - kv_pos[j] < window, and with an
attention `chunk` q_pos[i] // chunk == kv_pos[j] // chunk; `sinks` add one logit per head to every softmax, merged
once after the ring. The engine uses the plan/run form (`plan_from_metadata(...).run`).
"""
from __future__ import annotations

import torch

from cpinfer.cp.plan import STRATEGIES, CPAttentionPlan, exchange_and_plan, plan_from_metadata

__all__ = ["cp_attention", "plan_cp_attention", "plan_from_metadata", "CPAttentionPlan", "STRATEGIES"]


def plan_cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, *, group, strategy="pass-kv",
                      scale=None, kv_seq_end=None, backend="auto", control_group=None, window=None,
                      chunk=None, sinks=None) -> CPAttentionPlan:
    """Validate inputs on all ranks, exchange metadata once (over `control_group`, a gloo group, if given), and
    return the reusable plan (`sinks` is only validated here: pass it to `run`)."""
    return exchange_and_plan(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=group, strategy=strategy, scale=scale,
                             kv_seq_end=kv_seq_end, backend=backend, control_group=control_group, window=window,
                             chunk=chunk, sinks=sinks)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                 kv_seq: torch.Tensor, kv_pos: torch.Tensor, *, group, strategy: str = "pass-kv",
                 scale: float | None = None, kv_seq_end: torch.Tensor | None = None,
                 backend: str = "auto", control_group=None, window: int | None = None, chunk: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over the whole CP group. q [Lq, H, D], k [Lkv, Hkv, D], v [Lkv, Hkv, Dv], metadata int64 →
    out [Lq, H, Dv]. The value head size Dv may differ from D; v may be the view k[..., :Dv] (MLA: the latent is the
    key's first part and the value), and then K/V messages carry the keys alone. The softmax scale defaults to
    1/sqrt(D).

    strategy: "pass-kv" (ring K/V, Alg. 2), "pass-q" (ring Q + All2All, Alg. 3/4) or "all-gather" (baseline).
    kv_seq_end [Lkv] (default kv_seq + 1): key j is visible to labels in [kv_seq[j], kv_seq_end[j]).
    backend: "auto" (or $CPINFER_ATTENTION_BACKEND), "cpu-flash", "triton", "flash-attn", "torch-cudnn",
    "torch-flash" or "math".
    control_group: a gloo group over the same ranks for the metadata exchange (GPUs: NCCL `group` for tensors).
    window: a sliding window (transformers' convention: key j visible iff q_pos - kv_pos < window); tiles and
    ring steps with no visible key are skipped, and rows no query can see never travel.
    chunk: an attention chunk (Llama 4: key j visible only iff q_pos // chunk == kv_pos // chunk, beside the other
    rules); skipped like a window's invisible keys.
    sinks [H] float: a logit per query head added once to every query's softmax denominator (gpt-oss), merged after
    the ring as one more partial with lse = sink and zero output.
    Queries with no visible key get zeros (with sinks too). Raises ValueError on every rank if any rank's input is bad.
    """
    plan = plan_cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=group, strategy=strategy, scale=scale,
                             kv_seq_end=kv_seq_end, backend=backend, control_group=control_group, window=window,
                             chunk=chunk, sinks=sinks)
    return plan.run(q, k, v, sinks=sinks)
