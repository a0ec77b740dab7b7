"""Merge and local partial attention against a float64 reference (no communication)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cpinfer.attention.local import CAUSAL, FULL, build_items, local_attention, reference_attention, visible
from cpinfer.attention.merge import merge_into, merge_partials


def _check_local(q_seq, q_pos, kv_seq, kv_pos, h=8, hkv=2, d=16, seed=0, kv_seq_end=None, window=None, chunk=None):
    g = torch.Generator().manual_seed(seed)
    q_seq, q_pos, kv_seq, kv_pos = (torch.as_tensor(np.asarray(x), dtype=torch.int64)
                                    for x in (q_seq, q_pos, kv_seq, kv_pos))
    q = torch.randn(len(q_seq), h, d, generator=g)
    k = torch.randn(len(kv_seq), hkv, d, generator=g)
    v = torch.randn(len(kv_seq), hkv, d, generator=g)
    out, lse = local_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_seq_end, window=window,
                               chunk=chunk)
    ref_out, ref_lse = reference_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_seq_end=kv_seq_end,
                                           window=window, chunk=chunk)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_merge_two_halves_equals_whole():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(12, 4, 8, generator=g), torch.randn(12, 4, 8, generator=g)
    seq, kseq = torch.zeros(5, dtype=torch.long), torch.zeros(12, dtype=torch.long)
    pos, kpos = torch.full((5,), 100), torch.arange(12)
    whole = reference_attention(q, k, v, seq, pos, kseq, kpos)
    a = reference_attention(q, k[:7], v[:7], seq, pos, kseq[:7], kpos[:7])
    b = reference_attention(q, k[7:], v[7:], seq, pos, kseq[7:], kpos[7:])
    out, lse = merge_partials([a[0], b[0]], [a[1], b[1]])
    torch.testing.assert_close(out.double(), whole[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), whole[1], rtol=1e-6, atol=1e-6)
    acc_out, acc_lse = a[0].float().clone(), a[1].float().clone()
    merge_into(acc_out, acc_lse, b[0], b[1])
    torch.testing.assert_close(acc_out.double(), whole[0], rtol=1e-5, atol=1e-5)


def test_merge_empty_partials_contribute_nothing_and_all_empty_rows_are_zero():
    out1, lse1 = torch.randn(3, 2, 4), torch.randn(3, 2)
    empty_out, empty_lse = torch.full((3, 2, 4), 7.0), torch.full((3, 2), -torch.inf)
    out, lse = merge_partials([empty_out, out1, empty_out], [empty_lse, lse1, empty_lse])
    torch.testing.assert_close(out, out1)
    torch.testing.assert_close(lse, lse1)
    out, lse = merge_partials([torch.zeros(3, 2, 4)] * 2, [empty_lse] * 2)
    assert torch.equal(out, torch.zeros(3, 2, 4)) and torch.isneginf(lse).all()
    acc_out, acc_lse = torch.zeros(3, 2, 4), empty_lse.clone()
    merge_into(acc_out, acc_lse, torch.zeros(3, 2, 4), empty_lse)
    assert not torch.isnan(acc_out).any() and torch.isneginf(acc_lse).all()


def test_merge_is_stable_for_large_lse():
    out1, out2 = torch.ones(1, 1, 2), -torch.ones(1, 1, 2)
    lse1, lse2 = torch.tensor([[1000.0]]), torch.tensor([[1000.0]])
    out, lse = merge_partials([out1, out2], [lse1, lse2])
    torch.testing.assert_close(out, torch.zeros(1, 1, 2))
    torch.testing.assert_close(lse, torch.tensor([[1000.0 + float(np.log(2.0))]], dtype=torch.float32))


@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 4), (8, 2), (8, 1), (16, 2)])
def test_causal_single_sequence_is_one_causal_call(h, hkv):
    n = 97
    _check_local([0] * n, range(n), [0] * n, range(n), h=h, hkv=hkv)
    items = build_items(np.zeros(n), np.arange(n), np.zeros(n), np.arange(n))
    assert [(it.kind, it.q0, it.q1, it.k0, it.k1) for it in items] == [(CAUSAL, 0, n, 0, n)]


def test_partial_prefill_splits_into_full_block_and_causal_square():
    items = build_items(np.zeros(20), np.arange(80, 100), np.zeros(100), np.arange(100))
    assert [(it.kind, it.q0, it.q1, it.k0, it.k1) for it in items] == [(FULL, 0, 20, 0, 80), (CAUSAL, 0, 20, 80, 100)]
    _check_local([0] * 20, range(80, 100), [0] * 100, range(100))


def test_no_visible_key_gives_zeros_not_nan():
    _check_local([0, 1, 2, -1], [0, 5, 3, 0], [1, 1, 2], [6, 7, 4])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 120), st.integers(0, 300), st.booleans())
def test_random_metadata_matches_reference(seed, lq, lk, sorted_runs):
    rng = np.random.default_rng(seed)
    if sorted_runs:  # realistic: runs of one sequence with increasing positions
        q_seq, kv_seq = np.sort(rng.integers(0, 3, lq)), np.sort(rng.integers(0, 3, lk))
        q_pos, kv_pos = np.sort(rng.choice(500, lq, replace=False)), np.sort(rng.choice(500, lk, replace=False))
    else:  # arbitrary order, padding ids included
        q_seq, kv_seq = rng.integers(-1, 3, lq), rng.integers(-1, 3, lk)
        q_pos, kv_pos = rng.integers(0, 60, lq), rng.integers(0, 60, lk)
    _check_local(q_seq, q_pos, kv_seq, kv_pos, seed=seed % 1000)


def test_long_sequence_uses_no_dense_mask():
    n = 4096
    pos = np.concatenate((np.arange(0, 512), np.arange(3584, 4096)))  # rank 0 of CP4: chunks 0 and 7
    items = build_items(np.zeros(1024), pos, np.zeros(n), np.arange(n))
    assert all(it.mask is None for it in items)
    assert len(items) <= 3


def _random_tree(rng, n_segs):
    """Parents of a random prefix tree in DFS preorder, each segment's first position and subtree end."""
    parent, start, lens = [-1], [0], rng.integers(1, 40, n_segs)
    for s in range(1, n_segs):
        # in preorder the parent of s is on the path from the root to s - 1
        path, a = [], s - 1
        while a >= 0:
            path.append(a)
            a = parent[a]
        parent.append(int(rng.choice(path)))
        start.append(start[parent[s]] + int(lens[parent[s]]))
    end = list(range(1, n_segs + 1))
    for s in reversed(range(1, n_segs)):
        end[parent[s]] = max(end[parent[s]], end[s])
    return parent, np.array(start), lens, np.array(end)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8), st.integers(0, 100), st.sampled_from(["sorted", "shuffled"]))
