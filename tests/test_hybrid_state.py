"""The KV manager's state bookkeeping for hybrid models (no ranks): live slots, snapshots at request ends and every
interval, matches cut back to the last snapshot inside them, splits carrying snapshots, eviction that never takes a
snapshot a request has yet to read, and slots returned on release; snapshots going down the KV tiers with their
segment and restored by a match (the operations the ranks would apply), a failed restore dropping the copy."""
import numpy as np
import pytest

from cpinfer.engine.kv.manager import KVManager
from cpinfer.engine.kv.state_store import StateSlots, StateStore


def _run(kv, rid, tokens, new, interval_ends=()):
    """Attach, place `new` tokens in one forward (as the engine does), read the state_in; returns the SeqKV."""
    seq = kv.attach(rid, np.asarray(tokens))
    kv.begin_forward()
    start = seq.num_stored
    assert kv.reserve(seq, np.asarray(tokens[start:start + new])) is not None
    copy = kv.interval_snapshot(seq, start, seq.num_stored)
    assert (copy >= 0) == (seq.num_stored in interval_ends)
    kv.consume_state_in(seq)
    return seq


def test_live_slots_snapshots_and_cut_back_matches():
    kv = KVManager(1, 1024)
    kv.enable_states(StateSlots(8), interval=0)
    a = list(range(10, 60))  # 50 tokens
    s1 = _run(kv, "a", a, 50)
    assert s1.state_in == s1.state_out >= 0 and kv.states.in_use == 1
    kv.release(s1, keep=True)
    assert kv.state_snapshots == 1 and kv.states.in_use == 1  # the live slot became the snapshot at 50
    snap = s1.leaf.snapshots[50]
    # a continuation matches through the snapshot
    s2 = kv.attach("b", np.asarray(a + [1, 2, 3]))
    assert s2.num_stored == 50 and s2.state_in == snap and s2.state_out not in (-1, snap)
    kv.release(s2, keep=False)
    # a request sharing only 30 tokens: K/V there, no state: nothing matched
    s3 = kv.attach("c", np.asarray(a[:30] + [7, 7, 7]))
    assert s3.num_stored == 0 and s3.state_in == -1
    kv.release(s3, keep=False)
    assert kv.states.in_use == 1
    kv.check_invariants()


def test_interval_snapshots_split_and_eviction_keeps_pinned_ones():
    kv = KVManager(1, 4096)
    kv.enable_states(StateSlots(4), interval=32)
    doc = list(range(100, 200))  # 100 tokens in chunks of 40: snapshots at 40 and 80
    seq = kv.attach("a", np.asarray(doc + [1]))
    for n, ends in ((40, (40,)), (40, (80,)), (21, (101,))):  # each forward passing a multiple of 32
        kv.begin_forward()
        start = seq.num_stored
        kv.reserve(seq, np.asarray((doc + [1])[start:start + n]))
        assert (kv.interval_snapshot(seq, start, seq.num_stored) >= 0) == (seq.num_stored in ends)
        kv.consume_state_in(seq)
    kv.release(seq, keep=True)
    assert sorted(seq.leaf.snapshots) == [40, 80, 101] and kv.states.in_use == 3  # the live slot replaced 101
    # a request sharing 90 tokens continues from the snapshot at 80; the split moves 40 and 80 to the new parent
    b = kv.attach("b", np.asarray(doc[:90] + [5, 5]))
    assert b.num_stored == 80 and b.state_in == b.leaf.parent.snapshots[80]
    assert sorted(b.leaf.parent.snapshots) == [40, 80]
    # every slot is taken now (3 snapshots + b's live one): a new request evicts the least recently used snapshot
    # that no one has yet to read — never b's pinned one at 80
    pinned = b.state_in
    c = kv.attach("c", np.asarray([9, 9, 9, 9]))  # takes the unreferenced segment's snapshot at 101
    assert c.state_out >= 0 and sorted(b.leaf.parent.snapshots) == [40, 80] and not seq.leaf.snapshots
    d = kv.attach("d", np.asarray([8, 8, 8]))  # then the one at 40 (on b's path, but b does not need it)
    assert d.state_out >= 0 and b.leaf.parent.snapshots == {80: pinned} and kv.states.in_use == 4
    with pytest.raises(RuntimeError, match="no free state slot"):  # all live or pinned: a sizing bug, named
        kv.attach("e", np.asarray([7, 7, 7]))
    kv.release(d, keep=False)
    kv.release(c, keep=False)
    kv.consume_state_in(b)  # b read its snapshot: it may go now
    kv.release(b, keep=False)
    kv.check_invariants()


