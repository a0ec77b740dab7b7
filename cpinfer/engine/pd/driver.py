"""Prefill and decode on separate groups of ranks in one world (paper §4.3: CP for prefill, decoupled from decode).

Ranks [0, N·TP) are the prefill group; decode group g holds the next M·TP ranks. Each group has its own engine
(`GroupEngine`: an `LLMEngine` over its ranks, with its own KV manager and scheduler). The prefill group runs
every prompt and never decodes. When the forward that completes a prompt is scheduled, the least-loaded decode
group reserves slots for it in its own layout, and the prefill ranks send each layer's K/V straight there as that
forward writes it (`handoffs.py`, sent by `kv/transfer.py`, planned by `cp/pd_plan.py`); once the first token is
sampled the request belongs to that group, which decodes it when all its rows are in. A finished answer's K/V move
back to the prefill ranks' prefix tree, so a chat's next turn recomputes none of its history. The groups' forwards
run side by side: the driver (`PDEngine`) submits each idle group's next call without waiting and handles whichever
returns first.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time

from cpinfer.device import comm_backend, ranks_on_this_node
from cpinfer.engine import model_runner as MR
from cpinfer.engine.llm_engine import EngineDeadError, LLMEngine, _spec_stats
from cpinfer.engine.pd.group import GroupEngine
from cpinfer.engine.pd.handoffs import PREFILL, Handoff, Handoffs
from cpinfer.engine.pd.ranks import allocate_role_kv, init_role_runner, role_call
from cpinfer.engine.pd.roles import PDConfig, RoleRanks, check_pd_args, log_role_capacities, role_capacities
from cpinfer.engine.request import EngineStats, Request, RequestOutput
from cpinfer.engine.spec_decode.adaptive import verify_widths
from cpinfer.engine.sampling import SamplingParams
from cpinfer.launch import JoinedWorld, WorkerPool, joined_world_requested
from cpinfer.utils import get_logger

log = get_logger()


@dataclasses.dataclass
class _Call:
    """A group's call in flight."""

    forward: tuple | None  # (scheduled, batch, choice, form) or None for a transfer-only call
    t0: float
    t_schedule: float
    early: list[Handoff] = dataclasses.field(default_factory=list)  # placed when this prefill forward was scheduled
    send_reqs: dict = dataclasses.field(default_factory=dict)  # transfer id → request, of this call's handoff sends


