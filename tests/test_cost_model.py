"""The shared ring cost model (cpinfer/cp/cost_model.py, ring_shape.py): the pair geometry against a brute-force
count of the visibility rule, the SendRecv / All2All / merge physics, sliding windows, the per-forward API that the
heuristic and the engine call, and the layering (cp/ imports nothing from perf/, the model needs no torch)."""
from __future__ import annotations

import ast
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cpinfer
from cpinfer.cp import cost_model
from cpinfer.cp.cost_model import AttnShape, Link, predict_attention, ring_cost
from cpinfer.cp.ring_shape import RingShape
from cpinfer.perf.catalog import HARDWARE

GTT = HARDWARE["h100-gtt"]
SHAPE = AttnShape(16, 1, 128, 2, partial_bytes=2)  # one GPU of Llama3-405B under TP8, bf16 partial outputs


# --- geometry against the visibility rule itself ---------------------------------------------------------------
def _new_positions(ring: RingShape, rank: int) -> np.ndarray:
    c = ring.chunk
    return np.concatenate([np.arange(a * c, (a + 1) * c) for a in ring.chunks_of(rank)])


def _brute_pairs(ring: RingShape, q_rank: int, kv_rank: int) -> float:
    """Pairs by the rule (key j visible to query i iff j <= i, windowed i - j < W, chunked (i + P) // C ==
    (j + P) // C); positions relative to P, cached keys at -P..-1 of which kv_rank holds its share."""
    qi = _new_positions(ring, q_rank)[:, None]
    kj = _new_positions(ring, kv_rank)[None, :]
    visible = kj <= qi
    cached = np.arange(-ring.cached, 0)[None, :]
    seen = np.ones((len(qi), ring.cached), dtype=bool)
    if ring.window:
        visible &= qi - kj < ring.window
        seen = qi - cached < ring.window
    if ring.attention_chunk:
        block = (lambda x: (x + ring.cached) // ring.attention_chunk)  # noqa: E731
        visible &= block(qi) == block(kj)
        seen &= block(qi) == block(cached)
    share = ring.cached_on(kv_rank) / ring.cached if ring.cached else 0.0
    return int(visible.sum()) + int(seen.sum()) * share


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 6), t=st.integers(1, 200), p=st.integers(0, 300), w=st.integers(0, 150),
       c=st.sampled_from([0, 0, 1, 7, 16, 64, 1000]))
def test_pairs_follow_the_visibility_rule(n, t, p, w, c):
    ring = RingShape(n, t, p, w, c)
    for q in range(n):
        for k in range(n):
            assert ring.visible_pairs(q, k) == pytest.approx(_brute_pairs(ring, q, k), rel=1e-12, abs=1e-9)
    for j in range(n):  # the slowest rank of every step (closed form without a window)
        assert ring.step_pairs(j) == pytest.approx(max(ring.visible_pairs(r, (r - j) % n) for r in range(n)))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), t=st.integers(1, 500), p=st.integers(0, 300))
def test_ring_pairs_cover_the_padded_causal_matrix(n, t, p):
    ring = RingShape(n, t, p)
    padded = 2 * n * ring.chunk
    assert ring.padding == padded - t
    assert ring.total_pairs() == padded * (padded + 1) // 2 + padded * p
    assert sum(ring.cached_on(r) for r in range(n)) == p


def test_load_balanced_full_prefill_gives_every_rank_equal_work_per_step():
    ring = RingShape(4, 8 * 100, 0)
    c = ring.chunk
    for q in range(4):
        for k in range(4):
            assert ring.visible_pairs(q, k) == (2 * c * c if q != k else c * c + c * (c + 1))


def test_a_window_longer_than_the_context_changes_nothing():
    assert RingShape(4, 4000, 9000, 13001).total_pairs() == RingShape(4, 4000, 9000).total_pairs()
    short = RingShape(4, 4000, 0, 100)  # W << c = 500: own chunks, and the neighbours' last 99 keys
    assert [short.step_pairs(j) > 0 for j in range(4)] == [True, True, False, True]
    with pytest.raises(ValueError, match="window"):
        RingShape(2, 10, 0, -1)


