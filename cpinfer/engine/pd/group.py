"""One role of a prefill / decode world (paper §4.3): `GroupEngine`, an `LLMEngine` over its own ranks of the world
with its own KV manager, scheduler and output processing (the P/D driver, `driver.py`, runs its calls), and its
start-up (`RoleStartup`: its ranks start with the world's, its KV cache is sized with its role's own profile)."""
from __future__ import annotations

import os
import time

from cpinfer.device import ranks_on_this_node
from cpinfer.engine.kv.capacity import kv_tokens_from_host_ram, profile_tokens_per_rank
from cpinfer.engine.kv.manager import BLOCK
from cpinfer.engine.llm_engine import LLMEngine
from cpinfer.engine.pd.draft_rows import fill_batches
from cpinfer.engine.pd.roles import RoleRanks
from cpinfer.engine.request import Request
from cpinfer.engine.scheduler import Scheduler, SchedulerConfig
from cpinfer.engine.spec_decode import draft_runner as DR
from cpinfer.engine.spec_decode.adaptive import SpecState
from cpinfer.engine.spec_decode.draft import draft_token_bytes
from cpinfer.engine.startup import EngineStartup


class RoleStartup(EngineStartup):
    """A role's start-up: validated like any engine's, but its ranks start later, once every role is (the P/D
    driver starts the world, then calls `GroupEngine.start_kv`)."""

    def start_ranks(self, capacity: int | None) -> int:
        """The world starts later, once every role is validated. Capacity None (CUDA): measured then, with this
        role's profile (`role_sizing`); until then the KV manager holds one block per rank."""
        e = self.engine
        e._pool = e.view
        e.rank_pids = []
        if capacity is not None:
            return capacity
        e.sizing = self.role_sizing()
        return BLOCK

    def fit_max_model_len(self, capacity: int) -> None:
        """Checked against the role's own capacity; one measured on the GPUs is checked once the world has started
        (`GroupEngine.start_kv`), not against the one-block placeholder before."""
        e = self.engine
        if e.sizing is not None and e.view.pool is None:
            return
        super().fit_max_model_len(capacity)

    def load_draft(self) -> None:
        """A decode group's draft loads once the world runs and its KV store is sized (`PDEngine._start_roles`)."""
        if self.engine.view.pool is not None:
            super().load_draft()

    def default_capacity(self, fraction: float) -> int:
        """The host-RAM share split over every CP rank of the world (all roles), not this group's alone; a draft's
        store (a decode group's) counted with the target's."""
        e = self.engine
        per_token = e.kv_bytes_per_token + draft_token_bytes(getattr(e, "draft", None), e.elem_bytes)
        return kv_tokens_from_host_ram(fraction, e.world_cp, per_token, BLOCK, e.max_model_len)

    def capacity_where(self) -> str:
        return f" on the {self.engine.role} group"

    def role_sizing(self) -> dict:
        """What this role's ranks profile before the KV cache is sized from GPU memory: the prefill group its largest
        prefill (max_num_batched_tokens, or a whole max_model_len prompt, in its 2N chunks per rank); a decode group
        its decode batch on each rank (a request's new tokens go to one rank, so one rank may get them all; a
        request recomputed after preemption there goes in chunks of that size too: `GroupEngine.start_kv`)."""
        e = self.engine
        a = e.args
        if e.role == "prefill":
            tokens = profile_tokens_per_rank(a.max_num_batched_tokens, e.max_model_len, e.n)
        else:
            tokens = self.decode_batch_tokens()
        return self.memory_sizing(tokens, ranks_on_this_node(e.world_cp * a.tensor_parallel_size))

    def decode_batch_tokens(self) -> int:
        """A decode group's largest forward: max_num_seqs rows (k + 1 each when it speculates), within
        max_num_batched_tokens."""
        a = self.engine.args
        spec = a.speculative_config
        rows = a.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        return min(rows, a.max_num_batched_tokens or rows)

    def threads_per_rank(self) -> int:
        """As the world's ranks get them (the placement's cost model reads each rank's share of the cores)."""
        a = self.engine.args
        world = self.engine.world_cp * a.tensor_parallel_size
        return a.threads_per_rank or max(1, (os.cpu_count() or 1) // world)

    def start_tiers(self):
        """No tiers while the world has not started (the KV manager is made without them); `start_kv` then."""
        return None if self.engine.view.pool is None else super().start_tiers()


class GroupEngine(LLMEngine):
    """One role's engine: its KV manager, scheduler and output processing over its own ranks of the world."""

    startup_class = RoleStartup

    def __init__(self, model, ranks: RoleRanks, role: str, world_cp: int, **kwargs):
        self.view, self.role, self.world_cp = ranks, role, world_cp
        self.on_retire = None  # called with (request) before a finished request's K/V are released
        self.sizing: dict | None = None  # what its ranks profile when the KV cache is sized from GPU memory
        self.draft_rows = None  # a decode group with a draft model: () → which slots hold the draft's rows
        self._draft_filled: set[str] = set()  # running requests whose draft rows are all computed here
        super().__init__(model, **kwargs)
        if self.proposer is not None and getattr(self, "draft", None) is not None:
            release = self.scheduler.on_release  # preempted: its path may be rebuilt from rows without draft K/V

            def released(req: Request) -> None:
                self._draft_filled.discard(req.request_id)
                release(req)
            self.scheduler.on_release = released

    def start_kv(self, capacity: int | None = None) -> None:
        """Once its ranks run: this group's KV manager at its measured capacity (None: as made), over the host / disk
        tiers below its device cache (the prefill group's: the system's cache of history). A decode group sized from
        GPU memory schedules at most its profiled decode batch per forward (`RoleStartup.role_sizing`)."""
        tiers = self.startup.start_tiers()
        if tiers is None and capacity is None:
            return
        a = self.args
        if capacity is not None:  # measured: max_model_len is checked against it now
            self.startup.fit_max_model_len(capacity)
        self.startup.make_kv(capacity or self.kv.capacity_per_rank, tiers)
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
                    req.spec = SpecState.of(self.args.speculative_config.num_speculative_tokens)
            if self.draft_rows is not None:
                self._fill_draft()
        super()._propose()

    def _fill_draft(self) -> None:
        """A draft model's rows of the slots that arrived by a handoff (target K/V only) are recomputed before the
        request first drafts here: draft-only prefill forwards on this group's ranks (`pd/draft_rows.py`)."""
        todo = [r for r in self.scheduler.running if not r.is_prefill and r.request_id not in self._draft_filled]
        if not todo:
            return
        ok = self.draft_rows()
        counts = self._counters.setdefault("draft_fill", {"forwards": 0, "tokens": 0, "seconds": 0.0})
        self._draft_filled.update(r.request_id for r in todo)
        while todo:  # a round per shared prefix: a request whose missing rows another one writes goes after it
            batches, written, todo = fill_batches(todo, ok, self.n)
            if not batches:
                break
            t0 = time.perf_counter()
            self._on_ranks(self._pool.run, DR.fill, tuple(batches))
            counts["seconds"] += time.perf_counter() - t0
            for ranks, slots in written:
                ok[ranks, slots] = True
            counts["forwards"] += len(batches)
            counts["tokens"] += sum(len(r) for r, _ in written)

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
