"""Triton GEMM for block-scaled FP8 weights (the `fp8` format's 128x128 `weight_scale_inv`, compressed-tensors
`block`): y = x @ dequant(W)^T with W kept e4m3 in memory and dequantized tile by tile in registers.

Activations stay in their dtype (no activation quantization: the product equals x @ dequant(W)^T up to fp32
summation order). A K tile never crosses a scale block, so the tile's product is computed on the exact e4m3 values
(widened to x's dtype: exact) and scaled once per output column: acc += (x_tile @ w_tile) * s[n // bo, k // bi].
The weight is read either as float8e4nv (sm_89+, one hardware convert) or as its uint8 bits decoded with integer
arithmetic (any GPU, Ampere included); both run in Triton's interpreter (TRITON_INTERPRET=1), which is how the
tests verify them. Tile configs are chosen for Hopper by shape alone (no autotuning: CUDA-graph safe); unmeasured.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


@triton.jit
def _e4m3_bits_to_f32(b):
    """uint8 e4m3fn bits -> fp32, exactly: normal (1 + m/8) 2^(e-7), subnormal m 2^-9, 0x7F / 0xFF NaN."""
    b = b.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # fp32 exponent e + 120, mantissa m << 20
    sub = (mag & 7).to(tl.float32) * 0.001953125  # e = 0: m * 2^-9
    v = tl.where(mag < 8, sub, normal)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def _block_fp8_gemm_kernel(X, W, S, BIAS, Y, M, N, K, K_SPLIT, sxm, sxk, swn, swk, ssn, ssk, sym, syn, sys,
                           QN: tl.constexpr, QK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                           DECODE_BITS: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    # program (p, split) -> (m tile, n tile) of the K range [split * K_SPLIT, +K_SPLIT) (a multiple of BLOCK_K; one
    # split: all of K); GROUP_M m tiles side by side so their programs share W tiles in L2
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M  # (not tl.cdiv: a jit helper the interpreter may not have patched)
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    rows_here = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows_here
    pid_n = (pid % group) // rows_here
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_ok, n_ok = m < M, n < N
    x_ptr = X + m.to(tl.int64)[:, None] * sxm + (k_lo + k)[None, :] * sxk  # [BLOCK_M, BLOCK_K]
    w_ptr = W + n.to(tl.int64)[None, :] * swn + (k_lo + k)[:, None] * swk  # [BLOCK_K, BLOCK_N]: W^T's tile
    s_ptr = S + (n // QN) * ssn  # [BLOCK_N]: each column's scale row; the K block is added per tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = k < k_hi - k0
        x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & n_ok[None, :]
        s = tl.load(s_ptr + (k0 // QK) * ssk, mask=n_ok, other=0.0)  # [BLOCK_N] fp32
        if DECODE_BITS:
            w = _e4m3_bits_to_f32(tl.load(w_ptr, mask=w_ok, other=0))  # the exact e4m3 values, fp32
        else:  # float8e4nv cannot take `other`: masked lanes are zeroed after the convert
            w = tl.where(w_ok, tl.load(w_ptr, mask=w_ok).to(tl.float32 if DOT_F32 else X.dtype.element_ty), 0.0)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            part = tl.dot(x, w.to(x.dtype))  # e4m3 -> bf16 / fp16 is exact; fp32 accumulation
        acc += part * s[None, :]
        x_ptr += BLOCK_K * sxk
        w_ptr += BLOCK_K * swk
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + tl.program_id(1).to(tl.int64) * sys + m.to(tl.int64)[:, None] * sym + n[None, :] * syn
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch's tiles: BLOCK_K divides the scale block's K size, so a K tile uses one scale per column."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1  # K ranges summed afterwards in a fixed order (deterministic), for decode on few N tiles

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16 (tl.dot), got {v}")
        if self.split_k < 1:
            raise ValueError(f"GemmConfig.split_k must be >= 1, got {self.split_k}")


def block_k_for(qk: int, most: int = 128) -> int | None:
    """The largest power-of-two K tile (16 .. `most`) dividing the scale block's K size `qk`; None if none does."""
    b = most
    while b >= 16:
        if qk % b == 0:
            return b
        b //= 2
    return None


