"""Decode under CUDA graphs (issue 16, Must 5), checked on CPU: the static-shape decode path — what a CUDA graph
captures per batch-size bucket — run eagerly (its attention in Triton's interpreter) gives token for token the
output of the dynamic path and log-probs equal within fp32 rounding, at CP1 and CP2, with sliding windows, padded
buckets, split-KV pieces and prefix sharing; its tile tables cover every visible key exactly once; the
`enforce_eager` / `--enforce-eager` switch. On a CUDA machine one more test compares graphs with eager decode.
"""
import argparse
import os
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the pool spawns: the static path's attention is Triton's
pytest.importorskip("triton", reason="the static decode path's attention is the Triton kernel")

from cpinfer import LLM, SamplingParams  # noqa: E402
from cpinfer.engine.decode_tables import bucket_sizes, split_rows  # noqa: E402
from cpinfer.engine.startup import EngineStartup  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402
from pooled_engine import PooledLLM  # noqa: E402

pytest.importorskip("transformers")


def test_bucket_sizes():
    assert bucket_sizes(64) == [1, 2, 4] + list(range(8, 65, 8))
    assert bucket_sizes(3) == [1, 2, 3] and bucket_sizes(1) == [1] and bucket_sizes(13) == [1, 2, 4, 8, 13]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 6), st.integers(1, 5))
def test_split_rows_covers_each_row_key_once(seed, rows, pieces):
    """Every key of a row's runs is visited once, by one of that row's `pieces` programs; padded rows' programs
    and rows without keys visit nothing; programs are (row, part) in order, each part's keys about equal."""
    rng = np.random.default_rng(seed)
    n_real = int(rng.integers(0, rows + 1))
    row_runs = []
    for _ in range(n_real):
        starts = np.sort(rng.choice(200, int(rng.integers(0, 5)), replace=False)) * 3
        row_runs.append(np.stack((starts, starts + rng.integers(1, 4, len(starts))), axis=1).reshape(-1, 2))
    t = split_rows(row_runs, rows, pieces)
    assert len(t["row0"]) == rows * pieces and len(t["off"]) == rows * pieces + 1
    for prog in range(rows * pieces):
        i, part = divmod(prog, pieces)
        a, b = t["off"][prog], t["off"][prog + 1]
        if i >= n_real:
            assert a == b and t["row0"][prog] == t["row1"][prog]
            continue
        assert (t["row0"][prog], t["row1"][prog]) == (i, i + 1)
        assert (t["r0"][a:b] == i).all() and (t["r1"][a:b] == i + 1).all() and (t["slot"][prog] == (
            part if pieces > 1 else -1))
    for i, runs in enumerate(row_runs):
        want = np.concatenate([np.arange(x, y) for x, y in runs]) if len(runs) else np.zeros(0, int)
        progs = range(i * pieces, (i + 1) * pieces)
        got = [np.arange(t["k0"][r], t["k1"][r]) for p in progs for r in range(t["off"][p], t["off"][p + 1])]
        got = np.concatenate(got) if got else np.zeros(0, int)
        assert np.array_equal(got, want)  # in order, once each
        sizes = [int((t["k1"] - t["k0"])[t["off"][p]:t["off"][p + 1]].sum()) for p in progs]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 4), st.integers(1, 5), st.integers(1, 3), st.integers(1, 5))
