"""`LLMEngine`: the step-wise engine the offline `LLM`, the asyncio `AsyncLLM` and the server are thin layers over.

`step()` is three parts: the scheduler picks this forward's work (and the KV manager the slot of every new token),
the ranks run it (`model_runner.execute_batch`, SPMD; paper §3's CP ring inside), and the driver turns sampled tokens
into outputs, stopping and releasing requests. Requests come and go between steps (`add_request`, `abort`); start-up
(model, ranks, KV cache sizing, tiers) is `startup.py`, the arguments `config.py`.
"""
from __future__ import annotations

import pickle
import random
import time

import numpy as np

from cpinfer.engine import model_runner as MR
from cpinfer.engine import hybrid
from cpinfer.engine.batch import ForwardBatch, RankResult, SeqInput
from cpinfer.engine.config import EngineConfig
from cpinfer.engine.kv.ops import STATE_RESTORES, FromHost, LoadEntry
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.engine.mla_form import choose_form
from cpinfer.engine.output import OutputProcessor
from cpinfer.engine.request import EngineStats, Request, RequestOutput
from cpinfer.engine.sampling import SampleSpec, SamplingParams
from cpinfer.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from cpinfer.engine.spec_decode.adaptive import VERIFY_TOKEN_COST, SpecState, StepCost
from cpinfer.engine.spec_decode.config import SpeculativeConfig
from cpinfer.engine.spec_decode.registry import make_proposer
from cpinfer.engine.startup import EngineStartup
from cpinfer.engine.strategy import choose_for_batch
from cpinfer.engine.structured import GrammarCompiler, Matcher
from cpinfer.launch import InProcessWorld, WorkerPool
from cpinfer.utils import get_logger

log = get_logger()
_RESTORE_ROUNDS = 4  # schedule again at once after failed restores, this many times in one step


class EngineDeadError(RuntimeError):
    """A rank died or the engine failed: no request can be served any more."""