@functools.lru_cache(maxsize=4096)  # called per linear per step: the choice is a pure function of the shape
def pick_config(m: int, n: int, k: int, qk: int, x_dtype: torch.dtype, sms: int = 132) -> GemmConfig:
    """Tiles for an [m, k] x [k, n] product on a Hopper-class GPU (`sms` multiprocessors), chosen by shape only.

    Decode (m <= 16) is bound by reading W: one 16-row tile, narrow N tiles so that about every SM streams its own
    columns, a deep pipeline of weight loads, and when even 32-wide N tiles leave SMs idle (a TP slice: N = 1024)
    K split into up to 8 ranges of at least 4 tiles. Prefill is bound by the tensor cores: 128 x 128 tiles,
    8 warps, 3 stages (48 KB of shared memory per stage for bf16 x and 128-wide K). Unmeasured: no GPU ran these."""
    block_k = block_k_for(qk)
    if block_k is None:
        raise ValueError(f"block FP8 GEMM needs a scale block K size divisible by 16, got {qk}")
    wide = x_dtype == torch.float32  # 4-byte activations: half the stages fit
    if m <= 16:
        bm, warps, stages = 16, 4, 4
    elif m <= 64:
        bm, warps, stages = 64, 4, 4
    else:
        bm, warps, stages = 128, 8, 3
    bn = 128
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < sms:
        bn //= 2
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = min(8, triton.cdiv(sms, tiles), k // (4 * block_k)) if m <= 16 and tiles < sms else 1
    return GemmConfig(bm, bn, block_k, warps, max(2, stages - 1) if wide else stages, split_k=max(1, split))


def native_fp8_convert(device: torch.device) -> bool:
    """Whether the GPU converts float8e4nv in hardware (compute capability 8.9+); else the kernel decodes bits."""
    return device.type == "cuda" and _cuda_traits(device.index)[0] >= (8, 9)


@functools.lru_cache(maxsize=None)
def _cuda_traits(index: int | None) -> tuple[tuple[int, int], int]:
    """(compute capability, multiprocessor count) of a CUDA device, read once."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return (props.major, props.minor), props.multi_processor_count


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, decode_bits: bool | None = None,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] (fp32 / bf16 / fp16) @ dequant(weight [N, K] e4m3, scale [ceil(N/bo), ceil(K/bi)] fp32)^T (+ bias
    [N]) -> [..., N] in x's dtype. `decode_bits`: read the weight's uint8 bits (default: unless the GPU converts
    e4m3 itself)."""
    n, kdim = weight.shape
    qn, qk = block
    if x.shape[-1] != kdim:
        raise ValueError(f"block FP8 linear: x has {x.shape[-1]} features, the weight [{n}, {kdim}] wants {kdim}")
    if weight.dtype not in (FP8, torch.uint8) or tuple(scale.shape) != (-(-n // qn), -(-kdim // qk)):
        raise ValueError(f"block FP8 linear needs an e4m3 weight and a [{-(-n // qn)}, {-(-kdim // qk)}] scale, got "
                         f"{weight.dtype} and {tuple(scale.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, kdim)  # [M, K]
    if x2.shape[0] == 0:
        return x.new_empty(lead + (n,))
    if decode_bits is None:
        decode_bits = not native_fp8_convert(x.device)
    w = weight.view(torch.uint8) if decode_bits else weight.view(FP8)
    if config is None:
        sms = _cuda_traits(x.device.index)[1] if x.is_cuda else 132
        config = pick_config(x2.shape[0], n, kdim, qk, x.dtype, sms)
    if qk % config.block_k:
        raise ValueError(f"GemmConfig.block_k {config.block_k} must divide the scale block's K size {qk}")
    k_split = triton.cdiv(triton.cdiv(kdim, config.split_k), config.block_k) * config.block_k  # whole K tiles
    splits = triton.cdiv(kdim, k_split)
    # [splits, M, N] fp32 partials when K is split (summed below in split order), else y itself
    y = torch.empty((splits,) * (splits > 1) + (x2.shape[0], n), dtype=torch.float32 if splits > 1 else x.dtype,
                    device=x.device)
    grid = (triton.cdiv(x2.shape[0], config.block_m) * triton.cdiv(n, config.block_n), splits)
    _block_fp8_gemm_kernel[grid](
        x2, w, scale, bias if bias is not None else scale, y, x2.shape[0], n, kdim, k_split,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        y.stride(-2), y.stride(-1), y.stride(0) if splits > 1 else 0, QN=qn, QK=qk, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        HAS_BIAS=bias is not None and splits == 1, DECODE_BITS=decode_bits,
        DOT_F32=x.dtype == torch.float32 or interpreting(), PRECISION="ieee",
        num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        y = y.sum(0) if bias is None else y.sum(0) + bias.float()  # [M, N] fp32
        y = y.to(x.dtype)
    return y.reshape(lead + (n,))


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) computes 16-bit dots in fp32 (its numpy has no bf16)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compile_for(arch: int, m: int, n: int, qk: int = 128, x_dtype: str = "bf16", decode_bits: bool = False):
    """Compile the kernel ahead of time for NVIDIA sm_`arch` as `block_fp8_linear` would launch it for an [m, K] x
    [K, n] product (no GPU needed; a process without TRITON_INTERPRET); returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    cfg = pick_config(m, n, 4096, qk, dtypes[x_dtype])
    sig = {"X": f"*{x_dtype}", "W": "*u8" if decode_bits else "*fp8e4nv", "S": "*fp32", "BIAS": "*fp32",
           "Y": f"*{x_dtype}", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32"}
    sig.update({s: "i32" for s in ("sxm", "sxk", "swn", "swk", "ssn", "ssk", "sym", "syn", "sys")})
    consts = dict(QN=128, QK=qk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, HAS_BIAS=False, DECODE_BITS=decode_bits, DOT_F32=x_dtype == "fp32",
                  PRECISION="ieee")
    sig.update({c: "constexpr" for c in consts})
    return triton.compile(ASTSource(fn=_block_fp8_gemm_kernel, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