def test_split_rows_of_verify_groups(seed, groups, width, pieces, rows_per_prog):
    """Verify groups: group i's row u (u < its k + 1 rows) sees every cached key of the group once and its new tokens
    0 .. u, read by the `pieces` programs of the row block holding it (blocks of `rows_per_prog` rows); rows past a
    group's own are never a program's; the table's diagonals give exactly that causal bound."""
    from cpinfer.engine.decode_tables import verify_runs

    rng = np.random.default_rng(seed)
    n_real = int(rng.integers(0, groups + 1))
    runs, used, want = [], [], []
    for i in range(n_real):
        w = int(rng.integers(1, width + 1))
        ctx_starts = np.sort(rng.choice(50, int(rng.integers(0, 4)), replace=False)) * 8
        ctx = np.stack((ctx_starts, ctx_starts + rng.integers(1, 5, len(ctx_starts))), axis=1).reshape(-1, 2)
        first = 500 + 40 * i
        new = first + np.arange(w) + (np.arange(w) >= int(rng.integers(0, w + 1))) * 7  # one jump between runs
        runs.append(verify_runs(ctx, new, i * width))
        used.append(w)
        cached = {int(k) for a, b in ctx for k in range(a, b)}
        want.append([cached | {int(k) for k in new[:u + 1]} for u in range(w)])
    rpp = min(rows_per_prog, width)
    nblk = -(-width // rpp)
    t = split_rows(runs, groups, pieces, width, used, rpp)
    assert len(t["row0"]) == groups * nblk * pieces and len(t["off"]) == groups * nblk * pieces + 1
    for prog in range(groups * nblk * pieces):
        i, blk = prog // (nblk * pieces), prog // pieces % nblk
        a = i * width + blk * rpp
        real = i < n_real and blk * rpp < used[i]
        assert (t["row0"][prog], t["row1"][prog]) == ((a, min(a + rpp, i * width + used[i])) if real else (0, 0))
        assert real or t["off"][prog] == t["off"][prog + 1]
    for i in range(n_real):
        for u in range(used[i]):
            r, seen = i * width + u, []
            blk = u // rpp
            for p in range((i * nblk + blk) * pieces, (i * nblk + blk + 1) * pieces):
                assert t["row0"][p] <= r < t["row1"][p]
                for x in range(t["off"][p], t["off"][p + 1]):
                    if t["r0"][x] <= r < t["r1"][x]:
                        seen += [k for k in range(t["k0"][x], t["k1"][x]) if k - r <= t["diag"][x]]
            assert len(seen) == len(set(seen)) and set(seen) == want[i][u]


# ---------------------------------------------------------------- the engine: static (eager) vs dynamic

@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, threads_per_rank=1, timeout_s=120) as p:
        yield p


def _set_pieces(ctx, pieces):
    ctx.state["runner"].static.pieces = pieces


def _static_forwards(ctx):
    return ctx.state["runner"].static.forwards


def _run(path, cp, pool, static: bool, pieces=None, tp=1, placement="shard"):
    """Three requests (two share a 40-token prefix; different lengths and stop points, so the decode batch shrinks
    from 3 to 1 and buckets change), greedy with log-probs. `placement` "shard": every request in the ring (ring rows
    on every rank); "local": each on one rank (local rows; a rank without one is idle)."""
    kw = dict(context_parallel_size=cp, tensor_parallel_size=tp, max_kv_tokens_per_rank=1024, static_decode=static,
              placement=placement)
    llm = LLM(str(path), threads_per_rank=1, **kw) if cp * tp == 1 else PooledLLM(str(path), pool, **kw)
    with llm:
        if static and pieces:
            llm.engine._pool.run(_set_pieces, pieces)
        rng = np.random.default_rng(cp)
        doc = rng.integers(3, 256, 40).tolist()
        prompts = [doc + rng.integers(3, 256, 3).tolist(), doc + rng.integers(3, 256, 21).tolist(),
                   rng.integers(3, 256, 30).tolist()]
        params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True) for n in (9, 5, 7)]
        outs = llm.generate(prompts, params)
        served = llm.engine._pool.run(_static_forwards) if static else [0]
    return outs, served


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("variant,pieces", [("gqa", None), ("gemma3", 2), ("mistral", 3), ("deepseek_v3", None),
                                            ("deepseek_v2", 2)])
