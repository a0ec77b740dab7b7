"""Attention backends by name, tile tables and plan step vectors (metadata only; no Triton needed)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cpinfer.attention import backends
from cpinfer.attention.backends import ENV_VAR, attend_local, resolve_name
from cpinfer.attention.local import FULL, build_items, reference_attention, visible
from cpinfer.attention.tiles import tile_table
from cpinfer.cp import STRATEGIES, plan_from_metadata

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_resolves_by_device_and_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_name("auto", CPU) == "cpu-flash"
    assert resolve_name(None, CPU) == "cpu-flash"
    from cpinfer.attention import flash_backend

    monkeypatch.setattr(flash_backend, "detect", lambda: None)  # flash-attn absent (or broken)
    assert resolve_name("auto", CUDA) == "triton"
    monkeypatch.setattr(flash_backend, "detect", lambda: flash_backend.FlashAPI("flash-attn 2.7.4", None, False))
    assert resolve_name("auto", CUDA) == "flash-attn"
    monkeypatch.setenv(ENV_VAR, "math")
    assert resolve_name("auto", CPU) == "math"
    assert resolve_name("cpu-flash", CPU) == "cpu-flash"  # an explicit name wins over the env var
    monkeypatch.setenv(ENV_VAR, "fast-please")
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast-please' \(from \$CPINFER_ATTENTION"):
        resolve_name("auto", CPU)


def test_unusable_backends_raise_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="allowed: auto, cpu-flash, triton, flash-attn, torch-cudnn, torch-flash, math"):
        resolve_name("flash", CPU)
    with pytest.raises(ValueError, match="torch-flash needs a CUDA device"):
        resolve_name("torch-flash", CPU)
    with pytest.raises(ValueError, match="cpu-flash is the CPU kernel"):
        resolve_name("cpu-flash", CUDA)
    with pytest.raises(ValueError, match="flash-attn needs a CUDA device"):
        resolve_name("flash-attn", CPU)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backends, "_has", lambda m: True)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_name("triton", CPU)


@pytest.mark.parametrize("name", ["cpu-flash", "math"])
def test_item_backends_by_name_match_reference(name):
    """attend_local by name, and merging a second key block into the first's partial."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(30, 6, 8, generator=g), torch.randn(50, 2, 8, generator=g), torch.randn(50, 2, 8, generator=g)
    q_seq, q_pos = torch.zeros(30, dtype=torch.long), torch.arange(20, 50)
    kv_seq, kv_pos = torch.zeros(50, dtype=torch.long), torch.arange(50)
    acc = attend_local(q, k[:25], v[:25], q_seq, q_pos, kv_seq[:25], kv_pos[:25], backend=name)
    out, lse = attend_local(q, k[25:], v[25:], q_seq, q_pos, kv_seq[25:], kv_pos[25:], backend=name, acc=acc)
    ref_out, ref_lse = reference_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def _covered(table, n_rows, n_keys):
    """Dense [rows, keys] bool of what the programs of a tile table visit; checks rows and ranges are disjoint."""
    seen = np.zeros((n_rows, n_keys), dtype=bool)
    owner = np.zeros(n_rows, dtype=int)
    for t in range(table.num_programs):
        owner[table.row0[t]:table.row1[t]] += 1
        ranges = table.key_ranges(t)
        assert all(a < b for a, b in ranges) and all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))
        for a, b in ranges:
            seen[table.row0[t]:table.row1[t], a:b] = True
    assert owner.max(initial=0) <= 1  # one program per query row: it may merge into the running result alone
    return seen


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 150), st.integers(0, 300), st.integers(1, 40), st.booleans())
def test_tile_table_covers_every_visible_pair_and_nothing_outside_items(seed, lq, lk, rows, sorted_runs):
    rng = np.random.default_rng(seed)
    if sorted_runs:
        q_seq, kv_seq = np.sort(rng.integers(0, 3, lq)), np.sort(rng.integers(0, 3, lk))
        q_pos, kv_pos = np.sort(rng.choice(400, lq, replace=False)), np.sort(rng.choice(400, lk, replace=False))
    else:
        q_seq, kv_seq = rng.integers(-1, 3, lq), rng.integers(-1, 3, lk)
        q_pos, kv_pos = rng.integers(0, 60, lq), rng.integers(0, 60, lk)
    kv_end = kv_seq + rng.integers(1, 3, lk)  # some keys visible to the next label too
    items = build_items(q_seq, q_pos, kv_seq, kv_pos, kv_end)
    seen = _covered(tile_table(items, lq, rows), lq, lk)
    vis = visible(q_seq, q_pos, kv_seq, kv_pos, kv_end)
    assert not (vis & ~seen).any()  # a visible pair outside the table would be lost
    allowed = np.zeros((lq, lk), dtype=bool)  # a program visits only keys some item gives one of its rows
    for it in items:
        b0, b1 = it.q0 // rows * rows, min(lq, -(-it.q1 // rows) * rows)
        allowed[b0:b1, it.k0:it.k1] = True
    assert not (seen & ~allowed).any()


