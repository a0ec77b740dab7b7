"""The KV manager's state bookkeeping for hybrid models (no ranks): live slots, snapshots at request ends and every
interval, matches cut back to the last snapshot inside them, splits carrying snapshots, eviction that never takes a
snapshot a request has yet to read, and slots returned on release."""
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
