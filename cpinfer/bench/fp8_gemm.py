"""FP8 weight GEMMs against bf16 (`cpinfer bench fp8-gemm`; needs CUDA for timings).

For each weight shape and token count M: the bf16 `F.linear`, the block-FP8 Triton GEMM (`BlockFp8Linear`: e4m3
weights, 128x128 scales, activations unquantized) and, where `torch._scaled_mm` runs, the row-wise `Fp8Linear`
(activations quantized per token). Reports the median time (CUDA events), the weight bytes read per second
(decode is bound by them: FP8 reads half of bf16's) and TFLOP/s, and checks each result against the bf16 product
of the dequantized weight (relative Frobenius error). On CPU with TRITON_INTERPRET=1 it runs tiny shapes through
the interpreter (times meaningless): how the tests check this command.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from cpinfer.timing import median_seconds

# Llama-3-70B's dense linears (N, K): q/o, k+v fused size, gate/up, down
DEFAULT_SHAPES = "8192x8192,2048x8192,28672x8192,8192x28672"
# largest relative error vs the fp32 product each kernel may show: 16-bit output rounding; per-token activations
MAX_ERROR = {"bf16": 1e-2, "block-fp8 (triton)": 1e-2, "row-fp8 (_scaled_mm)": 0.1}


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"shapes must be NxK[,NxK...] with positive sizes, got {text!r}")
    return out


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def _weights(n: int, k: int, device, block=(128, 128)):
    """Random e4m3 weight [n, k], its block scales and row scales, and the dequantized bf16 / fp32 weights."""
    from cpinfer.model.quant import FP8, WeightScheme

    w = (torch.randn(n, k, device=device) * 64).clamp(-448, 448).to(FP8)  # [N, K]
    s_block = torch.rand(-(-n // block[0]), -(-k // block[1]), device=device) * 1e-3 + 1e-4  # [N/bo, K/bi]
    deq = WeightScheme("block", "weight_scale_inv", block).dequantize("w", w, s_block)  # [N, K] fp32
    s_row = deq.abs().amax(-1) / 448  # [N]: a row-wise requantization for Fp8Linear
    w_row = (deq / s_row[:, None]).clamp(-448, 448).to(FP8)
    return w, s_block, w_row, s_row, deq


def measure(shapes, tokens, dtype, repeat, device, on_row=None) -> list[dict]:
    """Rows (N, K, M, kernel, ms, weight_GBps, TFLOPs, rel_err) of every kernel at every shape and M; `on_row(row)`
    is called as each is measured."""
    from cpinfer.model.quant import BlockFp8Linear, Fp8Linear, scaled_mm_runs

    cuda = device.type == "cuda"
    rows = []
    scaled = scaled_mm_runs(device)
    for n, k in shapes:
        w, s_block, w_row, s_row, deq = _weights(n, k, device)
        ref_w = deq.to(dtype)
        kernels = {"bf16": lambda x: F.linear(x, ref_w),
                   "block-fp8 (triton)": BlockFp8Linear(w, s_block, (128, 128), None)}
        if scaled and n % 16 == 0 and k % 16 == 0:
            kernels["row-fp8 (_scaled_mm)"] = Fp8Linear(w_row, s_row, None)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            want = (x.float() @ deq.t())  # [M, N] fp32
            for name, fn in kernels.items():
                err = float((fn(x).float() - want).norm() / want.norm().clamp(min=1e-30))
                sec = median_seconds(lambda: fn(x), repeat, "cuda" if cuda else "cpu")
                w_bytes = n * k * (2 if name == "bf16" else 1)
                rows.append({"N": n, "K": k, "M": m, "kernel": name, "ms": sec * 1e3,
                             "weight_GBps": w_bytes / sec / 1e9, "TFLOPs": 2.0 * m * n * k / sec / 1e12,
                             "rel_err": err})
                if on_row is not None:
                    on_row(rows[-1])
    return rows


HEADER = ["N x K", "M", "kernel", "ms", "weight GB/s", "TFLOP/s", "rel. error vs fp32"]


def row_cells(r: dict) -> list[str]:
    return [f"{r['N']} x {r['K']}", str(r["M"]), r["kernel"], f"{r['ms']:.3f}", f"{r['weight_GBps']:.0f}",
            f"{r['TFLOPs']:.1f}", f"{r['rel_err']:.1e}"]


def format_table(rows: list[dict]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(out + ["| " + " | ".join(row_cells(r)) + " |" for r in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=_shapes, default=_shapes(DEFAULT_SHAPES),
                        help=f"weight shapes NxK (default: Llama-3-70B's, {DEFAULT_SHAPES})")
    parser.add_argument("--tokens", type=_ints, default=[1, 16, 128, 4096],
                        help="token counts M (default 1,16,128,4096: decode to prefill)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="also print the rows as one JSON line")


def run(args) -> int:
    from cpinfer.model.fp8_gemm import interpreting

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif interpreting():
        device = torch.device("cpu")
    else:
        raise SystemExit("cpinfer bench fp8-gemm needs a CUDA GPU (or TRITON_INTERPRET=1 for a functional run on CPU)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows = measure(args.shapes, args.tokens, dtype, args.repeat, device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton interpreter (times meaningless)"
    print(f"FP8 weight GEMMs vs bf16 on {where}, activations {args.dtype}\n" + format_table(rows))
    if args.json:
        print(json.dumps({"device": where, "rows": rows}))
    bad = [r for r in rows if not r["rel_err"] <= MAX_ERROR[r["kernel"]]]
    for r in bad:
        print(f"WRONG: {r['kernel']} at N={r['N']} K={r['K']} M={r['M']}: relative error {r['rel_err']:.2e} > "
              f"{MAX_ERROR[r['kernel']]:.0e}")
    return 1 if bad else 0