class PDEngine:
    """Prefill group + decode groups behind `LLMEngine`'s interface (`add_request`, `abort`, `step`, ...)."""

    before_forward = None  # as LLMEngine's: called once the step's calls are submitted, before waiting for them

    def __init__(self, model: str | None = None, pd_decode_cp: int | None = None, pd_decode_groups: int = 1,
                 **kwargs):
        self.dead_error: str | None = None
        self._pool = None
        self.pd = PDConfig(kwargs.get("context_parallel_size", 1), pd_decode_cp, pd_decode_groups,
                           kwargs.get("tensor_parallel_size", 1))
        check_pd_args(kwargs)
        t0 = time.perf_counter()
        views = [RoleRanks(range(off, off + cp * tp)) for cp, tp, off in self.pd.roles]
        self.groups: list[GroupEngine] = self._make_groups(model, views, dict(kwargs, in_process=False))
        self.prefill, self.decode = self.groups[PREFILL], self.groups[1:]
        self.handoffs = Handoffs(self.pd, self.groups)
        self._inflight: dict[int, _Call] = {}
        self._busy_s = [0.0] * len(self.groups)
        self._t_start = time.perf_counter()
        self.last_step_host: dict = {}
        self._start_world(views)
        self._fit_max_model_len()
        log.info("start-up: P/D engine ready in %.1f s", time.perf_counter() - t0)

    def _fit_max_model_len(self) -> None:
        """Every group serves the smallest max_model_len a group's KV cache holds (each lowered its own, or refused
        one the user set): a request passes through the prefill group and one decode group."""
        least = min(self.groups, key=lambda g: g.max_model_len)
        for g in self.groups:
            g.max_model_len, g.max_model_len_note = least.max_model_len, least.max_model_len_note

    # ------------------------------------------------------------------ set-up
    def _make_groups(self, model, views: list[RoleRanks], base: dict) -> list[GroupEngine]:
        """Every role validated (model, TP divisibility, sizes) before a rank starts; the prefill group never
        decodes, so it never speculates: the decode groups do. The KV tiers sit below the prefill group's tree."""
        world_cp = self.pd.cp_ranks
        prefill = GroupEngine(model, views[0], "prefill", world_cp, **dict(base, speculative_config=None))
        decode_kw = dict(base, context_parallel_size=self.pd.decode_cp, kv_host_gib=0.0, kv_disk_dir=None,
                         kv_disk_gib=None)
        return [prefill, *(GroupEngine(model, views[1 + g], f"decode{g}", world_cp, **decode_kw)
                           for g in range(self.pd.decode_groups))]

    def _start_world(self, views: list[RoleRanks]) -> None:
        a = self.prefill.args
        world = self.pd.world_size
        backend = comm_backend(a.device, ranks_on_this_node(world), a.share_gpus)
        threads = a.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
        self._pool = self._make_pool(world, backend, threads)
        try:
            for v in views:
                v.pool = self._pool
            infos = self._start_roles(views, backend)
        except BaseException:
            self._pool.close(force=True)
            raise
        log_role_capacities(self.groups, infos, views)
        self.rank_pids = [i["pid"] for i in infos]
        for g, v in zip(self.groups, views):
            g.rank_pids = [self.rank_pids[r] for r in v.ranks]
            g.attention_backend = infos[v.ranks[0]]["attention_backend"]
        self.kv_token_bytes = [i["kv_bytes_per_token"] for i in infos]
        log.info("P/D roles: prefill CP %d x TP %d on ranks %s; %s (%s over %s)", self.pd.prefill_cp, self.pd.tp,
                 views[0].ranks, "; ".join(f"decode group {i} CP {self.pd.decode_cp} x TP {self.pd.tp} on ranks "
                                           f"{v.ranks}" for i, v in enumerate(views[1:])), a.device, backend)

    def _start_roles(self, views: list[RoleRanks], backend: str) -> list[dict]:
        """Every rank loads its role's model runner; each role's KV cache as given or (None) measured, its smallest
        rank's, then each group's KV manager over it. Returns what each rank reported."""
        a, p = self.prefill.args, self.prefill
        caps = [None if g.sizing is not None else g.kv.capacity_per_rank for g in self.groups]
        decode = p.startup.decode_config(backend)
        spec = self.decode[0].args.speculative_config  # the prefill group never verifies: the decode groups' widths
        if spec is not None:
            decode.update(verify_width=1 + spec.num_speculative_tokens,
                          verify_widths=verify_widths(spec.num_speculative_tokens))
        infos = self._pool.run(init_role_runner, self.pd.roles, p.model_path, a.dtype, caps, p.attention_backend,
                               decode, a.kv_cache_dtype, a.load_format,
                               [g.sizing for g in self.groups])
        sized = role_capacities(caps, infos, [v.ranks for v in views])
        if None in caps:  # measured: every rank of a role holds its role's smallest
            self._pool.run(allocate_role_kv, sized)
        for g, cap, given in zip(self.groups, sized, caps):
            g.start_kv(cap if given is None else None)
        for g in self.decode:  # a draft model: on the decode groups' ranks, its store of their sized capacity
            if getattr(g, "draft", None) is not None:
                g.startup.load_draft()
        return infos

    def _make_pool(self, world: int, backend: str, threads: int) -> WorkerPool | JoinedWorld:
        a = self.prefill.args
        if joined_world_requested():  # torchrun / --nnodes: rank 0 drives (and computes), the others serve
            pool = JoinedWorld(backend, a.threads_per_rank, a.timeout_s, device=a.device, subsets=True)
            if pool.world_size != world:
                raise ValueError(f"prefill and decode groups need (context_parallel_size + pd_decode_groups x "
                                 f"pd_decode_cp) x tensor_parallel_size = ({self.pd.prefill_cp} + "
                                 f"{self.pd.decode_groups} x {self.pd.decode_cp}) x {self.pd.tp} = {world} ranks, but "
                                 f"the launched world has {pool.world_size} processes")
            if pool.rank != 0:
                pool.serve_forever()  # never returns: the process exits when rank 0 shuts the world down
            return pool
        return WorkerPool(world, backend=backend, threads_per_rank=threads, timeout_s=a.timeout_s, device=a.device,
                          driver_rank=False)

    def __getattr__(self, name):  # tokenizer, config, validate's helpers, generation defaults: the prefill group's
        if name in ("prefill", "groups"):
            raise AttributeError(name)
        return getattr(self.prefill, name)

    # ------------------------------------------------------------------ requests
    @property
    def requests(self) -> dict[str, Request]:
        out = {}
        for g in self.groups:
            out.update(g.requests)
        out.update({r.request_id: r for r in self.handoffs.parked})
        return out

    def validate(self, prompt, params: SamplingParams) -> list[int]:
        tokens = self.prefill.validate(prompt, params)
        for g in self.decode:
            g.kv.check_room(len(tokens), params.max_tokens, " on a decode group", f"pd_decode_cp={self.pd.decode_cp}")
        return tokens

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> Request:
        self._check_alive()
        params = params or SamplingParams()
        if isinstance(request_id, str) and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt, params)
        return self.prefill.add_request(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        if request_id in self.prefill.requests:
            return self.prefill.abort(request_id)
        if self.handoffs.abort_parked(request_id):
            return None
        for i, g in enumerate(self.decode, start=1):
            if request_id in g.requests:  # its rows on their way: freed once they are in
                return None if self.handoffs.abort_pending(i, request_id) else g.abort(request_id)
        raise ValueError(f"unknown request id {request_id!r} (finished requests cannot be aborted)")

    def has_unfinished_requests(self) -> bool:
        return (any(g.requests for g in self.groups) or bool(self.handoffs.outputs) or bool(self._inflight)
                or self.handoffs.busy())

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Submit the next call of every idle group (prefill first, so the sends a decode group receives are out
        before it), then handle whichever group's call comes back first."""
        self._check_alive()
        outputs = self.handoffs.take_outputs()
        if PREFILL not in self._inflight:
            self.handoffs.place_parked()
        for i in range(len(self.groups)):
            if i not in self._inflight:
                outputs += self._submit(i)
        if not self._inflight:
            if not outputs and self.has_unfinished_requests():
                raise RuntimeError(f"P/D engine stalled: {len(self.handoffs.parked)} request(s) wait for a decode "
                                   "group, nothing runs (this is a bug)")
            return outputs
        if self.before_forward is not None:
            self.before_forward()
        for i in self._wait_any():
            outputs += self._finish(i)
        return outputs

    def _submit(self, i: int) -> list[RequestOutput]:
        """Group i's next call, without waiting for it: its forward when it has work, with the transfer orders
        queued for its ranks (none: nothing to submit). Returns the outputs of aborts applied on the way."""
        g, h = self.groups[i], self.handoffs
        outputs: list[RequestOutput] = []
        forward = None
        # answers moving back to the prefill tree arrive in a call of their own: the next forward is scheduled
        # once their segments are in (and no longer held), so it can match them, evict them or restore beside them
        receiving = i == PREFILL and h.transfers.receiving(i)
        if not receiving:
            outputs = g._apply_aborts()
        if not receiving and g.scheduler.has_work():
            forward = self._on_ranks(g._schedule_forward, bool(outputs) or h.holds(i))
        early = [] if forward is None else h.scheduled(i, forward[0])  # prompts it completes: their sends ride it
        orders = h.transfers.orders.pop(i, {})
        if forward is None and not orders and not h.transfers.awaiting(i):
            return outputs
        # tier operations decided since the last call (e.g. a segment evicted for a moved-back answer's slots) run
        # before the orders write received rows; a forward's own go with its batch
        ops = tuple(g.kv.take_ops()) if receiving else ()
        t0 = time.perf_counter()
        blob = None if forward is None else pickle.dumps(forward[1], protocol=pickle.HIGHEST_PROTOCOL)
        per_rank, send_reqs = h.transfers.rank_orders(g.view.ranks, orders, wait=forward is None)
        args = {r: (to, blob, ops) for r, to in per_rank.items()}
        self._on_ranks(self._pool.submit_some, role_call, args)
        self._inflight[i] = _Call(forward, time.perf_counter(), time.perf_counter() - t0, early, send_reqs)
        if i == PREFILL:
            h.prefill_call_out()
        return outputs

    def _wait_any(self) -> list[int]:
        while True:
            ready = [i for i in self._inflight if self._pool.answered(self.groups[i].view.ranks)]
            if ready:
                return ready
            if self._pool.dead_reason is not None:  # collecting raises with the reason
                return list(self._inflight)
            self._pool.wait_any([r for i in self._inflight for r in self.groups[i].view.ranks], 0.5)

    def _finish(self, i: int) -> list[RequestOutput]:
        """Group i's call is back: the transfers its ranks report, then its forward's outputs."""
        call = self._inflight.pop(i)
        g, h = self.groups[i], self.handoffs
        answers = self._on_ranks(self._pool.collect_some, g.view.ranks, "forward")
        t1 = time.perf_counter()
        self._busy_s[i] += t1 - call.t0
        settled = h.transfers.report(g.view.ranks, [fig for _, fig in answers], call.send_reqs)
        g._tier_events([fig.get("tier_events", ()) for _, fig in answers])
        h.settle(settled, t1)
        outputs = []
        if call.forward is not None:
            outputs += self._process(i, call, [a[0] for a in answers], t1)
        if i != PREFILL:
            h.promote(i)
        return outputs + h.take_outputs()

    def _process(self, i: int, call: _Call, results: list, t1: float) -> list[RequestOutput]:
        """A group's forward results → its outputs (as `LLMEngine.step` does); completed prompts leave the prefill."""
        g = self.groups[i]
        scheduled, batch, choice, form = call.forward
        host = {"schedule_s": call.t_schedule, "forward_s": t1 - call.t0,
                **{f"rank0_{k}_s": v for k, v in results[0].phases.items()}, "detokenize_s": 0.0}
        key = f"{batch.phase}/{batch.strategy}"
        g._counters["forwards"][key] = g._counters["forwards"].get(key, 0) + 1
        g.last_step_host = host
        g._tier_events(results)
        outputs = g._process(scheduled, results, choice, batch.phase, host, form)
        if i == PREFILL:
            self.handoffs.leave_prefill(scheduled, t1, call.early)
        return outputs

    def _on_ranks(self, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            if isinstance(exc, ValueError):
                raise
            self.dead_error = f"{type(exc).__name__}: {exc}"
            for g in self.groups:
                g.dead_error = self.dead_error
            raise EngineDeadError(f"the engine failed: {self.dead_error}") from exc

    # ------------------------------------------------------------------ health, stats, shutdown
    _check_alive = LLMEngine._check_alive  # the same two checks, on this engine's dead_error and pool
    rank_failure = LLMEngine.rank_failure  # the pool's watcher, read from AsyncLLM's monitor thread

    def check_ranks(self) -> str | None:
        if self.dead_error is None and self._pool is not None and self._pool.dead_reason is not None:
            self.dead_error = self._pool.dead_reason
        return self.dead_error

    def heartbeat(self) -> None:
        pass

    def sync_tiers(self, force: bool = False) -> None:
        """Between steps: the prefill group's waiting cache operations and disk acknowledgements (not while a call
        of its ranks is in flight)."""
        if PREFILL not in self._inflight and not self.handoffs.transfers.orders.get(PREFILL):
            self.prefill.sync_tiers(force)

    def flush_tiers(self) -> None:
        self.prefill.flush_tiers()

    def pd_stats(self) -> dict:
        """Transfers (count, bytes, seconds), answers moved back, and each role's share of wall time in forwards."""
        wall = max(1e-9, time.perf_counter() - self._t_start)
        roles = ["prefill"] + [f"decode{g}" for g in range(self.pd.decode_groups)]
        out = {**self.handoffs.counters, "utilization": {r: b / wall for r, b in zip(roles, self._busy_s)},
               "parked": len(self.handoffs.parked)}
        fills = [g._counters["draft_fill"] for g in self.decode if "draft_fill" in g._counters]
        if fills:  # a draft model's rows recomputed on the decode groups after handoffs (`pd/draft_rows.py`)
            out["draft_fill"] = {k: sum(f[k] for f in fills) for k in fills[0]}
        return out

    def cache_stats(self) -> dict:
        out = self.prefill.cache_stats()
        out["kv_tokens_per_rank"] = [t for g in self.groups for t in g.kv.tokens_per_rank()]
        out["pd"] = self.pd_stats()
        return out

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) as `stats()` counts them; call it on the thread that steps the engine."""
        counts = [g.queue_counts() for g in self.groups]
        return (sum(r for r, _ in counts) + self.handoffs.on_way(),
                sum(w for _, w in counts) + len(self.handoffs.parked))

    def stats(self) -> EngineStats:
        return _merged_stats([g.stats() for g in self.groups], self.handoffs.on_way(), len(self.handoffs.parked),
                             self.pd_stats(), _decode_spec_stats(self.decode))

    def ring_wait_s(self) -> list[float]:
        return self._pool.run(MR.ring_wait)

    def _abandon_inflight(self) -> None:
        """Calls still in flight at shutdown are given up: the pool drops their late replies."""
        for i in list(getattr(self, "_inflight", ())):
            if self._pool is not None:
                self._pool.abandon(self.groups[i].view.ranks)
            del self._inflight[i]

    def shutdown(self) -> None:
        if self._pool is not None and self.dead_error is None:
            try:  # calls still in flight come back first (then the prefill tiers flush on their own ranks)
                for i in list(self._inflight):
                    self._finish(i)
            except Exception as exc:  # noqa: BLE001 - shutting down: say so, do not mask the shutdown
                log.error("P/D shutdown: a call in flight failed: %s", exc)
        self._abandon_inflight()
        for g in getattr(self, "groups", ()):
            g.shutdown()
        if self._pool is not None:
            self._pool.close(force=self.dead_error is not None)
            self._pool = None


def _merged_stats(parts: list[EngineStats], on_way: int, parked: int, pd: dict, spec: dict) -> EngineStats:
    """The groups' stats as one engine's (prefill first): requests on their way count as running, parked ones as
    waiting; the prefix cache, tiers and attention backend are the prefill group's."""
    p = parts[0]
    merged, finished = {}, {}
    for s in parts:
        for k, v in s.forwards.items():
            merged[k] = merged.get(k, 0) + v
    for s in parts:
        for k, v in s.requests_finished.items():
            finished[k] = finished.get(k, 0) + v
    return EngineStats(sum(s.num_running for s in parts) + on_way, sum(s.num_waiting for s in parts) + parked,
                       [t for s in parts for t in s.kv_tokens_per_rank], p.kv_capacity_per_rank,
                       p.prefix_cache_queries, p.prefix_cache_hits, p.prompt_tokens,
                       sum(s.generation_tokens for s in parts), merged, sum(s.preemptions for s in parts),
                       finished, p.tiers, p.attention_backend, p.attention_timings_ms, p.request_prompt_tokens,
                       pd, spec=spec)


def _decode_spec_stats(decode: list[GroupEngine]) -> dict:
    """Speculative decoding's counters summed over the decode groups (the prefill group never speculates)."""
    parts = [g._counters["spec"] for g in decode if g._counters["spec"]]
    if not parts:
        return {}
    total = {k: sum(c[k] for c in parts) for k in parts[0] if k != "accepted_per_pos"}
    total["accepted_per_pos"] = [sum(col) for col in zip(*(c["accepted_per_pos"] for c in parts))]
    return _spec_stats(total)