def test_static_decode_equals_the_dynamic_path(llama_checkpoint, pool, cp, variant, pieces):
    """Token for token the same, log-probs within fp32 rounding: full attention (Llama), sliding layers beside full
    ones (Gemma 3) and every layer sliding (Mistral, window 24 < the contexts), split-KV pieces per row; MLA
    (DeepSeek-V3 and V2: one latent head of 16 + 8 channels whose first 16 are the values)."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    dynamic, _ = _run(path, cp, pool, static=False)
    static, served = _run(path, cp, pool, static=True, pieces=pieces)
    assert min(served) >= 8  # every decode step after the prefill went through the static path, on every rank
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", ["gqa", "gemma3"])
def test_static_decode_of_local_requests_at_cp2(llama_checkpoint, pool, variant):
    """Requests placed on one rank each (issue 18): their decode rows are a rank's local rows (no ring), a rank
    with no request left is idle; the same tokens as the dynamic path with the same placement."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    dynamic, _ = _run(path, 2, pool, static=False, placement="local")
    static, served = _run(path, 2, pool, static=True, placement="local")
    assert all(p == "local" for o in static for p in (s["placement"] for s in o.metrics["steps"]))
    assert min(served) >= 1 and sum(served) >= 8  # both ranks held requests; every decode step went static
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


def _fast_links_profile(path) -> str:
    """cpu-gloo with 30x faster links: on the tiny test model a ~900-token prompt spreads, short ones stay local."""
    import dataclasses

    from cpinfer.perf.hardware import load_hardware_profile

    hw, f = load_hardware_profile("cpu-gloo"), 30.0
    fast = dataclasses.replace(hw, name="cpu-fast-links", inter_latency_us=hw.inter_latency_us / f,
                               intra_latency_us=hw.intra_latency_us / f, ring_step_us=hw.ring_step_us / f,
                               inter_gbs=hw.inter_gbs * f, inter_gbs_peak=hw.inter_gbs_peak * f,
                               intra_gbs=hw.intra_gbs * f)
    fast.to_json(path)
    return str(path)