def test_tile_table_merges_ranges_and_cuts_programs_at_item_edges():
    class It:  # duck-typed items: rows [q0, q1) with keys [k0, k1)
        def __init__(self, q0, q1, k0, k1):
            self.q0, self.q1, self.k0, self.k1 = q0, q1, k0, k1

    tab = tile_table([It(0, 20, 0, 50), It(0, 20, 40, 80), It(0, 20, 90, 95), It(40, 41, 5, 6)], 41, 32)
    assert tab.row0.tolist() == [0, 40] and tab.row1.tolist() == [20, 41]  # rows no item covers: no program
    assert tab.key_ranges(0) == [(0, 80), (90, 95)] and tab.key_ranges(1) == [(5, 6)]
    decode = [It(b, b + 1, 100 * b, 100 * b + 50) for b in range(5)]  # one query row per sequence
    tab = tile_table(decode, 5, 16)  # programs are cut at item edges: each sequence visits only its context
    assert tab.row0.tolist() == list(range(5)) and [tab.key_ranges(t) for t in range(5)] == [
        [(100 * b, 100 * b + 50)] for b in range(5)]


def _world_meta(world, seed):
    """Random metadata per rank: (q_meta, kv_meta with interval ends), sorted runs and a shuffled rank."""
    rng = np.random.default_rng(seed)
    q_meta, kv_meta = [], []
    for r in range(world):
        lq, lk = int(rng.integers(0, 40)), int(rng.integers(0, 60))
        q_meta.append((rng.integers(0, 4, lq), rng.integers(0, 50, lq)))
        ks = rng.integers(-1, 4, lk)
        kv_meta.append((ks, rng.integers(0, 50, lk), ks + rng.integers(1, 3, lk)))
    return q_meta, kv_meta


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_step_vectors_describe_each_steps_items(strategy, world):
    """Per step: items stay inside the vectors, FULL items are fully visible, every visible pair is in an item;
    over all steps a query sees exactly the keys of every rank that the contract makes visible."""
    q_meta, kv_meta = _world_meta(world, world * 7 + len(strategy))
    all_kv = [np.concatenate([m[i] for m in kv_meta]) for i in range(3)]
    for rank in range(world):
        plan = plan_from_metadata(q_meta, kv_meta, group=None, rank=rank, world=world, strategy=strategy)
        for j, items in enumerate(plan.steps):
            qs, qp, ks, ke, kp = plan.step_vectors(j)
            src = plan.source(j)
            want_q = q_meta[src] if strategy == "pass-q" else q_meta[rank]
            assert np.array_equal(qs, want_q[0]) and np.array_equal(qp, want_q[1])
            vis = visible(qs, qp, ks, kp, ke)
            cover = np.zeros_like(vis)
            for it in items:
                assert 0 <= it.q0 < it.q1 <= len(qs) and 0 <= it.k0 < it.k1 <= len(ks)
                cover[it.q0:it.q1, it.k0:it.k1] = True
                if it.kind == FULL:
                    assert vis[it.q0:it.q1, it.k0:it.k1].all()
            assert not (vis & ~cover).any()
        if strategy != "pass-q":  # my queries' visible keys over all steps = the contract over the whole group
            got = sum(visible(*plan.step_vectors(j)[:2], plan.step_vectors(j)[2], plan.step_vectors(j)[4],
                              plan.step_vectors(j)[3]).sum(axis=1) for j in range(world))
            want = visible(q_meta[rank][0], q_meta[rank][1], all_kv[0], all_kv[1], all_kv[2]).sum(axis=1)
            assert np.array_equal(got, want)


def test_tile_table_cuts_causal_squares_per_block():
    """One 100-token causal square in blocks of 16 rows: block b visits keys [0, 16(b+1)) only."""
    items = build_items(np.zeros(100), np.arange(100), np.zeros(100), np.arange(100))
    tab = tile_table(items, 100, 16)
    assert [tab.key_ranges(t) for t in range(tab.num_programs)] == [[(0, min(100, 16 * (b + 1)))] for b in range(7)]


def test_per_item_kernel_lookup_by_name(monkeypatch):
    """Per-item kernels by name: `kernels.kernel_by_name` (cpu-flash, math; None by device) and
    `backends.item_kernel`, which also resolves "auto" and refuses what the device cannot run."""
    from cpinfer.attention.backends import item_kernel
    from cpinfer.attention.kernels import cpu_flash_backend, kernel_by_name, sdpa_math_backend

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert item_kernel("auto", CPU) is cpu_flash_backend and kernel_by_name(None, CUDA) is sdpa_math_backend
    assert item_kernel("math", CPU) is sdpa_math_backend and kernel_by_name("cpu-flash", CPU) is cpu_flash_backend
    with pytest.raises(ValueError, match="needs a CUDA device"):
        item_kernel("flash-attn", CPU)
    with pytest.raises(ValueError, match="not a per-item kernel"):
        kernel_by_name("triton", CPU)


