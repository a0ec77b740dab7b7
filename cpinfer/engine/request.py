"""A request's state on the driver (status, tokens, cache handle, metrics) and what the engine returns for it."""
from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from cpinfer.engine.kv.manager import SeqKV
from cpinfer.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet (or preempted: its blocks were freed, it is recomputed when readmitted)
    RUNNING = "running"  # holds a cache path; prefilling in chunks, then decoding
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_lp: list[float | None] | None = None
    prompt_top_lp: list[dict[int, float] | None] | None = None  # with prompt_lp when top_logprobs is set
    lp_source: "Request | None" = dataclasses.field(default=None, repr=False)  # an earlier request of the same
    # prompt whose prompt log-probs this one copies (it waits for them, then reuses that prompt's cached K/V)
    lp_copied: bool = False  # its prompt log-probs were copied from its source
    kv: SeqKV | None = None
    num_cached: int = -1  # prompt tokens reused from the prefix cache at first admission (-1: not admitted yet)
    refilled: int = -1  # it filled a hole of its cached path up to here and waits to match on below (else -1)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""  # the output text so far (engine/output.py extends it token by token)
    text_state: object = None  # its incremental detokenizer and stop-string bookkeeping (output.TextState)
    metrics: dict = dataclasses.field(default_factory=lambda: {"steps": [], "ttit_s": []})
    t_last: float = 0.0
    spec: object = None  # speculative decoding: its spec.adaptive.SpecState (None: the engine does not speculate)
    draft: np.ndarray | None = dataclasses.field(default=None, repr=False)  # [k] this step's draft, if any
    _prompt_set: np.ndarray | None = dataclasses.field(default=None, repr=False)

    @property
    def known(self) -> list[int]:
        """Every token whose K/V the request needs: prompt and output (the last output token is fed next)."""
        return self.prompt + self.out

    @property
    def num_stored(self) -> int:
        return self.kv.num_stored if self.kv is not None else 0

    @property
    def num_to_compute(self) -> int:
        return len(self.prompt) + len(self.out) - self.num_stored

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or, after preemption, earlier output) tokens beyond the next decode token."""
        return self.num_to_compute > 1 or not self.out

    def token_slice(self, start: int, n: int) -> np.ndarray:
        """known[start:start+n] without building the whole list (a decode step reads one output token)."""
        p = len(self.prompt)
        if start >= p:
            return np.asarray(self.out[start - p:start - p + n], dtype=np.int64)
        return np.asarray((self.prompt[start:start + n] + self.out[:max(0, start + n - p)]), dtype=np.int64)

    def known_array(self) -> np.ndarray:
        return np.asarray(self.known, dtype=np.int64)

    def take_source_prompt_logprobs(self) -> bool:
        """Copy the prompt log-probs of `lp_source` once it has them (its prompt is computed: it has output);
        False while it is still computing them. A source that ended without them is dropped: this request then
        computes its own."""
        src = self.lp_source
        if src is None:
            return True
        if not src.out or src.prompt_lp is None:
            if src.status is RequestStatus.FINISHED:
                self.lp_source = None
                return True
            return False
        self.prompt_lp = list(src.prompt_lp)
        self.prompt_top_lp = list(src.prompt_top_lp) if src.prompt_top_lp is not None else None
        self.lp_source, self.lp_copied = None, True
        return True

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Its prompt's rows must be computed for their log-probs (not taken from the prefix cache)."""
        return self.params.prompt_logprobs and not self.lp_copied and not self.out

    def prompt_set(self) -> np.ndarray:
        """[u] int64: the prompt's distinct tokens (what the repetition penalty reads), computed once."""
        if self._prompt_set is None:
            self._prompt_set = np.unique(np.asarray(self.prompt, dtype=np.int64))
        return self._prompt_set


@dataclasses.dataclass
class RequestOutput:
    """A request's output so far (cumulative). `finished` is True on the last one."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    num_cached_tokens: int
    finish_reason: str | None
    metrics: dict
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    stop_reason: str | int | None = None
    error: str | None = None  # finish_reason "error": why this request alone failed (for the log, not clients)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, when asked (first None)


@dataclasses.dataclass
class EngineStats:
    """A snapshot of the engine for monitoring (the server's /metrics)."""

    num_running: int
    num_waiting: int
    kv_tokens_per_rank: list[int]
    kv_capacity_per_rank: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    forwards: dict[str, int]  # "phase/strategy" → count
    preemptions: int
    requests_finished: dict[str, int]  # finish reason → count
    tiers: dict = dataclasses.field(default_factory=dict)  # per KV tier: hits, bytes, restores (cache_stats)
    attention_backend: str = ""  # what rank 0 runs ("auto" resolved on its device)
    attention_timings_ms: dict = dataclasses.field(default_factory=dict)  # backend → ms, when `auto` timed them
    request_prompt_tokens: int = 0  # whole prompts (cached tokens too) of requests whose prefill finished
    spec: dict = dataclasses.field(default_factory=dict)  # speculative decoding (empty when off): num_drafts (verify
    # steps), num_draft_tokens, num_accepted_tokens, num_emitted_tokens, accepted_per_pos (accepted drafts by
    # position), acceptance_rate, mean_accepted_length (accepted drafts per verify step)
