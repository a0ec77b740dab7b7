"""Attention kernel TFLOP/s on one GPU vs the matmul rate of the same run (`cpinfer bench gpu`; needs CUDA).

Causal full prefill of one sequence (the paper's 8K-128K range, Llama-3-8B heads by default) through each
backend's one-step path (`triton`; `flash-attn` when installed; `torch-cudnn` and `torch-flash` when their probes
passed) and PyTorch's dense SDPA for reference (`torch-sdpa`: its own dispatch; `sdpa-cudnn`: forced onto cuDNN
attention with `sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`); every rate is also given as a fraction of a bf16 GEMM
measured in the same process (FLOPs: 2 matmuls x 2 x L^2/2 x H x D), every backend's output is compared with
SDPA's (max |diff|), and torch-cudnn's rate is reported as a ratio of dense cuDNN SDPA's timed in the same run.
"ms at a new length": one call at tokens - 1, wall time with planning and any per-shape plan the library builds
(cuDNN's graph) — what a prompt of a length not seen before pays.
`--plan-only` (no GPU needed) times the host side of one forward instead: the plan and the Triton tile tables of
every ring step at CP1 and CP8, which are built once per forward and reused by every layer.
It ran on an H100 as part (b) of scripts/gpu_check.sh (docs/benchmarks.md, "GPU").
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cpinfer.bench.attention import _fmt_table, positive_int
from cpinfer.timing import median_seconds


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    """FLOPs of exact causal attention over one sequence: QK^T and PV over the L(L+1)/2 visible pairs."""
    return 4.0 * heads * head_dim * tokens * (tokens + 1) / 2


def matmul_rate(dtype: torch.dtype, n: int = 8192, repeat: int = 5, device: str = "cuda") -> float:
    """TFLOP/s of an n x n x n GEMM in `dtype` on `device` (the current GPU)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n ** 3 / median_seconds(lambda: a @ b, repeat, device) / 1e12


def default_backends(device=None) -> list[str]:
    """The backends worth timing here: triton, plus flash-attn when it imports and torch-cudnn / torch-flash when
    their probes pass on the GPU."""
    from cpinfer.attention.backends import _unusable

    device = torch.device(device or "cuda")
    return ["triton"] + [n for n in ("flash-attn", "torch-cudnn", "torch-flash") if not _unusable(n, device)]


REFERENCES = ("torch-sdpa", "sdpa-cudnn")  # dense SDPA, not cpinfer backends