def test_attention_modules_import_without_a_cycle():
    """The attention package is layered (items, kernels ← local ← tiles ← step ← triton / flash backends ←
    backends): no module imports, even lazily inside a function, one that imports it back."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "cpinfer" / "attention"
    graph = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):  # every import, also those inside functions
            if isinstance(node, ast.ImportFrom) and node.module == "cpinfer.attention":
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpinfer.attention."):
                deps.add(node.module.split(".")[-1])
        graph[path.stem] = deps - {path.stem}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in graph.get(a, ()))

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}: {graph}"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 120), st.integers(1, 200), st.integers(1, 40))
def test_item_table_is_exactly_the_full_and_causal_items(seed, lq, lk, rows):
    """Item mode: each (row, key) pair of a FULL / CAUSAL item is visited once, nothing else is."""
    from cpinfer.attention.local import CAUSAL, MASK
    from cpinfer.attention.tiles import item_table

    rng = np.random.default_rng(seed)
    q_seq, kv_seq = np.sort(rng.integers(0, 3, lq)), np.sort(rng.integers(0, 3, lk))
    q_pos, kv_pos = np.sort(rng.choice(300, lq, replace=False)), np.sort(rng.choice(300, lk, replace=False))
    items = [it for it in build_items(q_seq, q_pos, kv_seq, kv_pos) if it.kind != MASK]
    want = np.zeros((lq, lk), dtype=int)
    for it in items:
        block = np.ones((it.q1 - it.q0, it.k1 - it.k0), dtype=bool)
        want[it.q0:it.q1, it.k0:it.k1] += np.tril(block) if it.kind == CAUSAL else block
    tab = item_table(items, lq, rows)
    got = np.zeros((lq, lk), dtype=int)
    for t in range(tab.num_programs):
        for r in range(tab.off[t], tab.off[t + 1]):
            assert tab.row0[t] <= tab.r0[r] < tab.r1[r] <= tab.row1[t]
            i, j = np.arange(tab.r0[r], tab.r1[r])[:, None], np.arange(tab.k0[r], tab.k1[r])[None, :]
            got[tab.r0[r]:tab.r1[r], tab.k0[r]:tab.k1[r]] += (j - i) <= tab.diag[r]
    assert np.array_equal(got, want) and want.max(initial=0) <= 1


def test_bench_gpu_plan_only_runs_on_cpu_and_refuses_kernels_without_cuda(capsys):
    import argparse

    from cpinfer.bench import gpu

    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    assert gpu.run(parser.parse_args(["--plan-only", "--tokens", "512", "--json"])) == 0
    out = capsys.readouterr().out
    rows = __import__("json").loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["tokens"], r["cp"]) for r in rows] == [(512, 1), (512, 8)] and all(r["programs"] > 0 for r in rows)
    if not torch.cuda.is_available():
        assert gpu.run(parser.parse_args(["--tokens", "512"])) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out
    assert gpu.causal_flops(4, 2, 8) == 4 * 2 * 8 * 10  # 10 visible (query, key) pairs in a 4-token causal square


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 60), st.integers(1, 200), st.integers(1, 50))
def test_split_table_keeps_every_pair_once_in_small_pieces(seed, lq, lk, split_keys):
    from cpinfer.attention.local import MASK
    from cpinfer.attention.tiles import item_table, split_table

    rng = np.random.default_rng(seed)
    q_seq, kv_seq = np.sort(rng.integers(0, 3, lq)), np.sort(rng.integers(0, 3, lk))
    q_pos, kv_pos = np.sort(rng.choice(300, lq, replace=False)), np.sort(rng.choice(300, lk, replace=False))
    items = [it for it in build_items(q_seq, q_pos, kv_seq, kv_pos) if it.kind != MASK]
    tab = item_table(items, lq, 8)

    def dense(t):
        got = np.zeros((lq, lk), dtype=int)
        for r in range(len(t.k0)):
            i, j = np.arange(t.r0[r], t.r1[r])[:, None], np.arange(t.k0[r], t.k1[r])[None, :]
            got[t.r0[r]:t.r1[r], t.k0[r]:t.k1[r]] += (j - i) <= t.diag[r]
        return got

    new, slot, n_slots = split_table(tab, split_keys)
    assert np.array_equal(dense(new), dense(tab))
    sizes = [int((new.k1[new.off[t]:new.off[t + 1]] - new.k0[new.off[t]:new.off[t + 1]]).sum())
             for t in range(new.num_programs)]
    assert max(sizes, default=0) <= split_keys
    for r0 in np.unique(new.row0):  # pieces of one row block: slots 0..c-1, or -1 when it was not cut
        s = slot[new.row0 == r0]
        assert s.tolist() == [-1] or s.tolist() == list(range(len(s)))
    assert n_slots == max((len(slot[new.row0 == r]) for r in np.unique(new.row0) if (slot[new.row0 == r] >= 0).any()),
                          default=0)