def test_static_decode_with_ring_and_local_rows(llama_checkpoint, pool, tmp_path):
    """Placement "auto" (issue 18): a long request spread over both ranks (ring rows, pass-Q decode) beside short
    ones each on one rank (local rows) in the same decode forwards: the same tokens and log-probs as the dynamic
    path, every decode step through the static path on both ranks."""
    path = llama_checkpoint("gqa", max_position_embeddings=4096)
    profile = _fast_links_profile(tmp_path / "fast.json")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (900, 12, 30)]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, ignore_eos=True)
    runs = {}
    for static in (False, True):
        with PooledLLM(str(path), pool, context_parallel_size=2, max_kv_tokens_per_rank=2048, static_decode=static,
                       hardware_profile=profile) as llm:
            outs = llm.generate(prompts, params)
            runs[static] = (outs, llm.engine._pool.run(_static_forwards) if static else None)
    (dynamic, _), (static, served) = runs[False], runs[True]
    where = [[s["placement"] for s in o.metrics["steps"]] for o in static]
    assert where[0] == ["spread"] * 5 and where[1] == where[2] == ["local"] * 5, where
    assert min(served) >= 4  # the decode forwards (4 per request, run together) went static on both ranks
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", ["qwen2", "deepseek_v3"])
def test_static_decode_with_tensor_parallel(llama_checkpoint, pool, variant):
    """TP2 inside one CP rank: both TP ranks run the static forward (its all-reduces at fixed shapes), rank 0
    samples; the same tokens as the dynamic path. Qwen2: a sliding layer, biases split by rows; DeepSeek-V3: MLA's
    query heads split, the latent whole on both ranks."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    dynamic, _ = _run(path, 1, pool, static=False, tp=2)
    static, served = _run(path, 1, pool, static=True, tp=2)
    assert min(served) >= 8
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


# ---------------------------------------------------------------- switches

def _decode_config(**args):
    widths = args.pop("widths", (16, 16))  # the model's key and value head sizes (MLA: they differ)
    config = types.SimpleNamespace(kv_key_width=widths[0], kv_value_width=widths[1],
                                   values_in_keys=widths[0] != widths[1], hybrid=False, dsa=None)
    fake = types.SimpleNamespace(args=types.SimpleNamespace(**{"enforce_eager": False, "static_decode": None,
                                                                "max_num_seqs": 16, "kv_cache_dtype": "auto",
                                                                "speculative_config": None, "spec_verify": "decode",
                                                                **args}),
                                 parallel=types.SimpleNamespace(world_size=args.pop("world", 2)), config=config)
    return EngineStartup(fake).decode_config(args.pop("comm", "nccl"))


def test_decode_mode_follows_device_and_enforce_eager(monkeypatch):
    """CUDA: graphs unless enforce_eager; a gloo world (ranks sharing a GPU) cannot capture; CPU: off unless asked."""
    from cpinfer.engine import startup

    monkeypatch.setattr(startup, "backend_problem", lambda name, device: "")  # Triton usable everywhere here
    assert _decode_config(device="cuda")["mode"] == "graph"
    assert _decode_config(device="cuda", enforce_eager=True)["mode"] == "off"
    assert _decode_config(device="cuda", enforce_eager=True, static_decode=True)["mode"] == "eager"
    assert _decode_config(device="cuda", comm="gloo")["mode"] == "eager"
    assert _decode_config(device="cuda", static_decode=False)["mode"] == "off"
    assert _decode_config(device="cpu")["mode"] == "off"
    assert _decode_config(device="cpu", static_decode=True) == {"mode": "eager", "max_rows": 16, "verify": "decode",
                                                                 "verify_width": 1, "verify_widths": (1,)}
    assert _decode_config(device="cuda", widths=(576, 512))["mode"] == "graph"  # MLA: values inside the keys
    monkeypatch.setattr(startup, "backend_problem", lambda name, device: "no triton")
    assert _decode_config(device="cuda")["mode"] == "off"  # graphs need the Triton kernel: off, with a warning


def test_enforce_eager_flag_and_bad_values(llama_checkpoint, monkeypatch):
    from cpinfer.device import add_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert engine_kwargs(parser.parse_args([]))["enforce_eager"] is False
    path = str(llama_checkpoint("gqa", max_position_embeddings=512))
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        LLM(path, enforce_eager="yes")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="static_decode=True runs decode attention in the Triton kernel.*"
                                         "TRITON_INTERPRET=1"):
        LLM(path, static_decode=True)


GPU_SCRIPT = """
import sys, torch
from cpinfer import LLM, SamplingParams
path = sys.argv[1]
prompts = [list(range(3, 60)), list(range(7, 30)), list(range(11, 20))]
params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
outs = {}
for eager in (True, False):
    with LLM(path, device="cuda", dtype="float32", enforce_eager=eager, max_kv_tokens_per_rank=1024) as llm:
        outs[eager] = llm.generate(prompts, params)
        if not eager:
            assert min(llm.engine._pool.run(lambda ctx: ctx.state["runner"].static.replays)) > 0
for a, b in zip(outs[True], outs[False]):
    assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-4)
print("graphs == eager")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_equal_eager_decode(llama_checkpoint):
    """On a GPU: decode replayed from CUDA graphs gives the tokens of eager decode (fp32), log-probs within 1e-4.
    In a process of its own: this module's Triton runs in the interpreter, which cannot take CUDA tensors."""
    import subprocess
    import sys

    path = str(llama_checkpoint("gemma3", max_position_embeddings=512))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", GPU_SCRIPT, path], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "graphs == eager" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _static_verify(ctx):
    static = ctx.state["runner"].static
    return static.forwards, static.verify_forwards, static.verify_fallbacks


def _set_static(ctx, **values):
    for name, value in values.items():
        setattr(ctx.state["runner"].static, name, value)


def _speculate(path, cp, pool, static: bool, placement: str, variant: str, lanes: int | None = None):
    """Prompts that repeat a passage (prompt lookup drafts from them) and one that does not, greedy with log-probs,
    speculating: verify rows beside plain decode rows in the same decode forwards. `lanes`: the static path's
    `max_lanes` (small: a verify group's rows in blocks of several programs), with 2 split-KV pieces per group."""
    kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=1024, static_decode=static, placement=placement,
              speculative_config=NGRAM)
    llm = LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)
    with llm:
        if static and lanes:
            llm.engine._pool.run(_set_static, max_lanes=lanes, pieces=2)
        rng = np.random.default_rng(3)
        a, b = rng.integers(3, 256, 13).tolist(), rng.integers(3, 256, 9).tolist()
        prompts = [a * 3 + a[:4], b + a + b + a[:5], rng.integers(3, 256, 20).tolist()]
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True, seed=0)
        outs = llm.generate(prompts, params)
        counts = llm.engine._pool.run(_static_verify) if static else None
        spec = llm.engine.stats().spec
    return outs, counts, spec