# --- physics of the components ---------------------------------------------------------------------------------
def test_all2all_posts_every_peer_at_once():
    """(N-1) latencies one after another, the bytes concurrently: each flow at most the SendRecv rate, all of them
    within the device's line rate."""
    link = Link(bandwidth=12e9, latency=30e-6, aggregate=50e9)
    m = 10e6
    assert cost_model.all2all_time(m, 4, link) == pytest.approx(3 * 30e-6 + m / 12e9)          # per-flow bound
    assert cost_model.all2all_time(m, 16, link) == pytest.approx(15 * 30e-6 + 15 * m / 50e9)   # line-rate bound
    assert cost_model.all2all_time(m, 1, link) == 0.0 and cost_model.all2all_time(0, 4, link) == 0.0


def test_pass_q_sends_q_and_pays_all2all_permute_and_merge_of_partial_outputs():
    ring = RingShape(4, 12800, 115200)
    kv, q = (ring_cost(GTT, SHAPE, ring, s, tp=8) for s in ("pass-kv", "pass-q"))
    lq = ring.q_tokens
    assert kv.attention == pytest.approx(q.attention, rel=1e-12)           # the same pairs, met the other way
    assert kv.message_bytes == SHAPE.kv_bytes(ring.max_kv_tokens) and q.message_bytes == SHAPE.q_bytes(lq)
    per_peer = lq * 16 * (128 * 2 + 4)                                      # bf16 outputs + fp32 LSE (App. C)
    link = GTT.ring_link(4, 8)
    assert q.all2all == pytest.approx(cost_model.all2all_time(per_peer, 4, link)) and kv.all2all == 0.0
    rate = GTT.mem_tbps * 1e12 * GTT.mem_efficiency
    merge = (4 * per_peer + SHAPE.q_bytes(lq)) / rate
    assert kv.merge == pytest.approx(merge) and q.merge == pytest.approx(merge + 2 * 3 * per_peer / rate)
    fp32 = ring_cost(GTT, dataclasses.replace(SHAPE, partial_bytes=4), ring, "pass-q", tp=8)
    assert fp32.all2all > q.all2all  # cpinfer's fp32 partials move twice the output bytes


def test_exposed_transfer_is_what_the_step_cannot_hide():
    ring = RingShape(4, 3200, 124800)  # 2.5% miss: pass-KV's 16 MB of K/V per step outlast the attention
    kv = ring_cost(GTT, SHAPE, ring, "pass-kv", tp=8)
    steps = [cost_model.attention_time(GTT, SHAPE, ring.step_pairs(j), ring.q_tokens, ring.max_kv_tokens)
             for j in range(4)]
    assert kv.sendrecv_exposed == pytest.approx(sum(kv.step_sendrecv - s for s in steps[:3]))
    assert kv.ring_steps == pytest.approx(4 * GTT.ring_step_us * 1e-6)
    assert kv.total == pytest.approx(kv.attention + kv.sendrecv_exposed + kv.ring_steps + kv.merge)


def test_windowed_layer_computes_only_what_its_window_shows():
    full = ring_cost(GTT, SHAPE, RingShape(8, 128000, 0), "pass-kv", tp=8)
    win = ring_cost(GTT, SHAPE, RingShape(8, 128000, 0, 1024), "pass-kv", tp=8)
    assert win.attention < full.attention / 10
    assert win.steps_run == 8  # the neighbour on the far side of the ring is 7 hops away: every step relays
    assert win.sendrecv_exposed > full.sendrecv_exposed  # nothing left to hide the K/V transfers under


def test_chunked_layer_computes_only_its_chunks():
    """32K tokens 2N-sharded at CP4 with chunk 8K (Llama 4's local layers): each query sees its own chunk only, so
    the pairs are 4 triangles of 8K instead of one of 32K, step 2 pairs nothing, and mixing layers sums them."""
    ring = RingShape(4, 32768, 0, attention_chunk=8192)
    assert ring.total_pairs() == 4 * 8192 * 8193 // 2
    assert ring.step_pairs(2) == 0 and ring.step_pairs(1) > 0 and ring.step_pairs(3) > 0
    assert RingShape(2, 32768, 0, attention_chunk=8192).step_pairs(1) == 0  # CP2: no key crosses ranks
    full = ring_cost(GTT, SHAPE, RingShape(4, 32768, 0), "pass-kv", tp=8)
    chunked = ring_cost(GTT, SHAPE, ring, "pass-kv", tp=8)
    assert chunked.attention < full.attention / 2  # 3 of 4 steps, each about half a full step
    got = predict_attention(GTT, SHAPE, new=32768, cached=0, ranks=4, tp=8, layers=4, chunk=8192, chunk_layers=3,
                            strategy="pass-kv")
    assert got.seconds == pytest.approx(full.total + 3 * chunked.total)


