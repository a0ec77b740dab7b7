"""cpinfer's CPU flash kernel against aten's, side by side (`cpinfer bench cpu-attention`).

The prefill blocks the engine gives its `cpu-flash` backend, float32: SmolLM2-135M's heads (9 query / 3 KV, head size
64) at the two chunks of a 3,000-token prompt (a 2,048 causal square; 952 queries against the first chunk's keys and
their own causal square), one 3,000 causal square, a 100-token suffix against a 3,000-token cached prefix, and a
Llama-3-8B-shaped head layout (32 / 8, head size 128). Each block runs through `aten_flash_backend` (aten's CPU flash,
GQA as a batch over expanded K/V — the engine's path without the compiled kernels) and through
`torch.ops.cpinfer.flash_attention`, the two calls alternating, `--repeat` times each; the table has the median
times, GFLOP/s (2 x 2 x D multiply-adds per visible (query, key) pair and head) and the speed ratio, and the largest
difference between the two results (float32 rounding).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cpinfer.bench.common import DOC_PATH, fmt_table, run_measured

# name: (query rows, keys, query heads, KV heads, head size, causal)
BLOCKS = {
    "SmolLM2 chunk 1: 2,048 causal": (2048, 2048, 9, 3, 64, True),
    "SmolLM2 chunk 2: 952 x 2,048 full": (952, 2048, 9, 3, 64, False),
    "SmolLM2 chunk 2: 952 causal": (952, 952, 9, 3, 64, True),
    "SmolLM2 3,000 causal (one chunk)": (3000, 3000, 9, 3, 64, True),
    "SmolLM2 100 after a 3,000 prefix": (100, 3000, 9, 3, 64, False),
    "Llama-3-8B heads: 2,048 causal": (2048, 2048, 32, 8, 128, True),
}


def _block(text: str) -> tuple:
    """LQxLKxHxHKVxD[c]: a block given on the command line (c: causal)."""
    causal = text.endswith("c")
    try:
        dims = tuple(int(v) for v in text.rstrip("c").split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1 or dims[2] % dims[3]:
        raise argparse.ArgumentTypeError(f"a block is LQxLKxHxHKVxD[c] (H a multiple of HKV), got {text!r}")
    return dims + (causal,)


def measure(args) -> dict:
    from cpinfer.attention.cpu_kernels import flash_attention_op
    from cpinfer.attention.kernels import aten_flash_backend

    ours = flash_attention_op()
    if ours is None:
        raise SystemExit("cpinfer's CPU kernels are not built here (no C++ compiler, or CPINFER_CPU_KERNELS=0)")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = {f"{b[0]}x{b[1]}x{b[2]}x{b[3]}x{b[4]}{'c' if b[5] else ''}": b for b in args.blocks} if args.blocks \
        else BLOCKS
    rows = []
    try:
        gen = torch.Generator().manual_seed(0)
        for name, (lq, lk, h, hkv, d, causal) in blocks.items():
            q, k, v = (torch.randn(n, hh, d, generator=gen) for n, hh in ((lq, h), (lk, hkv), (lk, hkv)))
            scale = d ** -0.5
            calls = {"aten": lambda: aten_flash_backend(q, k, v, causal, None, scale),
                     "cpinfer": lambda: ours(q, k, v, causal, scale)}
            times = {key: [] for key in calls}
            results = {key: fn() for key, fn in calls.items()}  # a warm-up call each
            for _ in range(args.repeat):
                for key, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            pairs = lq * lk - (lq * (lq - 1) // 2 if causal and lq <= lk else 0)  # visible (query, key) pairs
            flop = 4.0 * pairs * h * d
            med = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
            rows.append({"block": name, "aten_ms": 1e3 * med["aten"], "cpinfer_ms": 1e3 * med["cpinfer"],
                         "aten_gflops": flop / med["aten"] / 1e9, "cpinfer_gflops": flop / med["cpinfer"] / 1e9,
                         "speedup": med["aten"] / med["cpinfer"],
                         "max_diff": float((results["aten"][0] - results["cpinfer"][0]).abs().max())})
    finally:
        torch.set_num_threads(threads)
    command = f"cpinfer bench cpu-attention --repeat {args.repeat}"
    command += f" --threads {args.threads}" if args.threads else ""
    return {"command": command, "threads": args.threads or threads, "rows": rows}


def format_report(res: dict) -> str:
    table = fmt_table(["block (float32)", "aten ms", "cpinfer ms", "aten GFLOP/s", "cpinfer GFLOP/s",
                       "cpinfer / aten speed", "max abs. difference"],
                      [[r["block"], f"{r['aten_ms']:.2f}", f"{r['cpinfer_ms']:.2f}", f"{r['aten_gflops']:.0f}",
                        f"{r['cpinfer_gflops']:.0f}", f"{r['speedup']:.2f}x", f"{r['max_diff']:.1e}"]
                       for r in res["rows"]])
    return f"{res['threads']} threads; medians of the alternating calls.\n\n{table}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=15, help="timed calls of each kernel per block (default 15)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own setting)")
    parser.add_argument("--blocks", type=_block, nargs="+", metavar="LQxLKxHxHKVxD[c]",
                        help="blocks to time instead of the default set (c: causal)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--write-doc", nargs="?", const=DOC_PATH, type=Path, metavar="FILE",
                        help=f"replace (or append) this run's section in FILE (default: {DOC_PATH})")


def run(args) -> int:
    return run_measured(args, measure, format_report, "cpu-attention",
                        "cpinfer's CPU flash kernel vs aten's (`cpinfer bench cpu-attention`)")
