"""`cp_attention` on 1-4 gloo ranks (one spawn per world size) against a float64 single-device reference."""
import numpy as np
import pytest
import torch

from cpinfer.attention.local import reference_attention, visible
from cpinfer.cp import STRATEGIES, cp_attention, plan_from_metadata
from cpinfer.cp.sharding import decode_ranks, shard_decode, shard_prefill
from cpinfer.launch import RemoteError, WorkerPool

WORLDS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(n):
        if n not in made:
            made[n] = WorkerPool(n, timeout_s=120)
        return made[n]

    yield get
    for pool in made.values():
        pool.close()


def rank_attention(ctx, q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale=None, kv_seq_end=None,
                   backend="auto", window=None, chunk=None, sinks=None, value_view=None):
    if value_view is not None:  # v is the view k[..., :Dv] (MLA's latent), made here: views do not survive pickling
        v = k[..., :value_view]
    return cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=ctx.group, strategy=strategy, scale=scale,
                        kv_seq_end=kv_seq_end, backend=backend, window=window, chunk=chunk, sinks=sinks)


def rank_attention_catching(ctx, *args, **kwargs):
    try:
        rank_attention(ctx, *args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


class Problem:
    """Global tensors of one attention problem and where each query / key lives."""

    def __init__(self, seed, n_q, n_kv, h=8, hkv=2, d=16):
        self.g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(n_q, h, d, generator=self.g)
        self.k = torch.randn(n_kv, hkv, d, generator=self.g)
        self.v = torch.randn(n_kv, hkv, d, generator=self.g)
        self.q_seq = torch.zeros(n_q, dtype=torch.long)
        self.q_pos = torch.zeros(n_q, dtype=torch.long)
        self.kv_seq = torch.zeros(n_kv, dtype=torch.long)
        self.kv_pos = torch.zeros(n_kv, dtype=torch.long)
        self.kv_end = None  # [n_kv] prefix-tree interval ends, or None for "same sequence id"
        self.window = None  # sliding window, or None
        self.chunk = None  # attention chunk, or None
        self.sinks = None  # [H] sink logits, or None
        self.value_view = None  # Dv when v is the view k[..., :Dv] (MLA), else None

    def with_values(self, dv: int, in_keys: bool) -> "Problem":
        """Values of head size dv: the first dv channels of the keys (MLA's latent) or their own random tensor."""
        if in_keys:
            self.v, self.value_view = self.k[..., :dv], dv
        else:
            self.v, self.value_view = torch.randn(self.k.shape[:2] + (dv,), generator=self.g), None
        return self

    def solve(self, pool, q_idx, kv_idx, strategy):
        """q_idx[r], kv_idx[r]: index arrays of rank r's queries / keys (-1 = padding). Returns out [n_q, H, D]."""
        args = []
        for qi, ki in zip(q_idx, kv_idx):
            qi, ki = torch.as_tensor(np.asarray(qi), dtype=torch.long), torch.as_tensor(np.asarray(ki), dtype=torch.long)
            qp, kp = qi < 0, ki < 0
            qc, kc = qi.clamp(min=0), ki.clamp(min=0)
            args.append((self.q[qc], self.k[kc], None if self.value_view else self.v[kc],
                         self.q_seq[qc].masked_fill(qp, -1), self.q_pos[qc].masked_fill(qp, 0),
                         self.kv_seq[kc].masked_fill(kp, -1), self.kv_pos[kc].masked_fill(kp, 0), strategy, None,
                         None if self.kv_end is None else self.kv_end[kc].masked_fill(kp, 0), "auto", self.window,
                         self.chunk, self.sinks, self.value_view))
        outs = pool.run_each(rank_attention, args)
        full = self.q.new_full(self.q.shape[:2] + self.v.shape[2:], float("nan"))  # [n_q, H, Dv]
        for qi, out in zip(q_idx, outs):
            qi = torch.as_tensor(np.asarray(qi), dtype=torch.long)
            assert out.shape == (len(qi),) + full.shape[1:]
            assert not torch.isnan(out).any()
            full[qi[qi >= 0]] = out[qi >= 0]
        return full

    def check(self, out, rows=None):
        """out against the float64 reference (of the query rows `rows` only, when given)."""
        rows = slice(None) if rows is None else rows
        ref, _ = reference_attention(self.q[rows], self.k, self.v, self.q_seq[rows], self.q_pos[rows], self.kv_seq,
                                     self.kv_pos, kv_seq_end=self.kv_end, window=self.window, chunk=self.chunk,
                                     sinks=self.sinks)
        torch.testing.assert_close(out[rows].double(), ref, rtol=1e-5, atol=1e-5)


def prefill_problem(seed, new_lens, cached_lens, n, hkv=2, h=8):
    """Queries = new tokens sharded 2N-chunk; keys = cached tokens (sharded as an earlier prefill) + new tokens."""
    total = [c + t for c, t in zip(cached_lens, new_lens)]
    p = Problem(seed, sum(new_lens), sum(total), h=h, hkv=hkv)
    q_off = np.cumsum([0] + list(new_lens))
    kv_off = np.cumsum([0] + total)
    for i, (c, t) in enumerate(zip(cached_lens, new_lens)):
        p.q_seq[q_off[i]:q_off[i + 1]] = i
        p.q_pos[q_off[i]:q_off[i + 1]] = torch.arange(c, c + t)
        p.kv_seq[kv_off[i]:kv_off[i + 1]] = i
        p.kv_pos[kv_off[i]:kv_off[i + 1]] = torch.arange(c + t)
    new_plan = shard_prefill(new_lens, n, cached_lens)
    q_idx = [sh.index for sh in new_plan.shards]
    kv_idx = [[] for _ in range(n)]
    cached_seqs = [i for i, c in enumerate(cached_lens) if c > 0]
    if cached_seqs:  # the earlier turn was itself a load-balanced prefill
        old = shard_prefill([cached_lens[i] for i in cached_seqs], n)
        for r, sh in enumerate(old.shards):
            ok = sh.valid
            seq = np.asarray(cached_seqs)[sh.seq[ok]]
            kv_idx[r].extend((kv_off[seq] + sh.pos[ok]).tolist())
    for r, sh in enumerate(new_plan.shards):
        ok = sh.valid
        kv_idx[r].extend((kv_off[sh.seq[ok]] + sh.pos[ok]).tolist())
    return p, q_idx, kv_idx


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_prefill_varlen(pools, n, strategy):
    lens = [1, 2, 7, 13, 31, 64, 97]  # lengths 1, primes, not multiples of 2N
    p, q_idx, kv_idx = prefill_problem(n * 10, lens, [0] * len(lens), n)
    p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_partial_prefill(pools, n, strategy):
    new_lens, cached = [1, 5, 40, 1, 17], [0, 33, 9, 120, 1]  # T_i = 1 and P_i = 0 included
    p, q_idx, kv_idx = prefill_problem(n, new_lens, cached, n)
    p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 4), (8, 2), (8, 1), (16, 2)])  # GQA 1, 2, 4, 8 and MQA