def _sdpa_cudnn(qh, kh, vh):
    """Dense SDPA forced onto cuDNN attention: with `enable_gqa` when cuDNN takes it, else with K/V heads repeated
    (decided by one untimed call) → a zero-argument callable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(k, v, gqa):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=gqa)

    try:
        run(kh, vh, True)
        return lambda: run(kh, vh, True)
    except RuntimeError:  # this cuDNN SDPA takes no GQA: repeat the K/V heads (same FLOPs)
        g = qh.shape[1] // kh.shape[1]
        kr, vr = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
        run(kr, vr, False)
        return lambda: run(kr, vr, False)


def _attention_fns(tokens, heads, kv_heads, head_dim, dtype, backends, device="cuda"):
    """(name → zero-argument callable computing causal attention over one sequence of `tokens`, name → one at a
    length not seen before (tokens - 1; called once: planning and per-shape plans included) for the cpinfer
    backends and SDPA's own dispatch)."""
    from cpinfer.attention.backends import LocalAttention

    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    seq = torch.zeros(tokens, dtype=torch.long)
    pos = torch.arange(tokens)
    fns, fresh, m = {}, {}, tokens - 1
    for name in backends:  # planned once; the device tables are built in the untimed warm-up call
        step = LocalAttention(seq, pos, seq, pos, backend=name, device=q.device)
        fns[name] = lambda step=step: step(q, k, v)
        fresh[name] = lambda name=name: LocalAttention(seq[:m], pos[:m], seq[:m], pos[:m], backend=name,
                                                       device=q.device)(q[:m], k[:m], v[:m])
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns["torch-sdpa"] = lambda: sdpa(qh, kh, vh, is_causal=True, enable_gqa=True)
    fresh["torch-sdpa"] = lambda: sdpa(qh[:, :, :m], kh[:, :, :m], vh[:, :, :m], is_causal=True, enable_gqa=True)
    try:
        fns["sdpa-cudnn"] = _sdpa_cudnn(qh, kh, vh)
    except RuntimeError as exc:  # no cuDNN attention here: reported as a row without a rate
        fns["sdpa-cudnn"] = exc
    return fns, fresh


def _wall(fn, device: str = "cuda") -> float:
    """Wall seconds of one call, the GPU idle before and drained after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _output(name: str, res) -> torch.Tensor:
    """A kernel's output as [L, H, D]: backends return (out [L, H, D] fp32, lse); SDPA out [1, H, L, D]."""
    return res[0].transpose(0, 1) if name in REFERENCES else res[0]


def measure(args, device: str = "cuda", on_row=None, gemm_n: int = 8192) -> dict:
    """Every length's rows (see the module's docstring); `on_row(row, gemm TFLOP/s)` is called as each row is
    measured."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gemm = matmul_rate(dtype, gemm_n, device=device)
    rows = []
    for tokens in args.tokens:
        flops = causal_flops(tokens, args.heads, args.head_dim)
        fns, fresh = _attention_fns(tokens, args.heads, args.kv_heads, args.head_dim, dtype, args.backends, device)
        try:  # SDPA's output [L, H, D] (untimed), what every kernel's output is compared with
            ref = _output("torch-sdpa", fns["torch-sdpa"]())
        except torch.cuda.OutOfMemoryError:
            ref = None
        for name, fn in fns.items():
            row = {"tokens": tokens, "kernel": name, "seconds": None, "tflops": None, "of_matmul": None,
                   "vs_sdpa": None, "new_length_s": None, "error": None}
            rows.append(row)
            _time_kernel(row, name, fn, fresh.get(name), ref, args.repeat, device, flops, gemm)
            if on_row is not None:
                on_row(row, gemm)
        del fns, fresh, ref
        torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"
    return {"device": where, "dtype": args.dtype, "matmul_tflops": gemm, "rows": rows, "gemm_n": gemm_n,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "cudnn_vs_sdpa": cudnn_ratios(rows)}


def _time_kernel(row: dict, name: str, fn, fresh, ref, repeat: int, device: str, flops: float, gemm: float) -> None:
    """Fill `row` with one kernel's median time, rate, distance from SDPA's output and its time at a new length."""
    if isinstance(fn, Exception):
        row["error"] = f"{type(fn).__name__}: {fn}"
        return
    try:
        sec = median_seconds(fn, repeat, device)
        out = _output(name, fn())
        row["new_length_s"] = _wall(fresh, device) if fresh is not None else None
    except torch.cuda.OutOfMemoryError:  # e.g. an SDPA fallback that materialises L x L scores
        row["error"] = "out of memory"
        torch.cuda.empty_cache()
        return
    row.update(seconds=sec, tflops=flops / sec / 1e12, of_matmul=flops / sec / 1e12 / gemm)
    if ref is not None and name != "torch-sdpa":
        row["vs_sdpa"] = float((out.float() - ref.float()).abs().max())


def cudnn_ratios(rows) -> dict:
    """tokens → torch-cudnn's TFLOP/s over dense cuDNN SDPA's in the same run (the issue's target: >= 0.9)."""
    rate = {(r["tokens"], r["kernel"]): r["tflops"] for r in rows}
    return {t: rate[(t, "torch-cudnn")] / rate[(t, "sdpa-cudnn")] for t in sorted({r["tokens"] for r in rows})
            if rate.get((t, "torch-cudnn")) and rate.get((t, "sdpa-cudnn"))}


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


ROW_HEADER = ["tokens", "kernel", "ms", "TFLOP/s", "of matmul", "max abs diff vs SDPA", "ms at a new length"]


def report_row(r: dict) -> list:
    """One measured row as the report's cells (`ROW_HEADER`)."""
    if r["seconds"] is None:
        error = r.get("error") or "out of memory"
        return [r["tokens"], r["kernel"], error if len(error) <= 100 else error[:97] + "...", "-", "-", "-", "-"]
    vs = "-" if r.get("vs_sdpa") is None else f"{r['vs_sdpa']:.1e}"
    fresh = "-" if r.get("new_length_s") is None else f"{1e3 * r['new_length_s']:.2f}"
    return [r["tokens"], r["kernel"], f"{1e3 * r['seconds']:.2f}", f"{r['tflops']:.1f}", f"{r['of_matmul']:.2f}",
            vs, fresh]


def format_report(res: dict) -> str:
    table = _fmt_table(ROW_HEADER, [report_row(r) for r in res["rows"]])
    ratios = res.get("cudnn_vs_sdpa") or {}
    line = ("\ntorch-cudnn / dense cuDNN SDPA (same run; target >= 0.90): "
            + ", ".join(f"{t}: {x:.2f}" for t, x in ratios.items())) if ratios else ""
    return (f"{res['device']}, {res['dtype']}, H={res['heads']} Hkv={res['kv_heads']} D={res['head_dim']}, "
            f"causal prefill of one sequence; {res['dtype']} GEMM {res.get('gemm_n', 8192)}^3: "
            f"{res['matmul_tflops']:.1f} TFLOP/s\n{table}"
            f"{line}")


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
                             "torch-cudnn / torch-flash when their probes pass; dense SDPA is always timed)")
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
