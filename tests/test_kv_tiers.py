"""The KV tiers without processes: the real scheduler, KV manager and tier index drive fake ranks that apply every
cache operation to arrays of token signatures (a hash of the whole token path up to each position). Random
multi-turn workloads under small device / host / disk bounds, with disk writes acknowledged late or failing, and
restarts at another CP size: after every step each request's visible slots hold exactly its prefix's signatures,
and every copy in every tier holds what the tree says it holds.
"""
import errno

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpinfer.engine.kv.ops import DeleteEntry, ForgetEntry, FromHost, LoadEntry, SaveEntry, TierEvent, ToHost
from cpinfer.engine.kv.disk_dir import _replace
from cpinfer.engine.kv.disk_files import Layout
from cpinfer.engine.kv.manager import BLOCK, KVManager
from cpinfer.engine.kv.tiers import DiskEntry, TierConfig
from cpinfer.engine.request import Request, RequestStatus
from cpinfer.engine.scheduler import Scheduler, SchedulerConfig
from test_kv_manager import FakeEngine

LAYOUT = Layout("0" * 64, "float32", 2, 2, 4, 1)
_P, _M = 1_000_003, (1 << 61) - 1


def signatures(tokens) -> np.ndarray:
    """[len] hash of tokens[:i+1] for every i: what the K/V at position i depends on."""
    out, h = np.empty(len(tokens), dtype=np.int64), 0
    for i, t in enumerate(tokens):
        h = (h * _P + int(t) + 1) % _M
        out[i] = h
    return out


class FakeRanks:
    """Every rank's device store, host pool and disk files, as token signatures; writes are acknowledged one step
    late, and fail with `fail_errno` while it is set (the rows stay readable until the driver forgets them)."""

    def __init__(self, n, capacity, host_slots):
        self.dev = np.full((n, capacity), -1, dtype=np.int64)
        self.host = np.full((n, max(host_slots, 1)), -1, dtype=np.int64)
        self.files: dict[tuple[str, int], dict] = {}  # (entry, shard) → {"sig", "positions", "path", "pos0"}
        self.kept: dict[tuple[str, int], np.ndarray] = {}  # failed writes, readable until ForgetEntry
        self.acks: list[TierEvent] = []
        self.fail_errno = 0
        self.loads = {"host": 0, "disk": 0}

    def apply(self, ops) -> list[TierEvent]:
        events, self.acks = self.acks, []
        for op in ops:
            r = op.rank
            if isinstance(op, ToHost):
                self.host[r, op.host_slots] = self.dev[r, op.slots]
            elif isinstance(op, FromHost):
                self.dev[r, op.slots] = self.host[r, op.host_slots]
                self.loads["host"] += len(op.slots)
            elif isinstance(op, SaveEntry):
                rows = (self.dev if op.source == "device" else self.host)[r, op.slots].copy()
                if self.fail_errno:
                    self.kept[(op.entry, r)] = rows
                    self.acks.append(TierEvent("saved", r, op.entry, r, ok=False, error="full", errno=self.fail_errno))
                else:
                    self.files[(op.entry, r)] = {"sig": rows, "positions": op.positions, "path": op.path,
                                                 "pos0": op.pos0, "cp": len(self.dev)}
                    self.acks.append(TierEvent("saved", r, op.entry, r, nbytes=len(rows)))
            elif isinstance(op, LoadEntry):
                parts = []
                for entry, shard, rows in op.parts:
                    f = self.files.get((entry, shard))
                    parts.append(f["sig"][rows] if f is not None else self.kept[(entry, shard)][rows])
                self.dev[r, op.slots] = np.concatenate(parts)
                self.loads["disk"] += len(op.slots)
            elif isinstance(op, DeleteEntry):
                self.files.pop((op.entry, op.shard), None)
                self.kept.pop((op.entry, op.shard), None)
            elif isinstance(op, ForgetEntry):
                self.kept.pop((op.entry, op.shard), None)
        return events