def test_gqa_ratios(pools, n, h, hkv):
    for strategy in STRATEGIES:
        p, q_idx, kv_idx = prefill_problem(h * hkv, [19, 50], [23, 0], n, hkv=hkv, h=h)
        p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", WORLDS)
def test_batched_decode_round_robin(pools, n):
    """A prefill then 6 decode steps: each step's tokens are queries, and join the KV where they were placed."""
    prompt = [9, 30, 4]
    b, steps = len(prompt), 6
    p = Problem(100 + n, b * steps, sum(prompt) + b * steps)
    kv_rank, kv_seq, kv_pos = [], [], []
    old = shard_prefill(prompt, n)
    for r, sh in enumerate(old.shards):
        ok = sh.valid
        kv_rank += [r] * int(ok.sum())
        kv_seq += sh.seq[ok].tolist()
        kv_pos += sh.pos[ok].tolist()
    for step in range(steps):
        ranks = decode_ranks(b, n, step)
        plan = shard_decode([prompt[i] + step for i in range(b)], ranks, n)
        kv_rank += ranks.tolist()
        kv_seq += list(range(b))
        kv_pos += [prompt[i] + step for i in range(b)]
        rows = np.arange(step * b, step * b + b)
        p.q_seq[rows] = torch.arange(b)
        p.q_pos[rows] = torch.tensor([prompt[i] + step for i in range(b)])
        p.kv_seq[:len(kv_seq)] = torch.tensor(kv_seq)
        p.kv_pos[:len(kv_pos)] = torch.tensor(kv_pos)
        p.kv_seq[len(kv_seq):] = -1  # future tokens are not in the cache yet
        q_idx = [rows[sh.index] for sh in plan.shards]
        kv_idx = [[j for j, rk in enumerate(kv_rank) if rk == r] for r in range(n)]
        for strategy in ("pass-q", "pass-kv"):
            out = p.solve(pools(n), q_idx, kv_idx, strategy)
            ref, _ = reference_attention(p.q[rows], p.k, p.v, p.q_seq[rows], p.q_pos[rows], p.kv_seq, p.kv_pos)
            torch.testing.assert_close(out[rows].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", WORLDS)
def test_random_placement_and_empty_ranks(pools, n):
    rng = np.random.default_rng(n)
    for trial in range(3):
        n_q, n_kv = int(rng.integers(1, 90)), int(rng.integers(1, 150))
        p = Problem(trial, n_q, n_kv)
        p.q_seq[:] = torch.from_numpy(rng.integers(0, 4, n_q))
        p.q_pos[:] = torch.from_numpy(rng.integers(0, 50, n_q))
        p.kv_seq[:] = torch.from_numpy(rng.integers(0, 4, n_kv))
        p.kv_pos[:] = torch.from_numpy(rng.integers(0, 50, n_kv))
        hole = int(rng.integers(0, n))  # this rank holds no queries
        q_owner = rng.choice([r for r in range(n) if r != hole] or [0], n_q)
        kv_owner = rng.integers(0, n, n_kv)
        q_idx = [rng.permutation(np.nonzero(q_owner == r)[0]) for r in range(n)]
        kv_idx = [rng.permutation(np.nonzero(kv_owner == r)[0]) for r in range(n)]
        for strategy in STRATEGIES:
            p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", WORLDS)
def test_queries_without_visible_keys_get_zeros(pools, n):
    p = Problem(7, 6, 8)
    p.q_seq[:] = torch.tensor([0, 1, 2, 3, 0, 0])
    p.q_pos[:] = torch.tensor([0, 0, 0, 0, 1, 2])
    p.kv_seq[:] = torch.tensor([0, 0, 0, 1, 1, 9, 9, 9])
    p.kv_pos[:] = torch.tensor([1, 2, 3, 5, 6, 0, 1, 2])  # seq 0 keys start at pos 1, seq 1 at 5, 2/3 absent
    q_idx = [np.arange(r, 6, n) for r in range(n)]
    kv_idx = [np.arange(r, 8, n) for r in range(n)]
    for strategy in STRATEGIES:
        out = p.solve(pools(n), q_idx, kv_idx, strategy)
        assert torch.equal(out[:4], torch.zeros_like(out[:4]))
        p.check(out)


# A prefix tree, segments numbered in DFS preorder: root 0 shared by branches 1, 2 and 5; branch 2 split into 3, 4.
TREE_PARENT = [-1, 0, 0, 2, 2, 0]
TREE_LENS = [21, 9, 6, 13, 1, 30]  # tokens per segment
LEAVES = [1, 3, 4, 5]


def tree_problem(seed, n, new_lens, placement):
    """Keys: every segment's tokens; queries: the last new_lens[i] tokens of leaf LEAVES[i] (partial prefill).

    placement "sharded": keys of each segment 2N-sharded as their own prefill, queries 2N-sharded;
    "random": every token on a random rank, in random order. Returns (problem, q_idx, kv_idx).
    """
    depth_start = [0] * len(TREE_PARENT)  # position of each segment's first token
    for s, par in enumerate(TREE_PARENT):
        if par >= 0:
            depth_start[s] = depth_start[par] + TREE_LENS[par]
    end = list(range(1, len(TREE_PARENT) + 1))  # end of each segment's subtree (preorder: descendants follow)
    for s in reversed(range(len(TREE_PARENT))):
        if TREE_PARENT[s] >= 0:
            end[TREE_PARENT[s]] = max(end[TREE_PARENT[s]], end[s])
    kv_off = np.cumsum([0] + TREE_LENS)
    p = Problem(seed, sum(new_lens), int(kv_off[-1]))
    p.kv_end = torch.zeros(int(kv_off[-1]), dtype=torch.long)
    for s, ln in enumerate(TREE_LENS):
        p.kv_seq[kv_off[s]:kv_off[s + 1]] = s
        p.kv_end[kv_off[s]:kv_off[s + 1]] = end[s]
        p.kv_pos[kv_off[s]:kv_off[s + 1]] = torch.arange(depth_start[s], depth_start[s] + ln)
    q_off = np.cumsum([0] + list(new_lens))
    for i, (leaf, t) in enumerate(zip(LEAVES, new_lens)):
        last = depth_start[leaf] + TREE_LENS[leaf]
        p.q_seq[q_off[i]:q_off[i + 1]] = leaf
        p.q_pos[q_off[i]:q_off[i + 1]] = torch.arange(last - t, last)
    # the interval encoding is exactly "key's segment is on the query's root path"
    on_path = np.zeros((len(p.q_seq), len(p.kv_seq)), dtype=bool)
    for qi, (leaf, pos) in enumerate(zip(p.q_seq.tolist(), p.q_pos.tolist())):
        path, s = set(), leaf
        while s >= 0:
            path.add(s)
            s = TREE_PARENT[s]
        on_path[qi] = [seg in path and kp <= pos for seg, kp in zip(p.kv_seq.tolist(), p.kv_pos.tolist())]
    assert np.array_equal(visible(p.q_seq.numpy(), p.q_pos.numpy(), p.kv_seq.numpy(), p.kv_pos.numpy(),
                                  p.kv_end.numpy()), on_path)
    rng = np.random.default_rng(seed)
    if placement == "random":
        q_owner, kv_owner = rng.integers(0, n, len(p.q_seq)), rng.integers(0, n, len(p.kv_seq))
        q_idx = [rng.permutation(np.nonzero(q_owner == r)[0]) for r in range(n)]
        kv_idx = [rng.permutation(np.nonzero(kv_owner == r)[0]) for r in range(n)]
        return p, q_idx, kv_idx
    kv_plan = shard_prefill(TREE_LENS, n)
    kv_idx = [kv_off[sh.seq[sh.valid]] + sh.pos[sh.valid] for sh in kv_plan.shards]
    q_idx = [sh.index for sh in shard_prefill(new_lens, n).shards]
    return p, q_idx, kv_idx


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_tree(pools, n, strategy):
    """Branches see the shared root (and branch 2's split sees branch 2) but never a sibling."""
    for placement, new_lens in (("sharded", [5, 13, 1, 30]), ("sharded", [1, 1, 1, 1]), ("random", [9, 4, 1, 17])):
        p, q_idx, kv_idx = tree_problem(n, n, new_lens, placement)
        p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


def test_shared_prefix_sends_only_keys_on_some_query_path():
    """pass-KV packs only keys whose interval holds some query's label: a leaf nobody queries stays home."""
    q_meta = [(np.array([3, 3]), np.array([40, 41])), (np.array([3]), np.array([42]))]
    kv_meta = [(np.array([0, 1, 2, 3]), np.array([0, 21, 21, 27]), np.array([6, 2, 5, 4])),
               (np.array([5, 0, 4]), np.array([21, 1, 27]), np.array([6, 6, 5]))]
    plan = plan_from_metadata(q_meta, kv_meta, group=None, rank=0, world=2, strategy="pass-kv")
    assert plan.metas[0].send.tolist() == [0, 2, 3] and plan.metas[1].send.tolist() == [1]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sliding_window(pools, n, strategy):
    """Windows of 1, 7 and 30 keys over prefills, partial prefills and a prefix tree (2N-sharded and random)."""
    for window in (1, 7, 30):
        p, q_idx, kv_idx = prefill_problem(n + window, [1, 5, 40, 1, 17, 97], [0, 33, 9, 120, 1, 0], n)
        p.window = window
        p.check(p.solve(pools(n), q_idx, kv_idx, strategy))
    for placement, new_lens in (("sharded", [5, 13, 1, 30]), ("random", [9, 4, 1, 17])):
        p, q_idx, kv_idx = tree_problem(n, n, new_lens, placement)
        p.window = 9
        p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sliding_window_decode_round_robin(pools, n):
    """Decode queries far past a window of 6: only the last keys (spread over the ranks) count."""
    lens, window = [40, 9, 70], 6
    p = Problem(n, len(lens), sum(lens))
    p.q_seq[:], p.q_pos[:] = torch.arange(3), torch.tensor(lens) - 1
    p.kv_seq[:] = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    p.kv_pos[:] = torch.cat([torch.arange(m) for m in lens])
    p.window = window
    kv_idx = [np.arange(r, sum(lens), n) for r in range(n)]  # round-robin placement of every key
    q_idx = [np.arange(r, 3, n) for r in range(n)]
    for strategy in ("pass-q", "pass-kv"):
        p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


def test_window_skips_pairs_steps_rows_and_tiles():
    """One 2N-sharded sequence of 8 chunks of W tokens at CP4 with window W: chunk c needs only chunks c - 1 and c,
    so rank r (chunks r, 7 - r) needs keys only from ranks r - 1 and r + 1 (not around the ring's ends): step 2
    is empty for every rank (no message), each pair moves at most W - 1 rows (pass-KV) or W queries (pass-Q), and
    the tiles cover the band only."""
    w, n = 64, 4
    plan = shard_prefill([8 * w], n)
    q_meta = [(sh.seq[sh.valid], sh.pos[sh.valid]) for sh in plan.shards]
    full = [plan_from_metadata(q_meta, q_meta, group=None, rank=r, world=n, strategy="pass-kv") for r in range(n)]
    for strategy in ("pass-kv", "pass-q"):
        plans = [plan_from_metadata(q_meta, q_meta, group=None, rank=r, world=n, strategy=strategy, window=w)
                 for r in range(n)]
        routes = plans[0].routes
        assert routes.empty_steps() == [2]
        for s in range(n):
            for r in range(n):
                count = routes.count(s, r)
                assert (count > 0) == (abs(r - s) == 1), (strategy, s, r)
                assert count <= (w - 1 if strategy == "pass-kv" else w)
        for r in range(n):
            assert not plans[r].steps[2]  # the skipped step has no kernel call either
            area = sum((it.q1 - it.q0) * (it.k1 - it.k0) for step in plans[r].steps for it in step)
            full_area = sum((it.q1 - it.q0) * (it.k1 - it.k0) for step in full[r].steps for it in step)
            assert area < 0.45 * full_area  # 2W tokens x W keys per query chunk, not a causal triangle over 8W


# (chunk, window, sinks?): sinks alone, chunks alone and with sinks, a chunk with a window (and sinks)
LOCAL_KINDS = [(None, None, True), (8, None, False), (13, None, True), (16, 5, True)]


def _local_kind(p, chunk, window, sinks, seed):
    p.chunk, p.window = chunk, window
    p.sinks = torch.randn(p.q.shape[1], generator=torch.Generator().manual_seed(seed)) * 2 if sinks else None
    return p


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunks_and_sinks(pools, n, strategy):
    """Chunks of 8-16 positions (much shorter than the sequences) and sinks, alone and together, and a chunk with a
    window: full and partial prefills in one batch, and a prefix tree (a chunk alone 2N-sharded; a chunk, a window
    and sinks with random placement), against the float64 softmax whose rows carry the sink's logit."""
    for i, (chunk, window, sinks) in enumerate(LOCAL_KINDS):
        p, q_idx, kv_idx = prefill_problem(n + i, [1, 5, 40, 1, 17, 97], [0, 33, 9, 120, 1, 0], n)
        _local_kind(p, chunk, window, sinks, i).check(p.solve(pools(n), q_idx, kv_idx, strategy))
    for i, (placement, new_lens) in ((1, ("sharded", [5, 13, 1, 30])), (3, ("random", [9, 4, 1, 17]))):
        p, q_idx, kv_idx = tree_problem(n + i, n, new_lens, placement)
        _local_kind(p, *LOCAL_KINDS[i], i).check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", WORLDS)
def test_chunks_and_sinks_decode_round_robin(pools, n):
    """Decode queries (one per sequence, on different ranks) with every key placed round-robin: chunk 8 cuts each
    context to its last chunk (a query first in its chunk sees only itself); sinks join once whatever the CP size."""
    lens = [40, 9, 70, 23]
    p = Problem(n, len(lens), sum(lens))
    p.q_seq[:], p.q_pos[:] = torch.arange(4), torch.tensor(lens) - 1
    p.kv_seq[:] = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    p.kv_pos[:] = torch.cat([torch.arange(m) for m in lens])
    kv_idx = [np.arange(r, sum(lens), n) for r in range(n)]
    q_idx = [np.arange(r, 4, n) for r in range(n)]
    for i, (chunk, window, sinks) in enumerate(LOCAL_KINDS):
        _local_kind(p, chunk, window, sinks, i)
        for strategy in STRATEGIES:
            p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


@pytest.mark.parametrize("n", [1, 3])
def test_sinks_give_zeros_to_queries_without_keys(pools, n):
    """A query with no visible key — another sequence's, before its first key, or alone in a chunk with no key of
    its own — gets exactly zeros with sinks (0 · anything, never NaN); the others match the reference."""
    p = Problem(7, 6, 8)
    p.q_seq[:] = torch.tensor([0, 1, 2, 0, 0, 1])
    p.q_pos[:] = torch.tensor([0, 0, 0, 17, 2, 21])  # pos 17: chunk [16, 24) holds no key of sequence 0
    p.kv_seq[:] = torch.tensor([0, 0, 0, 1, 1, 9, 9, 9])
    p.kv_pos[:] = torch.tensor([1, 2, 3, 5, 6, 0, 1, 2])
    p.chunk, p.sinks = 8, torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0, 0.2, 4.0])
    q_idx = [np.arange(r, 6, n) for r in range(n)]
    kv_idx = [np.arange(r, 8, n) for r in range(n)]
    for strategy in STRATEGIES:
        out = p.solve(pools(n), q_idx, kv_idx, strategy)
        assert torch.equal(out[:4], torch.zeros_like(out[:4]))
        p.check(out)


