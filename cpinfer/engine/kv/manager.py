"""The driver's KV manager: the one owner of every CP rank's cache blocks (paper §3.3, persistent KV).

Cached tokens form a radix tree of token segments shared by every request that extends them; each token of a
segment lives on one CP rank, in a slot of a block of that rank. The manager decides the rank and slot of every new
token — a sequence's new tokens on one rank or 2N-sharded over all (§3.5.1) as the placement policy chooses, decode
tokens on the rank that holds the sequence or round-robin (§3.6) — and the ranks only write where told.
Splitting a segment relabels metadata here; K/V never move. Unreferenced leaves are evicted least recently used —
down to the host and disk tiers when there are some (tiers.py), from where a later match restores them.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from cpinfer.cp.sharding import chunk_ranks
from cpinfer.engine.kv.state_store import StateSlots
from cpinfer.engine.kv.tiers import TIERS, DiskEntry, DiskRef, Tiers
from cpinfer.engine.kv.placement import SPREAD, UNPLACED, Decision, ForwardLoad, Placer, Work
from cpinfer.utils import ceil_div

BLOCK = 64  # slots per allocation block


def request_tokens_held(num_ranks: int, capacity_tokens_per_rank: int) -> int:
    """The longest request (prompt + output tokens) that `KVManager.check_room` admits on an empty cache of
    `num_ranks` ranks of this capacity: the largest T with `blocks_for_request(T)` <= the blocks of a rank (0: none).
    It is what a max_model_len can be at most for every admitted request to fit."""
    blocks = capacity_tokens_per_rank // BLOCK
    return max(0, num_ranks * ((blocks - 1) * BLOCK - 2 * num_ranks))


class GrowArray:
    """An int64 array with amortised O(1) appends (decode appends one token at a time to long segments)."""

    def __init__(self, values=()):
        values = np.asarray(values, dtype=np.int64)
        self._buf = np.empty(max(16, 2 * len(values)), dtype=np.int64)
        self._buf[:len(values)] = values
        self.n = len(values)

    def extend(self, values) -> None:
        values = np.asarray(values, dtype=np.int64).reshape(-1)
        if self.n + len(values) > len(self._buf):
            buf = np.empty(2 * (self.n + len(values)), dtype=np.int64)
            buf[:self.n] = self._buf[:self.n]
            self._buf = buf
        self._buf[self.n:self.n + len(values)] = values
        self.n += len(values)

    def truncate(self, n: int) -> None:
        """Keep the first n values."""
        self.n = min(self.n, n)

    @property
    def view(self) -> np.ndarray:
        return self._buf[:self.n]

    def __len__(self) -> int:
        return self.n


class RankBlocks:
    """Blocks of one rank: reference counted (after a split, a block can hold tokens of two segments)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.num_free = num_blocks

    def alloc(self, prefer: int = -1) -> int:
        """A free block, `prefer` when it is free (keeps a segment's slots contiguous), else the lowest."""
        if self.num_free == 0:
            raise RuntimeError("no free block (the caller must check blocks_needed first; this is a bug)")
        b = prefer if 0 <= prefer < self.num_blocks and self.ref[prefer] == 0 else int(np.argmin(self.ref))
        self.ref[b] = 1
        self.num_free -= 1
        return b

    def incref(self, blocks: np.ndarray) -> None:
        self.ref[blocks] += 1

    def decref(self, blocks: np.ndarray) -> None:
        self.ref[blocks] -= 1
        freed = int(np.count_nonzero(self.ref[blocks] == 0))
        self.num_free += freed


class Node:
    """A segment of the prefix tree: tokens at positions pos0 ..., each stored on rank[i] in slot[i] while
    `on_device`; `host` / `disk`: its copies in the lower tiers (tiers.py). Off the device, rank[i] is where a
    restore puts token i (the rank whose host pool holds it) and `count` counts those; the slots mean nothing."""

    _ids = itertools.count(1)

    def __init__(self, parent: "Node | None", pos0: int, num_ranks: int, owner: str | None = None,
                 tokens=(), rank=(), slot=()):
        self.id = next(Node._ids)
        self.parent = parent
        self.children: list[Node] = []
        self.pos0 = pos0
        self.tokens, self.rank, self.slot = GrowArray(tokens), GrowArray(rank), GrowArray(slot)
        self.count = np.bincount(np.asarray(rank, dtype=np.int64), minlength=num_ranks)  # tokens per rank
        self.ref = 0  # requests whose path contains this node
        self.owner = owner  # the running request that appends to this (leaf) node
        self.last_access = time.monotonic()
        self.tail = [(-1, BLOCK)] * num_ranks  # per rank: (last block, slots used in it) for appending
        self.tail_held = [False] * num_ranks  # per rank: this node holds tokens in its tail block (counted in ref)
        self.on_device = True
        self.host: np.ndarray | None = None  # [len] host-pool slot of each token on its rank
        self.disk: DiskRef | None = None
        self.unverified = 0  # trailing drafted tokens of a private leaf awaiting verification: never matched
        self.snapshots: dict[int, int] = {}  # hybrid models: position -> state slot of the state after the tokens
        # before that position (state_store.py); a match is usable up to the last snapshot inside it
        self.state_host: dict[int, int] = {}  # ... and position -> host state slot of its copies in the host tier

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_hole(self) -> bool:
        """A segment whose K/V are nowhere (its lower copy was lost) kept for the copies below it: a request that
        reaches it recomputes its tokens, which then take its place (`KVManager.fill_hole`)."""
        return not self.on_device and self.host is None and self.disk is None

    def blocks(self, num_blocks: int) -> np.ndarray:
        """Distinct (rank * num_blocks + block) keys of the blocks holding this node's tokens (none off device)."""
        if not self.on_device:
            return np.zeros(0, dtype=np.int64)
        return np.unique(self.rank.view * num_blocks + self.slot.view // BLOCK)


@dataclasses.dataclass
class SeqKV:
    """A running request's view of the cache: its private leaf and the slot runs of everything it can see."""

    request_id: str
    leaf: Node
    num_stored: int  # tokens of the path (positions 0 .. num_stored-1) whose K/V are stored or being written
    runs: list[list[list[int]]]  # per rank: [start, end) slot runs of those tokens
    next_rank: int = 0  # decode round-robin
    per_rank: np.ndarray | None = None  # [N] tokens of the path on each rank
    home: int = UNPLACED  # the one rank holding the whole path, UNPLACED (no tokens yet) or SPREAD
    promised: int = 0  # decode tokens it may still write on its home, counted in the load of rank `promised_on`
    promised_on: int = -1
    hits: dict | None = None  # tier → tokens of the matched prefix found there (device, or restored from host/disk)
    fill_until: int = -1  # the matched path stops at a hole ending here: compute up to it first (then re-attach)
    fill_hole: int = -1  # that hole's node id
    state_in: int = -1  # hybrid models: the state slot its next forward starts from (-1: zero state) ...
    state_out: int = -1  # ... and its own live slot, where every forward leaves its state (state_store.py)

    def runs_array(self, rank: int) -> np.ndarray:
        """[R, 2] int64 snapshot of the runs on one rank."""
        return np.asarray(self.runs[rank], dtype=np.int64).reshape(-1, 2)

    def add(self, counts: np.ndarray) -> None:
        """Account new tokens ([N] per rank) and update the home."""
        self.per_rank += counts
        if self.home != SPREAD:
            held = np.flatnonzero(self.per_rank)
            self.home = UNPLACED if len(held) == 0 else int(held[0]) if len(held) == 1 else SPREAD


@dataclasses.dataclass(frozen=True)
class Placement:
    ranks: np.ndarray  # [T] rank of each new token
    slots: np.ndarray  # [T] its slot on that rank
    spread: bool  # the sequence's keys (cached and new) sit on more than one rank: it takes part in the ring
    decision: Decision | None = None  # how the span was chosen (None: decode on its rank / round-robin)


def _add_runs(runs: list[list[int]], slots: np.ndarray) -> None:
    """Append slots (in order) to a run list, extending the last run when contiguous."""
    if len(slots) == 0:
        return
    brk = np.nonzero(np.diff(slots) != 1)[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(slots)]))
    for a, e in zip(starts.tolist(), ends.tolist()):
        s0, s1 = int(slots[a]), int(slots[e - 1]) + 1
        if runs and runs[-1][1] == s0:
            runs[-1][1] = s1
        else:
            runs.append([s0, s1])


