"""Attention kernel TFLOP/s on one GPU vs the matmul rate of the same run (`cpinfer bench gpu`; needs CUDA).

Causal full prefill of one sequence (the paper's 8K-128K range, Llama-3-8B heads by default) through each
backend's one-step path (`triton`; `flash-attn` when installed; `torch-flash` when its probe passed) and PyTorch's
SDPA for comparison; every rate
is also given as a fraction of a bf16 GEMM measured in the same process (FLOPs: 2 matmuls x 2 x L^2/2 x H x D).
`--plan-only` (no GPU needed) times the host side of one forward instead: the plan and the Triton tile tables of
every ring step at CP1 and CP8, which are built once per forward and reused by every layer.
It ran on an H100 as part (b) of scripts/gpu_check.sh (docs/benchmarks.md, "GPU").
"""
from __future__ import annotations

import argparse
import json

import torch

from cpinfer.bench.attention import _fmt_table, positive_int


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    """FLOPs of exact causal attention over one sequence: QK^T and PV over the L(L+1)/2 visible pairs."""
    return 4.0 * heads * head_dim * tokens * (tokens + 1) / 2


def _time_cuda(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs, after one warm-up, with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def matmul_rate(dtype: torch.dtype, n: int = 8192, repeat: int = 5) -> float:
    """TFLOP/s of an n x n x n GEMM in `dtype` on the current GPU."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2.0 * n ** 3 / _time_cuda(lambda: a @ b, repeat) / 1e12


def default_backends(device=None) -> list[str]:
    """The backends worth timing here: triton, plus flash-attn when it imports and torch-flash when its probe passes
    on the GPU."""
    from cpinfer.attention.backends import _unusable

    device = torch.device(device or "cuda")
    return ["triton"] + [n for n in ("flash-attn", "torch-flash") if not _unusable(n, device)]


def _attention_fns(tokens, heads, kv_heads, head_dim, dtype, backends):
    """name → zero-argument callable computing causal attention over one sequence of `tokens`."""
    from cpinfer.attention.backends import LocalAttention

    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=dtype)
    seq = torch.zeros(tokens, dtype=torch.long)
    pos = torch.arange(tokens)
    fns = {}
    for name in backends:  # planned once; the device tables are built in the untimed warm-up call
        step = LocalAttention(seq, pos, seq, pos, backend=name, device=q.device)
        fns[name] = lambda step=step: step(q, k, v)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    fns["torch-sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                                 enable_gqa=True)
    return fns


def measure(args) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gemm = matmul_rate(dtype)
    rows = []
    for tokens in args.tokens:
        flops = causal_flops(tokens, args.heads, args.head_dim)
        for name, fn in _attention_fns(tokens, args.heads, args.kv_heads, args.head_dim, dtype,
                                       args.backends).items():
            try:
                sec = _time_cuda(fn, args.repeat)
            except torch.cuda.OutOfMemoryError:  # e.g. an SDPA fallback that materialises L x L scores
                rows.append({"tokens": tokens, "kernel": name, "seconds": None, "tflops": None, "of_matmul": None})
                torch.cuda.empty_cache()
                continue
            rows.append({"tokens": tokens, "kernel": name, "seconds": sec, "tflops": flops / sec / 1e12,
                         "of_matmul": flops / sec / 1e12 / gemm})
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "matmul_tflops": gemm, "rows": rows,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}


def measure_plan(args) -> dict:
    """Host milliseconds to plan one forward (rank 0, pass-KV) and build its tile tables (vector and item mode)."""
    import time

    from cpinfer.attention.local import MASK
    from cpinfer.attention.tiles import item_table, tile_table
    from cpinfer.cp import plan_from_metadata
    from cpinfer.cp.sharding import shard_prefill

    rows = []
    rows_per_prog = 64 // (args.heads // args.kv_heads) or 1
    for tokens in args.tokens:
        for n in (1, 8):
            meta = [(sh.seq, sh.pos) for sh in shard_prefill([tokens], n).shards]
            t0 = time.perf_counter()
            plan = plan_from_metadata(meta, meta, group=None, rank=0, world=n, strategy="pass-kv")
            t1 = time.perf_counter()
            tables = [tile_table(plan.steps[j], len(plan.me.q_seq), rows_per_prog) for j in range(n)]
            t2 = time.perf_counter()
            for j in range(n):
                item_table([it for it in plan.steps[j] if it.kind != MASK], len(plan.me.q_seq), rows_per_prog)
            t3 = time.perf_counter()
            rows.append({"tokens": tokens, "cp": n, "plan_ms": 1e3 * (t1 - t0), "tables_ms": 1e3 * (t2 - t1),
                         "item_tables_ms": 1e3 * (t3 - t2), "programs": sum(t.num_programs for t in tables)})
    return {"rows": rows, "rows_per_prog": rows_per_prog}


def format_plan_report(res: dict) -> str:
    table = _fmt_table(["tokens", "CP", "plan ms", "tile tables ms", "item tables ms", "programs (all steps)"],
                       [[r["tokens"], r["cp"], f"{r['plan_ms']:.1f}", f"{r['tables_ms']:.1f}",
                         f"{r['item_tables_ms']:.1f}", r["programs"]] for r in res["rows"]])
    return (f"host work per forward, rank 0 of a pass-KV full prefill of one sequence "
            f"({res['rows_per_prog']} query rows per program)\n{table}")


def format_report(res: dict) -> str:
    table = _fmt_table(["tokens", "kernel", "ms", "TFLOP/s", "of matmul"],
                       [[r["tokens"], r["kernel"], "out of memory", "-", "-"] if r["seconds"] is None else
                        [r["tokens"], r["kernel"], f"{1e3 * r['seconds']:.2f}", f"{r['tflops']:.1f}",
                         f"{r['of_matmul']:.2f}"] for r in res["rows"]])
    return (f"{res['device']}, {res['dtype']}, H={res['heads']} Hkv={res['kv_heads']} D={res['head_dim']}, "
            f"causal prefill of one sequence; {res['dtype']} GEMM 8192^3: {res['matmul_tflops']:.1f} TFLOP/s\n{table}")


def _tokens(text: str) -> list[int]:
    vals = [positive_int(x) for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("need at least one length, e.g. 8192,16384")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=_tokens, default=[8192, 16384, 32768, 65536, 131072],
                        help="sequence lengths, comma-separated (default 8K-128K)")
    parser.add_argument("--heads", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--backends", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="attention backends to time (default: triton, plus flash-attn when installed and "
                             "torch-flash when its probe passes)")
    parser.add_argument("--repeat", type=positive_int, default=5)
    parser.add_argument("--plan-only", action="store_true",
                        help="no GPU: time the host-side plan and tile tables of one forward instead")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line")


def run(args) -> int:
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.plan_only:
        res = measure_plan(args)
        print(format_plan_report(res))
        if args.json:
            print(json.dumps(res))
        return 0
    if not torch.cuda.is_available():
        print("cpinfer bench gpu needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured")
        return 2
    if args.backends is None:
        args.backends = default_backends()
    res = measure(args)
    print(format_report(res))
    if args.json:
        print(json.dumps(res))
    return 0
