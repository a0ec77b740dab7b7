"""The scheduler: waiting and running queues, one forward's worth of work per step under a token budget.

Running requests go first, oldest first: a decoding request takes one token, a prefilling one takes the next chunk
of its prompt (chunked prefill = the paper's persistent-KV partial prefill, §3.3). Then waiting requests are admitted
while the budget, `max_num_seqs` and the KV cache allow. When the cache runs out, the newest running request is
preempted: its private blocks are freed and it is recomputed later (as a partial prefill over what is still cached).
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from cpinfer.engine.kv_manager import KVManager, Placement
from cpinfer.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None  # None: no chunking, a whole prompt per forward
    max_num_seqs: int = 64

    def __post_init__(self):
        b = self.max_num_batched_tokens
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"max_num_batched_tokens must be a positive integer or None, got {b!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One request's part of the next forward."""

    request: Request
    tokens: np.ndarray  # [T] new tokens at positions start ... start+T-1
    start: int
    ctx_runs: tuple[np.ndarray, ...]  # per rank: [R, 2] slot runs of the tokens before `start` on its path
    placement: Placement
    sample: bool  # the last new token is the last known one: sample the next token from its logits
    is_decode: bool


class Scheduler:
    def __init__(self, kv: KVManager, config: SchedulerConfig):
        self.kv = kv
        self.config = config
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens or (1 << 62)
        out: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            sched = self._place(req, budget)
            if sched is None:  # no room even after eviction: preempt the newest running request
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
                continue
            out.append(sched)
            budget -= len(sched.tokens)
            i += 1
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if self._waits_for_inflight_prefix(req):
                skipped.append(req)
                continue
            first = req.num_cached < 0
            req.kv = self.kv.attach(req.request_id, req.known_array(), use_cache=not req.params.prompt_logprobs
                                    or bool(req.out))  # prompt log-probs need every prompt row computed once
            sched = self._place(req, budget)
            if sched is None:
                self.kv.release(req.kv, keep=False)
                req.kv = None
                self.waiting.appendleft(req)
                break
            if first:
                req.num_cached = min(sched.start, len(req.prompt))
                self.kv.prefix_queries += len(req.prompt)
                self.kv.prefix_hits += req.num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append(sched)
            budget -= len(sched.tokens)
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        return out

    def _place(self, req: Request, budget: int) -> ScheduledSeq | None:
        start = req.num_stored
        n = min(req.num_to_compute, budget)
        is_decode = not req.is_prefill
        tokens = req.token_slice(start, n)
        ctx = tuple(req.kv.runs_array(r) for r in range(self.kv.n))  # before the new tokens are appended
        placement = self.kv.reserve(req.kv, tokens, decode=is_decode)
        if placement is None:
            return None
        sample = start + n == len(req.prompt) + len(req.out)
        return ScheduledSeq(req, tokens, start, ctx, placement, sample, is_decode)

    def _waits_for_inflight_prefix(self, req: Request) -> bool:
        """True when a running request still prefilling a prompt shares more of req's prompt than the cache holds:
        req then waits, so the shared part is computed and stored once."""
        if not self.kv.enable_prefix_caching or req.params.prompt_logprobs:
            return False
        mine = req.known_array()
        cached = self.kv.match(mine, len(mine) - 1)[2]
        for other in self.running:
            if other.num_stored >= len(other.prompt):
                continue
            theirs = np.asarray(other.prompt, dtype=np.int64)
            m = min(len(theirs), len(mine) - 1)
            neq = np.nonzero(theirs[:m] != mine[:m])[0]
            if (int(neq[0]) if len(neq) else m) > cached:
                return True
        return False

    # ------------------------------------------------------------------ leaving the running set
    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req.kv, keep=False)
        req.kv = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, keep_cache: bool) -> None:
        """Remove a request (finished, aborted or failed) from whichever queue holds it; free or keep its cache."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv is not None:
            self.kv.release(req.kv, keep=keep_cache)
            req.kv = None
        req.status = RequestStatus.FINISHED