@pytest.mark.parametrize("cp,placement,lanes", [(1, "auto", None), (2, "shard", None), (2, "local", None),
                                                (2, "shard", 1)])
@pytest.mark.parametrize("variant", ["gqa", "deepseek_v3"])
def test_static_decode_takes_verify_rows(llama_checkpoint, pool, cp, placement, lanes, variant):
    """Speculative decoding's verify rows on the static path (each verify sequence one group of k + 1 rows, read in
    one program per KV head, its own causal bound per row; buckets per (sequences, k + 1)): the same tokens and
    log-probs as the dynamic path, verify forwards served statically on every rank that held rows, none left to
    the dynamic path. Ring rows (shard: pass-Q decode over both ranks) and local rows; GQA and MLA; a group's rows
    one per program (lanes 1) with its keys in 2 split-KV pieces."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    dynamic, _, spec_d = _speculate(path, cp, pool, False, placement, variant)
    static, counts, spec_s = _speculate(path, cp, pool, True, placement, variant, lanes)
    assert spec_s["num_drafts"] > 0 and spec_s == spec_d  # the same verify steps, the same acceptance
    assert sum(c[1] for c in counts) >= 2 and sum(c[2] for c in counts) == 0, counts
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


def test_verify_rows_of_a_windowed_model_fall_back(llama_checkpoint, pool):
    """A model with sliding-window layers: its verify forwards go to the dynamic path (a window bound differs per
    row), counted on the ranks; plain decode forwards stay static; the outputs equal the dynamic path's."""
    path = llama_checkpoint("gemma3", max_position_embeddings=512)
    dynamic, _, _ = _speculate(path, 1, pool, False, "auto", "gemma3")
    static, counts, spec = _speculate(path, 1, pool, True, "auto", "gemma3")
    assert spec["num_drafts"] > 0 and counts[0][1] == 0 and counts[0][2] > 0, (counts, spec)
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


# ---------------------------------------------------------------- DeepSeek sparse attention on the static path
def _static_counts(ctx):
    static = ctx.state["runner"].static
    return static.forwards, static.verify_forwards, static.verify_fallbacks


def _dsa_run(path, cp, pool, static: bool, placement: str, speculate: bool):
    """Prompts of 40-90 tokens (two share a 40-token prefix; two repeat a passage, for prompt-lookup drafts) with
    index_topk 16, greedy with log-probs; decode batches shrink as requests stop."""
    kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=1024, static_decode=static, placement=placement)
    if speculate:
        kw["speculative_config"] = NGRAM
    llm = LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)
    with llm:
        rng = np.random.default_rng(5)
        doc, a = rng.integers(3, 256, 40).tolist(), rng.integers(3, 256, 13).tolist()
        prompts = [doc + rng.integers(3, 256, 50).tolist(), doc + a * 3 + a[:4], a * 4 + rng.integers(3, 256, 9).tolist()]
        params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True) for n in (12, 8, 10)]
        outs = llm.generate(prompts, params)
        counts = llm.engine._pool.run(_static_counts) if static else None
        spec = llm.engine.stats().spec if speculate else None
    return outs, counts, spec


@pytest.mark.parametrize("cp,placement,speculate", [(1, "auto", False), (2, "shard", False), (2, "local", False),
                                                    (1, "auto", True), (2, "shard", True)])
