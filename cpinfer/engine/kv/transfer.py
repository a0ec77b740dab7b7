"""The rank side of moving K/V between a prefill group and a decode group (paper §4.3): point-to-point sends and
receives of stored rows, on the world group (NCCL on GPUs, gloo on CPUs), one message per (source, destination,
layer) of a transfer. Rows travel as stored: an FP8 cache's bytes, MLA's latent, each TP rank its own heads. A
sliding-window layer sends only the rows a decode after the transfer can still see (`layer_rows`). A group's call
runs them (`pd/ranks.py`).

Sends never wait. A prompt's sends ride the prefill forward that completes it: each layer's rows are copied and
posted as soon as that layer has written them (`ModelRunner.on_kv_written`), and the copies stay alive until they
are delivered. Other sends (an answer moving back, a prompt handed over late) are posted before the call's forward.
Receives are posted in the call that carries their orders and not waited for: every later call writes the messages
that have come in and reports the transfers whose every message on this rank is in (`recv_bytes`) or failed. A
call told to `wait` (its group has nothing else to run) blocks until every pending receive is in. The driver makes
a request runnable only when every rank has reported its transfer in, so nothing is ever computed from rows that
have not all arrived. gloo's point-to-point works only complete inside `wait()`, so a background thread per
direction waits on them in order and flags each one done (`_Waiter`).

Hybrid models: a handoff also moves the request's recurrent state (`StateSend` / `StateRecv`: every recurrent
layer's fp32 state and conv tail, one state slot) from a prefill rank to every rank of the decode group (each keeps
a replica), posted after the K/V rows sent at the same time (a state a forward completes: after that forward; any other: before
it, as the slot may be reused by then; receivers post them in the same order) and counted in the transfer like its
rows.
"""
from __future__ import annotations

import dataclasses
import queue
import threading

import numpy as np
import torch
import torch.distributed as dist

_TAG_SPAN = 1 << 30  # message tags: (transfer id, layer) modulo this


@dataclasses.dataclass(frozen=True)
class KVSend:
    tid: int  # the transfer's id (with the layer: the message tag)
    peer: int  # global rank of the receiver
    slots: np.ndarray  # [T] this rank's slots, in the order the receiver writes them
    positions: np.ndarray  # [T] their positions (windowed layers keep those a later decode still sees)
    stored: int | None = None  # tokens the request stores once sent (S); None: every row of every layer
    in_forward: bool = False  # posted layer by layer inside this call's forward (else before it)


@dataclasses.dataclass(frozen=True)
class KVRecv:
    tid: int
    peer: int  # global rank of the sender
    slots: np.ndarray  # [T] this rank's slots the rows go to, in the sender's order
    positions: np.ndarray  # [T]
    stored: int | None = None
    in_forward: bool = False  # its sends ride the sender's forward (messages are posted in the senders' order)


@dataclasses.dataclass(frozen=True)
class StateSend:
    """Send state slot `slot` (hybrid models: every recurrent layer's state and conv tail) to `peer`."""

    tid: int
    peer: int
    slot: int
    in_forward: bool = False  # the forward of this call completes it: posted after that forward


@dataclasses.dataclass(frozen=True)
class StateRecv:
    """Receive a state slot from `peer` into this rank's slot `slot`."""

    tid: int
    peer: int
    slot: int
    in_forward: bool = False


@dataclasses.dataclass(frozen=True)
class SlotMirror:
    """Positions of received slots on each CP rank of the group (windowed layers mirror every rank's slots)."""

    ranks: np.ndarray  # [T] CP rank (in the receiving group)
    slots: np.ndarray  # [T]
    positions: np.ndarray  # [T]


@dataclasses.dataclass(frozen=True)
class TransferOrders:
    sends: tuple[KVSend, ...] = ()
    recvs: tuple[KVRecv, ...] = ()
    mirrors: tuple[SlotMirror, ...] = ()
    wait: bool = False  # block until every pending receive of this rank is in (the group has nothing else to run)
    state_sends: tuple[StateSend, ...] = ()
    state_recvs: tuple[StateRecv, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs or self.mirrors or self.wait or self.state_sends or self.state_recvs)


