"""Prefill and decode on separate groups of ranks in one world (paper §4.3: CP for prefill, decoupled from decode).

Ranks [0, N·TP) are the prefill group; decode group g holds the next M·TP ranks. Each group has its own engine
(`GroupEngine`: an `LLMEngine` over its ranks, with its own KV manager and scheduler). The prefill group runs
every prompt and never decodes. When the forward that completes a prompt is scheduled, the least-loaded decode
group reserves slots for it in its own layout, and the prefill ranks send each layer's K/V straight there as that
forward writes it (`kv/transfer.py`, planned by `cp/pd_plan.py`); once the first token is sampled the request
belongs to that group, which decodes it when all its rows are in. A finished answer's K/V move back to the
prefill ranks' prefix tree, so a chat's next turn recomputes none of its history. The groups' forwards run side
by side: the driver submits each idle group's next call without waiting and handles whichever returns first.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import time

import numpy as np

from cpinfer.cp.pd_plan import TransferPlan, plan_transfer
from cpinfer.device import comm_backend, ranks_on_this_node
from cpinfer.distributed import ParallelConfig
from cpinfer.engine.kv import transfer as T
from cpinfer.engine.kv.capacity import kv_tokens_from_host_ram, profile_tokens_per_rank
from cpinfer.engine.kv.disk_dir import rebuild_index
from cpinfer.engine.kv.manager import BLOCK, KVManager, SeqKV
from cpinfer.engine.llm_engine import EngineDeadError, LLMEngine, _spec_stats
from cpinfer.engine.request import EngineStats, Request, RequestOutput, RequestStatus
from cpinfer.engine.sampling import SamplingParams
from cpinfer.engine.scheduler import Scheduler, SchedulerConfig
from cpinfer.engine.spec_decode.adaptive import SpecState
from cpinfer.engine.spec_decode.config import SpeculativeConfig
from cpinfer.launch import JoinedWorld, WorkerPool, joined_world_requested
from cpinfer.utils import get_logger

log = get_logger()
PREFILL = 0  # the prefill group's index; decode group g is index 1 + g


@dataclasses.dataclass(frozen=True)
class PDConfig:
    """The roles of a prefill / decode world: CP-N prefill and K decode groups of CP-M, all with TP ranks each."""

    prefill_cp: int
    decode_cp: int
    decode_groups: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("prefill_cp", "decode_cp", "decode_groups", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                what = {"prefill_cp": "context_parallel_size", "decode_cp": "pd_decode_cp",
                        "decode_groups": "pd_decode_groups", "tp": "tensor_parallel_size"}[name]
                raise ValueError(f"{what} must be a positive integer, got {v!r}")

    @property
    def roles(self) -> list[tuple[int, int, int]]:
        """(cp, tp, first global rank) of every group, prefill first."""
        out = [(self.prefill_cp, self.tp, 0)]
        for g in range(self.decode_groups):
            out.append((self.decode_cp, self.tp, (self.prefill_cp + g * self.decode_cp) * self.tp))
        return out

    @property
    def world_size(self) -> int:
        return (self.prefill_cp + self.decode_groups * self.decode_cp) * self.tp

    @property
    def cp_ranks(self) -> int:
        return self.prefill_cp + self.decode_groups * self.decode_cp


def check_pd_args(kwargs: dict) -> None:
    """What P/D cannot combine with, refused before anything starts."""
    if kwargs.get("placement", "auto") == "local":
        raise ValueError("placement 'local' cannot be combined with pd_decode_cp: the decode group lays out a request's "
                         "K/V itself; use placement 'auto' or 'shard'")
    spec = SpeculativeConfig.parse(kwargs.get("speculative_config"))
    if spec is not None and spec.method != "ngram":
        raise ValueError("draft_model speculation cannot be combined with pd_decode_cp; use method 'ngram' (a draft "
                         "model would need its own K/V of every prompt on the decode group)")


def role_capacities(capacities: list[int | None], infos: list[dict], ranks: list[list[int]]) -> list[int]:
    """Each role's KV tokens per rank: as given, or (None: measured) the smallest its own ranks reported, so every
    rank of a group holds the same number of slots; the roles differ (their profiles and devices do)."""
    return [c if c is not None else min(infos[r]["kv_capacity"] for r in rs) for c, rs in zip(capacities, ranks)]


def _log_role_capacities(groups: list["GroupEngine"], infos: list[dict], views: list[RoleRanks]) -> None:
    """Each role's KV cache at start: measured (with its profile and its ranks' limits) or given."""
    gib = float(1 << 30)
    for g, v in zip(groups, views):
        cap, per_token = g.kv.capacity_per_rank, infos[v.ranks[0]]["kv_bytes_per_token"]
        if g.sizing is None:
            log.info("KV cache: %s group: %d tokens per rank (%.2f GiB each)", g.role, cap, cap * per_token / gib)
            continue
        m = infos[v.ranks[0]]["memory"]
        log.info("KV cache: %s group: %d tokens per rank (%.2f GiB each), from gpu_memory_utilization %.2f of %.1f GiB "
                 "per GPU after the weights and a profiling forward of %d tokens per rank peaked at %.2f GiB (rank "
                 "%d); per-rank limits %s", g.role, cap, cap * per_token / gib, g.sizing["utilization"],
                 m["total"] / gib, g.sizing["tokens"], m["peak"] / gib, v.ranks[0],
                 [infos[r]["kv_capacity"] for r in v.ranks])


class RoleRanks:
    """A group's ranks inside the world's pool, with the `run` interface `LLMEngine` calls between steps."""

    driver_rank = False

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.pool: WorkerPool | None = None  # set once the world has started

    @property
    def dead_reason(self) -> str | None:
        return None if self.pool is None else self.pool.dead_reason

    def run(self, fn, *args, **kwargs) -> list:
        answers = self.pool.run_some(fn, [args if r in self.ranks else None for r in range(self.pool.world_size)],
                                     kwargs)
        return [answers[r] for r in self.ranks]

    def close(self, force: bool = False) -> None:  # the P/D engine closes the world
        pass


class GroupEngine(LLMEngine):
    """One role's engine: its KV manager, scheduler and output processing over its own ranks of the world."""

    def __init__(self, model, ranks: RoleRanks, role: str, world_cp: int, **kwargs):
        self.view, self.role, self.world_cp = ranks, role, world_cp
        self.on_retire = None  # called with (request) before a finished request's K/V are released
        self.sizing: dict | None = None  # what its ranks profile when the KV cache is sized from GPU memory
        super().__init__(model, **kwargs)

    def _start_ranks(self, capacity: int | None) -> int:
        """The world starts later, once every role is validated. Capacity None (CUDA): measured then, with this
        role's profile (`role_sizing`); until then the KV manager holds one block per rank."""
        self._pool = self.view
        self.rank_pids = []
        if capacity is not None:
            return capacity
        self.sizing = self.role_sizing()
        return BLOCK

    def decode_batch_tokens(self) -> int:
        """A decode group's largest forward: max_num_seqs rows (k + 1 each when it speculates), within
        max_num_batched_tokens."""
        a = self.args
        spec = a.speculative_config
        rows = a.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        return min(rows, a.max_num_batched_tokens or rows)

    def role_sizing(self) -> dict:
        """What this role's ranks profile before the KV cache is sized from GPU memory: the prefill group its largest
        prefill (max_num_batched_tokens, or a whole max_model_len prompt, in its 2N chunks per rank); a decode group
        its decode batch on each rank (a request's new tokens go to one rank, so one rank may get them all; a
        request recomputed after preemption there goes in chunks of that size too: `start_kv`)."""
        a = self.args
        if self.role == "prefill":
            tokens = profile_tokens_per_rank(a.max_num_batched_tokens, self.max_model_len, self.n)
        else:
            tokens = self.decode_batch_tokens()
        return self.memory_sizing(tokens, ranks_on_this_node(self.world_cp * a.tensor_parallel_size))

    def _default_capacity(self, fraction: float) -> int:
        """The host-RAM share split over every CP rank of the world (all roles), not this group's alone."""
        return kv_tokens_from_host_ram(fraction, self.world_cp, self.kv_bytes_per_token, BLOCK, self.max_model_len)

    def _threads_per_rank(self) -> int:
        """As the world's ranks get them (the placement's cost model reads each rank's share of the cores)."""
        world = self.world_cp * self.args.tensor_parallel_size
        return self.args.threads_per_rank or max(1, (os.cpu_count() or 1) // world)

    def _start_tiers(self):
        """No tiers while the world has not started (the KV manager is made without them); `start_kv` then."""
        return None if self.view.pool is None else super()._start_tiers()

    def start_kv(self, capacity: int | None = None) -> None:
        """Once its ranks run: this group's KV manager at its measured capacity (None: as made), over the host / disk
        tiers below its device cache (the prefill group's: the system's cache of history). A decode group sized from
        GPU memory schedules at most its profiled decode batch per forward (`role_sizing`)."""
        tiers = self._start_tiers()
        if tiers is None and capacity is None:
            return
        a = self.args
        self.kv = KVManager(self.n, capacity or self.kv.capacity_per_rank, a.enable_prefix_caching, self._placer(),
                            tiers)
        if self.disk is not None:
            rebuild_index(self.kv, self.disk, tiers.layout)
        budget = a.max_num_batched_tokens
        if self.sizing is not None and self.role != "prefill":
            budget = self.sizing["tokens"]
        on_release = self.scheduler.on_release  # the proposer's hook
        self.scheduler = Scheduler(self.kv, SchedulerConfig(budget, a.max_num_seqs))
        self.scheduler.on_release = on_release

    def _propose(self) -> None:
        """A decode group speculates (ngram) on the requests handed to it: the prefill group made them without
        speculation state (it never decodes), so each starts its own here, at its first decode step."""
        if self.proposer is not None:
            for req in self.scheduler.running:
                if req.spec is None:
                    req.spec = SpecState(self.args.speculative_config.num_speculative_tokens)
        super()._propose()

    def _process(self, scheduled, results, choice, phase, host: dict, form=None):
        seconds = host.get("forward_s")  # the group's call, as the P/D driver timed it
        if self.proposer is not None and phase == "decode" and seconds is not None:  # the adaptive k's cost
            self._step_cost.add(sum(len(s.tokens) for s in scheduled), seconds)
        return super()._process(scheduled, results, choice, phase, host, form)

    def _retire(self, req: Request, keep_cache: bool) -> None:
        if self.on_retire is not None and keep_cache and req.kv is not None:
            self.on_retire(req)
        super()._retire(req, keep_cache)

    def shutdown(self) -> None:
        if self._pool is not None and self._pool.pool is not None and self.dead_error is None:
            self.flush_tiers()
        self._pool = None  # the P/D engine closes the world
        if getattr(self, "disk", None) is not None:
            self.disk.close()
            self.disk = None


@dataclasses.dataclass
class _Handoff:
    """A request moving to decode group `group`: runnable once every rank of it has its transfer's rows in."""

    req: Request
    tid: int | None  # None: nothing to move (the decode group had the whole prompt cached)
    plan_tokens: int
    group: int = 0
    dseq: SeqKV | None = None  # its path on the decode group (req.kv once it has left the prefill group)
    ready: bool = True  # False while the prefill forward that completes its prompt is out
    drop: bool = False  # it ended on the prefill side (finished at its first token, aborted, failed there)
    abort: bool = False
    failed: str | None = None  # why its transfer failed (it then ends with an error)


@dataclasses.dataclass
class _Call:
    forward: tuple | None  # (scheduled, batch, choice, form) or None for a transfer-only call
    recv_tids: set
    t0: float
    t_schedule: float
    early: list = dataclasses.field(default_factory=list)  # handoffs placed when this prefill forward was scheduled
    send_reqs: dict = dataclasses.field(default_factory=dict)  # transfer id → request, of this call's handoff sends


def _path(node) -> list:
    """The segments from the root's child down to `node` (the root excluded), root first."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


def _layout(nodes: list) -> tuple[np.ndarray, np.ndarray]:
    """([S] rank, [S] slot) of these segments' positions, in order."""
    empty = [np.zeros(0, dtype=np.int64)]
    return (np.concatenate([n.rank.view for n in nodes] or empty),
            np.concatenate([n.slot.view for n in nodes] or empty))


def path_layout(seq: SeqKV) -> tuple[np.ndarray, np.ndarray]:
    """([S] rank, [S] slot) of positions 0 .. S-1 of a request's cached path (S = num_stored)."""
    ranks, slots = _layout(_path(seq.leaf))
    if len(ranks) != seq.num_stored:
        raise RuntimeError(f"path of {seq.request_id} holds {len(ranks)} tokens, expected {seq.num_stored} (a bug)")
    return ranks, slots


def _path_ids(seq: SeqKV) -> set[int]:
    """Ids of the segments of a request's cached path (the root excluded)."""
    return {n.id for n in _path(seq.leaf)}


def _drop_unused(kv: KVManager, ids: set[int]) -> None:
    """Remove these segments from the tree, leaves first, as far as no request uses them."""
    changed = True
    while changed:
        changed = False
        for nid in list(ids):
            node = kv.nodes.get(nid)
            if node is not None and node.ref == 0 and node.owner is None and not node.children:
                kv._free_node(node)
                ids.discard(nid)
                changed = True


class PDEngine:
    """Prefill group + decode groups behind `LLMEngine`'s interface (`add_request`, `abort`, `step`, ...)."""

    def __init__(self, model: str | None = None, pd_decode_cp: int | None = None, pd_decode_groups: int = 1,
                 **kwargs):
        self.dead_error: str | None = None
        self._pool = None
        self.pd = PDConfig(kwargs.get("context_parallel_size", 1), pd_decode_cp, pd_decode_groups,
                           kwargs.get("tensor_parallel_size", 1))
        check_pd_args(kwargs)
        t0 = time.perf_counter()
        base = dict(kwargs, in_process=False)
        roles = self.pd.roles
        views = [RoleRanks(range(off, off + cp * tp)) for cp, tp, off in roles]
        # every role validated (model, TP divisibility, sizes) before a rank starts; the prefill group never
        # decodes, so it never speculates: the decode groups do
        self.prefill = GroupEngine(model, views[0], "prefill", self.pd.cp_ranks, **dict(base, speculative_config=None))
        decode_kw = dict(base, context_parallel_size=self.pd.decode_cp, kv_host_gib=0.0, kv_disk_dir=None,
                         kv_disk_gib=None)  # the KV tiers sit below the prefill group's tree alone
        self.decode = [GroupEngine(model, views[1 + g], f"decode{g}", self.pd.cp_ranks, **decode_kw)
                       for g in range(self.pd.decode_groups)]
        self.groups: list[GroupEngine] = [self.prefill, *self.decode]
        for g in self.decode:
            g.on_retire = lambda req, g=g: self._move_back(g, req)
        # sliding-window layers send only the rows a decode still sees: per decode slot, whether its row is there
        # for every layer (False: a windowed layer's row was not sent); a match never ends where a window needs one
        wins = [w for w in self.prefill.config.windows if w is not None]
        self._w_min, self._w_max = (min(wins), max(wins)) if wins else (None, None)
        self._complete: dict[int, np.ndarray] = {}
        self._match_from: int | None = None  # while a handoff attaches: the first position its decode needs
        if wins:
            for i, g in enumerate(self.decode, start=1):
                self._complete[i] = np.ones((self.pd.decode_cp, g.kv.capacity_per_rank + 1), dtype=bool)
                g.kv.match = self._windowed_match(i, g.kv.match)
        self._orders: dict[int, dict[int, dict]] = {}  # group → global rank → {"sends", "recvs", "mirrors"}
        self._inflight: dict[int, _Call] = {}
        self._pending: dict[int, list[_Handoff]] = {i: [] for i in range(1, len(self.groups))}
        self._parked: list[Request] = []  # first token sampled, waiting for room on a decode group
        self._sent_after_call: list[SeqKV] = []  # prefill paths whose sends ride the prefill group's next call
        self._outputs: list[RequestOutput] = []  # produced between steps (aborts of parked requests)
        self._tids = itertools.count(1)
        self._transfers: dict[int, dict] = {}  # tid → {"t0", "tokens", "req", "kind"} until it arrives
        self._counters = {"transfers": 0, "transfer_bytes": 0, "transfer_s": 0.0, "handoffs": 0, "move_backs": 0,
                          "move_back_bytes": 0, "move_backs_skipped": 0}
        self._busy_s = [0.0] * len(self.groups)
        self._t_start = time.perf_counter()
        self.last_step_host: dict = {}
        self._start_world(views)
        log.info("start-up: P/D engine ready in %.1f s", time.perf_counter() - t0)

    # ------------------------------------------------------------------ set-up
    def _start_world(self, views: list[RoleRanks]) -> None:
        a = self.prefill.args
        world = self.pd.world_size
        backend = comm_backend(a.device, ranks_on_this_node(world), a.share_gpus)
        threads = a.threads_per_rank or max(1, (os.cpu_count() or 1) // world)
        self._pool = self._make_pool(world, backend, threads)
        try:
            for v in views:
                v.pool = self._pool
            caps = [None if g.sizing is not None else g.kv.capacity_per_rank for g in self.groups]
            infos = self._pool.run(T.init_role_runner, self.pd.roles, self.prefill.model_path, a.dtype, caps,
                                   self.prefill.attention_backend, self.prefill.decode_config(backend),
                                   a.kv_cache_dtype, a.load_format, [g.sizing for g in self.groups])
            sized = role_capacities(caps, infos, [v.ranks for v in views])
            if None in caps:  # measured: every rank of a role holds its role's smallest
                self._pool.run(T.allocate_role_kv, sized)
            for g, cap, given in zip(self.groups, sized, caps):
                g.start_kv(cap if given is None else None)
        except BaseException:
            self._pool.close(force=True)
            raise
        _log_role_capacities(self.groups, infos, views)
        self.rank_pids = [i["pid"] for i in infos]
        for g, v in zip(self.groups, views):
            g.rank_pids = [self.rank_pids[r] for r in v.ranks]
            g.attention_backend = infos[v.ranks[0]]["attention_backend"]
        self.kv_token_bytes = [i["kv_bytes_per_token"] for i in infos]
        log.info("P/D roles: prefill CP %d x TP %d on ranks %s; %s (%s over %s)", self.pd.prefill_cp, self.pd.tp,
                 views[0].ranks, "; ".join(f"decode group {i} CP {self.pd.decode_cp} x TP {self.pd.tp} on ranks "
                                           f"{v.ranks}" for i, v in enumerate(views[1:])), a.device, backend)

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
        out.update({r.request_id: r for r in self._parked})
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
        for req in self._parked:
            if req.request_id == request_id:
                self._parked.remove(req)
                req.finish_reason = "abort"
                self.prefill._retire(req, keep_cache=False)  # frees its prefill path, counts it, drops its grammar
                self._outputs.append(self.prefill.output.output(req))
                return None
        for i, g in enumerate(self.decode, start=1):
            if request_id in g.requests:
                for h in self._pending[i]:
                    if h.req.request_id == request_id:  # its rows are on their way: freed once they are in
                        h.abort = True
                        return None
                return g.abort(request_id)
        raise ValueError(f"unknown request id {request_id!r} (finished requests cannot be aborted)")

    def has_unfinished_requests(self) -> bool:
        return (bool(self._parked) or any(g.requests for g in self.groups) or bool(self._outputs)
                or bool(self._orders) or bool(self._inflight)  # answers' K/V still moving back
                or any(self._pending.values()) or bool(self._transfers))  # rows still arriving

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Submit the next call of every idle group (prefill first, so the sends a decode group receives are out
        before it), then handle whichever group's call comes back first."""
        self._check_alive()
        outputs, self._outputs = self._outputs, []
        if PREFILL not in self._inflight:
            self._place_parked()
        for i in range(len(self.groups)):
            if i not in self._inflight:
                outputs += self._submit(i)
        if not self._inflight:
            if not outputs and self.has_unfinished_requests():
                raise RuntimeError(f"P/D engine stalled: {len(self._parked)} request(s) wait for a decode group, "
                                   "nothing runs (this is a bug)")
            return outputs
        ready = self._wait_any()
        for i in ready:
            outputs += self._finish(i)
        return outputs

    def _submit(self, i: int) -> list[RequestOutput]:
        g = self.groups[i]
        outputs: list[RequestOutput] = []
        forward = None
        orders = self._orders.get(i, {})
        # answers moving back to the prefill tree arrive in a call of their own: the next forward is scheduled
        # once their segments are in (and no longer held), so it can match them, evict them or restore beside them
        receiving = i == PREFILL and any(o.get("recvs") for o in orders.values())
        if not receiving:
            outputs = g._apply_aborts()
        if not receiving and g.scheduler.has_work():
            held = bool(outputs) or (i == PREFILL and bool(self._parked)) or bool(self._pending.get(i))
            forward = self._on_ranks(g._schedule_forward, held)
        early = []
        if forward is not None and i == PREFILL:  # prompts this forward completes: their decode slots now, and
            early = self._place_early(forward[0])  # their sends ride this very forward, layer by layer
        elif forward is not None and i in self._complete:
            for s in forward[0]:  # rows this decode forward computes are there for every layer
                self._complete[i][s.placement.ranks, s.placement.slots] = True
        orders = self._orders.pop(i, {})
        awaiting = i != PREFILL and any(t["dst"] == i and t["ranks"] for t in self._transfers.values())
        if forward is None and not orders and not awaiting:
            return outputs
        # tier operations decided since the last call (e.g. a segment evicted for a moved-back answer's slots) run
        # before the orders write received rows; a forward's own go with its batch
        ops = tuple(g.kv.take_ops()) if receiving else ()
        t0 = time.perf_counter()
        blob = None
        if forward is not None:
            blob = pickle.dumps(forward[1], protocol=pickle.HIGHEST_PROTOCOL)
        recv_tids, send_reqs = set(), {}
        args = {}
        for r in g.view.ranks:
            o = orders.get(r, {})
            # a call without a forward has nothing else to do: it blocks until every pending receive is in
            to = T.TransferOrders(tuple(o.get("sends", ())), tuple(o.get("recvs", ())), tuple(o.get("mirrors", ())),
                                  wait=forward is None)
            recv_tids.update(rv.tid for rv in to.recvs)
            send_reqs.update((sd.tid, self._transfers[sd.tid]["req"]) for sd in to.sends  # a prompt's handoff
                             if sd.tid in self._transfers and self._transfers[sd.tid]["kind"] == "handoff")
            args[r] = (to, blob, ops)
        self._on_ranks(self._pool.submit_some, T.role_call, args)
        self._inflight[i] = _Call(forward, recv_tids, time.perf_counter(), time.perf_counter() - t0, early,
                                  send_reqs)
        if i == PREFILL:  # their rows are copied at this call's start, before any later write or cache operation
            for seq in self._sent_after_call:
                self.prefill.kv.release(seq, keep=True)
            self._sent_after_call = []
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
        call = self._inflight.pop(i)
        g = self.groups[i]
        answers = self._on_ranks(self._pool.collect_some, g.view.ranks, "forward")
        t1 = time.perf_counter()
        self._busy_s[i] += t1 - call.t0
        results = [a[0] for a in answers]
        settled = set()
        for rank, (_, fig) in zip(g.view.ranks, answers):
            for tid, nbytes in fig.get("recv_bytes", {}).items():
                settled.add(self._rank_settled(tid, rank, nbytes, None))
            for tid, why in fig.get("failed", {}).items():
                settled.add(self._rank_settled(tid, rank, 0, why))
            for tid, per in fig.get("sends", {}).items():  # what the sending ranks posted, and when
                req = call.send_reqs.get(tid)
                if req is not None:
                    pd = req.metrics.setdefault("pd", {})
                    for key, v in (("send_messages", per["messages"]),
                                   ("send_messages_in_forward", per["in_forward"])):
                        pd[key] = pd.get(key, 0) + v
        g._tier_events([fig.get("tier_events", ()) for _, fig in answers])
        for tid in sorted(t for t in settled if t is not None):
            info = self._transfers[tid]
            if info["why"] is not None:
                self._transfer_failed(tid, info["why"])
            else:
                self._arrived(tid, info["bytes"], t1)
        outputs = []
        if call.forward is not None:
            scheduled, batch, choice, form = call.forward
            host = {"schedule_s": call.t_schedule, "forward_s": t1 - call.t0,
                    **{f"rank0_{k}_s": v for k, v in results[0].phases.items()}, "detokenize_s": 0.0}
            key = f"{batch.phase}/{batch.strategy}"
            g._counters["forwards"][key] = g._counters["forwards"].get(key, 0) + 1
            g.last_step_host = host
            g._tier_events(results)
            outputs += g._process(scheduled, results, choice, batch.phase, host, form)
            if i == PREFILL:
                self._leave_prefill(scheduled, t1, call.early)
        if i != PREFILL:
            self._promote(i)
        outputs += self._outputs
        self._outputs = []
        return outputs

    def _rank_settled(self, tid: int, rank: int, nbytes: int, why: str | None) -> int | None:
        """One rank has every message of transfer tid in (or failed); the id once every rank has."""
        info = self._transfers.get(tid)
        if info is None:
            return None
        info["ranks"].discard(rank)
        info["bytes"] += nbytes
        if why is not None and info["why"] is None:
            info["why"] = why
        return None if info["ranks"] else tid

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

    # ------------------------------------------------------------------ prefill → decode
    def _place_early(self, scheduled) -> list[_Handoff]:
        """The prompts the forward being submitted completes (a first token will be sampled): each one's decode
        group, its slots there and its transfer, now — the sends ride this forward. Requests waiting for room go
        first: while some do, later ones wait behind them (placed after their forward, as they are)."""
        out = []
        for s in scheduled:
            req = s.request
            if self._parked or not s.sample or s.is_decode or s.draft is not None:
                continue
            stored = s.start + len(s.tokens)
            if stored != req.kv.num_stored:
                continue
            for i in self._group_order():
                h = self._reserve(i, req, stored, early=True)
                if h is not None:
                    out.append(h)
                    break
        return out

    def _leave_prefill(self, scheduled, now: float, early: list[_Handoff]) -> None:
        """Requests whose prompt is done (first token sampled, not finished) leave the prefill group; their prompt's
        K/V stay in its prefix tree once sent. Those placed when the forward was scheduled move to their decode
        group; the others wait for room (`_parked`)."""
        placed = {h.req.request_id: h for h in early}
        for s in scheduled:
            req = s.request
            h = placed.get(req.request_id)
            left = (req.request_id in self.prefill.requests and req.finish_reason is None and bool(req.out)
                    and not req.is_prefill and req in self.prefill.scheduler.running
                    and req.request_id not in self.prefill._aborts)  # an abort of it is applied there next step
            if h is not None:
                h.ready = True
                if not left:  # it ended at its first token, failed, or is aborted: its rows are freed once in
                    h.drop = True
                    continue
            if not left:
                continue
            self.prefill.scheduler.running.remove(req)
            del self.prefill.requests[req.request_id]
            pd = req.metrics.setdefault("pd", {})
            pd.update(prefill_s=now - req.arrival, t_first=now)
            if h is None:
                self._parked.append(req)
                continue
            self.prefill.kv.release(req.kv, keep=True)  # its sends' rows were copied inside the forward
            self._join(h, 0.0)
        for h in early:
            self._promote(h.group)
        self._place_parked()

    def _group_order(self) -> list[int]:
        """Decode groups, least loaded first (requests held or on their way, then KV tokens stored)."""
        return sorted(range(1, len(self.groups)),
                      key=lambda i: (len(self.groups[i].requests) + sum(not h.ready for h in self._pending[i]),
                                     int(self.groups[i].kv.used.sum()), i))

    def _place_parked(self) -> None:
        still = []
        for req in self._parked:
            if not any(self._hand_to(i, req) for i in self._group_order()):
                still.append(req)
        self._parked = still

    def _reserve(self, i: int, req: Request, stored: int, early: bool) -> _Handoff | None:
        """Reserve req's first `stored` tokens on decode group i (what its prefix tree lacks) and queue the transfer
        from the prefill ranks (riding the prefill forward being submitted when `early`, else the prefill group's
        next call); None when the group has no room now."""
        g = self.groups[i]
        known = req.known_array()
        # attach never matches the last entry (a first token, maybe not sampled yet): a stand-in is enough
        self._match_from = None if self._w_max is None else stored - self._w_max  # the rows its decode will see
        try:
            dseq = g.kv.attach(req.request_id, np.append(known[:stored], 0))
        finally:
            self._match_from = None
        m = dseq.num_stored
        decode_left = max(0, req.params.max_tokens - max(1, len(req.out)))  # the first token is the prefill's
        placement = None
        if m < stored:
            g.kv.begin_forward()
            placement = g.kv.reserve(dseq, known[m:stored], decode=False, decode_left=decode_left)
            if placement is None:
                g.kv.release(dseq, keep=False)
                return None
        tid = None
        if placement is not None:
            src_r, src_s = path_layout(req.kv)
            plan = plan_transfer(np.arange(m, stored), src_r[m:stored], src_s[m:stored], placement.ranks,
                                 placement.slots)
            tid = self._queue(PREFILL, i, plan, req, "handoff", stored=stored, in_forward=early)
            if i in self._complete:  # windowed layers get the rows at positions >= stored - window only
                self._complete[i][plan.dst_ranks, plan.dst_slots] = plan.positions >= stored - self._w_min
        pd = req.metrics.setdefault("pd", {})
        pd.update(decode_group=i - 1, transfer_tokens=stored - m, transfer_bytes=0, transfer_s=0.0,
                  decode_cached_tokens=m, t_placed=time.perf_counter(), placed_early=early)
        h = _Handoff(req, tid, stored - m, group=i, dseq=dseq, ready=not early)
        self._pending[i].append(h)
        self._counters["handoffs"] += 1
        return h

    def _hand_to(self, i: int, req: Request) -> bool:
        """A parked request (first token sampled): reserve its prompt on decode group i and queue the transfer on
        the prefill group's next call; False when the group has no room now."""
        h = self._reserve(i, req, req.kv.num_stored, early=False)
        if h is None:
            return False
        # the prompt stays in the prefill tree; its blocks stay held until the call whose start copies them is out
        if h.tid is None:
            self.prefill.kv.release(req.kv, keep=True)
        else:
            self._sent_after_call.append(req.kv)
        pd = req.metrics["pd"]
        self._join(h, pd["t_placed"] - pd.get("t_first", pd["t_placed"]))
        self._promote(i)
        return True

    def _join(self, h: _Handoff, waited: float) -> None:
        """The request of a handoff becomes decode group h.group's (it runs once its rows are in: `_promote`)."""
        req, g = h.req, self.groups[h.group]
        req.kv = h.dseq
        g.requests[req.request_id] = req
        matcher = self.prefill._matchers.pop(req.request_id, None)
        if matcher is not None:
            g._matchers[req.request_id] = matcher
        req.metrics["pd"]["decode_wait_s"] = waited

    def _promote(self, i: int) -> None:
        """Handoffs of group i whose rows (and every earlier handoff's) have arrived start decoding."""
        g, pending = self.groups[i], self._pending[i]
        while pending and pending[0].ready and (pending[0].tid is None or pending[0].tid not in self._transfers):
            h = pending.pop(0)
            req = h.req
            if h.drop:  # it ended on the prefill side: the rows are in (kept as cache) or failed (dropped)
                nodes = _path_ids(h.dseq)
                g.kv.release(h.dseq, keep=h.failed is None)
                if h.failed is not None:
                    _drop_unused(g.kv, nodes)
                continue
            if h.failed is not None:  # its rows did not all arrive: it ends alone, its decode blocks are freed
                nodes = _path_ids(req.kv)
                self._outputs.append(g._fail(req, f"K/V transfer to the decode group failed: {h.failed}"))
                _drop_unused(g.kv, nodes)  # no cached segment keeps rows that may not have arrived
                continue
            if h.abort:
                g.abort(req.request_id)
                continue
            req.status = RequestStatus.RUNNING
            req.metrics.setdefault("pd", {})["t_runnable"] = time.perf_counter()
            g.scheduler.running.append(req)

    def _windowed_match(self, i: int, match):
        """Decode group i's prefix match, cut before a windowed layer's row that the request needs and that was not
        sent. A handoff of S tokens (`_match_from` = S - window) needs the rows at positions >= S - window: the match
        ends at the first missing one there (the rest is sent, each row the window needs with it). Otherwise (a
        request recomputing after a preemption) the match ends at the longest m whose positions [m - window, m) all
        have every layer's row, as the recomputed queries from m on see them."""
        kv = self.groups[i].kv
        ok = self._complete[i]

        def windowed(tokens, limit, through_holes=False):
            node, inside, matched = match(tokens, limit, through_holes)
            if matched == 0 or ok.all():
                return node, inside, matched
            need = self._match_from
            nodes = _path(node)
            ranks, slots = _layout(nodes)
            bad = ~ok[ranks[:matched], slots[:matched]]  # [matched]: a windowed layer's row missing at that position
            if not bad[max(0, matched - self._w_max if need is None else need):].any():
                return node, inside, matched
            if need is not None:  # the first missing row the handoff needs
                best = max(0, need) + int(np.flatnonzero(bad[max(0, need):])[0])
            else:
                before = np.concatenate([[0], np.cumsum(bad)])  # missing rows before each position
                ends = np.arange(matched + 1)
                fine = before[ends] == before[np.maximum(0, ends - self._w_max)]
                best = int(np.flatnonzero(fine).max())
            if best == 0:
                return kv.root, 0, 0
            n = next(n for n in nodes if n.pos0 < best <= n.pos0 + len(n))
            return n, best - n.pos0, best

        return windowed

    # ------------------------------------------------------------------ decode → prefill (the answer's K/V)
    def _move_back(self, g: GroupEngine, req: Request) -> None:
        """A finished request's stored tokens that the prefill tree lacks (its answer) move there, so the chat's
        next turn finds its whole history cached; without room there they are dropped (recomputed if needed)."""
        dseq = req.kv
        # verified rows only: drafts still awaiting verification (speculation) are no history; the engine truncates
        # them before a request retires, so this bound only guards that rule
        stored = min(dseq.num_stored - dseq.leaf.unverified, len(req.prompt) + len(req.out) - 1)
        if stored <= 0:
            return
        kv = self.prefill.kv
        known = req.known_array()[:stored + 1]
        pseq = kv.attach(f"{req.request_id}#history", known)
        m = pseq.num_stored
        if m >= stored:
            kv.release(pseq, keep=True)
            return
        kv.begin_forward()
        placement = kv.reserve(pseq, known[m:stored], decode=False)
        if placement is None:
            kv.release(pseq, keep=False)
            self._counters["move_backs_skipped"] += 1
            return
        src_r, src_s = path_layout(dseq)
        i = self.groups.index(g)
        if i in self._complete and not self._complete[i][src_r[m:], src_s[m:]].all():
            kv.release(pseq, keep=False)  # windowed rows the decode group never had: the prefill tree recomputes
            self._counters["move_backs_skipped"] += 1
            return
        plan = plan_transfer(np.arange(m, stored), src_r[m:], src_s[m:], placement.ranks, placement.slots)
        tid = self._queue(i, PREFILL, plan, req, "move_back")
        # in the tree now (received at the start of the prefill's next call, before its forward reads them), held
        # until then so that nothing evicts or writes its slots first
        self._transfers[tid]["hold"] = pseq
        req.metrics.setdefault("pd", {})["moved_back_tokens"] = plan.num_tokens
        self._counters["move_backs"] += 1

    # ------------------------------------------------------------------ transfers
    def _queue(self, src: int, dst: int, plan: TransferPlan, req: Request, kind: str, stored: int | None = None,
               in_forward: bool = False) -> int:
        """Orders for the next call of both groups: per (source, destination) CP pair, TP index and layer one
        message. stored: the request's tokens once sent (windowed layers send positions >= stored - window only;
        None: every row); in_forward: the sends ride the source's forward being submitted, layer by layer."""
        tid = next(self._tids)
        tp = self.pd.tp
        s_off, d_off = self.pd.roles[src][2], self.pd.roles[dst][2]
        ranks = set()  # destination ranks that report the transfer in
        for pair in plan.pairs:
            for t in range(tp):
                s_rank, d_rank = s_off + pair.src * tp + t, d_off + pair.dst * tp + t
                self._order(src, s_rank, "sends").append(T.KVSend(tid, d_rank, pair.src_slots, pair.positions,
                                                                  stored, in_forward))
                self._order(dst, d_rank, "recvs").append(T.KVRecv(tid, s_rank, pair.dst_slots, pair.positions,
                                                                  stored, in_forward))
                ranks.add(d_rank)
        if self.groups[dst].config.local_attention:  # windowed layers: every rank mirrors the slots' positions
            mirror = T.SlotMirror(plan.dst_ranks, plan.dst_slots, plan.positions)
            for r in self.groups[dst].view.ranks:
                self._order(dst, r, "mirrors").append(mirror)
        self._transfers[tid] = {"t0": time.perf_counter(), "req": req, "kind": kind, "dst": dst, "ranks": ranks,
                                "bytes": 0, "why": None}
        return tid

    def _transfer_failed(self, tid: int, why: str) -> None:
        """A transfer whose rows did not all arrive: a handoff's request fails (with every later handoff to that group
        whose decode path shares its segments), a moved-back answer is dropped from the prefill tree."""
        info = self._transfers.pop(tid)
        log.warning("K/V transfer %d (%s of %s) failed: %s", tid, info["kind"], info["req"].request_id, why)
        if info["kind"] == "move_back":
            self.prefill.kv.release(info["hold"], keep=False)
            self._counters["move_backs_skipped"] += 1
            return
        for i, pending in self._pending.items():
            bad = next((h for h in pending if h.tid == tid), None)
            if bad is None:
                continue
            nodes = _path_ids(bad.dseq)
            for h in pending[pending.index(bad):]:
                if h is bad or _path_ids(h.dseq) & nodes:
                    h.failed = why if h is bad else f"its cached prefix came with a failed transfer ({why})"

    def _order(self, group: int, rank: int, kind: str) -> list:
        return self._orders.setdefault(group, {}).setdefault(rank, {}).setdefault(kind, [])

    def _arrived(self, tid: int, nbytes: int, now: float) -> None:
        info = self._transfers.pop(tid)
        seconds = now - info["t0"]
        c = self._counters
        c["transfers"] += 1
        c["transfer_bytes"] += nbytes
        c["transfer_s"] += seconds
        pd = info["req"].metrics.setdefault("pd", {})
        if info["kind"] == "handoff":
            # the part of it after the first token (none when every row was in before the prefill call was back)
            pd.update(transfer_bytes=nbytes, transfer_s=seconds, t_arrived=now,
                      transfer_exposed_s=max(0.0, now - pd["t_first"]) if "t_first" in pd else 0.0)
        else:
            c["move_back_bytes"] += nbytes
            pd.update(move_back_bytes=nbytes, move_back_s=seconds)
            self.prefill.kv.release(info["hold"], keep=True)

    # ------------------------------------------------------------------ health, stats, shutdown
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        if self._pool is None:
            raise RuntimeError("the engine has been shut down")

    def check_ranks(self) -> str | None:
        if self.dead_error is None and self._pool is not None and self._pool.dead_reason is not None:
            self.dead_error = self._pool.dead_reason
        return self.dead_error

    def heartbeat(self) -> None:
        pass

    def sync_tiers(self, force: bool = False) -> None:
        """Between steps: the prefill group's waiting cache operations and disk acknowledgements (not while a call
        of its ranks is in flight)."""
        if PREFILL not in self._inflight and not self._orders.get(PREFILL):
            self.prefill.sync_tiers(force)

    def flush_tiers(self) -> None:
        self.prefill.flush_tiers()

    def pd_stats(self) -> dict:
        """Transfers (count, bytes, seconds), answers moved back, and each role's share of wall time in forwards."""
        wall = max(1e-9, time.perf_counter() - self._t_start)
        roles = ["prefill"] + [f"decode{g}" for g in range(self.pd.decode_groups)]
        return {**self._counters, "utilization": {r: b / wall for r, b in zip(roles, self._busy_s)},
                "parked": len(self._parked)}

    def cache_stats(self) -> dict:
        out = self.prefill.cache_stats()
        out["kv_tokens_per_rank"] = [t for g in self.groups for t in g.kv.tokens_per_rank()]
        out["pd"] = self.pd_stats()
        return out

    def stats(self) -> EngineStats:
        parts = [g.stats() for g in self.groups]
        p = parts[0]
        merged = {}
        for s in parts:
            for k, v in s.forwards.items():
                merged[k] = merged.get(k, 0) + v
        finished = {}
        for s in parts:
            for k, v in s.requests_finished.items():
                finished[k] = finished.get(k, 0) + v
        on_way = sum(1 for p in self._pending.values() for h in p if h.ready and not h.drop)
        return EngineStats(sum(s.num_running for s in parts) + on_way,
                           sum(s.num_waiting for s in parts) + len(self._parked),
                           [t for s in parts for t in s.kv_tokens_per_rank], p.kv_capacity_per_rank,
                           p.prefix_cache_queries, p.prefix_cache_hits, p.prompt_tokens,
                           sum(s.generation_tokens for s in parts), merged, sum(s.preemptions for s in parts),
                           finished, p.tiers, p.attention_backend, p.attention_timings_ms, p.request_prompt_tokens,
                           self.pd_stats(), spec=self._spec_stats())

    def _spec_stats(self) -> dict:
        """Speculative decoding's counters summed over the decode groups (the prefill group never speculates)."""
        parts = [g._counters["spec"] for g in self.decode if g._counters["spec"]]
        if not parts:
            return {}
        total = {k: sum(c[k] for c in parts) for k in parts[0] if k != "accepted_per_pos"}
        total["accepted_per_pos"] = [sum(col) for col in zip(*(c["accepted_per_pos"] for c in parts))]
        return _spec_stats(total)

    def ring_wait_s(self) -> list[float]:
        return self._pool.run(T.MR.ring_wait)

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
