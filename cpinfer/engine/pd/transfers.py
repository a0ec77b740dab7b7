"""The driver's record of K/V transfers between P/D groups (paper §4.3): the orders each group's next call carries,
per rank (`kv/transfer.py` runs them there), and every transfer in flight until each of its destination ranks has
reported its rows in (or failed)."""
from __future__ import annotations

import dataclasses
import itertools
import time

from cpinfer.cp.pd_plan import TransferPlan
from cpinfer.engine.kv import transfer as T
from cpinfer.engine.kv.manager import SeqKV
from cpinfer.engine.pd.roles import PDConfig
from cpinfer.engine.request import Request


@dataclasses.dataclass
class Transfer:
    """One transfer in flight: what it moves, where to, and what its destination ranks reported so far."""

    req: Request
    kind: str  # "handoff" (a prompt to a decode group) or "move_back" (an answer to the prefill tree)
    dst: int  # the destination group
    ranks: set  # destination ranks that have not reported it in yet
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    nbytes: int = 0  # bytes reported in so far
    why: str | None = None  # why it failed on some rank (None: no failure reported)
    hold: SeqKV | None = None  # a moved-back answer's prefill path, held until its rows are in


class Transfers:
    """Orders per group and global rank ({"sends", "recvs", "mirrors"}) until that group's next call takes them, and
    the transfers in flight by id."""

    def __init__(self, pd: PDConfig, groups: list):
        self.pd, self.groups = pd, groups
        self._tids = itertools.count(1)
        self.orders: dict[int, dict[int, dict]] = {}  # group → global rank → {"sends", "recvs", "mirrors"}
        self.in_flight: dict[int, Transfer] = {}  # tid → its transfer, until it arrives or fails

    def queue(self, src: int, dst: int, plan: TransferPlan, req: Request, kind: str, stored: int | None = None,
              in_forward: bool = False, hold: SeqKV | None = None) -> int:
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
        self.in_flight[tid] = Transfer(req, kind, dst, ranks, hold=hold)
        return tid

    def queue_state(self, tid: int, src: int, dst: int, src_slot: int, dst_slot: int, in_forward: bool) -> None:
        """Hybrid models: transfer tid also moves state slot src_slot of group src into slot dst_slot of every rank
        of group dst (each keeps a replica), sent by the source ranks in turn; every destination rank reports it."""
        tp = self.pd.tp
        (s_cp, _, s_off), (d_cp, _, d_off) = self.pd.roles[src], self.pd.roles[dst]
        for d in range(d_cp):
            for t in range(tp):
                s_rank, d_rank = s_off + (d % s_cp) * tp + t, d_off + d * tp + t
                self._order(src, s_rank, "state_sends").append(T.StateSend(tid, d_rank, src_slot, in_forward))
                self._order(dst, d_rank, "state_recvs").append(T.StateRecv(tid, s_rank, dst_slot, in_forward))
                self.in_flight[tid].ranks.add(d_rank)

    def _order(self, group: int, rank: int, kind: str) -> list:
        return self.orders.setdefault(group, {}).setdefault(rank, {}).setdefault(kind, [])

    def receiving(self, group: int) -> bool:
        """Whether the group's next call has receives to post."""
        return any(o.get("recvs") for o in self.orders.get(group, {}).values())

    def awaiting(self, group: int) -> bool:
        """Whether some rank of the group has not reported a transfer to it in yet."""
        return any(t.dst == group and t.ranks for t in self.in_flight.values())

    def rank_orders(self, ranks: list[int], orders: dict, wait: bool) -> tuple[dict, dict]:
        """The group's call's `TransferOrders` per rank (wait: a call without a forward blocks until every pending
        receive is in), and the requests of the prompt handoffs whose sends it carries (by transfer id)."""
        per_rank, send_reqs = {}, {}
        for r in ranks:
            o = orders.get(r, {})
            per_rank[r] = T.TransferOrders(tuple(o.get("sends", ())), tuple(o.get("recvs", ())),
                                           tuple(o.get("mirrors", ())), wait=wait,
                                           state_sends=tuple(o.get("state_sends", ())),
                                           state_recvs=tuple(o.get("state_recvs", ())))
            send_reqs.update((sd.tid, self.in_flight[sd.tid].req) for sd in per_rank[r].sends
                             if sd.tid in self.in_flight and self.in_flight[sd.tid].kind == "handoff")
        return per_rank, send_reqs

    def report(self, ranks: list[int], figures: list[dict], send_reqs: dict) -> list[int]:
        """What a group's ranks reported back from a call: the ids of the transfers that every destination rank has
        now reported (in or failed), in order. A prompt's sends posted there count in its request's metrics."""
        settled = set()
        for rank, fig in zip(ranks, figures):
            for tid, nbytes in fig.get("recv_bytes", {}).items():
                settled.add(self._rank_settled(tid, rank, nbytes, None))
            for tid, why in fig.get("failed", {}).items():
                settled.add(self._rank_settled(tid, rank, 0, why))
            for tid, per in fig.get("sends", {}).items():  # what the sending ranks posted, and when
                req = send_reqs.get(tid)
                if req is not None:
                    pd = req.metrics.setdefault("pd", {})
                    for key, v in (("send_messages", per["messages"]),
                                   ("send_messages_in_forward", per["in_forward"])):
                        pd[key] = pd.get(key, 0) + v
        return sorted(t for t in settled if t is not None)

    def _rank_settled(self, tid: int, rank: int, nbytes: int, why: str | None) -> int | None:
        """One rank has every message of transfer tid in (or failed); the id once every rank has."""
        info = self.in_flight.get(tid)
        if info is None:
            return None
        info.ranks.discard(rank)
        info.nbytes += nbytes
        if why is not None and info.why is None:
            info.why = why
        return None if info.ranks else tid
