"""Rotary position embedding (rotate-half convention of HF Llama), incl. Llama 3.1 frequency scaling.

Positions are per-token global positions within each token's own sequence, so tokens of many sequences can be
packed in any order; cos/sin are computed in fp32 for exactly the positions of the call (no table).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from cpinfer.model.config import Llama3RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 on CPU (always CPU, also under a meta-device context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    return inv_freq if scaling is None else _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: Tensor, s: Llama3RopeScaling) -> Tensor:
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


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """positions [L] int64 -> (cos, sin), each [L, D/2] fp32 on the positions' device."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [L, D/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [L, H, D] by per-token angles (cos, sin [L, D/2]); math in fp32, result in x.dtype.

    Pairs are (i, i + D/2) — HF's `x * cos + rotate_half(x) * sin` with cos/sin repeated over both halves.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]      # [L, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]      # [L, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class RotaryEmbedding:
    """Holds fp32 inverse frequencies (not a module buffer, so `.to(bf16)` cannot degrade them)."""

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2] fp32, CPU
        self._on_device: dict[torch.device, Tensor] = {}

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [L] int64 -> (cos, sin) [L, D/2] fp32, computed once per forward and shared by layers."""
        dev = positions.device
        if dev not in self._on_device:
            self._on_device[dev] = self.inv_freq.to(dev)
        return rope_cos_sin(self._on_device[dev], positions)