# --- the per-forward API ---------------------------------------------------------------------------------------
def test_predict_attention_picks_the_faster_and_sums_the_layers():
    got = predict_attention(GTT, SHAPE, new=3200, cached=124800, ranks=4, tp=8, layers=126)
    costs = {s: got.per_layer[s]["full"].total for s in ("pass-kv", "pass-q")}
    assert got.strategy == min(costs, key=costs.get) == "pass-q"
    assert got.seconds == pytest.approx(126 * costs["pass-q"])
    forced = predict_attention(GTT, SHAPE, new=3200, cached=124800, ranks=4, tp=8, layers=126, strategy="pass-kv")
    assert forced.strategy == "pass-kv" and forced.seconds > got.seconds
    mixed = predict_attention(GTT, SHAPE, new=8192, cached=0, ranks=2, tp=8, layers=6, window=512, window_layers=5)
    parts = mixed.per_layer[mixed.strategy]
    assert mixed.seconds == pytest.approx(parts["full"].total + 5 * parts["window"].total)


def test_one_rank_is_local_attention_without_communication():
    got = predict_attention(GTT, SHAPE, new=4096, cached=1000, ranks=1, layers=2)
    cost = got.per_layer["pass-kv"]["full"]
    assert got.strategy == "local"
    assert cost.sendrecv_exposed == cost.ring_steps == cost.all2all == cost.merge == 0.0
    assert got.seconds == pytest.approx(2 * cost.attention)


def test_spreading_pays_for_long_prompts_not_for_short_ones():
    """The placement question of the engine (issue 18): attention + ring of T new tokens on N ranks vs one."""
    def gain(t, n):
        one = predict_attention(GTT, SHAPE, new=t, cached=0, ranks=1, tp=8).seconds
        return one / predict_attention(GTT, SHAPE, new=t, cached=0, ranks=n, tp=8).seconds
    assert gain(128000, 4) > 3.0
    assert gain(64, 4) < 1.0  # per-step costs and latencies dwarf 64 tokens of attention


def test_predict_attention_is_cheap_enough_to_call_per_forward():
    kw = dict(new=3000, cached=90000, ranks=8, tp=8, layers=80)
    predict_attention(GTT, SHAPE, **kw)
    start = time.process_time()  # this process's CPU time: the call's cost, not the wait for a core on a busy machine
    for i in range(200):
        predict_attention(GTT, SHAPE, **(kw | {"new": 3000 + i}))
    assert (time.process_time() - start) / 200 < 2e-3


@pytest.mark.parametrize("kw,msg", [
    (dict(window_layers=3, layers=2), "window_layers"), (dict(window_layers=1), "positive window"),
    (dict(chunk_layers=1), "positive chunk"), (dict(window=8, window_layers=1, chunk=8, chunk_layers=1), "layers=1"),
    (dict(strategy="ring"), "strategy"),
])
def test_predict_attention_rejects_bad_input(kw, msg):
    with pytest.raises(ValueError, match=msg):
        predict_attention(GTT, SHAPE, **({"new": 10, "cached": 0, "ranks": 2} | kw))


def test_attention_shape_validates_itself():
    with pytest.raises(ValueError, match="partial_bytes"):
        AttnShape(16, 1, 128, 2, partial_bytes=0)
    with pytest.raises(ValueError, match="multiple"):
        AttnShape(12, 5, 128, 2)


# --- layering ---------------------------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = ".".join(path.relative_to(Path(cpinfer.__file__).parent.parent).with_suffix("").parts[:-1])
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
    return out


CP_DIR = Path(cpinfer.__file__).parent / "cp"


@pytest.mark.parametrize("path", sorted(CP_DIR.glob("*.py")), ids=lambda p: p.name)
def test_cp_imports_nothing_from_perf(path):
    """cp/ is the lower floor: the planner (perf/) imports the shared cost model from it, never the reverse."""
    assert not {m for m in _imports(path) if m == "cpinfer.perf" or m.startswith("cpinfer.perf.")}


@pytest.mark.parametrize("name", ["cost_model.py", "ring_shape.py", "heuristics.py"])
def test_the_cost_model_needs_no_torch(name):
    assert not {m for m in _imports(CP_DIR / name) if m.split(".")[0] == "torch"}
