"""Rotary position embedding (rotate-half convention of HF) with every scaling transformers defines: default,
linear, dynamic NTK, YaRN (with its attention factor), LongRoPE (short / long factors) and Llama 3.1's.

Positions are per-token global positions within each token's own sequence, so tokens of many sequences can be
packed in any order; cos/sin are computed in fp32 for exactly the positions of the call (no table). Frequencies
never depend on the batch: `dynamic` is evaluated at factor x max_position_embeddings and `longrope` picks its
long factors iff max_position_embeddings exceeds the original context (cached keys stay valid).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from cpinfer.attention.cpu_kernels import rope_op
from cpinfer.model.config_parts import RopeConfig


def _exponents(head_dim: int) -> Tensor:
    """[head_dim // 2] fp32: 2i / head_dim, as transformers builds them (int64 arange, then float)."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim


def rope_inv_freq(head_dim: int, rope: RopeConfig | None = None,
                  max_position_embeddings: int = 2048) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim // 2] fp32 on CPU, cos/sin scale) of one RoPE; always on CPU."""
    rope = rope or RopeConfig()
    t, base = rope.rope_type, rope.theta
    if t == "proportional":
        return _proportional(head_dim, rope), 1.0
    if rope.partial_rotary_factor != 1.0:  # as transformers: every other type over the rotated channels only
        head_dim = int(head_dim * rope.partial_rotary_factor)
    if t == "dynamic":  # transformers' formula at sequence length factor x max_position_embeddings
        seq_len = rope.factor * max_position_embeddings
        base = base * ((rope.factor * seq_len / max_position_embeddings) - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** _exponents(head_dim))
    if t == "linear":
        return inv_freq / rope.factor, 1.0
    if t == "llama3":
        return _llama3_scale(inv_freq, rope), 1.0
    if t == "yarn":
        return _yarn(head_dim, rope)
    if t == "longrope":
        return _longrope(head_dim, rope, max_position_embeddings)
    return inv_freq, 1.0


def _proportional(head_dim: int, s: RopeConfig) -> Tensor:
    """Gemma 4's global layers: the first int(f * head_dim // 2) pairs keep the frequencies of the full head_dim,
    the other pairs have frequency 0 (cos 1, sin 0: not rotated); all divided by `factor` (default 1)."""
    angles = int(s.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (s.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")))
    return inv_freq / (s.factor or 1.0)


def _llama3_scale(inv_freq: Tensor, s: RopeConfig) -> Tensor:
    """Keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    old_len = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / s.low_freq_factor    # longer wavelengths than this: fully scaled
    high_freq_wavelen = old_len / s.high_freq_factor  # shorter wavelengths than this: untouched
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, s: RopeConfig) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, extrapolate high ones, ramp in between (by rotations over
    the original context); cos/sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    factor, base, orig = s.factor, s.theta, s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        attention = (_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over orig
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, s: RopeConfig, max_position_embeddings: int) -> tuple[Tensor, float]:
    """LongRoPE: per-dimension factors, the long ones for a model configured past its original context."""
    orig = s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(orig))
    factors = s.long_factor if max_position_embeddings > orig else s.short_factor
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries, expected head_dim / 2 = {dim // 2}")
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * s.theta ** _exponents(dim)), float(attention)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """positions [L] int64 -> (cos, sin), each [L, D/2] fp32 on the positions' device, times `scale`."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [L, D/2]
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [L, H, D] by per-token angles (cos, sin [L, D/2]); math in fp32, result in x.dtype.

    Pairs are (i, i + D/2) — HF's `x * cos + rotate_half(x) * sin` with cos/sin repeated over both halves. Partial
    RoPE (cos/sin narrower than D/2: R/2 columns): the first R channels rotate as a head of R, the rest pass as is.
    """
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    if (x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3
            and cos.dim() == 2):
        op = rope_op()  # None without a compiled library
        if op is not None:  # the same products and sums in one pass (bit-identical to the ops below)
            return op(x if x.stride(-1) == 1 else x.contiguous(), cos, sin)
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]      # [L, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]      # [L, 1, D/2]
    out = torch.empty(xf.shape, dtype=xf.dtype, device=xf.device)  # [L, H, D] fp32, contiguous (x may be a view)
    # both halves written in place (no cat), each product rounded as transformers rounds it (x1 c - x2 s, x2 c + x1 s;
    # a fused multiply-add would round once, and a near-tie of a sparse model's top-k can turn on that last bit)
    torch.mul(x1, c, out=out[..., :half]).sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:]).add_(x1 * s)
    return out.to(x.dtype)


class RotaryEmbedding:
    """Holds fp32 inverse frequencies (not a module buffer, so `.to(bf16)` cannot degrade them)."""

    def __init__(self, head_dim: int, rope: RopeConfig | None = None, max_position_embeddings: int = 2048):
        self.inv_freq, self.scale = rope_inv_freq(head_dim, rope, max_position_embeddings)  # [D/2] fp32, CPU
        self._on_device: dict[torch.device, Tensor] = {}

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [L] int64 -> (cos, sin) [L, D/2] fp32, computed once per forward and shared by layers."""
        dev = positions.device
        if dev not in self._on_device:
            self._on_device[dev] = self.inv_freq.to(dev)
        return rope_cos_sin(self._on_device[dev], positions, self.scale)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE over adjacent pairs (2i, 2i + 1) — Llama 4's complex-multiply form — on x [L, H, D]; fp32 math."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]       # [L, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]      # [L, 1, D/2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
