"""The CPU prefill's attention for one layer, two ways, side by side: `BatchAttention.run` with a chunk's queries
against its cached prefix and its own keys in one call of cpinfer's flash kernel (the engine's path when they are one
run of store slots) vs the item plan (a FULL item over the prefix and a CAUSAL item over the chunk, each a kernel call,
merged in an fp32 accumulator: what runs when the flash op is hidden from the engine), alternating.

    PYTHONPATH=. python scripts/one_call_prefill.py [--threads 2] [--repeats 6]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64), float32; the rows: a 952-token chunk after
a 2,048-token prefix (a 3,000-token prompt's second chunk) and a first chunk of 2,048. Prints ms per call (min and
median over the repeats, each the mean of 5 calls). Not part of CI.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import cpinfer.engine.attention as engine_attention
from cpinfer.engine.attention import BatchAttention
from cpinfer.engine.batch import ForwardBatch, SeqInput
from cpinfer.engine.sampling import SampleSpec

H, HKV, D = 9, 3, 64


def _seq(prefix: int, n: int) -> SeqInput:
    runs = np.asarray([[0, prefix]] if prefix else np.zeros((0, 2)), dtype=np.int64).reshape(-1, 2)
    return SeqInput(np.full(n, 5, dtype=np.int64), prefix, np.zeros(n, dtype=np.int64),
                    np.arange(prefix, prefix + n), (runs,), SampleSpec(0.0, 1.0, 0, 0, 0, 0), spread=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    real = engine_attention.flash_attention_op
    if real() is None:
        raise SystemExit("cpinfer's CPU kernels are unavailable here (no C++ compiler?): nothing to compare")
    store_k, store_v = torch.randn(4096, HKV, D), torch.randn(4096, HKV, D)
    for prefix, n in ((2048, 952), (0, 2048)):
        batch = ForwardBatch((_seq(prefix, n),), "local", "prefill")
        q = torch.randn(n, H, D)
        k_new, v_new = store_k[prefix:prefix + n], store_v[prefix:prefix + n]  # (written to the store already)
        times: dict[str, list[float]] = {"one call": [], "items + merge": []}
        try:
            for _ in range(args.repeats):
                for name, ms in times.items():
                    engine_attention.flash_attention_op = real if name == "one call" else (lambda: None)
                    plan = BatchAttention(batch, 0, 1, None, "cpu-flash")
                    plan.prepare(None, [None])
                    plan.tables.upload()
                    plan.run(q, k_new, v_new, store_k, store_v, 0.125)
                    t = time.perf_counter()
                    for _ in range(5):
                        plan.run(q, k_new, v_new, store_k, store_v, 0.125)
                    ms.append((time.perf_counter() - t) / 5 * 1e3)
        finally:
            engine_attention.flash_attention_op = real
        line = ", ".join(f"{k} {min(v):.1f} ms (median {float(np.median(v)):.1f})" for k, v in times.items())
        ratio = min(times["items + merge"]) / min(times["one call"])
        print(f"prefix {prefix} + chunk {n}: {line}; items / one call {ratio:.2f}x")


if __name__ == "__main__":
    main()