class TierEngine(FakeEngine):
    """LLMEngine.step's bookkeeping over FakeRanks: schedule → apply the cache operations → write the new tokens'
    signatures → sample random tokens; finished requests keep their cache. (`add` is FakeEngine's.)"""

    def __init__(self, n, capacity, host_slots, disk_tokens, seed, budget=None, ranks=None):
        disk = disk_tokens > 0
        config = TierConfig(host_slots, "/fake" if disk else None, disk_tokens * 8, 8, LAYOUT if disk else None)
        self.kv = KVManager(n, capacity, placer=None, tiers=config)
        self.sched = Scheduler(self.kv, SchedulerConfig(budget, 4))
        self.ranks = ranks or FakeRanks(n, capacity, host_slots)
        self.rng = np.random.default_rng(seed)
        self.live: dict[str, Request] = {}
        self.done: list[list[int]] = []  # finished conversations (prompt + output)
        self.ids = 0

    def step(self):
        scheduled = self.sched.schedule()
        self.kv.tiers.on_events(self.ranks.apply(self.kv.take_ops()))
        for s in scheduled:
            req = s.request
            sig = signatures(req.known)
            seen = np.concatenate([self.ranks.dev[r, np.concatenate([np.arange(a, e) for a, e in runs] or [[]])
                                                   .astype(np.int64)] for r, runs in enumerate(s.ctx_runs)])
            assert sorted(seen.tolist()) == sorted(sig[:s.start].tolist()), "a request sees the wrong K/V"
            self.ranks.dev[s.placement.ranks, s.placement.slots] = sig[s.start:s.start + len(s.tokens)]
        for s in scheduled:
            req = s.request
            if s.sample:
                req.out.append(int(self.rng.integers(3, 40)))
                if len(req.out) >= req.params.max_tokens:
                    self.sched.finish(req, keep_cache=True)
                    self.done.append(req.known[:-1])
                    del self.live[req.request_id]
        return scheduled

    def abort_one(self):
        if self.live:
            req = self.live.pop(sorted(self.live)[0])
            self.sched.finish(req, keep_cache=False)

    def check(self):
        """The tree against the fake ranks: every copy of every segment holds its path's signatures."""
        self.kv.check_invariants()
        pending = {op.entry for op in self.kv.tiers.ops if isinstance(op, SaveEntry)}  # go with the next forward
        for node in self.kv.nodes.values():
            sig = _node_signatures(node)
            if node.on_device:
                np.testing.assert_array_equal(self.ranks.dev[node.rank.view, node.slot.view], sig)
            if node.host is not None:
                np.testing.assert_array_equal(self.ranks.host[node.rank.view, node.host], sig)
            if node.disk is not None and node.disk.entry.name not in pending:
                ref = node.disk
                got = [(self.ranks.files[(ref.entry.name, s)]["sig"] if (ref.entry.name, s) in self.ranks.files
                        else self.ranks.kept[(ref.entry.name, s)])[w] for s, w in zip(ref.shard, ref.row)]
                np.testing.assert_array_equal(np.asarray(got, dtype=np.int64), sig)


def _node_signatures(node) -> np.ndarray:
    parts, p = [], node
    while p.parent is not None:
        parts.append(p.tokens.view)
        p = p.parent
    return signatures(np.concatenate(parts[::-1]))[node.pos0:]


def restart(old: TierEngine, n: int, capacity: int, host_slots: int, disk_tokens: int, seed: int) -> TierEngine:
    """A new engine (CP size n) over the old one's disk files, adopted as rebuild_index does."""
    eng = TierEngine(n, capacity, host_slots, disk_tokens, seed)
    eng.ranks.files = dict(old.ranks.files)
    entries: dict[str, list] = {}
    for (name, shard), f in old.ranks.files.items():
        entries.setdefault(name, []).append((shard, f))
    found = []
    for name, files in entries.items():
        f0 = files[0][1]
        count = len(f0["path"]) - f0["pos0"]
        shard, row = np.full(count, -1), np.full(count, -1)
        for s, f in files:
            shard[f["positions"] - f["pos0"]] = s
            row[f["positions"] - f["pos0"]] = np.arange(len(f["positions"]))
        if (shard < 0).any():
            continue  # a shard's write had not been acknowledged: incomplete
        found.append((f0["pos0"], name, f0["path"], shard, row, tuple(s for s, _ in files), f0["cp"]))
    tiers = eng.kv.tiers
    for pos0, name, path, shard, row, shards, cp in sorted(found, key=lambda f: f[0]):
        ranks = shard.copy() if cp == n else _replace(shard, n)  # (cp: the size that wrote it, maybe restarts ago)
        entry = DiskEntry(name, cp, shards, 8 * len(shard), 0.0)
        if eng.kv.adopt(entry, path, pos0, ranks, shard, row, 0.0):
            tiers.entries[name] = entry
            tiers.disk_used += entry.nbytes
    tiers.trim()
    eng.kv.tiers.on_events(eng.ranks.apply(eng.kv.take_ops()))
    return eng


ops = st.lists(st.tuples(st.sampled_from(["new", "turn", "turn", "shared", "step", "step", "step", "abort", "fail",
                                          "heal", "restart"]), st.integers(0, 10**6)), min_size=8, max_size=50)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, n=st.integers(1, 3), host=st.sampled_from([0, 2 * BLOCK, 6 * BLOCK]),
       disk=st.sampled_from([0, 300, 5000]), budget=st.sampled_from([None, 40]), seed=st.integers(0, 1000))