class LLMEngine:
    """Driver of N×M ranks: `add_request`, `abort`, `step() -> list[RequestOutput]`, `has_unfinished_requests()`."""

    startup_class = EngineStartup  # its start-up's steps; an engine over other ranks gives a subclass (startup.py)
    before_forward = None  # called (no arguments) on the stepping thread once a step is scheduled, before its forward

    def __init__(self, model: str | None = None, **kwargs):
        self.dead_error: str | None = None
        self.args = EngineConfig(**kwargs)
        a = self.args
        t0 = time.perf_counter()
        self._last_sync = 0.0  # when `sync_tiers` last polled the ranks
        self.startup = self.startup_class(self)
        self.startup.run(model)  # model_path, config, tokenizer, the ranks (_pool), kv, disk, ...: startup.py
        self._mirrors_slots = self.config.local_attention  # windowed / chunked layers: ranks keep SlotPositions
        self._mirrors_slots |= self.config.hybrid  # hybrid: every rank advances its replica of every state
        self.scheduler = Scheduler(self.kv, SchedulerConfig(a.max_num_batched_tokens, a.max_num_seqs))
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, tuple(self.config.eos_token_ids))
        self._matchers: dict[str, Matcher] = {}  # request id → its grammar state (constrained requests only)
        self._failed: dict[str, str] = {}  # request id → why it fails at the end of this step (its own fault)
        self._aborts: list[str] = []
        self._rng = random.Random(a.seed)
        self._counters = {"prompt_tokens": 0, "request_prompt_tokens": 0, "generation_tokens": 0, "forwards": {},
                          "finished": {}}
        self._counters["spec"] = _spec_counters(a.speculative_config)
        self.output = OutputProcessor(self.tokenizer, self.config.eos_token_ids, self._counters)
        self.proposer = None  # speculative decoding's drafter (engine/spec_decode), built last: it may use the engine
        self._draft_rows: dict[str, np.ndarray] = {}  # this step's grammar bitmasks of constrained verify rows
        self._step_cost = StepCost()  # decode forwards' seconds against their rows (the adaptive k's cost)
        self._state_picks: list[tuple[int, int]] = []  # hybrid: (state slot, tokens dropped) of the last verify runs
        if a.speculative_config is not None:
            try:
                self.proposer = make_proposer(a.speculative_config, self)
            except BaseException:
                self.shutdown()
                raise
            self.scheduler.on_release = self.proposer.release
            log.info("speculative decoding: %s", a.speculative_config.as_dict())
        self.last_step_host: dict = {}  # the last step's host timings (AsyncLLM adds its streaming time)
        log.info("start-up: engine ready in %.1f s", time.perf_counter() - t0)

    # ------------------------------------------------------------------ one step: schedule → run → process
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule a forward → run it on the ranks → process its results into outputs."""
        self._check_alive()
        t0 = time.perf_counter()
        self.last_step_host = {}  # this step's, once it runs a forward
        outputs = self._apply_aborts()
        forward = self._schedule_forward(bool(outputs))
        if forward is None:
            return outputs
        scheduled, batch, choice, form = forward
        if self.before_forward is not None:
            self.before_forward()
        t1 = time.perf_counter()
        results = self._run(batch)
        t2 = time.perf_counter()
        # host seconds of this step, shared by its requests' step metrics (docs/engine.md, "Metrics")
        host = {"schedule_s": t1 - t0, "forward_s": t2 - t1,
                **{f"rank0_{k}_s": v for k, v in results[0].phases.items()}, "detokenize_s": 0.0}
        self.last_step_host = host
        if self.proposer is not None and batch.phase == "decode":  # plain and verify rows: the adaptive k's cost
            self._step_cost.add(sum(len(s.tokens) for s in scheduled), t2 - t1)
        outputs += self._process(scheduled, results, choice, batch.phase, host, form)
        host["process_s"] = time.perf_counter() - t2  # tokens, stop checks, detokenizing, outputs
        return outputs

    def _schedule_forward(self, have_outputs: bool):
        """(scheduled work, its ForwardBatch, the ring choice, the MLA form choice or None), or None when nothing
        can run this step."""
        self._propose()
        scheduled, ops, restore_failed = self._schedule()
        batch_q = {s.request.request_id: s.request.draft_q for s in scheduled if s.draft is not None}  # [k, V] each
        for req in self.scheduler.running:  # a draft serves one step only
            req.draft = req.draft_q = None
        if not scheduled:
            self.kv.put_back_ops(ops)  # they go with the next forward
            if self.scheduler.has_work() and not have_outputs and not restore_failed:
                raise RuntimeError("scheduler stalled: no request fits the cache state (this is a bug)")
            return None
        choice, phase = self._choose(scheduled)
        form = self._mla_form(scheduled, choice.strategy)
        seqs = tuple(self._seq_input(s, batch_q) for s in scheduled)
        batch = ForwardBatch(seqs, choice.strategy, phase, tuple(ops), "absorbed" if form is None else form.form,
                             state_picks=self._take_state_picks())
        return scheduled, batch, choice, form

    def _run(self, batch: ForwardBatch) -> list[RankResult]:
        """Every rank runs the forward; what they report about the tiers goes to the tier index."""
        results: list[RankResult] = self._on_ranks(self._run_batch, batch)
        self._tier_events(results)
        key = f"{batch.phase}/{batch.strategy}"
        self._counters["forwards"][key] = self._counters["forwards"].get(key, 0) + 1
        return results

    def _process(self, scheduled, results: list[RankResult], choice, phase, host: dict,
                 form=None) -> list[RequestOutput]:
        """The forward's results → request state and outputs (engine/output.py); finished requests leave."""
        step_info = {"phase": phase, "strategy": choice.strategy, "method": choice.method, "inputs": choice.inputs,
                     "host": host}
        if form is not None:  # MLA: the forward's attention form and the FLOPs of both
            step_info["mla"] = form.as_metrics()
        for s in scheduled:
            s.request.metrics["steps"].append(self._step_metrics(step_info, s))
        if any(r.verify_fallback for r in results):  # verify rows the static / CUDA-graph path left to eager
            self._counters["spec"]["verify_fallbacks"] += 1
        outputs = []
        for req, why in self.output.process(scheduled, results, time.perf_counter(), host, self._failed,
                                            self._matchers):
            if req.kv is not None and req.kv.leaf.unverified:  # a verify step: roll back what it does not keep
                ran = req.kv.num_stored
                self.kv.truncate(req.kv, min(req.kv.num_stored, len(req.known) - 1))
                if req.kv.state_out >= 0 and req.kv.num_stored < ran and why is None:  # hybrid: the state too,
                    self._state_picks.append((req.kv.state_out, ran - req.kv.num_stored))  # at the next forward
                if self.proposer is not None and why is None and req.spec is not None:
                    self.proposer.verified(req, req.spec.last_drafted, req.spec.last_accepted)
            if why is not None:
                outputs.append(self._fail(req, why))
                continue
            if req.finish_reason is not None:
                self._retire(req, keep_cache=True)
            outputs.append(self.output.output(req))
        for rid in [r for r in self._failed if r not in self.requests]:
            del self._failed[rid]
        for s in scheduled:  # a hole's tokens recomputed: it is filled, the request matches on below it
            kv = s.request.kv
            if kv is not None and kv.fill_until == kv.num_stored:
                self.scheduler.refill(s.request)
        return outputs

    # ------------------------------------------------------------------ requests
    def validate(self, prompt, params: SamplingParams) -> list[int]:
        """Token ids of a prompt, or ValueError saying what is wrong (no engine state is read or changed)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.top_logprobs > self.max_logprobs:
            raise ValueError(f"top_logprobs must be at most max_logprobs = {self.max_logprobs} (the engine's bound: "
                             f"LLM(max_logprobs=...) / cpinfer serve --max-logprobs), got {params.top_logprobs}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the model directory has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        try:
            prompt = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise ValueError("prompt must be a string or a list of token ids") from None
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the model directory has none (use stop_token_ids)")
        bad = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias / stop_token_ids name token ids outside [0, {vocab}): {bad[:5]}")
        if params.grammar is not None:
            self.grammars.validate(params.grammar)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                             f"the maximum model length {self.max_model_len} ({self.max_model_len_note}); shorten the "
                             "prompt or lower max_tokens")
        self.kv.check_room(len(prompt), params.max_tokens)
        return prompt

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> Request:
        """Queue a request (validated now: ValueError before any compute; nothing else is disturbed)."""
        self._check_alive()
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        tokens = self.validate(prompt, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(request_id, tokens, params, seed)
        req.lp_source = self._prompt_logprobs_source(tokens, params)
        if self.args.speculative_config is not None:
            req.spec = SpecState.of(self.args.speculative_config.num_speculative_tokens)
        if params.grammar is not None:
            self._matchers[request_id] = self.grammars.matcher(params.grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _prompt_logprobs_source(self, tokens: list[int], params: SamplingParams) -> Request | None:
        """An unfinished request of the same prompt that computes the same prompt log-probs (n samples of one
        prompt with echo): the new one copies them and reuses that prompt's K/V, so the prompt is computed once.
        None without prefix caching (nothing could be reused) or when there is none."""
        if not params.prompt_logprobs or not self.kv.enable_prefix_caching:
            return None
        for other in self.requests.values():
            if (other.params.prompt_logprobs and other.lp_source is None  # computes them, or has copied them
                    and other.params.top_logprobs == params.top_logprobs and other.prompt == tokens):
                return other
        return None

    def abort(self, request_id: str) -> None:
        """Stop a request; what it held is freed at the next step. Unknown ids are a ValueError."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request id {request_id!r} (finished requests cannot be aborted)")
        self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) requests now; call it on the thread that steps the engine."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def heartbeat(self) -> None:
        """Idle liveness check of ranks without a process sentinel (a torchrun world): raises if one is gone."""
        beat = getattr(self._pool, "heartbeat", None)
        if beat is not None:
            beat()

    def rank_failure(self) -> str | None:
        """Why a rank is gone as its pool's watcher saw it (a process sentinel, a closed control connection), or None.
        It only reads, so another thread may ask while a step runs (AsyncLLM's monitor)."""
        pool = self._pool
        return None if pool is None else getattr(pool, "dead_reason", None)

    def check_ranks(self) -> str | None:
        """Why the engine is dead (a rank process exited, found without a forward), or None while it is alive."""
        if self.dead_error is None and self._pool is not None:
            reason = getattr(self._pool, "dead_reason", None)
            if reason is not None:
                self.dead_error = reason
        return self.dead_error

    # ------------------------------------------------------------------ scheduling a forward
    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._aborts:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.finish_reason = "abort"
            self._retire(req, keep_cache=False)
            outputs.append(self.output.output(req))
        self._aborts = []
        return outputs

    def _schedule(self) -> tuple[list[ScheduledSeq], list, bool]:
        """The next forward's work, its cache operations, and whether a restore failed. Restores run first; when
        one fails, the requests that needed it are scheduled again at once without it (each failure removes a bad
        copy; after a few rounds the rest waits for the next step)."""
        failed = False
        for _ in range(_RESTORE_ROUNDS):
            scheduled = self.scheduler.schedule()
            ops = self.kv.take_ops()  # K/V moving between tiers, decided while scheduling
            if not any(isinstance(op, (LoadEntry, FromHost, *STATE_RESTORES)) for op in ops):
                return scheduled, ops, failed
            kept = self._on_ranks(self._restore, ops, scheduled)
            failed |= len(kept) < len(scheduled)
            if kept or not self.scheduler.waiting:
                return kept, [], failed
        return [], [], failed

    def _restore(self, ops: list, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Apply cache operations that restore K/V (from host or disk) before the forward, in their own call: a
        failed restore (damaged bytes, a vanished file, an I/O error) requeues only the requests whose prefix needed
        it, and the bad copy is dropped (a disk entry from the index and the directory). Returns the scheduled
        work that can run."""
        events = self._tier_events(self._pool.run(MR.apply_cache_ops, tuple(ops), self._take_state_picks()))
        failed = {ev.node: ev.tier for ev in events if ev.kind == "load_failed"}
        states = {(ev.node, ev.pos): ev.tier for ev in events if ev.kind == "state_failed"}  # hybrid models
        if not failed and not states:
            return scheduled
        for ev in events:
            if ev.kind == "load_failed":
                log.warning("KV %s tier: restoring a cached prefix failed on rank %d (%s); it is recomputed",
                            ev.tier or "disk", ev.rank, ev.error)
            elif ev.kind == "state_failed":
                log.warning("KV %s tier: restoring a recurrent-state snapshot failed on rank %d (%s); its prefix is "
                            "recomputed", ev.tier, ev.rank, ev.error)
        bad = set(failed) | {nid for nid, _ in states}
        keep = []
        for s in scheduled:
            p, hit = s.request.kv.leaf, False
            while p is not None and not hit:
                hit, p = p.id in bad, p.parent
            if hit:
                self.scheduler.requeue(s.request)
            else:
                keep.append(s)
        self.kv.discard_state(states)
        self.kv.discard(failed)
        return keep

    def _propose(self) -> None:
        """Speculative decoding: draft tokens for the decoding requests that speculate this step (each one's k from
        its acceptance: spec/adaptive.py), at most what its max_tokens leaves after the target's own token."""
        if self.proposer is None:
            return
        reqs, ks = [], []
        self._draft_rows = {}
        decoding = [r for r in self.scheduler.running if not r.is_prefill]
        cost = self._step_cost.row_share(len(decoding))  # one more verified row's share of this decode step
        for req in decoding:
            req.draft = None
            if req.spec is None or req.request_id in self._failed:
                continue
            # a seeded request's k must not depend on timings (its draws follow its k): the fixed row cost
            k = min(req.spec.next_k(cost if req.params.seed is None else VERIFY_TOKEN_COST),
                    req.params.max_tokens - len(req.out) - 1)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if reqs:
            for req in reqs:
                req.draft_q = None
            for req, k, draft in zip(reqs, ks, self._on_ranks(self.proposer.propose, reqs, ks)):
                draft = np.asarray(draft, dtype=np.int64).reshape(-1)[:k]
                if len(draft) and req.request_id in self._matchers:
                    draft = self._grammar_rows(req, draft)
                req.draft = draft if len(draft) else None

    def _grammar_rows(self, req: Request, draft: np.ndarray) -> np.ndarray:
        """A constrained request's draft cut before the first token its grammar forbids (or that completes it), and
        the grammar's bitmask of each verify row (kept for `_seq_input`): its matcher walks the draft and steps
        back. A grammar failure here leaves the draft empty (the request's own sampling then reports it)."""
        matcher = self._matchers[req.request_id]
        rows, consumed, taken = [], 0, 0
        try:
            rows.append(matcher.bitmask())
            for d in draft.tolist():
                if not (int(rows[-1][d >> 5]) >> (d & 31)) & 1:
                    break
                matcher.consume(d)
                consumed += 1
                if matcher.done:  # it would end the output: verify up to the token before it
                    break
                rows.append(matcher.bitmask())
                taken += 1
        except Exception:  # noqa: BLE001 - decoded plainly; the plain path reports the grammar's error
            taken = 0
        try:
            matcher.rollback(consumed)
        except Exception as exc:  # noqa: BLE001 - this request's grammar state is lost: it fails alone
            self._failed[req.request_id] = f"{type(exc).__name__}: {exc}"
            return draft[:0]
        if taken:
            self._draft_rows[req.request_id] = np.stack(rows[:taken + 1])  # [k+1, ceil(V/32)]
        return draft[:taken]

    def _choose(self, scheduled: list[ScheduledSeq]):
        """(the ring variant of the sequences that spread over ranks, or no ring; the forward's phase)."""
        ring = [s for s in scheduled if s.placement.spread]
        t = sum(len(s.tokens) for s in ring)
        p = sum(s.start for s in ring)
        # a verify sequence is k+1 decode rows (spec_verify "decode": the decode ring, pass-Q), or a partial prefill
        # of k+1 tokens ("prefill": the ring variant chosen as for a mixed forward)
        verify = self.args.spec_verify == "prefill" and any(s.draft is not None for s in ring)
        phase = "mixed" if verify and _phase(ring) == "decode" else _phase(ring)
        return choose_for_batch(self, t, p, phase, ring=bool(ring)), _phase(scheduled)

    def _mla_form(self, scheduled: list[ScheduledSeq], strategy: str):
        """MLA models: the forward's attention form (`mla_form.choose_form`); None for other models."""
        c = self.config
        if not c.values_in_keys:
            return None
        seqs = [(s.start, len(s.tokens), bool(s.placement.spread) and self.n > 1) for s in scheduled]
        mode = "absorbed" if c.dsa is not None else self.args.mla_form  # DSA reads top-k latent rows: absorbed
        return choose_form(c.mla, c.num_attention_heads, seqs, self.n, strategy, mode)

    def _seq_input(self, s: ScheduledSeq, draft_q: dict | None = None) -> SeqInput:
        req = s.request
        spec = self._sample_spec(req) if s.sample else None
        end = s.start + len(s.tokens)
        known = len(req.prompt) + len(req.out)
        next_token = int(req.token_slice(end, 1)[0]) if end < known else -1
        want_lp = req.params.prompt_logprobs and s.start < len(req.prompt) - 1
        rows = self._draft_rows.get(req.request_id)
        spec_args = {} if s.draft is None else {  # a verify sequence (engine/spec_decode)
            "draft": s.draft, "draft_key": req.request_id,
            "draft_allowed": None if rows is None else rows[:len(s.draft) + 1],
            "draft_q": None if (draft_q or {}).get(req.request_id) is None else draft_q[req.request_id][:len(s.draft)],
            "draft_suppress": max(0, req.params.min_tokens - len(req.out)) if spec.suppress else 0}
        if req.kv.state_out >= 0:  # hybrid models: from its state slot; every later forward from its live one
            spec_args.update(state_in=req.kv.state_in, state_out=req.kv.state_out,  # (no snapshot of drafts)
                             state_copy=-1 if s.draft is not None else self.kv.interval_snapshot(req.kv, s.start, end))
            self.kv.consume_state_in(req.kv)
        return SeqInput(s.tokens, s.start, s.placement.ranks, s.placement.slots, s.ctx_runs, spec, next_token,
                        want_lp, s.placement.spread, req.params.top_logprobs if want_lp else 0, **spec_args)

    def _sample_spec(self, req: Request) -> SampleSpec:
        """What the sampling rank needs: the stop tokens held back until min_tokens, and the tokens so far when a
        penalty reads them (the output, and the prompt's distinct tokens for the repetition penalty)."""
        p = req.params
        suppress: tuple[int, ...] = ()
        if len(req.out) < p.min_tokens:
            suppress = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.config.eos_token_ids))
        output = prompt = None
        if p.penalized:
            output = np.asarray(req.out, dtype=np.int64)
            prompt = req.prompt_set() if p.repetition_penalty != 1.0 else None
        return SampleSpec.of(p, req.seed, len(req.out), self._allowed(req), suppress, output, prompt)

    def _allowed(self, req: Request):
        """The grammar's bitmask of allowed next tokens (None: unconstrained, or its grammar failed: it ends)."""
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            return None
        try:
            return matcher.bitmask()
        except Exception as exc:  # noqa: BLE001 - the request's own grammar: it fails after this forward
            self._failed[req.request_id] = f"{type(exc).__name__}: {exc}"
            return None

    # ------------------------------------------------------------------ running it on the ranks
    def _run_batch(self, batch: ForwardBatch) -> list[RankResult]:
        """Every rank runs the batch, except that a local rank with no token and no ring to serve is not even sent
        it (unless sliding-window layers need every rank to mirror every batch's slot positions). Rank processes
        receive it pickled once (not once per rank); rank 0, when it runs in this process, takes it as it is."""
        if isinstance(self._pool, InProcessWorld):
            return self._pool.run(MR.execute_batch, batch)
        if not isinstance(self._pool, WorkerPool):
            return self._pool.run(MR.execute_batch, pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        active = np.repeat(MR.active_cp_ranks(batch, self.n) | self._mirrors_slots, self.parallel.tp)
        here = bool(self._pool.driver_rank and active[0])  # rank 0 is this process: it takes the batch as it is
        blob = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL) if active[int(here):].any() else None
        args = [((batch,) if here and r == 0 else (blob,)) if on else None for r, on in enumerate(active)]
        results = self._pool.run_some(MR.execute_batch, args)
        return [RankResult((), {}, 0.0, 0.0, idle=True) if res is None else res for res in results]

    def _on_ranks(self, fn, *args):
        """fn(*args), which runs something on the ranks: any failure there kills the engine."""
        try:
            return fn(*args)
        except Exception as exc:
            self.dead_error = f"{type(exc).__name__}: {exc}"
            raise EngineDeadError(f"the engine failed during a forward: {self.dead_error}") from exc

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        if self._pool is None:
            raise RuntimeError("the engine has been shut down")

    # ------------------------------------------------------------------ its results
    def _step_metrics(self, step_info: dict, s: ScheduledSeq) -> dict:
        """One forward in a request's metrics: the forward's phase and ring strategy, where this request's new
        tokens went and whether its keys spread over ranks (with the prediction when the placement decided)."""
        out = dict(step_info, placement="spread" if s.placement.spread else "local",
                   new_tokens_per_rank=np.bincount(s.placement.ranks, minlength=self.n).tolist())
        if s.placement.decision is not None:
            out["placement_inputs"] = s.placement.decision.as_metrics()
        return out

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request whose own work failed (sampling, grammar, output): free its private blocks."""
        log.warning("request %s failed: %s", req.request_id, why)
        req.finish_reason = "error"
        self._retire(req, keep_cache=False)
        out = self.output.output(req)
        out.error = why
        return out

    def _retire(self, req: Request, keep_cache: bool) -> None:
        """A request with its finish reason set leaves the engine: its blocks go back to the scheduler (its K/V
        kept in the prefix cache or freed), its grammar state and pending failure are dropped, and it is counted."""
        self.scheduler.finish(req, keep_cache=keep_cache)
        self.requests.pop(req.request_id, None)
        self._matchers.pop(req.request_id, None)
        self._failed.pop(req.request_id, None)
        f = self._counters["finished"]
        f[req.finish_reason] = f.get(req.finish_reason, 0) + 1

    # ------------------------------------------------------------------ tiers and shutdown
    def flush_tiers(self) -> None:
        """Send the cache operations still waiting, wait for every disk write, and account them (shutdown)."""
        tiers = getattr(getattr(self, "kv", None), "tiers", None)
        if tiers is None:
            return
        try:
            if self.disk is not None and tiers.save_ancestors():  # every entry's prefix on disk too
                log.info("KV disk tier: wrote the prefixes that entries on disk depend on")
            self.sync_tiers(force=True)
            if self.disk is not None:
                self._tier_events(self._pool.run(MR.flush_tiers))
                self.sync_tiers(force=True)  # deletions and forgets the acks asked for
                self._pool.run(MR.flush_tiers)
                log.info("KV disk tier %s: %d entries (%.2f GiB) on disk", self.disk.path, len(tiers.entries),
                         tiers.disk_used / (1 << 30))
        except Exception as exc:  # noqa: BLE001 - shutting down: say so, do not mask the shutdown
            log.error("KV tiers: flushing at shutdown failed: %s", exc)

    def sync_tiers(self, force: bool = False) -> None:
        """Between steps (idle server): send waiting cache operations (background disk writes) and read what the
        ranks report. Cheap when there is nothing to do."""
        tiers = self.kv.tiers if self._pool is not None else None
        if tiers is None or not (force or tiers.ops or tiers.unacked):
            return
        now = time.monotonic()
        if not (force or tiers.ops) and now - self._last_sync < 0.25:  # only acks to collect: poll calmly
            return
        self._last_sync = now
        ops = self.kv.take_ops()
        self._tier_events(self._pool.run(MR.apply_cache_ops, tuple(ops), self._take_state_picks()))

    def _take_state_picks(self) -> tuple:
        """The hybrid verify rollbacks not yet sent to the ranks (they go before any other cache operation)."""
        picks, self._state_picks = tuple(self._state_picks), []
        return picks

    def _tier_events(self, per_rank) -> list:
        """Hand what the ranks reported (a list per rank of events, or of RankResults) to the tier index."""
        events = []
        for item in per_rank:
            events.extend(item.tier_events if isinstance(item, RankResult) else (item or ()))
        if events and self.kv.tiers is not None:
            self.kv.tiers.on_events(events)
        return events

    def shutdown(self) -> None:
        if getattr(self, "proposer", None) is not None:
            self.proposer.close()
            self.proposer = None
        if getattr(self, "_pool", None) is not None:
            if self.dead_error is None:
                self.flush_tiers()
            self._pool.close(force=self.dead_error is not None)
            self._pool = None
        if getattr(self, "disk", None) is not None:
            self.disk.close()
            self.disk = None

    # ------------------------------------------------------------------ introspection
    def cache_stats(self) -> dict:
        return {"kv_tokens_per_rank": self.kv.tokens_per_rank(), "kv_capacity_per_rank": self.kv.capacity_per_rank,
                "kv_cache_dtype": self.args.kv_cache_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefix_cache_queries": self.kv.prefix_queries, "prefix_cache_hits": self.kv.prefix_hits,
                "tiers": self.tier_stats(), **self.state_stats()}

    def state_stats(self) -> dict:
        """Hybrid models: the recurrent state cache (slots, those in use, snapshots in the prefix tree, bytes per rank,
        counted in the KV capacity); {} for the others."""
        slots = self.kv.states
        if slots is None:
            return {}
        per_slot = hybrid.state_bytes_per_slot(self.config, self.elem_bytes)
        return {"state_cache": {"slots": slots.max_slots, "in_use": slots.in_use, "snapshots": self.kv.state_snapshots,
                                "bytes_per_slot": per_slot, "bytes_per_rank": slots.max_slots * per_slot}}

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K/V bytes on one CP rank (every layer, every KV head: its TP ranks together)."""
        c = self.config
        return KVStore.bytes_per_token(c.num_kv_layers, c.cached_kv_heads, KVWidths.of(c), self.elem_bytes,
                                          self.args.kv_cache_dtype)

    def tier_stats(self) -> dict:
        """Per tier (device, host, disk): hit tokens, bytes and tokens held, capacity, restores (tokens, bytes,
        seconds), disk writes. Without tiers, the device's alone."""
        kv = self.kv
        if kv.tiers is not None:
            out = kv.tiers.snapshot(int(kv.used.sum()))
        else:
            out = {"device": {"bytes": None, "tokens": int(kv.used.sum())}}
        for tier, hits in kv.tier_hits.items():
            if tier in out:
                out[tier]["hit_tokens"] = hits
        return out

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.tokens_per_rank(),
                           self.kv.capacity_per_rank, self.kv.prefix_queries, self.kv.prefix_hits,
                           c["prompt_tokens"], c["generation_tokens"], dict(c["forwards"]),
                           self.scheduler.num_preemptions, dict(c["finished"]), self.tier_stats(),
                           self.attention_backend, dict(self.attention_timings_ms), c["request_prompt_tokens"],
                           spec=_spec_stats(c["spec"]))

    def ring_wait_s(self) -> list[float]:
        return self._pool.run(MR.ring_wait)


def _spec_counters(config: SpeculativeConfig | None) -> dict:
    """The engine's speculative-decoding counters (empty when it does not speculate)."""
    if config is None:
        return {}
    return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_emitted_tokens": 0,
            "accepted_per_pos": [0] * config.num_speculative_tokens, "verify_fallbacks": 0}


def _spec_stats(c: dict) -> dict:
    """The counters with the derived rates (EngineStats.spec)."""
    if not c:
        return {}
    d = c["num_draft_tokens"]
    return dict(c, accepted_per_pos=list(c["accepted_per_pos"]),
                acceptance_rate=c["num_accepted_tokens"] / d if d else 0.0,
                mean_accepted_length=c["num_accepted_tokens"] / c["num_drafts"] if c["num_drafts"] else 0.0)


def _phase(scheduled: list[ScheduledSeq]) -> str:
    decodes = sum(s.is_decode for s in scheduled)
    return "decode" if decodes == len(scheduled) else "prefill" if decodes == 0 else "mixed"
