"""Typed messages between the driver and the ranks: one `ForwardBatch` per step, one `RankResult` back per rank.

The batch carries every decision (which rank and slot each new token takes, which cached slot runs each sequence
sees, which K/V move between the device, host and disk tiers); ranks apply it and never re-decide. Its size grows
with the new tokens and the number of slot runs, not with the cached context, so a decode step ships a few hundred
bytes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from cpinfer.engine.kv.ops import CacheOp
from cpinfer.engine.sampling import SampleSpec


@dataclasses.dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a forward: T new tokens at positions start ... start+T-1."""

    token_ids: np.ndarray  # [T] int64
    start: int
    ranks: np.ndarray  # [T] CP rank that computes and stores each new token
    slots: np.ndarray  # [T] its KV slot on that rank (the cache operation the rank applies)
    ctx_runs: tuple[np.ndarray, ...]  # per CP rank: [R, 2] slot runs of every key before `start` on its path
    sample: SampleSpec | None  # sample the next token from the last new token's logits
    next_token: int = -1  # the token after the last new one, when known (prompt log-probabilities of a chunk)
    prompt_logprobs: bool = False  # return log p(next token) for each new token held on a rank
    spread: bool = True  # its keys (cached and new) sit on more than one rank: it takes part in the ring; else all
    # of them, old and new, are on ranks[0] and no other rank needs them
    prompt_top: int = 0  # with prompt_logprobs: also the k most likely tokens at each of those positions
    # speculative decoding (engine/spec_decode): a verify sequence is [last token, d_1 .. d_k], every token on one rank;
    # that rank computes the logits of all k+1 rows and keeps the target's distribution (spec/rejection.py)
    draft: np.ndarray | None = None  # [k] int64 the drafted tokens (token_ids[1:]); None: not a verify sequence
    draft_key: str = ""  # the request id: what a proposer keeps on the rank for it (a draft model's q rows)
    draft_allowed: np.ndarray | None = None  # [k+1, ceil(V/32)] int32 grammar bitmask of each row (constrained)
    draft_suppress: int = 0  # rows (from the first) that still hold back the stop tokens (min_tokens not reached)
    draft_q: np.ndarray | None = None  # [k, V] float32 the proposer's probabilities of its drafts, when shipped with
    # the batch (else the rank's ModelRunner.draft_probs[draft_key], else None: deterministic drafts)
    # hybrid (linear-attention) models: the state slot its recurrent layers start from (-1: a zero state and tail,
    # the sequence's start) and the one they leave its state in (`engine/kv/state_store.py`)
    state_in: int = -1
    state_out: int = -1
    state_copy: int = -1  # also leave the state after this forward in this slot (a snapshot: --state-snapshot-interval)

    @property
    def sampled_rows(self) -> int:
        """Rows whose logits its sampling reads (from its last new token back): 1, or k+1 for a verify sequence."""
        return 1 if self.draft is None else len(self.draft) + 1


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    seqs: tuple[SeqInput, ...]
    strategy: str  # "pass-kv" | "pass-q" for the ring's sequences; "local" when no sequence spreads (no ring)
    phase: str  # "prefill" | "decode" | "mixed"
    cache_ops: tuple[CacheOp, ...] = ()  # applied in order before the forward
    mla_form: str = "absorbed"  # multi-head latent attention: "absorbed" | "expanded" (`mla_form.py`); others ignore it
    # hybrid models with speculative decoding: (state slot, tokens to drop) per verify run of the last forward that
    # kept fewer tokens than it ran; every rank rolls those slots back before anything else (`kv/state_store.py`)
    state_picks: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class SampleResult:
    seq: int  # index into ForwardBatch.seqs
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    error: str | None = None  # this request's sampling failed (token is -1): it ends alone, the forward goes on
    # a verify sequence: the accepted drafts before `token`, each (token id, log-probability, top list) as above;
    # the request emits extra + (token,) in order (token: the target's correction or bonus token)
    extra: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class RankResult:
    samples: tuple[SampleResult, ...]
    prompt_lp: dict[int, tuple]  # seq → (offsets within its new tokens [M], log p(next) [M]) and, when its
    # prompt_top is k > 0, (top ids [M, k], top log-probabilities [M, k])
    forward_s: float
    ring_wait_s: float
    idle: bool = False  # this rank had no token and no ring to serve: it skipped the model
    tier_events: tuple = ()  # `TierEvent`s since the last result: disk writes done or failed, restore timings
    # host-side seconds of this forward's parts on the rank: "plan" (indices, tables and their upload, or the
    # static path's buffers), "model" (the layers and logits up to their copy to the host: it waits for the device;
    # a graph replay on the static path), "sample" (drawing tokens from the logits on the host)
    phases: dict = dataclasses.field(default_factory=dict)
    # a decode forward with verify rows that the static / CUDA-graph path could not take (a window or chunk bound
    # per row, wider than its largest captured verify width, more rows than its largest bucket): run eagerly here
    verify_fallback: bool = False