def test_every_tier_holds_what_the_tree_says(ops, n, host, disk, budget, seed):
    if not host and not disk:
        host = BLOCK
    eng = TierEngine(n, 4 * BLOCK, host, disk, seed, budget)
    rng = np.random.default_rng(seed)
    doc = rng.integers(3, 40, 90).tolist()
    for op, x in ops:
        if op == "new":
            eng.add(rng.integers(3, 40, 20 + x % 100).tolist(), 1 + x % 6)
        elif op == "turn" and eng.done:  # continue an earlier conversation
            eng.add(eng.done[x % len(eng.done)] + rng.integers(3, 40, 1 + x % 9).tolist(), 1 + x % 4)
        elif op == "shared":
            eng.add(doc[:40 + x % 50] + [3 + x % 30], 2)
        elif op == "abort":
            eng.abort_one()
        elif op == "fail":
            eng.ranks.fail_errno = errno.EIO if x % 2 else errno.ENOSPC
        elif op == "heal":
            eng.ranks.fail_errno = 0
        elif op == "restart" and disk and not eng.live:
            eng.kv.tiers.on_events(eng.ranks.apply(eng.kv.take_ops()))  # the shutdown flush
            eng.kv.tiers.on_events(eng.ranks.apply([]))
            n2 = 1 + x % 3
            done = eng.done
            eng = restart(eng, n2, 4 * BLOCK, host, disk, seed)
            eng.done = done
        for _ in range(1 if op != "step" else 1 + x % 5):
            eng.step()
            eng.check()
    for _ in range(400):
        if not eng.live:
            break
        eng.step()
        eng.check()
    assert not eng.live
    assert eng.kv.tiers.writable or eng.ranks.fail_errno or disk == 0 or eng.kv.tiers.stats["disk"].write_errors


def test_a_conversation_comes_back_from_each_tier_and_after_a_restart_at_another_cp_size():
    """Deterministic: three 100-token chats on a device that holds one; turn 2 of each restores its history
    (host first, disk when the host is full); a restart at CP3 of CP2-written entries restores them too."""
    eng = TierEngine(2, 2 * BLOCK, BLOCK, 10_000, seed=0)
    rng = np.random.default_rng(0)
    chats = [rng.integers(3, 40, 100).tolist() for _ in range(3)]
    for c in chats:
        eng.add(c, 3)
        while eng.live:
            eng.step()
            eng.check()
    for i in range(3):
        prompt = eng.done[i] + [7, 8]
        eng.add(prompt, 2)
        first = eng.step()[0]
        assert first.start == len(eng.done[i])  # the whole history was cached (its last token never ran)
        while eng.live:
            eng.step()
            eng.check()
    assert eng.ranks.loads["host"] > 0 and eng.ranks.loads["disk"] > 0
    hits = eng.kv.tier_hits
    assert hits["host"] > 0 and hits["disk"] > 0 and sum(hits.values()) == eng.kv.prefix_hits
    eng.kv.tiers.on_events(eng.ranks.apply(eng.kv.take_ops()))
    eng.kv.tiers.on_events(eng.ranks.apply([]))
    done = eng.done
    eng = restart(eng, 3, 3 * BLOCK, 0, 10_000, seed=1)  # (each segment of a path takes its own blocks)
    eng.kv.check_invariants()
    for conv in done[-3:]:
        eng.add(conv + [9], 2)
        first = eng.step()[0]
        assert first.start == len(conv)
        assert first.request.kv.hits["disk"] > 0
        while eng.live:
            eng.step()
            eng.check()