def test_static_decode_selects_each_rows_top_k_for_dsa(llama_checkpoint, pool, cp, placement, speculate):
    """GLM-5's sparse attention (index_topk 16 of up to 100 keys; a "shared" middle layer) on the static decode
    path: each decode row, and each verify row at its own position, selects its top-k inside the static step (ring
    rows gathered with candidates exchanged; local rows alone): the same tokens and log-probs within fp32 rounding
    as the dynamic path, every decode forward served statically (verify forwards too)."""
    path = llama_checkpoint("deepseek_v3", model_type="glm_moe_dsa", index_topk=16, index_n_heads=16,
                            index_head_dim=16, indexer_types=["full", "shared", "full"], max_position_embeddings=512)
    dynamic, _, _ = _dsa_run(path, cp, pool, False, placement, speculate)
    static, counts, spec_s = _dsa_run(path, cp, pool, True, placement, speculate)
    assert sum(c[0] for c in counts) >= 8 and sum(c[2] for c in counts) == 0, counts
    if speculate:  # (how many drafts follows the measured step costs: not compared between the runs)
        assert spec_s["num_drafts"] > 0 and sum(c[1] for c in counts) >= 1, (spec_s, counts)
    for a, b in zip(dynamic, static):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


def _bucket_widths(ctx):
    return sorted({key[2] for key in ctx.state["runner"].static.buckets})


def _adaptive(path, cp, pool, static: bool, widths=None):
    """Prompts that repeat a passage and one that does not, greedy with log-probs, speculating with k up to 5 (the
    adaptive k's sizes 1, 2, 4, 5: verify widths 2, 3, 5, 6) and prompt lookup, whose drafts may be shorter than
    k; `widths`: the static path's captured verify widths cut to these on every rank. (outputs, per-rank static
    counters, bucket widths, engine spec stats)."""
    kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=1024, static_decode=static, placement="shard",
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    llm = LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)
    with llm:
        if static and widths:
            llm.engine._pool.run(_set_static, verify_widths=widths)
        rng = np.random.default_rng(5)
        a, b = rng.integers(3, 256, 11).tolist(), rng.integers(3, 256, 7).tolist()
        prompts = [a * 4 + a[:3], b + a + b + a[:6], rng.integers(3, 256, 20).tolist(), b * 5 + b[:2]]
        params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True, ignore_eos=True, seed=0)
        outs = llm.generate(prompts, params)
        counts = llm.engine._pool.run(_static_verify) if static else None
        buckets = llm.engine._pool.run(_bucket_widths) if static else None
        spec = llm.engine.stats().spec
    return outs, counts, buckets, spec


@pytest.mark.parametrize("cp", [1, 2])
def test_adaptive_k_uses_the_captured_widths_and_counts_fallbacks(llama_checkpoint, pool, cp):
    """The adaptive k picks among the draft sizes whose widths (k + 1) the static path captures; a forward whose
    widest verify sequence is narrower (a shorter draft) is padded up to the next one: every bucket's width is one
    of them, and the static path equals the dynamic path (the same verify steps, tokens, log-probs). With the
    captured widths cut to (2, 3), the wider verify forwards run eagerly: counted on the ranks, in the engine's
    `stats().spec["verify_fallbacks"]` (what /metrics exports), and the outputs are still the dynamic path's."""
    path = llama_checkpoint("gqa", max_position_embeddings=512)
    dynamic, _, _, spec_d = _adaptive(path, cp, pool, False)
    static, counts, buckets, spec_s = _adaptive(path, cp, pool, True)
    assert spec_s["num_drafts"] > 0 and spec_s == spec_d and spec_d["verify_fallbacks"] == 0
    assert sum(c[1] for c in counts) >= 2 and sum(c[2] for c in counts) == 0, counts
    widths = {w for ws in buckets for w in ws}
    assert widths - {1} and widths <= {1, 2, 3, 5, 6}, buckets
    cut, cut_counts, cut_buckets, spec_c = _adaptive(path, cp, pool, True, widths=(2, 3))
    assert spec_c == dict(spec_d, verify_fallbacks=spec_c["verify_fallbacks"])
    assert spec_c["verify_fallbacks"] > 0 and max(c[2] for c in cut_counts) == spec_c["verify_fallbacks"], (
        cut_counts, spec_c)
    assert {w for ws in cut_buckets for w in ws} <= {1, 2, 3}, cut_buckets
    for a, b, c in zip(dynamic, static, cut):
        assert a.token_ids == b.token_ids == c.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
