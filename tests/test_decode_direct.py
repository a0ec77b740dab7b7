"""Host decode without a ring (`BatchAttention._run_direct`): each sequence's one query against its slot runs — in
one call of the batched CPU kernel (`attention/cpu_kernels.py`), or without it one aten call per run, partials
merged in place — exact against a float64 reference over the same keys, for one, two and three runs, GQA, and a
batch of sequences; a step it does not cover (a prefill token) keeps the general path."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from cpinfer.attention.cpu_kernels import decode_attention_op, flash_attention_op
from cpinfer.attention.local import reference_attention
from cpinfer.engine.attention import BatchAttention
from cpinfer.engine.batch import ForwardBatch, SeqInput
from cpinfer.engine.sampling import SampleSpec

H, HKV, D, CAP = 6, 2, 16, 200


def _seq(token: int, runs: list[tuple[int, int]], slot: int, n_new: int = 1) -> SeqInput:
    start = sum(e - a for a, e in runs)
    return SeqInput(np.full(n_new, token, dtype=np.int64), start, np.zeros(n_new, dtype=np.int64),
                    np.arange(slot, slot + n_new, dtype=np.int64), (np.asarray(runs, dtype=np.int64).reshape(-1, 2),),
                    SampleSpec(0.0, 1.0, 0, 0, 0, 0), spread=False)


def _reference(q_row, store_k, store_v, slots, scale):
    """float64 attention of one query row [1, H, D] over the store rows `slots` (all visible)."""
    zeros = torch.zeros(len(slots), dtype=torch.int64)
    out, _ = reference_attention(q_row, store_k[slots], store_v[slots], zeros[:1], torch.tensor([len(slots)]),
                                 zeros, torch.arange(len(slots)), scale)
    return out


@pytest.mark.parametrize("batched", [True, False], ids=["batched-kernel", "per-run"])
@pytest.mark.parametrize("runs_per_seq", [[[(0, 37)]], [[(64, 100), (10, 20)]],
                                          [[(0, 5), (100, 164), (30, 31)], [(170, 180)], [(40, 60), (180, 190)]]])
def test_direct_decode_matches_reference(runs_per_seq, batched, monkeypatch):
    if batched:
        if decode_attention_op() is None:  # only where no C++ compiler exists: then the engine keeps aten's
            assert shutil.which(os.environ.get("CXX") or "c++") is None
    else:
        monkeypatch.setattr("cpinfer.engine.attention.decode_attention_op", lambda: None)
    g = torch.Generator().manual_seed(len(runs_per_seq) * 13 + len(runs_per_seq[0]))
    store_k, store_v = (torch.randn(CAP + 1, HKV, D, generator=g) for _ in range(2))
    new_slots = [192 + i for i in range(len(runs_per_seq))]  # each decode token's own slot, written below
    batch = ForwardBatch(tuple(_seq(5 + i, runs, s) for i, (runs, s) in enumerate(zip(runs_per_seq, new_slots))),
                         "local", "decode")
    plan = BatchAttention(batch, 0, 1, None, "cpu-flash")
    plan.prepare(None, [None])
    plan.tables.upload()
    q = torch.randn(len(runs_per_seq), H, D, generator=g)
    k_new, v_new = (torch.randn(len(runs_per_seq), HKV, D, generator=g) for _ in range(2))
    store_k[new_slots], store_v[new_slots] = k_new, v_new  # the runner writes them before attention
    out = plan.run(q, k_new, v_new, store_k, store_v, 0.3)
    assert plan.direct is not None  # the host decode path ran
    assert bool(plan._direct_tables) == (batched and decode_attention_op() is not None)  # in one call, or per run
    for i, runs in enumerate(runs_per_seq):
        slots = np.concatenate([np.arange(a, e) for a, e in runs] + [[new_slots[i]]])
        ref = _reference(q[i:i + 1], store_k, store_v, torch.from_numpy(slots), 0.3)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)


def test_prefill_rows_keep_the_general_path():
    store_k, store_v = (torch.randn(CAP + 1, HKV, D) for _ in range(2))
    batch = ForwardBatch((_seq(5, [(0, 10)], 10, n_new=3),), "local", "prefill")
    plan = BatchAttention(batch, 0, 1, None, "cpu-flash")
    plan.prepare(None, [None])
    assert plan.direct is None


def _causal_reference(q, store_k, store_v, cached: list[np.ndarray], new: list[np.ndarray], scale):
    """float64 rows of every sequence: query i of a sequence sees its cached slots and its new slots 0..i."""
    outs = []
    for c, n in zip(cached, new):
        for i in range(len(n)):
            slots = torch.from_numpy(np.concatenate((c, n[:i + 1])))
            outs.append(_reference(q[len(outs):len(outs) + 1], store_k, store_v, slots, scale))
    return torch.cat(outs)


@pytest.mark.parametrize("case", ["chunk-after-prefix", "mixed", "split-prefix", "gap"])
def test_prefill_chunk_against_its_prefix_in_one_kernel_call(case, monkeypatch):
    """CPU prefill (`BatchAttention._one_run_calls`): a sequence whose cached keys and new rows are one run of slots
    is attended in one call of our flash kernel (causal offset = its cached keys); decode rows among them (keys in
    any runs) in one call of the decode kernel. Cached keys in two runs, or new rows not right after them, keep the
    item plan. Both exact (float64)."""
    if flash_attention_op() is None:
        assert shutil.which(os.environ.get("CXX") or "c++") is None
        return
    seqs_spec = {  # (cached runs, first new slot, new tokens) per sequence
        "chunk-after-prefix": [([(0, 40)], 40, 7)],
        "mixed": [([(100, 130)], 130, 5), ([], 150, 10), ([(0, 20)], 190, 1), ([(20, 25), (60, 70)], 191, 1)],
        "split-prefix": [([(0, 10), (50, 60)], 60, 6)],
        "gap": [([(0, 30)], 40, 4)],
    }[case]
    g = torch.Generator().manual_seed(len(case))
    store_k, store_v = (torch.randn(CAP + 1, HKV, D, generator=g) for _ in range(2))
    batch = ForwardBatch(tuple(_seq(3 + i, runs, s, n) for i, (runs, s, n) in enumerate(seqs_spec)), "local",
                         "prefill")
    rows = sum(n for _, _, n in seqs_spec)
    q = torch.randn(rows, H, D, generator=g)
    new = [np.arange(s, s + n) for _, s, n in seqs_spec]
    cached = [np.concatenate([np.arange(a, e) for a, e in runs] or [np.zeros(0, dtype=np.int64)]).astype(np.int64)
              for runs, _, _ in seqs_spec]
    k_new, v_new = (torch.randn(rows, HKV, D, generator=g) for _ in range(2))
    slots = torch.from_numpy(np.concatenate(new))
    store_k[slots], store_v[slots] = k_new, v_new  # the runner writes them before attention
    outs = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr("cpinfer.engine.attention.flash_attention_op", lambda: None)
        plan = BatchAttention(batch, 0, 1, None, "cpu-flash")
        plan.prepare(None, [None])
        plan.tables.upload()
        outs[kernel] = plan.run(q, k_new, v_new, store_k, store_v, 0.3)
        assert (plan.one_run is not None) == (case in ("chunk-after-prefix", "mixed"))
    if case == "chunk-after-prefix":
        assert plan.one_run == ([(0, 7, 0, 47, 40)], None)
    ref = _causal_reference(q, store_k, store_v, cached, new, 0.3)
    for out in outs.values():
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