def test_chunk_skips_pairs_steps_rows_and_tiles():
    """One 2N-sharded sequence of 8 shards of W tokens at CP4 with chunk 2W: rank r holds shards r and 7 - r, and
    chunk c is shards 2c, 2c + 1, so the ranks pair up (0, 1) and (2, 3): step 2 is empty for every rank (no
    message), only the pairs within a couple move rows (one shard: W keys or W queries each), and the kernel calls
    cover 3 W x W blocks per rank (a causal square for the chunk's first shard, a full block and a causal square
    for its second) instead of the causal band of the whole sequence."""
    w, n = 64, 4
    plan = shard_prefill([8 * w], n)
    q_meta = [(sh.seq[sh.valid], sh.pos[sh.valid]) for sh in plan.shards]
    full = [plan_from_metadata(q_meta, q_meta, group=None, rank=r, world=n, strategy="pass-kv") for r in range(n)]
    pairs = {(0, 1), (1, 0), (2, 3), (3, 2)}
    for strategy in ("pass-kv", "pass-q"):
        plans = [plan_from_metadata(q_meta, q_meta, group=None, rank=r, world=n, strategy=strategy, chunk=2 * w)
                 for r in range(n)]
        routes = plans[0].routes
        assert routes.empty_steps() == [2]
        for s in range(n):
            for r in range(n):
                assert routes.count(s, r) == (w if (s, r) in pairs else 0), (strategy, s, r)
        for r in range(n):
            assert not plans[r].steps[2]
            area = sum((it.q1 - it.q0) * (it.k1 - it.k0) for step in plans[r].steps for it in step)
            full_area = sum((it.q1 - it.q0) * (it.k1 - it.k0) for step in full[r].steps for it in step)
            assert (area, full_area) == (3 * w * w, 10 * w * w), r  # full: 2W queries of the 8W causal band