def _drop_runs(runs: list[list[int]], k: int) -> None:
    """Remove the last k slots from a run list (the inverse of _add_runs for its last appends)."""
    while k > 0:
        s0, s1 = runs[-1]
        if s1 - s0 <= k:
            runs.pop()
            k -= s1 - s0
        else:
            runs[-1][1] = s1 - k
            k = 0


class KVManager:
    """Owner of every rank's blocks and of the prefix tree. Pure bookkeeping: no tensors, no processes."""

    def __init__(self, num_ranks: int, capacity_tokens_per_rank: int, enable_prefix_caching: bool = True,
                 placer: Placer | None = None, tiers=None, preferred_rank: int | None = None):
        """preferred_rank: the rank a request kept whole goes to when no rank has local work in flight and that
        leaves it less than the request's own tokens ahead of the least-loaded rank (rank 0 when it runs in the
        driver process: a forward only it works in needs no message to another process); None: always the
        least-loaded rank."""
        self.n = num_ranks
        if preferred_rank is not None and not 0 <= preferred_rank < num_ranks:
            raise ValueError(f"preferred_rank must be in [0, {num_ranks}), got {preferred_rank}")
        self.preferred_rank = preferred_rank
        self.placer = placer or Placer("shard", num_ranks)  # who decides each sequence's span
        self.num_blocks = capacity_tokens_per_rank // BLOCK
        if self.num_blocks < 1:
            raise ValueError(f"KV capacity per rank must be at least {BLOCK} tokens, got {capacity_tokens_per_rank}")
        self.ranks = [RankBlocks(self.num_blocks) for _ in range(num_ranks)]
        self.root = Node(None, 0, num_ranks)
        self.root.ref = 1  # never evicted
        self.enable_prefix_caching = enable_prefix_caching
        self.used = np.zeros(num_ranks, dtype=np.int64)  # tokens stored per rank
        self.promised = np.zeros(num_ranks, dtype=np.int64)  # decode tokens local sequences may still add per rank
        self.nodes: dict[int, Node] = {}
        self.prefix_queries = 0  # prompt tokens looked up / found in the cache (the scheduler counts them)
        self.prefix_hits = 0
        self.tier_hits = dict.fromkeys(TIERS, 0)  # of the hits, where their K/V were when matched
        # host / disk tiers below the device (a TierConfig), or None: evicted segments are dropped
        self.tiers = Tiers(tiers, num_ranks, self._lost) if tiers is not None and tiers.enabled else None
        self.states: StateSlots | None = None  # hybrid models: the state slots (`enable_states`)
        self.state_interval = 0  # ... and a snapshot every this many tokens of a sequence (0: at turn ends only)
        self._state_pins: dict[int, int] = {}  # snapshot slot -> requests attached to it that have not read it yet
        self._state_fresh: set[int] = set()  # snapshot slots this forward writes (state_copy): not evicted before
        self.begin_forward()

    def enable_states(self, slots: StateSlots, interval: int = 0) -> None:
        """Hybrid (linear-attention) models: every request holds a live state slot, finished ones leave snapshots in
        the tree (and running ones one every `interval` tokens), and a prefix match is cut back to the last
        snapshot inside it."""
        self.states, self.state_interval = slots, interval

    def interval_snapshot(self, seq: SeqKV, start: int, end: int) -> int:
        """A forward of seq's tokens start .. end-1 that passes a multiple of the snapshot interval: a state slot
        for the state at `end`, kept as a snapshot of its leaf (the ranks copy the state there after the forward);
        -1 when no snapshot is due or no slot is free."""
        iv = self.state_interval
        if self.states is None or not iv or not self.enable_prefix_caching or end // iv == start // iv:
            return -1
        leaf = seq.leaf
        if end != leaf.pos0 + len(leaf) or end in leaf.snapshots:
            return -1
        try:
            slot = self._state_slot()
        except RuntimeError:
            return -1
        leaf.snapshots[end] = slot
        self._state_fresh.add(slot)
        return slot

    def consume_state_in(self, seq: SeqKV) -> None:
        """seq's next forward reads its state_in: every later one reads its live slot (the snapshot is free to go)."""
        self._unpin(seq)
        seq.state_in = seq.state_out

    def drop_live_state(self, seq: SeqKV) -> None:
        """seq's tokens come from elsewhere without their recurrent state (P/D): its live slot goes back, so that
        releasing it leaves no snapshot at its end."""
        if self.states is not None and seq.state_out >= 0:
            self._unpin(seq)
            self.states.free(seq.state_out)
            seq.state_out = seq.state_in = -1

    def _unpin(self, seq: SeqKV) -> None:
        slot = seq.state_in
        if slot >= 0 and slot != seq.state_out and slot in self._state_pins:
            self._state_pins[slot] -= 1
            if not self._state_pins[slot]:
                del self._state_pins[slot]

    # ------------------------------------------------------------------ capacity
    @property
    def capacity_per_rank(self) -> int:
        return self.num_blocks * BLOCK

    def free_blocks(self) -> np.ndarray:
        return np.asarray([r.num_free for r in self.ranks], dtype=np.int64)

    def blocks_for_request(self, num_tokens: int) -> int:
        """Blocks per rank a request of num_tokens (prompt + output) needs at most on an empty cache."""
        return ceil_div(ceil_div(num_tokens, self.n) + 2 * self.n, BLOCK) + 1

    @property
    def request_tokens_held(self) -> int:
        """The longest request (prompt + output) this cache can hold (`check_room` admits it when empty)."""
        return request_tokens_held(self.n, self.capacity_per_rank)

    def check_room(self, prompt_tokens: int, max_tokens: int, where: str = "", size: str = "") -> None:
        """ValueError when a request of prompt_tokens + max_tokens could not fit even in an empty cache; `where`
        names the ranks' group in the message (e.g. " on a decode group"), `size` the option setting its CP size
        ("pd_decode_cp=2"; default "CP=N", raised through context_parallel_size)."""
        need = self.blocks_for_request(prompt_tokens + max_tokens)
        if need > self.num_blocks:
            name = size.split("=")[0] if size else "context_parallel_size"
            raise ValueError(f"request needs about {need * BLOCK} KV tokens per rank{where} (prompt {prompt_tokens}, "
                             f"max_tokens {max_tokens}, {size or f'CP={self.n}'}) but each rank holds "
                             f"{self.capacity_per_rank}; raise max_kv_tokens_per_rank or {name}, or shorten the "
                             "request")

    # ------------------------------------------------------------------ prefix matching
    def match(self, tokens: np.ndarray, limit: int, through_holes: bool = False) -> tuple[Node, int, int]:
        """Longest cached prefix of tokens[:limit]: (node, tokens matched inside it, total matched). A hole (K/V
        nowhere) ends a match unless `through_holes` (adopting disk entries below it)."""
        node, done = self.root, 0
        while done < limit:
            best, best_len = None, 0
            for child in node.children:
                if len(child) == 0 or (child.is_hole and not through_holes):
                    continue
                m = min(len(child) - child.unverified, limit - done)  # drafts being verified are no prefix
                neq = np.nonzero(child.tokens.view[:m] != tokens[done:done + m])[0]
                common = int(neq[0]) if len(neq) else m
                if common > best_len or (common == best_len and common and child.on_device and not best.on_device):
                    best, best_len = child, common
            if best is None:
                break
            done += best_len
            if best_len < len(best):
                return best, best_len, done
            node = best
        return node, len(node), done

    def attach(self, request_id: str, tokens: np.ndarray, use_cache: bool = True) -> SeqKV:
        """Start a request: reuse the longest cached prefix of tokens[:-1], lock its path, open a private leaf."""
        limit = len(tokens) - 1 if (use_cache and self.enable_prefix_caching) else 0
        node, inside, matched = self.match(tokens, limit)
        if self.states is not None:  # a state exists only where a snapshot was kept: match up to the last one
            cut = self._last_snapshot(node, matched)
            if cut < matched:
                node, inside, matched = self.match(tokens, cut)
        if node is not self.root and (inside < len(node) or node.owner is not None):
            node = self._split(node, inside)  # the matched part becomes its own segment
        path = []
        p = node
        while p is not self.root:
            path.append(p)
            p = p.parent
        path.reverse()
        restored = [p for p in path if not p.on_device]
        usable, hits = self._restore(path)  # segments below the device come back into free slots
        state_in = -1
        if self.states is not None and usable == len(path) and matched:  # the snapshot it continues from
            state_in = self._state_at(node, matched)
        if self.states is not None and usable and (usable < len(path) or state_in is None):  # the snapshot lies
            for p in path[:usable]:  # past the usable part, or has no copy left: nothing of the match is usable
                p.ref -= 1  # (the restored segments stay cached)
            hits, usable, state_in = dict.fromkeys(TIERS, 0), 0, -1
        if usable < len(path):  # no room to restore all of it: the rest is recomputed
            path = path[:usable]
            node = path[-1] if path else self.root
            matched = node.pos0 + len(node) if path else 0
        leaf = Node(node, matched, self.n, owner=request_id)
        if restored and path and path[-1] is restored[-1]:
            self._hand_tail(node, leaf)  # the new tokens continue in the restored path's last blocks
        node.children.append(leaf)
        self.nodes[leaf.id] = leaf
        runs: list[list[list[int]]] = [[] for _ in range(self.n)]
        now = time.monotonic()
        per_rank = np.zeros(self.n, dtype=np.int64)
        for p in path:
            p.last_access = now
            per_rank += p.count
            for r in range(self.n):
                _add_runs(runs[r], p.slot.view[p.rank.view == r])
        leaf.ref = 1
        seq = SeqKV(request_id, leaf, matched, runs, next_rank=int(np.argmin(self.used)),
                    per_rank=np.zeros(self.n, dtype=np.int64), hits=hits)
        seq.add(per_rank)
        hole = self._hole_after(node, tokens, matched, limit) if usable == len(path) else None
        if hole is not None:
            seq.fill_until, seq.fill_hole = matched + len(hole), hole.id
        if self.states is not None:
            seq.state_in, seq.state_out = state_in, self._state_slot()
            if seq.state_in >= 0:  # read by its first forward: not evicted before
                self._state_pins[seq.state_in] = self._state_pins.get(seq.state_in, 0) + 1
        return seq

    def _last_snapshot(self, node: Node, matched: int) -> int:
        """The position of the last state snapshot at or before `matched` on the path ending in node, on the device
        or in a lower tier (0: none, the match is unusable for the recurrent layers)."""
        p = node
        while p is not None and p is not self.root:
            held = list(p.snapshots) + (self.tiers.state_positions(p) if self.tiers is not None else [])
            inside = [pos for pos in held if pos <= matched]
            if inside:
                return max(inside)
            p = p.parent
        return 0

    def _state_at(self, node: Node, pos: int) -> int | None:
        """The device state slot of node's snapshot at pos (its last position), restored from a lower tier into a
        new slot when only a copy there holds it; None when no copy is left (restoring the path's K/V made room by
        letting it go)."""
        slot = node.snapshots.get(pos)
        if slot is not None:
            return slot
        slot = self._state_slot()
        if self.tiers is None or self.tiers.restore_state(node, pos, slot) is None:
            self.states.free(slot)
            return None
        node.snapshots[pos] = slot
        self._state_fresh.add(slot)
        return slot

    def _state_slot(self) -> int:
        """A free state slot, evicting the least recently used snapshot if needed (unreferenced segments' first;
        never one a request attached to has yet to read, nor one this forward writes)."""
        slot = self.states.alloc()
        while slot is None:
            held = [(nd.ref > 0 or nd.owner is not None, nd.last_access, pos, nd)
                    for nd in self.nodes.values() for pos, sl in nd.snapshots.items()
                    if sl not in self._state_pins and sl not in self._state_fresh]
            if not held:
                raise RuntimeError(f"no free state slot: all {self.states.max_slots} are live or about to be read "
                                   "(this is a bug: the engine keeps 2 x max_num_seqs + 64)")
            _, _, pos, victim = min(held, key=lambda x: x[:3])
            self.states.free(victim.snapshots.pop(pos))
            slot = self.states.alloc()
        return slot

    def _drop_snapshots(self, node: Node) -> None:
        if self.states is not None:
            for slot in node.snapshots.values():
                self.states.free(slot)
        node.snapshots = {}

    @property
    def state_snapshots(self) -> int:
        """State snapshots kept in the tree (hybrid models)."""
        return sum(len(nd.snapshots) for nd in self.nodes.values())

    def _hole_after(self, node: Node, tokens: np.ndarray, matched: int, limit: int) -> Node | None:
        """A hole right below node whose tokens the request's next ones are, with more of the request after it:
        computing it first (it then replaces the hole) makes the copies below it reachable again."""
        for child in node.children:
            end = matched + len(child)
            if child.is_hole and end < limit and np.array_equal(child.tokens.view, tokens[matched:end]):
                return child
        return None

    def fill_hole(self, seq: SeqKV) -> None:
        """seq computed exactly a hole's tokens in its leaf (num_stored == fill_until): release it keeping them
        cached, and let the leaf take the hole's place (the segments below the hole hang from it now). The
        request then attaches again and matches on below."""
        leaf, hole = seq.leaf, self.nodes.get(seq.fill_hole)
        self.release(seq, keep=True)
        if (hole is None or not hole.is_hole or hole.parent is not leaf.parent or leaf.parent is None
                or not np.array_equal(hole.tokens.view, leaf.tokens.view)):
            return  # someone else filled it first: this copy stays a plain cached segment
        for c in hole.children:
            c.parent = leaf
            leaf.children.append(c)
        hole.children = []
        hole.parent.children.remove(hole)
        del self.nodes[hole.id]
        hole.parent = None

    def _restore(self, path: list[Node]) -> tuple[int, dict]:
        """Lock the path (root first) and bring its segments that are off the device back into free slots on their
        ranks, evicting other unreferenced segments for room. Returns how many segments of the path are usable
        (the rest are unlocked again) and the matched tokens per tier."""
        hits = dict.fromkeys(TIERS, 0)
        for p in path:
            p.ref += 1
        prev = None  # the segment restored just before p: p's tokens continue in its last blocks
        for i, p in enumerate(path):
            if p.on_device:
                hits["device"] += len(p)
                prev = None
                continue
            p.tail, p.tail_held = [(-1, BLOCK)] * self.n, [False] * self.n
            if prev is not None:
                self._hand_tail(prev, p)
            if not self.make_room(self._blocks_needed(p, p.count)):
                for q in path[i:]:
                    q.ref -= 1
                return i, hits
            slots = np.empty(len(p), dtype=np.int64)
            for r in np.flatnonzero(p.count).tolist():
                idx = np.flatnonzero(p.rank.view == r)
                slots[idx] = self._alloc_slots(p, r, len(idx))
            p.slot, p.on_device = GrowArray(slots), True
            self.used += p.count
            hits[self.tiers.restore(p)] += len(p)
            prev = p
        return len(path), hits

    @staticmethod
    def _hand_tail(giver: Node, taker: Node) -> None:
        """taker (a new or restored segment right below giver, which will not append again) goes on filling
        giver's last block on each rank, so that a path restored segment by segment takes the blocks it took when
        it was written, not one more per segment and rank. giver keeps its tokens there (and its block refs)."""
        taker.tail, taker.tail_held = list(giver.tail), [False] * len(giver.tail)
        giver.tail = [(-1, BLOCK)] * len(giver.tail)

    def _split(self, node: Node, m: int) -> Node:
        """Cut node after its first m tokens; the new parent segment P holds them (K/V stay where they are)."""
        pv = node.parent
        p = Node(pv, node.pos0, self.n, tokens=node.tokens.view[:m], rank=node.rank.view[:m],
                 slot=node.slot.view[:m])
        p.ref, p.last_access, p.on_device = node.ref, node.last_access, node.on_device
        if self.tiers is not None:
            self.tiers.split(p, node, m)
        end = node.pos0 + m  # state snapshots up to the cut belong to the new parent segment
        p.snapshots = {pos: sl for pos, sl in node.snapshots.items() if pos <= end}
        node.snapshots = {pos: sl for pos, sl in node.snapshots.items() if pos > end}
        rest = [a.view[m:].copy() for a in (node.tokens, node.rank, node.slot)]
        node.tokens, node.rank, node.slot = (GrowArray(a) for a in rest)
        node.count = node.count - p.count
        node.pos0 += m
        for r in range(self.n):  # the tail block may now hold only P's tokens: the next append must count it
            block = node.tail[r][0]
            node.tail_held[r] = bool(np.any(node.slot.view[node.rank.view == r] // BLOCK == block))
        pv.children[pv.children.index(node)] = p
        p.children.append(node)
        node.parent = p
        self.nodes[p.id] = p
        if not node.on_device:
            return p
        shared = np.intersect1d(p.blocks(self.num_blocks), node.blocks(self.num_blocks))
        for key in shared.tolist():  # a block now holds tokens of both segments
            self.ranks[key // self.num_blocks].incref(np.asarray([key % self.num_blocks]))
        return p

    # ------------------------------------------------------------------ placing new tokens
    def begin_forward(self, floor_s=None) -> None:
        """A new forward: no tokens placed yet. floor_s: a callable giving the forward's predicted total compute per
        rank (its work spread evenly), asked only when a placement has to be decided."""
        self._fwd_tokens = np.zeros(self.n, dtype=np.int64)
        self._fwd_items: list[tuple[int, int, int, int]] = []  # (rank or SPREAD, T, P, P on the busiest rank)
        self._fwd_load = ForwardLoad(np.zeros(self.n))
        self._fwd_costed = 0  # items already in _fwd_load (costs are predicted only when a decision needs them)
        self._floor = floor_s
        self._state_fresh = set()

    def forward_load(self) -> ForwardLoad:
        """This forward's predicted compute per rank from what was placed so far (the placement's view)."""
        load = self._fwd_load
        for where, t, p, p_max in self._fwd_items[self._fwd_costed:]:
            if where == SPREAD:
                load.compute_s += self.placer.cost(t, p, self.n, p_max).compute_s
                load.ring = True
            else:
                load.compute_s[where] += self.placer.cost(t, p).compute_s
        self._fwd_costed = len(self._fwd_items)
        if self._floor is not None:
            load.floor_s = float(self._floor() if callable(self._floor) else self._floor)
            self._floor = None
        return load

    def _load_order(self, slack: int = 0) -> list[int]:
        """Ranks for a local placement, least loaded first: KV tokens stored, plus the decode tokens the local
        sequences there may still add, plus this forward's new tokens (they cost compute now). When no local work
        is in flight (nothing promised, nothing else placed in this forward), the preferred rank comes first while
        its load is less than `slack` (the request's own tokens) above the least: a lone request then decodes
        there, and per-rank usage stays within about one request of balanced."""
        load = self.used + self.promised + self._fwd_tokens
        order = sorted(range(self.n), key=lambda r: (load[r], r))
        first = self.preferred_rank
        idle = not self.promised.any() and not self._fwd_tokens.any()
        if first is not None and idle and order[0] != first and load[first] - load[order[0]] < slack:
            order.remove(first)
            order.insert(0, first)
        return order

    def _promise(self, seq: SeqKV, tokens: int) -> None:
        """Record that seq may still write `tokens` decode tokens on its home (none once it spreads or leaves)."""
        if seq.promised:
            self.promised[seq.promised_on] -= seq.promised
        seq.promised, seq.promised_on = (tokens, seq.home) if tokens and seq.home >= 0 else (0, -1)
        if seq.promised:
            self.promised[seq.home] += tokens

    def _rank_order(self, leaf: Node) -> list[int]:
        return sorted(range(self.n), key=lambda r: (leaf.count[r], self.used[r], r))

    def _blocks_needed(self, leaf: Node, per_rank: np.ndarray) -> np.ndarray:
        need = np.zeros(self.n, dtype=np.int64)
        for r in range(self.n):
            room = BLOCK - leaf.tail[r][1]
            need[r] = ceil_div(max(0, int(per_rank[r]) - room), BLOCK)
        return need

    def _spread_ranks(self, seq: SeqKV, num_tokens: int, decode: bool) -> np.ndarray:
        """2N-sharded (prefill) or round-robin (one decode token) over all ranks."""
        if decode and num_tokens == 1:
            order = sorted(range(self.n), key=lambda r: (seq.leaf.count[r], (r - seq.next_rank) % self.n))
            return np.asarray([order[0]], dtype=np.int64)
        return chunk_ranks(num_tokens, self.n, self._rank_order(seq.leaf))

    def _fits(self, seq: SeqKV, ranks: np.ndarray) -> bool:
        """Room (evicting least recently used cached segments if needed) for tokens on these ranks."""
        return self.make_room(self._blocks_needed(seq.leaf, np.bincount(ranks, minlength=self.n)))

    def _choose(self, seq: SeqKV, work: Work, decode: bool) -> tuple[np.ndarray, Decision | None] | None:
        """The ranks of the new tokens, and the decision when one was made; None when they fit nowhere."""
        t, home, mode = work.new, seq.home, self.placer.mode
        if self.n == 1:
            ranks = np.zeros(t, dtype=np.int64)
            return (ranks, None) if self._fits(seq, ranks) else None
        if decode and t == 1 and home >= 0 and mode != "shard":  # stays with its keys unless that rank is full
            ranks = np.full(1, home, dtype=np.int64)
            return (ranks, None) if self._fits(seq, ranks) else self._spill(seq, home)
        if home == SPREAD or mode == "shard" or (decode and t == 1):  # keys span ranks already, or forced
            ranks = self._spread_ranks(seq, t, decode)
            decision = None if home == SPREAD or decode else Decision(True, -1, "forced")
            return (ranks, decision) if self._fits(seq, ranks) else None
        order = [home] if home >= 0 else self._load_order(t + work.later + work.decode)
        candidates = [r for r in order if self._room_for(r, t, seq.leaf)]
        if candidates:
            load = self.forward_load() if self.placer.needs_costs else None
            decision = self.placer.decide(work, home, candidates[0], load)
            ranks = self._spread_ranks(seq, t, decode) if decision.spread else \
                np.full(t, decision.rank, dtype=np.int64)
            if self._fits(seq, ranks):
                return ranks, decision
        ranks = self._spread_ranks(seq, t, decode)  # no single rank can take them: spread, whatever the policy
        return (ranks, Decision(True, -1, "capacity")) if self._fits(seq, ranks) else None

    def _room_for(self, r: int, t: int, leaf: Node) -> bool:
        """Whether rank r can hold t more tokens of this leaf after evicting every unreferenced cached segment."""
        need = ceil_div(max(0, t - (BLOCK - leaf.tail[r][1])), BLOCK)
        return self.ranks[r].num_free >= need or self.ranks[r].num_free + self._evictable_blocks(r) >= need

    def _evictable_blocks(self, r: int) -> int:
        """Upper bound on the blocks of rank r that eviction could free: every unreferenced segment's (a descendant
        of an unreferenced segment is unreferenced too, so leaf after leaf all of them can go)."""
        return sum(ceil_div(int(nd.count[r]), BLOCK) + 1 for nd in self.nodes.values()
                   if nd.on_device and nd.count[r] and nd.ref == 0 and nd.owner is None)

    def _spill(self, seq: SeqKV, home: int):
        """A local sequence's decode token when its rank is full: the least-loaded rank with room takes it."""
        for r in self._load_order():
            ranks = np.full(1, r, dtype=np.int64)
            if r != home and self._fits(seq, ranks):
                return ranks, Decision(True, -1, "capacity")
        return None

    def reserve(self, seq: SeqKV, tokens: np.ndarray, decode: bool = False, decode_left: int = 0,
                later: int = 0, verify: int = 0) -> Placement | None:
        """Place tokens (appended to seq's leaf at positions num_stored ...), evicting LRU cached segments if needed.
        decode_left: tokens the request may still generate; later: prompt tokens left for later chunks (both only
        inform the placement). verify: the last `verify` tokens are drafts (speculative decoding, with decode): all
        the tokens go to the one rank plain decode would pick, and the drafts are never matched as a prefix until
        `truncate` settles them. Returns None when even after eviction the blocks are not there (the scheduler then
        preempts)."""
        work = Work(len(tokens), seq.num_stored, later, decode_left)
        p_max = int(seq.per_rank.max())
        chosen = self._choose_verify(seq, len(tokens)) if verify else self._choose(seq, work, decode)
        if chosen is None:
            return None
        ranks, decision = chosen
        leaf = seq.leaf
        slots = np.empty(len(tokens), dtype=np.int64)
        for r in range(self.n):
            idx = np.nonzero(ranks == r)[0]
            if len(idx):
                slots[idx] = self._alloc_slots(leaf, r, len(idx))
                _add_runs(seq.runs[r], slots[idx])
        leaf.tokens.extend(tokens)
        leaf.rank.extend(ranks)
        leaf.slot.extend(slots)
        counts = np.bincount(ranks, minlength=self.n)
        leaf.count += counts
        self.used += counts
        seq.add(counts)
        self._promise(seq, decode_left)
        seq.num_stored += len(tokens)
        self._fwd_tokens += counts
        self._fwd_items.append((seq.home if seq.home >= 0 else SPREAD, len(tokens), work.cached, p_max))
        if decode:
            seq.next_rank = (int(ranks[-1]) + 1) % self.n
        leaf.unverified = verify
        leaf.last_access = time.monotonic()
        return Placement(ranks, slots, seq.home == SPREAD, decision)

    def verify_rank(self, seq: SeqKV) -> int:
        """The rank a verify sequence's tokens go to when it has room there (the first choice of `_choose_verify`):
        a local sequence's home, a spread one's next round-robin rank (as its decode token). A draft model keeps its
        proposals' q rows on this rank."""
        if self.n == 1:
            return 0
        if seq.home >= 0 and self.placer.mode != "shard":
            return int(seq.home)
        return int(self._spread_ranks(seq, 1, True)[0])

    def room_for(self, rank: int, tokens: int, seq: SeqKV) -> bool:
        """Whether `rank` can take `tokens` more of seq's tokens (evicting unreferenced cached segments if needed)."""
        return self._room_for(rank, tokens, seq.leaf)

    def _choose_verify(self, seq: SeqKV, t: int) -> tuple[np.ndarray, None] | None:
        """A verify sequence's t tokens, all on one rank: `verify_rank` (else the least-loaded rank with room: it
        spreads, as a plain decode spill)."""
        first = self.verify_rank(seq)
        for r in [first] + [r for r in self._load_order() if r != first]:
            ranks = np.full(t, r, dtype=np.int64)
            if self._fits(seq, ranks):
                return ranks, None
        return None

    def truncate(self, seq: SeqKV, num_tokens: int) -> None:
        """Keep only the first num_tokens tokens of seq's path: the rejected tail of a verify step leaves its private
        leaf (never a shared segment: drafts are not matched). Blocks left without a token of the leaf are freed,
        the leaf's append point on each rank goes back to the first dropped slot, and the slot runs, per-rank counts
        and usage follow."""
        leaf = seq.leaf
        drop = seq.num_stored - num_tokens
        if drop <= 0:
            leaf.unverified = 0
            return
        keep = len(leaf) - drop
        if keep < 0 or leaf.children or leaf.owner is None:
            raise RuntimeError(f"truncate: {drop} tokens are not all in the private leaf of {seq.request_id} "
                               "(this is a bug)")
        ranks, slots = leaf.rank.view, leaf.slot.view
        gone_r, gone_s = ranks[keep:], slots[keep:]
        counts = np.bincount(gone_r, minlength=self.n)
        for r in np.flatnonzero(counts).tolist():
            mine = gone_s[gone_r == r]  # in allocation order
            first = int(mine[0])
            kept_r = np.flatnonzero(ranks[:keep] == r)
            shares = len(kept_r) > 0 and int(slots[kept_r[-1]]) // BLOCK == first // BLOCK  # the leaf keeps a
            blocks = np.unique(mine // BLOCK)  # token in the first dropped slot's block
            if shares:
                blocks = blocks[blocks != first // BLOCK]
            if len(blocks):
                self.ranks[r].decref(blocks)
            if first % BLOCK:  # go on filling that block (another segment of the path, or the leaf, holds it)
                leaf.tail[r], leaf.tail_held[r] = (first // BLOCK, first % BLOCK), shares
            else:  # the dropped slots began a block: the next append takes a fresh one (this one, when still free)
                leaf.tail[r], leaf.tail_held[r] = (first // BLOCK - 1, BLOCK), False
            _drop_runs(seq.runs[r], len(mine))
        for a in (leaf.tokens, leaf.rank, leaf.slot):
            a.truncate(keep)
        leaf.count -= counts
        self.used -= counts
        seq.per_rank -= counts
        if seq.home != SPREAD:
            held = np.flatnonzero(seq.per_rank)
            seq.home = UNPLACED if len(held) == 0 else int(held[0]) if len(held) == 1 else SPREAD
        seq.num_stored = num_tokens
        leaf.unverified = 0

    def _alloc_slots(self, leaf: Node, r: int, k: int) -> np.ndarray:
        out = []
        block, used = leaf.tail[r]
        if used < BLOCK and not leaf.tail_held[r]:  # appending into a block another segment holds tokens in
            self.ranks[r].incref(np.asarray([block]))
            leaf.tail_held[r] = True
        while k > 0:
            if used == BLOCK:
                block, used = self.ranks[r].alloc(prefer=block + 1 if block >= 0 else -1), 0
                leaf.tail_held[r] = True
            take = min(k, BLOCK - used)
            out.append(np.arange(block * BLOCK + used, block * BLOCK + used + take, dtype=np.int64))
            used += take
            k -= take
        leaf.tail[r] = (block, used)
        return np.concatenate(out)

    # ------------------------------------------------------------------ freeing
    def make_room(self, need: np.ndarray) -> bool:
        """Evict least recently used unreferenced segments with nothing below them on the device, holding tokens on
        a rank short of blocks, until every rank has `need` free blocks (down a tier when there are tiers)."""
        while np.any(self.free_blocks() < need):
            short = self.free_blocks() < need
            victims = [nd for nd in self.nodes.values() if nd.on_device and nd.ref == 0 and nd.owner is None
                       and not any(c.on_device for c in nd.children)]
            if not victims:
                return False
            useful = [nd for nd in victims if nd.count[short].any()]  # else one whose parent holds such tokens
            self._evict(min(useful or victims, key=lambda nd: nd.last_access))
        return True

    def _evict(self, node: Node) -> None:
        """node leaves the device: a copy stays below (the tiers copy it before its slots can be reused), or it goes
        with its subtree (already off the device)."""
        if self.tiers is None or not self.tiers.demote(node):
            self._drop_subtree(node)
            return
        self._free_device(node)

    def _free_device(self, node: Node) -> None:
        self._drop_snapshots(node)  # a state snapshot lives beside the K/V on the device (no tier holds it)
        for key in node.blocks(self.num_blocks).tolist():
            self.ranks[key // self.num_blocks].decref(np.asarray([key % self.num_blocks]))
        if node.on_device:
            self.used -= node.count
        node.on_device = False
        node.slot = GrowArray(np.full(len(node), -1, dtype=np.int64))

    def _free_node(self, node: Node) -> None:
        self._free_device(node)
        if self.tiers is not None:
            self.tiers.forget(node)
        parent = node.parent
        parent.children.remove(node)
        del self.nodes[node.id]
        node.parent = None
        if parent is not self.root and parent.is_hole and not parent.children:
            self._free_node(parent)  # a hole kept only for what was below it

    def _lost(self, node: Node) -> None:
        """node's last copy is gone. The segments below it that still have a copy keep it as a hole (recomputed
        by the next request that reaches it, costing that prefix only); with none, it goes with its subtree."""
        if node.parent is None or not node.is_hole:
            return
        if self._copies_below(node):
            node.count = np.zeros(self.n, dtype=np.int64)
            node.rank = GrowArray(np.zeros(len(node), dtype=np.int64))
            return
        self._drop_subtree(node)

    @staticmethod
    def _copies_below(node: Node) -> bool:
        stack = list(node.children)
        while stack:
            nd = stack.pop()
            if not nd.is_hole:
                return True
            stack.extend(nd.children)
        return False

    def _drop_subtree(self, node: Node) -> None:
        """Remove an unreferenced segment and everything below it, from every tier."""
        stack, order = [node], []
        while stack:
            nd = stack.pop()
            assert nd.ref == 0 and nd.owner is None, "dropping a segment a request still uses (this is a bug)"
            order.append(nd)
            stack.extend(nd.children)
        for nd in reversed(order):  # leaves first
            self._free_node(nd)

    def release(self, seq: SeqKV, keep: bool) -> None:
        """A request leaves: unlock its path; keep its tokens cached (finished) or free its private leaf
        (aborted / preempted). Without prefix caching nothing is ever matched: a finished leaf is freed at once."""
        keep = keep and self.enable_prefix_caching
        self._promise(seq, 0)
        leaf = seq.leaf
        leaf.owner = None
        p = leaf
        now = time.monotonic()
        path = []
        while p is not self.root:
            p.ref -= 1
            p.last_access = now
            path.append(p)
            p = p.parent
        if self.states is not None:
            self._unpin(seq)
        if self.states is not None and seq.state_out >= 0:  # the live state: a snapshot at its end, or freed
            if keep and len(leaf) and seq.num_stored == leaf.pos0 + len(leaf):
                old = leaf.snapshots.get(seq.num_stored)
                if old is not None:
                    self.states.free(old)
                leaf.snapshots[seq.num_stored] = seq.state_out
            else:
                self.states.free(seq.state_out)
            seq.state_out = seq.state_in = -1
        if keep and self.tiers is not None:  # (the snapshot at its end is written with its leaf)
            self.tiers.write_through(path[::-1])
        if not keep or len(leaf) == 0:
            if not leaf.children:
                self._free_node(leaf)
            elif len(leaf) == 0:  # an empty segment left over by a split: fold it away
                self._free_node_keep_children(leaf)

    def _free_node_keep_children(self, node: Node) -> None:
        self._drop_snapshots(node)
        parent = node.parent
        parent.children.remove(node)
        for c in node.children:
            c.parent = parent
            parent.children.append(c)
        del self.nodes[node.id]
        node.parent = None

    # ------------------------------------------------------------------ tiers
    def count_tier_hits(self, hits: dict | None, sign: int = 1) -> None:
        for tier, tokens in (hits or {}).items():
            self.tier_hits[tier] += sign * tokens

    def take_ops(self) -> list:
        """The cache operations decided since the last call (for the next batch), in order."""
        return self.tiers.take_ops() if self.tiers is not None else []

    def put_back_ops(self, ops: list) -> None:
        """Operations that could not be sent yet go first in the next batch."""
        if ops:
            self.tiers.ops[:0] = ops

    def discard(self, failed: dict[int, str]) -> None:
        """Segments whose restore failed (node id → the tier it was read from; no request holds them any more):
        their device slots (unwritten) are freed and the bad copy dropped — a disk entry from the index and the
        directory. A segment left without a copy becomes a hole when copies below it survive, else it goes."""
        for nid, tier in failed.items():
            node = self.nodes.get(nid)
            if node is None:
                continue
            assert node.ref == 0 and node.owner is None, "discarding a segment a request holds (this is a bug)"
            if node.on_device:
                self._free_device(node)
            if tier == "host" and node.host is not None:
                self.tiers.forget_host(node)
            elif node.disk is not None:
                self.tiers.drop_entry(node.disk.entry)  # every segment it holds loses that copy
            self._lost(node)

    def discard_state(self, failed: dict[tuple[int, int], str]) -> None:
        """Recurrent-state snapshots whose restore failed ((node id, position) → the tier it was read from; no
        request holds them any more): the device slot given to each is freed and the bad copy dropped. Its K/V
        stay; a later match stops at an earlier snapshot (or none: a cache miss, recomputed)."""
        for (nid, pos), tier in failed.items():
            node = self.nodes.get(nid)
            if node is None:
                continue
            slot = node.snapshots.pop(pos, None)
            if slot is not None:
                self.states.free(slot)
                self._state_fresh.discard(slot)
            self.tiers.drop_state(node, pos, tier)

    def adopt(self, entry: DiskEntry, path: np.ndarray, pos0: int, ranks: np.ndarray, shard: np.ndarray,
              row: np.ndarray, last_access: float) -> bool:
        """Put a disk entry found at start into the tree as an off-device segment: tokens path[pos0:] with, per
        token, its restore rank and (shard, row). Its prefix must be there already (entries are adopted by
        position); tokens another entry covers are skipped. False: nothing of it is usable (orphan or duplicate)."""
        node, inside, matched = self.match(path, len(path), through_holes=True)
        if matched == len(path):
            return False
        if node is not self.root and inside < len(node):
            node = self._split(node, inside)
        if matched < pos0:  # the entries before it are lost (damaged, deleted): a hole stands for those tokens
            hole = Node(node, matched, self.n, tokens=path[matched:pos0], rank=np.zeros(pos0 - matched),
                        slot=np.full(pos0 - matched, -1, dtype=np.int64))
            hole.on_device, hole.last_access, hole.count = False, last_access, np.zeros(self.n, dtype=np.int64)
            node.children.append(hole)
            self.nodes[hole.id] = hole
            node, matched = hole, pos0
        k = matched - pos0
        seg = Node(node, matched, self.n, tokens=path[matched:], rank=ranks[k:],
                   slot=np.full(len(path) - matched, -1, dtype=np.int64))
        seg.on_device, seg.last_access = False, last_access
        seg.disk = DiskRef(entry, shard[k:].copy(), row[k:].copy())
        entry.nodes[seg.id] = seg
        node.children.append(seg)
        self.nodes[seg.id] = seg
        return True

    # ------------------------------------------------------------------ introspection
    def tokens_per_rank(self) -> list[int]:
        return self.used.tolist()

    def check_invariants(self) -> None:
        """Recount everything from the tree (tests): block refs, free counts, usage, ref counts >= 0."""
        refs = np.zeros((self.n, self.num_blocks), dtype=np.int64)
        used = np.zeros(self.n, dtype=np.int64)
        seen = set()
        all_slots = []
        stack = [self.root]
        while stack:
            nd = stack.pop()
            for c in nd.children:
                assert c.parent is nd, "broken parent link"
                assert c.pos0 == nd.pos0 + len(nd) or nd is self.root and c.pos0 == 0, "positions not contiguous"
                stack.append(c)
            if nd is self.root:
                continue
            seen.add(nd.id)
            assert nd.ref >= 0, f"negative ref count on node {nd.id}"
            if nd.is_hole:
                assert nd.ref == 0 and nd.owner is None and not nd.count.any(), f"hole {nd.id} is in use"
                assert self._copies_below(nd), f"hole {nd.id} has no copy below it"
                continue
            np.testing.assert_array_equal(nd.count, np.bincount(nd.rank.view, minlength=self.n))
            if not nd.on_device:  # off the device: a lower copy, nothing below on the device, nobody using it
                assert nd.host is not None or nd.disk is not None, f"node {nd.id} is in no tier"
                assert nd.ref == 0 and nd.owner is None, f"node {nd.id} is used off the device"
                assert not any(c.on_device for c in nd.children), f"node {nd.id} has a child on the device"
                continue
            for key in nd.blocks(self.num_blocks).tolist():
                refs[key // self.num_blocks, key % self.num_blocks] += 1
            used += nd.count
            all_slots.append(nd.rank.view * self.num_blocks * BLOCK + nd.slot.view)
        assert seen == set(self.nodes), "node registry out of step with the tree"
        flat = np.concatenate(all_slots) if all_slots else np.zeros(0, dtype=np.int64)
        assert len(np.unique(flat)) == len(flat), "a slot holds two tokens"
        for r in range(self.n):
            np.testing.assert_array_equal(self.ranks[r].ref, refs[r], err_msg=f"block refs of rank {r}")
            assert self.ranks[r].num_free == int(np.count_nonzero(refs[r] == 0)), "free count"
        np.testing.assert_array_equal(self.used, used)
        assert (self.promised >= 0).all(), f"negative promised decode tokens {self.promised}"
        if self.tiers is not None:
            self.tiers.check(self.nodes)
