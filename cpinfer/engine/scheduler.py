"""The scheduler: waiting and running queues, one forward's worth of work per step under a token budget.

Running requests go first, oldest first: a decoding request takes one token, a prefilling one takes the next chunk
of its prompt (chunked prefill = the paper's persistent-KV partial prefill, §3.3). Then waiting requests are admitted
while the budget, `max_num_seqs` and the KV cache allow (per rank: a request kept on one rank needs its blocks
there). When the cache runs out, the newest running request is preempted: its private blocks are freed and it is
recomputed later (as a partial prefill over what is still cached). The KV manager places each one's new tokens.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from cpinfer.engine.kv.manager import KVManager, Placement
from cpinfer.engine.request import Request, RequestStatus


# the tokens of one forward unless told otherwise (EngineConfig, serve; vLLM's default for its server): a longer prompt
# is prefilled in chunks, and a burst of long prompts gets first tokens one prompt after another, oldest first, instead
# of all at the end of one forward over every prompt (measured: docs/benchmarks.md, `cpinfer bench burst`)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


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
    draft: np.ndarray | None = None  # [k] speculative decoding: tokens[1:] are drafts to verify (tokens[0] the last)


class Scheduler:
    def __init__(self, kv: KVManager, config: SchedulerConfig):
        self.kv = kv
        self.config = config
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.on_release = None  # callable(request) when a request leaves the running set (a proposer's hook)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens or (1 << 62)
        self.kv.begin_forward(self._work_estimate(budget) if self.kv.placer.needs_costs else None)
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
            use_cache = not req.computes_prompt_logprobs  # prompt log-probs: every row computed (or copied)
            req.kv = self.kv.attach(req.request_id, req.known_array(), use_cache=use_cache)
            sched = self._place(req, budget)
            if sched is None and use_cache and not self.running and not out:
                # nothing else holds blocks: its cached path itself (one block per segment and rank at least)
                # leaves no room for its new tokens — recompute it rather than wait for ever
                self.kv.release(req.kv, keep=False)
                req.kv = self.kv.attach(req.request_id, req.known_array(), use_cache=False)
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
                self.kv.count_tier_hits(req.kv.hits)
            elif req.refilled >= 0:  # back after filling a hole: what it matched below the hole was cached too
                hits = dict(req.kv.hits)  # the path down to the filled hole is on the device, counted before
                hits["device"] = max(0, hits["device"] - req.refilled)
                req.num_cached += sum(hits.values())
                self.kv.prefix_hits += sum(hits.values())
                self.kv.count_tier_hits(hits)
                req.refilled = -1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append(sched)
            budget -= len(sched.tokens)
        for req in reversed(skipped):
            self.waiting.appendleft(req)
        return out

    def _place(self, req: Request, budget: int) -> ScheduledSeq | None:
        start = req.num_stored
        todo = req.num_to_compute
        n = min(todo, budget)
        if req.kv.fill_until > start:  # a hole in its cached path: compute just it first (then match on below)
            n = min(n, req.kv.fill_until - start)
        is_decode = not req.is_prefill
        tokens = req.token_slice(start, n)
        ctx = tuple(req.kv.runs_array(r) for r in range(self.kv.n))  # before the new tokens are appended
        decode_left = max(0, req.params.max_tokens - len(req.out) - 1)  # decode forwards it may still need
        draft = req.draft[:budget - 1] if is_decode and req.draft is not None else None
        if draft is not None and len(draft):  # verify [last, drafts] on one rank; no room: decode plainly
            tokens = np.concatenate([tokens, draft])
            placement = self.kv.reserve(req.kv, tokens, decode=True, decode_left=decode_left, verify=len(draft))
            if placement is not None:
                return ScheduledSeq(req, tokens, start, ctx, placement, True, True, draft)
            tokens = tokens[:1]
        placement = self.kv.reserve(req.kv, tokens, decode=is_decode, decode_left=decode_left, later=todo - n)
        if placement is None:
            return None
        sample = start + n == len(req.prompt) + len(req.out)
        return ScheduledSeq(req, tokens, start, ctx, placement, sample, is_decode)

    def _work_estimate(self, budget: int):
        """A callable predicting this forward's compute per rank with its work spread evenly (the floor the placement
        balances against), from the queues as they are now; evaluated only if a placement must be decided."""
        if not self.waiting and not any(r.is_prefill for r in self.running):
            return None  # decodes only: their tokens follow their keys, nothing to decide
        running = [(r.num_stored, r.num_to_compute, r) for r in self.running]
        room = self.config.max_num_seqs - len(self.running)
        waiting = list(itertools.islice(self.waiting, max(0, room)))

        def estimate() -> float:
            cost, left, total = self.kv.placer.cost, budget, 0.0
            shared = _SharedPrefixes()
            for stored, todo, req in running:
                n = min(todo, left)
                left -= n
                total += cost(n, stored).compute_s
                if stored < len(req.prompt):  # a prompt being prefilled: waiting requests may share it
                    shared.add(np.asarray(req.prompt, dtype=np.int64))
            for req in waiting:
                if left <= 0:
                    break
                tokens = req.known_array()
                cached = self.kv.match(tokens, len(tokens) - 1)[2] if self.kv.enable_prefix_caching else 0
                cached = max(cached, shared.longest(tokens))
                n = min(len(tokens) - cached, left)
                left -= n
                total += cost(n, cached).compute_s
                shared.add(tokens)
            return total / self.kv.n
        return estimate

    def _waits_for_inflight_prefix(self, req: Request) -> bool:
        """True when a running request still prefilling a prompt shares more of req's prompt than the cache holds:
        req then waits, so the shared part is computed and stored once. A request that copies another's prompt
        log-probs waits for them."""
        if not req.take_source_prompt_logprobs():  # an earlier sample of its prompt computes them: wait
            return True
        if not self.kv.enable_prefix_caching or req.computes_prompt_logprobs:
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
        self._released(req)
        self.kv.release(req.kv, keep=False)
        req.kv = None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def refill(self, req: Request) -> None:
        """req computed a hole of its cached path: the hole is filled with its tokens, and req waits again (first in
        line) to match on below it — the segments there come back from their tiers instead of being recomputed."""
        self.running.remove(req)
        self._released(req)
        req.refilled = req.kv.num_stored
        self.kv.fill_hole(req.kv)
        req.kv = None
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def requeue(self, req: Request) -> None:
        """Take back a request scheduled in this step whose restored prefix turned out unreadable: it waits again
        (first in line) and matches what is left; a first admission is undone in the counters."""
        if not req.metrics["steps"] and req.num_cached >= 0:
            self.kv.prefix_queries -= len(req.prompt)
            self.kv.prefix_hits -= req.num_cached
            self.kv.count_tier_hits(req.kv.hits, -1)
            req.num_cached = -1
        self.running.remove(req)
        self._released(req)
        self.kv.release(req.kv, keep=False)
        req.kv = None
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request, keep_cache: bool) -> None:
        """Remove a request (finished, aborted or failed) from whichever queue holds it; free or keep its cache."""
        if req in self.running:
            self.running.remove(req)
            self._released(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv is not None:
            self.kv.release(req.kv, keep=keep_cache)
            req.kv = None
        req.status = RequestStatus.FINISHED

    def _released(self, req: Request) -> None:
        req.draft = req.draft_q = None
        if self.on_release is not None:
            self.on_release(req)


class _SharedPrefixes:
    """Prompts seen so far, bucketed by their first tokens: the longest prefix a new prompt shares with one of them
    (a document several requests read is computed once)."""

    KEY = 16

    def __init__(self):
        self.buckets: dict[tuple, list[np.ndarray]] = {}

    def add(self, tokens: np.ndarray) -> None:
        if len(tokens) > self.KEY:
            self.buckets.setdefault(tuple(tokens[:self.KEY].tolist()), []).append(tokens)

    def longest(self, tokens: np.ndarray) -> int:
        best = 0
        for other in self.buckets.get(tuple(tokens[:self.KEY].tolist()), ()) if len(tokens) > self.KEY else ():
            m = min(len(other), len(tokens) - 1)
            neq = np.flatnonzero(other[:m] != tokens[:m])
            best = max(best, int(neq[0]) if len(neq) else m)
        return best