def _bad_inputs(n):
    """(description, per-rank argument tuples, expected message fragment) — only the last rank is wrong."""
    good = lambda: [torch.randn(4, 8, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16),
                    torch.zeros(4, dtype=torch.long), torch.arange(4), torch.zeros(4, dtype=torch.long), torch.arange(4)]
    cases = []
    for what, idx, value, frag in [
        ("heads not divisible", 1, torch.randn(4, 3, 16), "multiple of key/value heads"),
        ("metadata length", 4, torch.arange(5), "q_pos has 5 entries"),
        ("negative position", 6, torch.tensor([0, -1, 2, 3]), "negative positions"),
        ("integer q", 0, torch.zeros(4, 8, 16, dtype=torch.long), "floating"),
        ("2-D k", 1, torch.randn(4, 16), "3-D"),
    ]:
        args = [tuple(good()) + ("pass-kv",) for _ in range(n)]
        bad = list(args[-1])
        bad[idx] = value
        if idx == 1:
            bad[2] = value.clone()
        args[-1] = tuple(bad)
        cases.append((what, args, frag))
    args = [tuple(good()) + ("ring-magic",) for _ in range(n)]
    cases.append(("unknown strategy", args, "unknown strategy"))
    args = [tuple(good()) + ("pass-q", None, torch.ones(4, dtype=torch.long)) for _ in range(n)]
    args[-1] = args[-1][:-1] + (torch.zeros(4, dtype=torch.long),)  # an empty interval [0, 0)
    cases.append(("empty kv interval", args, "kv_seq_end must be > kv_seq"))
    args = [tuple(good()) + ("pass-kv", None, None, "cpu-flash") for _ in range(n)]
    args[-1] = args[-1][:-1] + ("flash-attn",)  # not usable on a CPU rank
    cases.append(("backend unusable here", args, "cannot run on cpu"))
    args = [tuple(good()) + ("pass-q", None, None, "auto", 8) for _ in range(n)]
    args[-1] = args[-1][:-1] + (0,)
    cases.append(("window not positive", args, "window must be a positive integer"))
    args = [tuple(good()) + ("pass-kv", None, None, "auto", None, 8) for _ in range(n)]
    args[-1] = args[-1][:-1] + (-8,)
    cases.append(("chunk not positive", args, "chunk must be a positive integer"))
    args = [tuple(good()) + ("pass-q", None, None, "auto", None, None, torch.zeros(8)) for _ in range(n)]
    args[-1] = args[-1][:-1] + (torch.zeros(2),)
    cases.append(("a sink per KV head", args, "sinks has 2 entries but q has 8 heads"))
    return cases