def test_prefix_tree_intervals_match_reference(seed, n_segs, lq, order):
    """Keys of a random prefix tree with [segment, subtree end) labels; queries in random segments."""
    rng = np.random.default_rng(seed)
    parent, start, lens, end = _random_tree(rng, n_segs)
    kv_seq = np.repeat(np.arange(n_segs), lens)
    kv_pos = np.concatenate([np.arange(a, a + n) for a, n in zip(start, lens)])
    kv_end = end[kv_seq]
    q_seq = rng.integers(0, n_segs, lq)
    q_pos = start[q_seq] + rng.integers(0, lens[q_seq] + 3)  # may run past the segment's cached tokens
    if order == "sorted":  # runs per segment with increasing positions: the segment-pair planner
        o = np.lexsort((q_pos, q_seq))
        q_seq, q_pos = q_seq[o], q_pos[o]
    else:  # keys shuffled: the tile planner
        o = rng.permutation(len(kv_seq))
        kv_seq, kv_pos, kv_end = kv_seq[o], kv_pos[o], kv_end[o]
    on_path = np.zeros((lq, len(kv_seq)), dtype=bool)
    for i, (s, p) in enumerate(zip(q_seq, q_pos)):
        path = set()
        while s >= 0:
            path.add(int(s))
            s = parent[s]
        on_path[i] = np.isin(kv_seq, list(path)) & (kv_pos <= p)
    assert np.array_equal(visible(q_seq, q_pos, kv_seq, kv_pos, kv_end), on_path)
    _check_local(q_seq, q_pos, kv_seq, kv_pos, seed=seed % 1000, kv_seq_end=kv_end)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 80), st.sampled_from([1, 3, 8, 25]),
       st.sampled_from([None, 5]), st.booleans())