def test_a_full_disk_pauses_writes_logged_once_and_they_resume_when_it_has_room(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("cpinfer.engine.kv.tiers.time.monotonic", lambda: now[0])
    eng = TierEngine(1, 2 * BLOCK, 0, 10_000, seed=0)
    eng.ranks.fail_errno = errno.ENOSPC
    rng = np.random.default_rng(1)
    for _ in range(4):
        eng.add(rng.integers(3, 40, 80).tolist(), 2)
        while eng.live:
            eng.step()
            eng.check()
        now[0] += 0.5
    eng.step()
    eng.check()
    tiers = eng.kv.tiers
    assert not tiers.can_write and tiers.writable  # paused, not switched off
    assert sum("writes are retried with backoff" in r.message for r in caplog.records) == 1
    assert not eng.ranks.kept  # every failed write was forgotten once the driver saw it
    assert tiers.disk_used == 0 and not tiers.entries
    # the disk has room again: after the backoff the next finished request is written, and accounted
    eng.ranks.fail_errno = 0
    now[0] += 120
    eng.add(eng.done[0] + [5], 2)
    while eng.live:
        eng.step()
        eng.check()
    eng.step()
    assert tiers.can_write and tiers.entries and tiers.disk_used == sum(e.nbytes for e in tiers.entries.values())
    assert any("works again" in r.message for r in caplog.records)


def test_a_failed_delete_stays_counted_and_is_retried_when_writing_works_again(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("cpinfer.engine.kv.tiers.time.monotonic", lambda: now[0])
    eng = TierEngine(1, 4 * BLOCK, 0, 10_000, seed=0)
    eng.add(np.random.default_rng(2).integers(3, 40, 80).tolist(), 2)
    while eng.live:
        eng.step()
    eng.step()
    tiers = eng.kv.tiers
    entry = next(iter(tiers.entries.values()))
    nbytes = tiers.disk_used
    tiers.drop_entry(entry)
    assert [type(op) for op in tiers.take_ops()] == [DeleteEntry] and tiers.disk_used == 0
    tiers.on_events([TierEvent("deleted", 0, entry.name, 0, ok=False, error="EACCES")])
    assert tiers.disk_used == nbytes and tiers.snapshot(0)["disk"]["stray_bytes"] == nbytes
    eng.kv.check_invariants()
    # writing fails (full), then works again: the delete is sent once more, and its success clears the count
    tiers.on_events([TierEvent("saved", 0, "x", 0, ok=False, error="full", errno=errno.ENOSPC)])
    now[0] += 120
    tiers.on_events([TierEvent("saved", 0, "y", 0, nbytes=1)])
    retry = [op for op in tiers.take_ops() if isinstance(op, DeleteEntry)]
    assert [(op.entry, op.shard) for op in retry] == [(entry.name, 0)] and tiers.disk_used == 0
    tiers.on_events([TierEvent("deleted", 0, entry.name, 0)])
    assert tiers.disk_used == 0 and not tiers.undeleted and not tiers.deleting
    eng.kv.check_invariants()


@pytest.mark.parametrize("bad", [dict(host_slots=-1), dict(token_bytes=0), dict(disk_dir="/x", disk_bytes=0)])
def test_bad_tier_configs_are_refused(bad):
    with pytest.raises(ValueError):
        TierConfig(**{"layout": LAYOUT, **bad})


def test_each_tier_lets_go_of_its_least_recently_used_first():
    """CP2, a 100-token chat takes one block per rank: the device holds two chats, the host one, the disk two
    entries. Of five chats one after another the device keeps the two newest, the host the one before, the disk the
    one before that; the oldest is gone from every tier (its entry deleted)."""
    eng = TierEngine(2, 2 * BLOCK, BLOCK, 2 * 110, seed=0)  # a chat: 100 prompt tokens + 2 sampled (101 cached)
    rng = np.random.default_rng(3)
    chats = []
    for _ in range(5):
        chats.append(rng.integers(3, 40, 100).tolist())
        eng.add(chats[-1], 2)
        while eng.live:
            eng.step()
            eng.check()
    eng.kv.tiers.on_events(eng.ranks.apply(eng.kv.take_ops()))
    eng.check()

    def where(chat):
        node, _, matched = eng.kv.match(np.asarray(chat + [1]), len(chat))
        if matched < len(chat):
            return None
        return "device" if node.on_device else "host" if node.host is not None else "disk"

    got = [where(c) for c in chats]
    assert got == [None, "disk", "host", "device", "device"], got
    assert len(eng.kv.tiers.entries) == 2 and len(eng.ranks.files) == 4  # 2 entries x 2 CP shards, within the bound


def test_tier_options_are_checked():
    from cpinfer.engine.config import EngineConfig

    for bad, fragment in ((dict(kv_host_gib=-1), "kv_host_gib"), (dict(kv_host_gib=float("inf")), "kv_host_gib"),
                          (dict(kv_host_gib="1"), "kv_host_gib"), (dict(kv_disk_gib=0), "kv_disk_gib"),
                          (dict(kv_disk_dir=""), "kv_disk_dir")):
        with pytest.raises(ValueError, match=fragment):
            EngineConfig(**bad)
    assert EngineConfig(kv_disk_dir=__import__("pathlib").Path("/tmp/x")).kv_disk_dir == "/tmp/x"


def test_serve_flags_reach_the_engine(tmp_path):
    from cpinfer.cli import build_parser
    from cpinfer.commands.serve import engine_kwargs

    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-host-gib", "2.5", "--kv-disk-dir", str(tmp_path), "--kv-disk-gib", "10"])
    kw = engine_kwargs(args)
    assert (kw["kv_host_gib"], kw["kv_disk_dir"], kw["kv_disk_gib"]) == (2.5, str(tmp_path), 10.0)
    kw = engine_kwargs(parser.parse_args(["serve"]))
    assert "kv_host_gib" not in kw and "kv_disk_dir" not in kw
    for flag in ("--kv-host-gib", "--kv-disk-dir", "--kv-disk-gib"):
        assert flag in parser._subparsers._group_actions[0].choices["serve"].format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-host-gib", "-1"])
