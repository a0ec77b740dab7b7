"""Run the Triton kernels on tensors whose element offsets pass 2^31: `python triton_int64.py [--cuda] [CASE ...]`.

Each tensor is a strided view into one large fp32 storage that is allocated but never touched beyond the few
rows the kernels read (virtual memory: ~9 GiB reserved, a few MiB resident). Every stride stays below 2^31, so
Triton passes it as an int32 argument and only int64 address arithmetic inside the kernel reaches the far rows;
int32 arithmetic wraps to a wrong address (a crash or wrong numbers). Prints "CASE ok" on success.
On CPU the kernels run in Triton's interpreter (tests/test_triton_int64.py, in a subprocess: a wrapped address may
kill the process); with --cuda they run compiled on the GPU (scripts/gpu_check.sh; the storage is then real, 9 GiB).
"""
import os
import sys

DEVICE = "cuda" if "--cuda" in sys.argv else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cpinfer.attention import triton_attention  # noqa: E402
from cpinfer.attention.backends import LocalAttention  # noqa: E402
from cpinfer.attention.triton_backend import TritonBackend  # noqa: E402
from cpinfer.attention.local import reference_attention  # noqa: E402
from cpinfer.attention.merge import merge_partials  # noqa: E402
from cpinfer.attention.triton_merge import triton_merge  # noqa: E402

LIMIT = 2 ** 31
FAR = 2 ** 30 + 64  # a row stride below 2^31: row 2 starts past 2^31


class Arena:
    """Views into one big untouched fp32 storage; checks that no two views' elements overlap."""

    def __init__(self, elements: int):
        self.store = torch.empty(elements, dtype=torch.float32, device=DEVICE)  # CPU: virtual until written
        self.used: list[tuple[int, int]] = []

    def view(self, base: int, shape, strides) -> torch.Tensor:
        spans = [(base, base + 1)]
        for n, st in zip(shape, strides):  # the element ranges of the view, as [start, end) runs
            spans = [(a + i * st, b + i * st) for a, b in spans for i in range(n)] if st > 1 else \
                [(a, b + (n - 1) * st) for a, b in spans]
        assert max(b for _, b in spans) <= self.store.numel(), "view outside the arena"
        for a, b in spans:
            assert all(b <= c or d <= a for c, d in self.used), "views overlap"
        self.used += spans
        return self.store.as_strided(shape, strides, base)


def _fill(x: torch.Tensor, gen) -> torch.Tensor:
    x.copy_(torch.randn(x.shape, generator=gen).to(x.device))
    return x


def _check_merge(out, lse, outs, lses) -> None:
    ref, ref_lse = merge_partials([x.cpu() for x in outs], [x.cpu() for x in lses])
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-6, atol=1e-6)


def check_merge() -> None:
    """pass-Q's merge of S partials: source stride and row stride both push offsets past 2^31."""
    s_, rows, h, d = 3, 3, 2, 16
    arena = Arena(2 * FAR + 2 ** 23)
    outs = arena.view(0, (s_, rows, h, d), (FAR, 2 ** 20, d, 1))  # sources FAR apart: source 2 past 2^31
    lses = arena.view(1024, (s_, rows, h), (FAR, 2 ** 20, 1))
    gen = torch.Generator().manual_seed(0)
    _fill(outs, gen), _fill(lses, gen)
    assert (s_ - 1) * FAR > LIMIT
    out, lse = triton_merge(outs, lses, torch.float32)
    _check_merge(out, lse, outs, lses)

    rows_far = arena_rows = Arena(2 * FAR + 2 ** 23)  # now rows FAR apart (row 2 past 2^31), sources adjacent
    outs = rows_far.view(0, (s_, rows, h, d), (h * d, FAR, d, 1))
    lses = arena_rows.view(1024, (s_, rows, h), (h, FAR, 1))
    _fill(outs, gen), _fill(lses, gen)
    out, lse = triton_merge(outs, lses, torch.float32)
    _check_merge(out, lse, outs, lses)


def check_step(split: bool) -> None:
    """The step kernel: query / output rows and key rows past 2^31 elements; with `split`, the split-KV scratch
    slots past 2^31 too (slot x its stride), folded back by the merge kernel."""
    lq, lk, h, hkv, d = 3, 34, 4, 2, 16
    k_far = 2 ** 26 + 32  # key 32 starts past 2^31
    arena = Arena(2 ** 31 + 2 ** 28)
    q = arena.view(0, (lq, h, d), (FAR, d, 1))
    k = arena.view(1024, (lk, hkv, d), (k_far, d, 1))
    v = arena.view(2048, (lk, hkv, d), (k_far, d, 1))
    acc_out = arena.view(3072, (lq, h, d), (FAR, d, 1))
    acc_lse = arena.view(4096, (lq, h), (FAR, 1))
    assert (lq - 1) * FAR > LIMIT and (lk - 1) * k_far > LIMIT
    gen = torch.Generator().manual_seed(1)
    for x in (q, k, v):
        _fill(x, gen)
    acc_out.zero_()
    acc_lse.fill_(-torch.inf)
    q_seq, kv_seq = np.zeros(lq, dtype=np.int64), np.zeros(lk, dtype=np.int64)
    q_pos, kv_pos = np.array([5, 20, 33]), np.arange(lk)
    step = LocalAttention(q_seq, q_pos, kv_seq, kv_pos, backend="triton", device=DEVICE, scale=0.25)
    used = []
    if split:  # every program's keys cut into pieces of 16: slots 0, 1, 2 with slot 2 past 2^31
        step.backend = TritonBackend(block_m=16, block_n=16, min_programs=10 ** 6, split_keys=16)

        def far_scratch(n_slots, rows, heads, dim, device):
            scratch = arena.view(8192, (n_slots, rows, heads, dim + 1), (FAR, heads * (dim + 1), dim + 1, 1))
            scratch.zero_()
            scratch[..., dim] = -torch.inf
            used.append(n_slots)
            return scratch

        triton_attention.split_scratch = far_scratch
    step(q, k, v, (acc_out, acc_lse))
    if split:
        assert used and used[0] >= 3 and (used[0] - 1) * FAR > LIMIT, used
    ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu(), torch.from_numpy(q_seq),
                                           torch.from_numpy(q_pos), torch.from_numpy(kv_seq),
                                           torch.from_numpy(kv_pos), scale=0.25)
    torch.testing.assert_close(acc_out.cpu().double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse.cpu().double(), ref_lse, rtol=1e-5, atol=1e-5)


CASES = {"merge": check_merge, "step": lambda: check_step(False), "step-split": lambda: check_step(True)}

if __name__ == "__main__":
    for name in [a for a in sys.argv[1:] if a != "--cuda"] or list(CASES):
        CASES[name]()
        print(name, "ok", flush=True)