def test_chunk_labels_are_the_chunk_rule(seed, n_segs, lq, chunk, window, shuffled):
    """Folding the chunk into the labels (`chunk_labels`) gives exactly the chunk rule on top of a random prefix
    tree, a window and padding, and local attention planned from it matches the float64 reference."""
    from cpinfer.attention.local import chunk_labels

    rng = np.random.default_rng(seed)
    parent, start, lens, end = _random_tree(rng, n_segs)
    kv_seq = np.repeat(np.arange(n_segs), lens)
    kv_pos = np.concatenate([np.arange(a, a + n) for a, n in zip(start, lens)])
    kv_end = end[kv_seq]
    q_seq = np.where(rng.random(lq) < 0.1, -1, rng.integers(0, n_segs, lq))  # some padding
    q_pos = start[np.maximum(q_seq, 0)] + rng.integers(0, lens[np.maximum(q_seq, 0)] + 3)
    if shuffled:
        o = rng.permutation(len(kv_seq))
        kv_seq, kv_pos, kv_end = kv_seq[o], kv_pos[o], kv_end[o]
    else:
        o = np.lexsort((q_pos, q_seq))
        q_seq, q_pos = q_seq[o], q_pos[o]
    [(qs, qp)], [(ks, kp, ke)] = chunk_labels([(q_seq, q_pos)], [(kv_seq, kv_pos, kv_end)], chunk)
    assert np.array_equal(visible(qs, qp, ks, kp, ke, window),
                          visible(q_seq, q_pos, kv_seq, kv_pos, kv_end, window, chunk))
    assert (qs < 0).sum() == (q_seq < 0).sum() and max(qs.max(initial=0), ke.max(initial=0)) < 2 ** 30
    _check_local(q_seq, q_pos, kv_seq, kv_pos, seed=seed % 1000, kv_seq_end=kv_end, window=window, chunk=chunk)


def test_query_pairs_with_every_ancestor_segment():
    """A leaf's queries against root, middle and own segments: one item list spanning all three, no masks."""
    kv_seq, kv_end = np.repeat([0, 1, 2, 3], 10), np.repeat([4, 3, 3, 4], 10)  # 0 ⊃ 1 ⊃ 2, 0 ⊃ 3
    kv_pos = np.concatenate([np.arange(10), np.arange(10, 20), np.arange(20, 30), np.arange(10, 20)])
    items = build_items(np.full(5, 2), np.arange(25, 30), kv_seq, kv_pos, kv_end)
    assert [(it.kind, it.k0, it.k1) for it in items] == [(FULL, 0, 10), (FULL, 10, 20), (FULL, 20, 25),
                                                        (CAUSAL, 25, 30)]
    assert all(it.mask is None for it in items)
    own = build_items(np.full(5, 2), np.arange(25, 30), kv_seq, kv_pos)  # default: the same segment id only
    assert [(it.kind, it.k0, it.k1) for it in own] == [(FULL, 20, 25), (CAUSAL, 25, 30)]


@pytest.mark.parametrize("lq, h, hkv, lk", [(1, 8, 2, 1500), (3, 4, 4, 2048), (2, 8, 1, 1024), (1, 9, 3, 37),
                                             (4, 6, 3, 5)])
def test_cpu_kernel_few_queries_over_many_keys_matches_reference(lq, h, hkv, lk):
    """The decode path of the CPU kernel (a fully visible block of a few queries, any number of keys: a KV head's
    query heads as one call's rows) vs float64; K/V are row ranges of a larger store, as the engine passes them."""
    from cpinfer.attention.local import cpu_flash_backend

    g = torch.Generator().manual_seed(lq * 7 + lk)
    q = torch.randn(lq, h, 16, generator=g)
    k, v = (torch.randn(lk + 9, hkv, 16, generator=g)[5:5 + lk] for _ in range(2))  # [lk, Hkv, 16] views
    out, lse = cpu_flash_backend(q, k, v, False, None, 0.25)
    seq = torch.zeros(lk, dtype=torch.int64)
    ref_out, ref_lse = reference_attention(q, k, v, seq[:lq], torch.full((lq,), lk), seq, torch.arange(lk), 0.25)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lq, hkv, extra", [(1, 3, 1), (2, 3, 0)])
def test_cpu_kernel_few_queries_split_among_threads_matches_reference(lq, hkv, extra):
    """3 KV heads on 2 threads, from `_SPLIT_MIN_KEYS` keys on: the decode path cuts the keys into one piece per
    thread (an odd count leaves one more piece) and merges them; vs float64."""
    from cpinfer.attention.kernels import _SPLIT_MIN_KEYS
    from cpinfer.attention.local import cpu_flash_backend

    lk = _SPLIT_MIN_KEYS + extra
    g = torch.Generator().manual_seed(lk)
    q = torch.randn(lq, 3 * hkv, 16, generator=g)
    k, v = (torch.randn(lk + 9, hkv, 16, generator=g)[5:5 + lk] for _ in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, lse = cpu_flash_backend(q, k, v, False, None, 0.25)
    finally:
        torch.set_num_threads(threads)
    seq = torch.zeros(lk, dtype=torch.int64)
    ref_out, ref_lse = reference_attention(q, k, v, seq[:lq], torch.full((lq,), lk), seq, torch.arange(lk), 0.25)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
