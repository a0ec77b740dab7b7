"""`cp_attention` on 1-4 gloo ranks (one spawn per world size) against a float64 single-device reference."""
import numpy as np
import pytest
import torch

from cpinfer.attention.local import reference_attention
from cpinfer.cp import STRATEGIES, cp_attention
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


def rank_attention(ctx, q, k, v, q_seq, q_pos, kv_seq, kv_pos, strategy, scale=None):
    return cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=ctx.group, strategy=strategy, scale=scale)


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

    def solve(self, pool, q_idx, kv_idx, strategy):
        """q_idx[r], kv_idx[r]: index arrays of rank r's queries / keys (-1 = padding). Returns out [n_q, H, D]."""
        args = []
        for qi, ki in zip(q_idx, kv_idx):
            qi, ki = torch.as_tensor(np.asarray(qi), dtype=torch.long), torch.as_tensor(np.asarray(ki), dtype=torch.long)
            qp, kp = qi < 0, ki < 0
            qc, kc = qi.clamp(min=0), ki.clamp(min=0)
            args.append((self.q[qc], self.k[kc], self.v[kc],
                         self.q_seq[qc].masked_fill(qp, -1), self.q_pos[qc].masked_fill(qp, 0),
                         self.kv_seq[kc].masked_fill(kp, -1), self.kv_pos[kc].masked_fill(kp, 0), strategy))
        outs = pool.run_each(rank_attention, args)
        full = torch.full_like(self.q, float("nan"))
        for qi, out in zip(q_idx, outs):
            qi = torch.as_tensor(np.asarray(qi), dtype=torch.long)
            assert out.shape == (len(qi),) + self.q.shape[1:]
            assert not torch.isnan(out).any()
            full[qi[qi >= 0]] = out[qi >= 0]
        return full

    def check(self, out):
        ref, _ = reference_attention(self.q, self.k, self.v, self.q_seq, self.q_pos, self.kv_seq, self.kv_pos)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


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
    # the group still works after the errors
    p, q_idx, kv_idx = prefill_problem(3, [11], [0], n)
    p.check(p.solve(pool, q_idx, kv_idx, "pass-kv"))


def test_remote_error_reports_rank():
    with WorkerPool(2, timeout_s=30) as pool:
        with pytest.raises(RemoteError, match="ValueError"):
            pool.run(rank_attention, torch.randn(2, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8),
                     torch.zeros(2, dtype=torch.long), torch.arange(2), torch.zeros(2, dtype=torch.long),
                     torch.arange(2), "pass-kv")