def layer_rows(windows, positions: np.ndarray, stored: int | None) -> list[np.ndarray | None]:
    """Per layer, the entries of a message's [T] tokens it carries: None for all of them (a full-attention layer,
    or `stored` None), else those at positions >= stored - window (the rows a decode at position >= stored can
    still see, one spare), possibly none. Sender and receiver compute the same lists from the same orders."""
    out = []
    for w in windows:
        if w is None or stored is None:
            out.append(None)
        else:
            out.append(np.flatnonzero(np.asarray(positions) >= stored - w))
    return out


def _layer_slots(slots: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    return slots if keep is None else slots[keep]


def _rows(store, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, W] one layer's stored rows of these slots, K then V channels side by side (MLA: the latent only)."""
    k = store.k[layer].index_select(0, slots)
    if store.widths.values_in_keys:
        return k.contiguous()
    return torch.cat([k, store.v[layer].index_select(0, slots)], dim=-1)


def _write_rows(store, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    dk = store.k.shape[-1]
    store.k[layer].index_copy_(0, slots, rows[..., :dk])
    if not store.widths.values_in_keys:
        store.v[layer].index_copy_(0, slots, rows[..., dk:])
    store.note_written(slots.cpu().numpy())


def row_shape(store, num_tokens: int) -> tuple[int, ...]:
    """[T, Hkv, W] of one layer's message."""
    width = store.k.shape[-1] + (0 if store.widths.values_in_keys else store.v.shape[-1])
    return (num_tokens, store.k.shape[2], width)


def _tag(tid: int, layer: int, num_layers: int) -> int:
    return (tid * num_layers + layer) % _TAG_SPAN


def _state_tag(tid: int, part: int) -> int:
    """A state message's tag (part 0: the states, 1: the conv tails), apart from the K/V messages' tags."""
    return (_TAG_SPAN // 2 + 2 * tid + part) % _TAG_SPAN


def _state_parts(states, slot: int) -> list[torch.Tensor]:
    """[states of every recurrent layer, flat fp32], [conv tails, flat in the compute dtype] of one slot."""
    layers = sorted(states.layers)
    return [torch.cat([states.states[l][slot].reshape(-1) for l in layers]),
            torch.cat([states.tails[l][slot].reshape(-1) for l in layers])]


def _write_state(states, slot: int, parts: list[torch.Tensor]) -> None:
    states.ensure(slot + 1)
    for table, flat in zip((states.states, states.tails), parts):
        at = 0
        for layer in sorted(states.layers):
            dst = table[layer][slot]
            dst.copy_(flat[at:at + dst.numel()].view(dst.shape))
            at += dst.numel()


class _Message:
    """One posted send or receive: its work, its buffer (alive until done) and, for a receive, where it goes."""

    __slots__ = ("work", "buf", "tid", "layer", "slots", "done", "error")

    def __init__(self, work, buf, tid: int, layer: int, slots: torch.Tensor | None = None):
        self.work, self.buf, self.tid, self.layer, self.slots = work, buf, tid, layer, slots
        self.done = threading.Event()
        self.error: str | None = None


class _Waiter:
    """A daemon thread that waits on posted works in order and flags each done (gloo completes point-to-point works
    only inside `wait()`, which releases the GIL: the rank's forwards go on meanwhile)."""

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name="kv-transfer-wait").start()

    def _loop(self) -> None:
        while True:
            m = self.q.get()
            if m is None:  # closed: its rank's transfers were replaced (a new engine on these ranks)
                return
            try:
                m.work.wait()
            except Exception as exc:  # noqa: BLE001 - this message did not arrive: its transfer fails here
                m.error = f"{type(exc).__name__}: {exc}"
            m.done.set()

    def put(self, m: _Message | None) -> None:
        self.q.put(m)


class RankTransfers:
    """A rank's transfers in flight: sends whose copies must outlive the call, receives not yet written."""

    def __init__(self, ctx, runner):
        self.ctx, self.runner, self.store = ctx, runner, runner.store
        self.host = ctx.group is not None and dist.get_backend(ctx.group) == "gloo" and ctx.device.type != "cpu"
        self.sends: list[_Message] = []
        self.recvs: list[_Message] = []
        self.left: dict[int, int] = {}  # transfer id → its messages still expected here
        self.got: dict[int, int] = {}  # transfer id → bytes written here
        self.failed: dict[int, str] = {}  # transfer id → why a message of it failed here
        self.state_parts: dict[tuple[int, int], dict] = {}  # (transfer id, state slot) → its parts in so far
        self._send_wait, self._recv_wait = _Waiter(), _Waiter()

    # ---------------------------------------------------------------- sending
    def keeps(self, orders) -> list[list[np.ndarray | None]]:
        """Per send or receive order, per layer, the entries of its tokens that travel (`layer_rows`): worked out
        once per call, not once per layer posted."""
        windows = [self.runner.windows[l] for l in self.runner.config.attention_layers]  # per KV store layer
        return [layer_rows(windows, o.positions, o.stored) for o in orders]

    def post_sends(self, sends, keeps, layers, figures: dict, inside: bool = False) -> None:
        """Copy and post these sends' messages of these layers (one per send and layer that has rows; `keeps`:
        `self.keeps(sends)`); `inside`: from inside the forward, right after the layer was written."""
        store, n_layers = self.store, self.store.k.shape[0]
        self.sends = [m for m in self.sends if not m.done.is_set()]  # delivered copies are dropped
        for layer in layers:  # layer-major, as the receivers post them (NCCL matches a pair's messages in order)
            for s, keep in zip(sends, keeps):
                slots = _layer_slots(s.slots, keep[layer])
                if not len(slots):
                    continue
                rows = _rows(store, layer, torch.as_tensor(slots, device=self.ctx.device))
                rows = rows.cpu() if self.host else rows
                m = _Message(dist.isend(rows, s.peer, group=self.ctx.group, tag=_tag(s.tid, layer, n_layers)), rows,
                             s.tid, layer)
                self._send_wait.put(m)
                self.sends.append(m)
                nbytes = rows.numel() * rows.element_size()
                figures["sent_bytes"] = figures.get("sent_bytes", 0) + nbytes
                per = figures.setdefault("sends", {}).setdefault(s.tid, {"messages": 0, "in_forward": 0, "bytes": 0})
                per["messages"] += 1
                per["in_forward"] += inside
                per["bytes"] += nbytes

    def post_state_sends(self, sends, figures: dict) -> None:
        """Copy and post these state slots (after the forward that wrote them, when it is this call's)."""
        states = self.runner.states
        for s in sends:
            for part, buf in enumerate(_state_parts(states, s.slot)):
                buf = buf.cpu() if self.host else buf.clone()
                m = _Message(dist.isend(buf, s.peer, group=self.ctx.group, tag=_state_tag(s.tid, part)), buf, s.tid,
                             -1)
                self._send_wait.put(m)
                self.sends.append(m)
                figures["sent_bytes"] = figures.get("sent_bytes", 0) + buf.numel() * buf.element_size()

    # ---------------------------------------------------------------- receiving
    def post_state_recvs(self, recvs) -> None:
        """Post the receives of state slots (one message each for the states and the tails); written by `settle`
        once both are in."""
        states = self.runner.states
        for r in recvs:
            self.left.setdefault(r.tid, 0)
            states.ensure(r.slot + 1)
            like = _state_parts(states, r.slot)
            for part in range(2):
                try:
                    buf = torch.empty_like(like[part], device="cpu" if self.host else self.ctx.device)
                    work = dist.irecv(buf, r.peer, group=self.ctx.group, tag=_state_tag(r.tid, part))
                except Exception as exc:  # noqa: BLE001
                    self.failed[r.tid] = f"{type(exc).__name__}: {exc}"
                    continue
                m = _Message(work, buf, r.tid, -1 - part, torch.tensor([r.slot]))
                self._recv_wait.put(m)
                self.recvs.append(m)
                self.left[r.tid] += 1

    def post_recvs(self, recvs, state_recvs=()) -> None:
        """Post the receives of these orders, in the order their senders post them: each run of orders posted
        before the senders' forwards or inside them, layer by layer, then the state slots sent at the same time."""
        runs = []
        for r in recvs:
            self.left.setdefault(r.tid, 0)
            if runs and runs[-1][0].in_forward == r.in_forward:
                runs[-1].append(r)
            else:
                runs.append([r])
        states = {flag: [r for r in state_recvs if r.in_forward == flag] for flag in (False, True)}
        for run in runs:
            self._post_run(run)
            self.post_state_recvs(states.pop(run[0].in_forward, ()))
        for flag in (False, True):
            self.post_state_recvs(states.pop(flag, ()))

    def _post_run(self, recvs) -> None:
        store, n_layers = self.store, self.store.k.shape[0]
        keeps = self.keeps(recvs)
        for layer in range(n_layers):
            for r, keep in zip(recvs, keeps):
                slots = _layer_slots(r.slots, keep[layer])
                if not len(slots):
                    continue
                try:
                    buf = torch.empty(row_shape(store, len(slots)), dtype=store.k.dtype,
                                      device="cpu" if self.host else self.ctx.device)
                    work = dist.irecv(buf, r.peer, group=self.ctx.group, tag=_tag(r.tid, layer, n_layers))
                except Exception as exc:  # noqa: BLE001 - e.g. no memory for the buffer
                    self.failed[r.tid] = f"{type(exc).__name__}: {exc}"
                    continue
                m = _Message(work, buf, r.tid, layer, torch.as_tensor(slots, device=self.ctx.device))
                self._recv_wait.put(m)
                self.recvs.append(m)
                self.left[r.tid] += 1

    def _state_in(self, m: _Message) -> None:
        """A state message is in: held until its other part is, then the slot is written."""
        key = (m.tid, int(m.slots[0]))
        parts = self.state_parts.setdefault(key, {})
        parts[-1 - m.layer] = m.buf
        self.got[m.tid] = self.got.get(m.tid, 0) + m.buf.numel() * m.buf.element_size()
        if len(parts) == 2:
            del self.state_parts[key]
            try:
                _write_state(self.runner.states, key[1], [parts[0].to(self.ctx.device), parts[1].to(self.ctx.device)])
            except Exception as exc:  # noqa: BLE001 - the state is not here: the transfer fails
                self.failed[m.tid] = f"{type(exc).__name__}: {exc}"

    def settle(self, wait: bool) -> tuple[dict, dict]:
        """Write the receives that are in (all of them first when `wait`); returns ({transfer id: bytes} of the
        transfers whose every message here is in, {transfer id: why} of those that failed here and have no message
        left in flight)."""
        still = []
        for m in self.recvs:
            if wait:
                m.done.wait()
            if not m.done.is_set():
                still.append(m)
                continue
            self.left[m.tid] -= 1
            if m.error is not None:
                self.failed.setdefault(m.tid, m.error)
            elif m.tid not in self.failed and m.layer < 0:  # a state slot's part: written once both are in
                self._state_in(m)
            elif m.tid not in self.failed:  # rows of a transfer that failed here are never written
                try:
                    _write_rows(self.store, m.layer, m.slots, m.buf.to(self.ctx.device))
                    self.got[m.tid] = self.got.get(m.tid, 0) + m.buf.numel() * m.buf.element_size()
                except Exception as exc:  # noqa: BLE001 - the rows of this transfer are not (all) here: never used
                    self.failed[m.tid] = f"{type(exc).__name__}: {exc}"
        self.recvs = still
        done, failed = {}, {}
        for tid in [t for t, n in self.left.items() if n == 0]:
            del self.left[tid]
            if tid in self.failed:
                failed[tid] = self.failed.pop(tid)
            else:
                done[tid] = self.got.get(tid, 0)
            self.got.pop(tid, None)
        return done, failed


def apply_orders(ctx, runner, orders: TransferOrders) -> dict:
    """Before a call's forward: post this rank's sends that do not ride the forward, post its receives (not waited
    for), mirror slot positions. Returns the call's transfer figures so far."""
    rt = transfers_of(ctx, runner)
    figures: dict = {}
    early = [s for s in orders.sends if not s.in_forward]
    if early:
        rt.post_sends(early, rt.keeps(early), range(runner.store.k.shape[0]), figures)
    rt.post_state_sends([s for s in orders.state_sends if not s.in_forward], figures)
    rt.post_recvs(orders.recvs, orders.state_recvs)
    if runner.slot_positions is not None:
        for m in orders.mirrors:
            runner.slot_positions.pos[m.ranks, m.slots] = m.positions
    return figures


def transfers_of(ctx, runner) -> RankTransfers:
    """This rank's transfers in flight, for its current model runner (made at its first call)."""
    rt = ctx.state.get("pd_transfers")
    if rt is None or rt.runner is not runner:
        if rt is not None:  # the waiters of an earlier engine's runner end once their works are done
            rt._send_wait.put(None)
            rt._recv_wait.put(None)
        rt = ctx.state["pd_transfers"] = RankTransfers(ctx, runner)
    return rt
