"""Property tests of load-balanced prefill sharding and round-robin decode placement."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cpinfer.cp.sharding import PAD_SEQ, decode_ranks, shard_decode, shard_prefill


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.integers(1, 5), st.data())
def test_prefill_places_every_token_once_with_equal_counts(new_lens, n, data):
    cached = data.draw(st.lists(st.integers(0, 50), min_size=len(new_lens), max_size=len(new_lens)))
    plan = shard_prefill(new_lens, n, cached)
    assert len({len(sh) for sh in plan.shards}) == 1  # equal per-rank counts after padding
    idx = np.concatenate([sh.index[sh.valid] for sh in plan.shards])
    assert sorted(idx.tolist()) == list(range(sum(new_lens)))  # every real token exactly once
    starts = np.cumsum([0] + new_lens[:-1])
    for sh in plan.shards:
        assert (sh.seq[~sh.valid] == PAD_SEQ).all()
        ok = sh.valid
        seq = sh.seq[ok]
        assert np.array_equal(sh.pos[ok], np.asarray(cached)[seq] + sh.index[ok] - starts[seq])
    x = torch.arange(sum(new_lens) * 2).view(-1, 2)
    assert torch.equal(plan.unshard([plan.shard_tensor(x, r) for r in range(n)]), x)  # round trip
    rank, slot = plan.inverse()
    for t in range(sum(new_lens)):
        assert plan.shards[rank[t]].index[slot[t]] == t


def test_prefill_chunk_assignment_matches_paper():
    plan = shard_prefill([8], 2)  # 4 chunks of 2: rank 0 takes C0, C3; rank 1 takes C1, C2
    assert plan.shards[0].pos.tolist() == [0, 1, 6, 7]
    assert plan.shards[1].pos.tolist() == [2, 3, 4, 5]


def test_prefill_pads_per_sequence():
    plan = shard_prefill([5, 4], 2)
    assert [len(sh) for sh in plan.shards] == [6, 6]
    # seq 0 (5 tokens) → 4 chunks of 2 (offsets 0-7, 5-7 padding); seq 1 (4 tokens) → 4 chunks of 1
    assert plan.shards[0].index.tolist() == [0, 1, -1, -1, 5, 8]
    assert plan.shards[1].index.tolist() == [2, 3, 4, -1, 6, 7]
    assert plan.shards[0].seq.tolist() == [0, 0, PAD_SEQ, PAD_SEQ, 1, 1]


def test_decode_round_robin_balances_every_sequence():
    n, b, steps = 3, 4, 30
    counts = np.zeros((b, n), dtype=int)
    for step in range(steps):
        ranks = decode_ranks(b, n, step)
        plan = shard_decode(np.full(b, 100 + step), ranks, n)
        for r, sh in enumerate(plan.shards):
            counts[sh.index, r] += 1
    assert (counts.max(1) - counts.min(1) <= 1).all()
    assert counts.sum() == b * steps


@pytest.mark.parametrize("bad", [dict(new_lens=[0], num_ranks=2), dict(new_lens=[3], num_ranks=0),
                                 dict(new_lens=[3], num_ranks=2, cached_lens=[-1]),
                                 dict(new_lens=[3, 4], num_ranks=2, cached_lens=[1])])
def test_prefill_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        shard_prefill(**bad)


def test_decode_rejects_rank_out_of_range():
    with pytest.raises(ValueError, match="decode ranks must be in"):
        shard_decode([5, 6], [0, 2], 2)
