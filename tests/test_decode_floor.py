"""`bench decode-overhead --floor`'s accounting: profiler events under the bench's labels → per-category seconds
(spans are wall time, top-level ops their own time; nothing outside a decode step counts), and its Linear pass."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cpinfer.bench.decode_floor import classify, linear_pass


def _ev(name, us, parent=None):
    return SimpleNamespace(name=name, cpu_time_total=us, cpu_parent=parent)


def test_classify_splits_a_step_into_its_categories():
    step = _ev("cpinfer.step", 1000)
    execute = _ev("cpinfer.execute", 900, step)
    forward = _ev("cpinfer.forward", 700, execute)
    attention = _ev("cpinfer.attention", 150, forward)
    sample = _ev("cpinfer.sample", 120, execute)
    events = [step, execute, forward, attention, sample,
              _ev("aten::linear", 400, forward), _ev("aten::mm", 390, None),  # a linear's child: not top level
              _ev("aten::index_copy_", 10, forward), _ev("aten::rms_norm", 30, forward),
              _ev("aten::_scaled_dot_product_flash_attention_for_cpu", 100, attention),
              _ev("aten::linear", 100, sample), _ev("aten::argmax", 15, sample),
              _ev("cpinfer.forward", 5000), _ev("aten::linear", 4000, None)]  # a prefill outside any step
    events[6].cpu_parent = events[5]
    got = {k: round(v * 1e6, 6) for k, v in classify(events).items()}
    assert got == {"linears": 500, "attention": 150, "kv_write": 10, "small_ops": 30, "layer_python": 110,
                   "sampling": 20, "rank_host": 80, "driver": 100, "total": 1000}


def test_linear_pass_counts_a_tied_weight_once():
    lm = torch.nn.Module()
    lm.a, lm.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8, bias=False)
    lm.head = torch.nn.Linear(16, 8, bias=False)
    lm.head.weight = lm.b.weight  # tied, as lm_head and the embedding
    run, nbytes = linear_pass(lm)
    run()
    assert nbytes == (8 * 16 + 16 + 16 * 8) * 4