@pytest.mark.parametrize("n", WORLDS)
def test_bad_input_raises_same_value_error_on_every_rank(pools, n):
    pool = pools(n)
    for what, args, frag in _bad_inputs(n):
        msgs = pool.run_each(rank_attention_catching, args)
        assert all(m is not None and frag in m for m in msgs), (what, msgs)
        assert len(set(msgs)) == 1, (what, msgs)
        assert f"rank {n - 1}" in msgs[0]
    if n > 1:  # ranks disagree on head_dim: detected from the exchanged shapes
        args = [(torch.randn(2, 4, 8 if r else 16), torch.randn(2, 4, 8 if r else 16), torch.randn(2, 4, 8 if r else 16),
                 torch.zeros(2, dtype=torch.long), torch.arange(2), torch.zeros(2, dtype=torch.long), torch.arange(2),
                 "pass-q") for r in range(n)]
        msgs = pool.run_each(rank_attention_catching, args)
        assert all("disagree on head_dim" in m for m in msgs)
        good = (torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.zeros(2, dtype=torch.long),
                torch.arange(2), torch.zeros(2, dtype=torch.long), torch.arange(2), "pass-kv", None, None, "auto")
        msgs = pool.run_each(rank_attention_catching, [good + (16 if r else None,) for r in range(n)])
        assert all("disagree on window" in m for m in msgs)
        args = [good[:2] + (torch.randn(2, 4, 8 if r else 6),) + good[3:] for r in range(n)]
        msgs = pool.run_each(rank_attention_catching, args)
        assert all("disagree on value head size" in m for m in msgs)
        # rank 0 passes its own v of 6 channels, the others the view k[..., :6]
        args = [good[:2] + (torch.randn(2, 4, 6),) + good[3:] + (None, None, None, 6 if r else None) for r in range(n)]
        msgs = pool.run_each(rank_attention_catching, args)
        assert all("disagree on whether v is the view" in m for m in msgs)

    # the group still works after the errors
    p, q_idx, kv_idx = prefill_problem(3, [11], [0], n)
    p.check(p.solve(pool, q_idx, kv_idx, "pass-kv"))


