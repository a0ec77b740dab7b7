"""A cold prefill's FLOP rate against the machine's fp32 GEMM rate, measured side by side in one process.

    PYTHONPATH=. python scripts/prefill_rate.py [--prompt 3100] [--threads 2] [--repeats 3]

The embedded model (SmolLM2-135M-Instruct) at CP1 in float32 on `--threads` threads (rank 0 in this process, as
`cpinfer generate` and `serve --cp 1` run it): each repeat times `LLM.generate` of one new random `--prompt`-token
prompt to its first token (the engine's prefill, chunked as it is by default), then, on the same threads, a 2048^3
float32 GEMM through torch.mm (MKL's sgemm) and through oneDNN's packed weights (what the engine's Linears run),
timed before the first prefill and after each one; a repeat's ratio is its prefill's rate over the mean of the GEMM
rates just before and just after it.
The prefill's FLOPs: every layer's Linears (2 x weights x tokens), the causal attention (2 x T^2 x query width x
layers, the paper's App. A count) and the LM head for the last token. Prints each repeat and the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def gemm_rates(n: int = 2048, reps: int = 5) -> tuple[float, float]:
    """(GFLOP/s of an n^3 float32 product through torch.mm, through oneDNN's packed weight), medians."""
    from cpinfer.bench.efficiency import gemm_rate
    from cpinfer.timing import median_seconds

    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = torch.ops.mkldnn._reorder_linear_weight(b)
    onednn = median_seconds(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), reps, "cpu",
                            warmup=2)
    return gemm_rate(n, reps, device="cpu", dtype=torch.float32) * 1e3, 2.0 * n ** 3 / onednn / 1e9


def prefill_flops(config, tokens: int) -> float:
    """`efficiency.prefill_flops` (the paper's App. A count) over the layers' Linears, plus the LM head for the
    last token: the engine computes no logits for the other rows."""
    from cpinfer.bench.efficiency import prefill_flops as app_a
    from cpinfer.model.loader import build_model

    model = build_model(config)  # meta tensors: no memory
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    count = app_a(linear, tokens, config.num_hidden_layers, config.num_attention_heads * config.head_dim)
    return count["total"] + 2.0 * config.hidden_size * config.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=3100, help="prompt tokens (default 3100)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of rank 0 and of the GEMMs (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="prefill / GEMM pairs (default 3)")
    args = ap.parse_args()

    from cpinfer import LLM, SamplingParams
    from cpinfer.bench.common import random_prompt
    from cpinfer.model.resolve import resolve_model

    with LLM(str(resolve_model(None)), context_parallel_size=1, threads_per_rank=args.threads,
             dtype="float32") as llm:
        torch.set_num_threads(args.threads)
        config = llm.config
        flops = prefill_flops(config, args.prompt)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([random_prompt(64, config.vocab_size, seed=1)], params, use_tqdm=False)  # warm-up
        rows = []
        before = gemm_rates()
        for i in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate([random_prompt(args.prompt, config.vocab_size, seed=100 + i)], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            after = gemm_rates()  # the GEMMs right before and right after: a drifting machine moves both sides
            mkl, onednn = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
            rate = flops / seconds / 1e9
            rows.append((seconds, rate, mkl, onednn, rate / mkl, rate / onednn))
            print(f"repeat {i + 1}: prefill {seconds:.2f} s = {rate:.0f} GFLOP/s; GEMM 2048^3 around it: torch.mm "
                  f"{mkl:.0f} ({rate / mkl:.0%}), oneDNN packed {onednn:.0f} GFLOP/s ({rate / onednn:.0%})",
                  flush=True)
            before = after
    med = [statistics.median(r[j] for r in rows) for j in range(6)]
    print(f"{args.prompt}-token prefill ({flops / 1e12:.3f} TFLOP) on {args.threads} threads, medians of "
          f"{args.repeats}: {med[0]:.2f} s, {med[1]:.0f} GFLOP/s; of the GEMM rate around each: {med[4]:.0%} of "
          f"torch.mm's (median {med[2]:.0f}), {med[5]:.0%} of oneDNN's (median {med[3]:.0f} GFLOP/s); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
