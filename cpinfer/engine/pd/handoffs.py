"""Requests moving between the groups of a prefill / decode world (paper §4.3): a completed prompt's decode group
and slots, its K/V sent there (riding the prefill forward that completes it, or later from `parked`), the request
runnable there once every row is in, and a finished answer's K/V moved back to the prefill tree (`Handoffs`)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from cpinfer.cp.pd_plan import plan_transfer
from cpinfer.engine.kv.manager import SeqKV
from cpinfer.engine.pd.draft_rows import DraftRows
from cpinfer.engine.pd.paths import drop_unused, path_ids, path_layout
from cpinfer.engine.pd.roles import PDConfig
from cpinfer.engine.pd.transfers import Transfers
from cpinfer.engine.pd.windows import WindowedRows
from cpinfer.engine.request import Request, RequestOutput, RequestStatus
from cpinfer.utils import get_logger

log = get_logger()
PREFILL = 0  # the prefill group's index; decode group g is index 1 + g


@dataclasses.dataclass
class Handoff:
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


class Handoffs:
    """Every request between groups: handoffs pending per decode group (in order), requests parked for room, and
    the transfers that move their K/V (`transfers`). Outputs it makes between steps wait in `outputs`."""

    def __init__(self, pd: PDConfig, groups: list):
        self.groups, self.prefill = groups, groups[PREFILL]
        self.transfers = Transfers(pd, groups)
        # sliding-window layers send only the rows a decode still sees; a match never ends where a window needs one
        self.windows = WindowedRows(self.prefill.config.windows, groups[1:], pd.decode_cp)
        self.draft_rows = DraftRows(groups[1:], pd.decode_cp)  # a draft model's rows recomputed after a handoff
        self.pending: dict[int, list[Handoff]] = {i: [] for i in range(1, len(groups))}
        self.parked: list[Request] = []  # first token sampled, waiting for room on a decode group
        self.sent_after_call: list[SeqKV] = []  # prefill paths whose sends ride the prefill group's next call
        self.outputs: list[RequestOutput] = []  # produced between steps (aborts of parked requests, failures)
        self.counters = {"transfers": 0, "transfer_bytes": 0, "transfer_s": 0.0, "handoffs": 0, "move_backs": 0,
                         "move_back_bytes": 0, "move_backs_skipped": 0}
        for g in groups[1:]:
            g.on_retire = lambda req, g=g: self.move_back(g, req)

    # ------------------------------------------------------------------ what the driver asks
    def busy(self) -> bool:
        """Requests parked or on their way, or K/V still moving (answers' K/V back, rows arriving)."""
        t = self.transfers
        return bool(self.parked) or bool(t.orders) or any(self.pending.values()) or bool(t.in_flight)

    def holds(self, i: int) -> bool:
        """Whether requests wait on group i's next forward (a scheduler with nothing to run is then no stall)."""
        return (i == PREFILL and bool(self.parked)) or bool(self.pending.get(i))

    def on_way(self) -> int:
        """Requests whose prompt left the prefill group and that do not run yet on their decode group."""
        return sum(1 for p in self.pending.values() for h in p if h.ready and not h.drop)

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs

    def scheduled(self, i: int, scheduled) -> list[Handoff]:
        """Group i's next forward is scheduled: the prefill's completed prompts are placed now (their sends ride
        it); a decode forward's rows are there for every layer."""
        if i == PREFILL:
            return self.place_early(scheduled)
        if self.windows.tracks(i):
            self.windows.computed(i, scheduled)
        self.draft_rows.computed(i, scheduled)
        return []

    def prefill_call_out(self) -> None:
        """The prefill group's call is out: its start copied the rows of the sends it carries, so their paths are
        no longer held (before any later write or cache operation)."""
        for seq in self.sent_after_call:
            self.prefill.kv.release(seq, keep=True)
        self.sent_after_call = []

    def abort_parked(self, request_id: str) -> bool:
        """Abort a parked request (its output waits in `outputs`); False when none has that id."""
        for req in self.parked:
            if req.request_id == request_id:
                self.parked.remove(req)
                req.finish_reason = "abort"
                self.prefill._retire(req, keep_cache=False)  # frees its prefill path, counts it, drops its grammar
                self.outputs.append(self.prefill.output.output(req))
                return True
        return False

    def abort_pending(self, i: int, request_id: str) -> bool:
        """A request of decode group i whose rows are on their way is aborted once they are in; False if none."""
        for h in self.pending[i]:
            if h.req.request_id == request_id:
                h.abort = True
                return True
        return False

    # ------------------------------------------------------------------ prefill → decode
    def place_early(self, scheduled) -> list[Handoff]:
        """The prompts the forward being submitted completes (a first token will be sampled): each one's decode
        group, its slots there and its transfer, now — the sends ride this forward. Requests waiting for room go
        first: while some do, later ones wait behind them (placed after their forward, as they are)."""
        out = []
        for s in scheduled:
            req = s.request
            if self.parked or not s.sample or s.is_decode or s.draft is not None:
                continue
            stored = s.start + len(s.tokens)
            if stored != req.kv.num_stored:
                continue
            for i in self.group_order():
                h = self._reserve(i, req, stored, early=True)
                if h is not None:
                    out.append(h)
                    break
        return out

    def leave_prefill(self, scheduled, now: float, early: list[Handoff]) -> None:
        """Requests whose prompt is done (first token sampled, not finished) leave the prefill group; their prompt's
        K/V stay in its prefix tree once sent. Those placed when the forward was scheduled move to their decode
        group; the others wait for room (`parked`)."""
        placed = {h.req.request_id: h for h in early}
        p = self.prefill
        for s in scheduled:
            req = s.request
            h = placed.get(req.request_id)
            left = (req.request_id in p.requests and req.finish_reason is None and bool(req.out)
                    and not req.is_prefill and req in p.scheduler.running
                    and req.request_id not in p._aborts)  # an abort of it is applied there next step
            if h is not None:
                h.ready = True
                if not left:  # it ended at its first token, failed, or is aborted: its rows are freed once in
                    h.drop = True
                    continue
            if not left:
                continue
            p.scheduler.running.remove(req)
            del p.requests[req.request_id]
            req.metrics.setdefault("pd", {}).update(prefill_s=now - req.arrival, t_first=now)
            if h is None:
                self.parked.append(req)
                continue
            p.kv.release(req.kv, keep=True)  # its sends' rows were copied inside the forward
            self._join(h, 0.0)
        for h in early:
            self.promote(h.group)
        self.place_parked()

    def group_order(self) -> list[int]:
        """Decode groups, least loaded first (requests held or on their way, then KV tokens stored)."""
        return sorted(range(1, len(self.groups)),
                      key=lambda i: (len(self.groups[i].requests) + sum(not h.ready for h in self.pending[i]),
                                     int(self.groups[i].kv.used.sum()), i))

    def place_parked(self) -> None:
        still = []
        for req in self.parked:
            if not any(self._hand_to(i, req) for i in self.group_order()):
                still.append(req)
        self.parked = still

    def _reserve(self, i: int, req: Request, stored: int, early: bool) -> Handoff | None:
        """Reserve req's first `stored` tokens on decode group i (what its prefix tree lacks) and queue the transfer
        from the prefill ranks (riding the prefill forward being submitted when `early`, else the prefill group's
        next call); None when the group has no room now."""
        g = self.groups[i]
        known = req.known_array()
        with self.windows.attaching(stored):  # the rows its decode will see
            # attach never matches the last entry (a first token, maybe not sampled yet): a stand-in is enough
            dseq = g.kv.attach(req.request_id, np.append(known[:stored], 0))
        m = dseq.num_stored
        decode_left = max(0, req.params.max_tokens - max(1, len(req.out)))  # the first token is the prefill's
        placement = None
        if m < stored:
            g.kv.begin_forward()
            placement = g.kv.reserve(dseq, known[m:stored], decode=False, decode_left=decode_left)
            if placement is None:
                g.kv.release(dseq, keep=False)
                return None
            self.draft_rows.received(i, placement.ranks, placement.slots)
        tid = None
        if placement is not None:
            src_r, src_s = path_layout(req.kv)
            plan = plan_transfer(np.arange(m, stored), src_r[m:stored], src_s[m:stored], placement.ranks,
                                 placement.slots)
            tid = self.transfers.queue(PREFILL, i, plan, req, "handoff", stored=stored, in_forward=early)
            if self.windows.tracks(i):  # windowed layers get the rows at positions >= stored - window only
                self.windows.sent(i, plan, stored)
            if dseq.state_out >= 0:  # hybrid models: the state after the prompt (its live slot on the prefill
                # group, final once the forward completing it is done) goes to its live slot there, read first
                self.transfers.queue_state(tid, PREFILL, i, req.kv.state_out, dseq.state_out, early)
                g.kv.consume_state_in(dseq)
        pd = req.metrics.setdefault("pd", {})
        pd.update(decode_group=i - 1, transfer_tokens=stored - m, transfer_bytes=0, transfer_s=0.0,
                  decode_cached_tokens=m, t_placed=time.perf_counter(), placed_early=early)
        h = Handoff(req, tid, stored - m, group=i, dseq=dseq, ready=not early)
        self.pending[i].append(h)
        self.counters["handoffs"] += 1
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
            self.sent_after_call.append(req.kv)
        pd = req.metrics["pd"]
        self._join(h, pd["t_placed"] - pd.get("t_first", pd["t_placed"]))
        self.promote(i)
        return True

    def _join(self, h: Handoff, waited: float) -> None:
        """The request of a handoff becomes decode group h.group's (it runs once its rows are in: `promote`)."""
        req, g = h.req, self.groups[h.group]
        req.kv = h.dseq
        g.requests[req.request_id] = req
        matcher = self.prefill._matchers.pop(req.request_id, None)
        if matcher is not None:
            g._matchers[req.request_id] = matcher
        req.metrics["pd"]["decode_wait_s"] = waited

    def promote(self, i: int) -> None:
        """Handoffs of group i whose rows (and every earlier handoff's) have arrived start decoding."""
        g, pending = self.groups[i], self.pending[i]
        flying = self.transfers.in_flight
        while pending and pending[0].ready and (pending[0].tid is None or pending[0].tid not in flying):
            h = pending.pop(0)
            req = h.req
            if h.drop:  # it ended on the prefill side: the rows are in (kept as cache) or failed (dropped)
                nodes = path_ids(h.dseq)
                g.kv.release(h.dseq, keep=h.failed is None)
                if h.failed is not None:
                    drop_unused(g.kv, nodes)
                continue
            if h.failed is not None:  # its rows did not all arrive: it ends alone, its decode blocks are freed
                nodes = path_ids(req.kv)
                self.outputs.append(g._fail(req, f"K/V transfer to the decode group failed: {h.failed}"))
                drop_unused(g.kv, nodes)  # no cached segment keeps rows that may not have arrived
                continue
            if h.abort:
                g.abort(req.request_id)
                continue
            req.status = RequestStatus.RUNNING
            req.metrics.setdefault("pd", {})["t_runnable"] = time.perf_counter()
            g.scheduler.running.append(req)

    # ------------------------------------------------------------------ decode → prefill (the answer's K/V)
    def move_back(self, g, req: Request) -> None:
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
            self.counters["move_backs_skipped"] += 1
            return
        src_r, src_s = path_layout(dseq)
        i = self.groups.index(g)
        if not self.windows.all_there(i, src_r[m:], src_s[m:]):
            kv.release(pseq, keep=False)  # windowed rows the decode group never had: the prefill tree recomputes
            self.counters["move_backs_skipped"] += 1
            return
        plan = plan_transfer(np.arange(m, stored), src_r[m:], src_s[m:], placement.ranks, placement.slots)
        # in the tree now (received at the start of the prefill's next call, before its forward reads them), held
        # until then so that nothing evicts or writes its slots first
        tid = self.transfers.queue(i, PREFILL, plan, req, "move_back", hold=pseq)
        if pseq.state_out >= 0:  # hybrid models: the state after the answer (the decode's live slot) comes too,
            # the snapshot at the history's end; a live slot past it (drafts) has none: no snapshot there
            if dseq.state_out >= 0 and dseq.num_stored == stored:
                self.transfers.queue_state(tid, i, PREFILL, dseq.state_out, pseq.state_out, False)
            else:
                kv.drop_live_state(pseq)
        req.metrics.setdefault("pd", {})["moved_back_tokens"] = plan.num_tokens
        self.counters["move_backs"] += 1

    # ------------------------------------------------------------------ transfers that settled
    def settle(self, tids: list[int], now: float) -> None:
        """Transfers every destination rank has reported: arrived, or failed on some rank."""
        for tid in tids:
            info = self.transfers.in_flight[tid]
            if info.why is not None:
                self._failed(tid, info.why)
            else:
                self._arrived(tid, info.nbytes, now)

    def _failed(self, tid: int, why: str) -> None:
        """A transfer whose rows did not all arrive: a handoff's request fails (with every later handoff to that group
        whose decode path shares its segments), a moved-back answer is dropped from the prefill tree."""
        info = self.transfers.in_flight.pop(tid)
        log.warning("K/V transfer %d (%s of %s) failed: %s", tid, info.kind, info.req.request_id, why)
        if info.kind == "move_back":
            self.prefill.kv.release(info.hold, keep=False)
            self.counters["move_backs_skipped"] += 1
            return
        for pending in self.pending.values():
            bad = next((h for h in pending if h.tid == tid), None)
            if bad is None:
                continue
            nodes = path_ids(bad.dseq)
            for h in pending[pending.index(bad):]:
                if h is bad or path_ids(h.dseq) & nodes:
                    h.failed = why if h is bad else f"its cached prefix came with a failed transfer ({why})"

    def _arrived(self, tid: int, nbytes: int, now: float) -> None:
        info = self.transfers.in_flight.pop(tid)
        seconds = now - info.t0
        c = self.counters
        c["transfers"] += 1
        c["transfer_bytes"] += nbytes
        c["transfer_s"] += seconds
        pd = info.req.metrics.setdefault("pd", {})
        if info.kind == "handoff":
            # the part of it after the first token (none when every row was in before the prefill call was back)
            pd.update(transfer_bytes=nbytes, transfer_s=seconds, t_arrived=now,
                      transfer_exposed_s=max(0.0, now - pd["t_first"]) if "t_first" in pd else 0.0)
        else:
            c["move_back_bytes"] += nbytes
            pd.update(move_back_bytes=nbytes, move_back_s=seconds)
            self.prefill.kv.release(info.hold, keep=True)