def test_remote_error_reports_rank():
    with WorkerPool(2, timeout_s=30) as pool:
        with pytest.raises(RemoteError, match="ValueError"):
            pool.run(rank_attention, torch.randn(2, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8),
                     torch.zeros(2, dtype=torch.long), torch.arange(2), torch.zeros(2, dtype=torch.long),
                     torch.arange(2), "pass-kv")


# value head size != key head size: (h, hkv, Dv, v is k[..., :Dv]) — MLA's shape (one KV head of latent + rotary
# key, the latent also the value), a separate narrower value, a wider one
VALUE_KINDS = [(8, 1, 12, True), (8, 2, 8, False), (4, 2, 24, False)]


@pytest.mark.parametrize("n", WORLDS)
def test_value_head_size_differs(pools, n):
    """Dv != Dk under every strategy: full + partial prefill, a prefix tree (sharded and random placement), chunks
    with sinks, a window, and round-robin decode; with v = k[..., :Dv] the K/V messages carry the keys alone."""
    for i, (h, hkv, dv, in_keys) in enumerate(VALUE_KINDS):
        for strategy in STRATEGIES:
            p, q_idx, kv_idx = prefill_problem(50 + n + i, [1, 5, 40, 17], [0, 33, 9, 1], n, hkv=hkv, h=h)
            p.with_values(dv, in_keys).check(p.solve(pools(n), q_idx, kv_idx, strategy))
            chunk, window, sinks = LOCAL_KINDS[(i + STRATEGIES.index(strategy)) % len(LOCAL_KINDS)]
            _local_kind(p, chunk, window, sinks, i).check(p.solve(pools(n), q_idx, kv_idx, strategy))
            p, q_idx, kv_idx = tree_problem(60 + n + i, n, [5, 13, 1, 30], ("sharded", "random")[i % 2])
            p.with_values(dv, in_keys).check(p.solve(pools(n), q_idx, kv_idx, strategy))
        p = Problem(70 + i, 3, 40, h=h, hkv=hkv).with_values(dv, in_keys)  # decode: one query per sequence
        p.q_seq[:], p.q_pos[:] = torch.arange(3), torch.tensor([12, 7, 20])
        p.kv_seq[:] = torch.arange(40) % 3
        p.kv_pos[:] = torch.arange(40) // 3
        q_idx = [np.arange(r, 3, n) for r in range(n)]
        kv_idx = [np.arange(r, 40, n) for r in range(n)]
        for strategy in STRATEGIES:
            p.check(p.solve(pools(n), q_idx, kv_idx, strategy))


def test_values_in_keys_messages_carry_keys_once():
    """The packed K/V row of v = k[..., :Dv] is the key alone; a separate v adds its Dv channels."""
    from cpinfer.attention.kv_pack import pack_rows, row_width, same_head_size, unpack_rows, values_in_keys

    k = torch.randn(5, 1, 24)
    v = k[..., :16]
    assert values_in_keys(k, v) and not values_in_keys(k, v.clone()) and values_in_keys(k[:0], v[:0]) is None
    assert row_width(24, 16, True) == 24 and row_width(24, 16, False) == 40
    rows = pack_rows(k, v, True, idx=torch.tensor([4, 1]))
    assert rows.shape == (2, 1, 24)
    k2, v2 = unpack_rows(rows, 24, 16)
    torch.testing.assert_close(v2, k[[4, 1], :, :16])
    v_own = torch.randn(5, 1, 16)
    k3, v3 = unpack_rows(pack_rows(k, v_own, False), 24, 16)
    assert torch.equal(k3, k) and torch.equal(v3, v_own)
    q = torch.randn(3, 4, 24)
    assert same_head_size(q, k, v)[2] is k  # the keys serve as values; the output's first Dv channels are P·v