def test_state_store_replica_grows_and_round_trips():
    import torch

    store = StateStore({0: ((2, 3, 4), 4, 5)}, torch.float32, "cpu")
    state, tail = store.load(0, -1)
    assert state is None and tail.shape == (3, 5) and not tail.any()
    store.ensure(3)
    s, t = torch.randn(2, 3, 4), torch.randn(3, 5)
    store.save(0, 2, s, t)
    store.ensure(10)  # grows, keeping what was saved
    got_s, got_t = store.load(0, 2)
    assert torch.equal(got_s, s) and torch.equal(got_t, t) and store.slots >= 10
    assert StateStore.bytes_per_slot({0: ((2, 3, 4), 4, 5)}, torch.float32) == 2 * 3 * 4 * 4 + 3 * 5 * 4


# ------------------------------------------------------------------ snapshots over the KV tiers (driver side)
def _tiered(host: bool, disk: bool):
    from cpinfer.engine.kv.disk_files import Layout
    from cpinfer.engine.kv.tiers import TierConfig

    layout = Layout("0" * 64, "float32", 2, 2, 4, 1)
    config = TierConfig(256 if host else 0, "/fake" if disk else None, 1 << 20, 8, layout if disk else None,
                        host_state_slots=4 if host else 0, state_bytes=100)
    kv = KVManager(2, 256, tiers=config)
    kv.enable_states(StateSlots(8))
    return kv


@pytest.mark.parametrize("host, disk", [(True, False), (False, True)])
def test_snapshots_go_down_with_their_segment_and_come_back(host, disk):
    """A finished request's snapshot leaves the device with its segment (a StateToHost copy / carried by the
    entry's first SaveEntry) and a match restores it into a new device slot (StateFromHost / LoadState)."""
    from cpinfer.engine.kv.ops import LoadState, StateFromHost, StateToHost

    kv = _tiered(host, disk)
    a = list(range(10, 110))  # 100 tokens over 2 ranks
    s = _run(kv, "a", a, 100)
    kv.release(s, keep=True)
    leaf = next(nd for nd in kv.nodes.values() if nd.snapshots)
    slot = leaf.snapshots[100]
    kv.take_ops()
    assert kv.make_room(np.full(2, kv.num_blocks))  # everything off the device
    ops = kv.take_ops()
    assert not leaf.on_device and not leaf.snapshots and kv.states.in_use == 0
    if host:
        assert [(o.slot, o.host_slot) for o in ops if isinstance(o, StateToHost)] == [(slot, leaf.state_host[100])]
    else:
        assert 100 in leaf.disk.entry.states and not any(isinstance(o, StateToHost) for o in ops)
    kv.check_invariants()
    b = a + [7, 8]
    t = kv.attach("b", np.asarray(b))
    assert t.num_stored == 100 and t.state_in >= 0 and t.state_in != t.state_out
    restores = [o for o in kv.take_ops() if isinstance(o, (StateFromHost, LoadState))]
    assert len(restores) == 1 and restores[0].slot == t.state_in and restores[0].pos == 100
    assert isinstance(restores[0], StateFromHost if host else LoadState)
    kv.check_invariants()
    # the restore failed on the ranks: the request goes, the copy is dropped, the next match finds no state
    kv.release(t, keep=False)
    kv.discard_state({(restores[0].node, 100): "host" if host else "disk"})
    kv.check_invariants()
    u = kv.attach("c", np.asarray(b))
    assert u.num_stored == 0 and u.state_in == -1
    kv.release(u, keep=False)
    kv.check_invariants()


def test_a_disk_entry_carries_its_segments_snapshots():
    from cpinfer.engine.kv.ops import SaveEntry

    kv = _tiered(False, True)
    a = list(range(10, 110))
    s = _run(kv, "a", a, 100)
    kv.release(s, keep=True)  # write-through: the snapshot at its end is written with its leaf
    saves = [o for o in kv.take_ops() if isinstance(o, SaveEntry)]
    carried = [o.states for o in saves if o.states]
    assert len(carried) == 1 and [(pos, src) for pos, src, _ in carried[0]] == [(100, "device")]
    entry = next(iter(kv.tiers.entries.values()))
    assert entry.states == {100: saves[0].rank} and entry.nbytes == 100 * 8 + 100
