"""FP8 KV cache (`kv_cache_dtype="fp8"`): every K or V row — one token, one KV head — is stored as e4m3 values with
its own fp32 scale (amax / 448), packed into one uint8 row [width + 4]: values, then the scale's 4 bytes.

Why per token and head: the scale depends on that row alone, so a token's stored bytes are the same whatever rank
holds it, however the prompt was chunked and whatever the CP size — CP N equals CP 1 exactly, and a tier entry
written at one CP size restores at another. (A static per-layer scale from a first prefill would depend on which
tokens that rank saw.) The cost is 4 bytes per row: (D + 4) / 2D of bf16, 0.52 at D = 128.

The store, the pass-KV ring messages and the tier entries carry packed rows; the attention step dequantizes them
(`decode`) to the compute dtype, new tokens included, so every query sees the same K/V whichever step reads it.
Nothing here knows the row width: keys and values may differ in width (MLA).
"""
from __future__ import annotations

import torch
from torch import Tensor

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" means e4m3
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # one fp32 scale per row


def check_kv_cache_dtype(name: str) -> str:
    """The canonical name ("auto" or "fp8"); anything else is a ValueError naming the allowed values."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "auto" if name == "auto" else "fp8"


def is_fp8(kv_cache_dtype: str) -> bool:
    return check_kv_cache_dtype(kv_cache_dtype) == "fp8"


def row_bytes(width: int, elem_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one stored K or V row of `width` values: width x element size, or width + 4 in FP8."""
    return width + SCALE_BYTES if is_fp8(kv_cache_dtype) else width * elem_bytes


def layout_dtype(dtype: str, kv_cache_dtype: str) -> str:
    """The dtype a KV-tier entry is keyed by: the compute dtype, or the FP8 row format (so an FP8 entry is never
    read back as full precision, nor the reverse)."""
    return "fp8_e4m3+scale_f32_per_token_head" if is_fp8(kv_cache_dtype) else dtype


def encode(x: Tensor) -> Tensor:
    """x [..., W] (any float dtype) -> packed uint8 [..., W + 4]: e4m3(x / s) then s = amax(|x|) / 448 as fp32
    bytes; an all-zero row gets s = 0 (and decodes to zeros)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # [..., 1]
    q = (xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)  # [..., W + 4]


def decode(p: Tensor, dtype: torch.dtype) -> Tensor:
    """packed uint8 [..., W + 4] -> [..., W] in `dtype` (computed as e4m3 value x scale in fp32)."""
    w = p.shape[-1] - SCALE_BYTES
    scale = p[..., w:].contiguous().view(torch.float32)  # [..., 1]
    return (p[..., :w].view(FP8).float() * scale).to(dtype)


def width(p: Tensor) -> int:
    """The number of values in a packed row."""
    return p.shape[-1] - SCALE_BYTES
