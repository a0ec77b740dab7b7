"""The normalisations of the decoder's layers: `RMSNorm` in its three styles (Llama, Gemma, gpt-oss) and Llama 4's
weightless q/k `l2_norm`. Below both the decoder and latent attention (`mla.py`), which build layers from them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `style` "llama": weight * x̂ cast first, "gemma": (x̂ * (1 + weight)) in fp32,
    "fp32": weight * x̂ in fp32, then cast (gpt-oss)."""

    def __init__(self, dim: int, eps: float, style: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if style == "gemma" else torch.ones(dim))
        self.eps, self.style = eps, style

    def forward(self, x: Tensor) -> Tensor:
        """x [..., dim] -> same shape and dtype; x̂ = x / rms(x) in fp32 (one fused op where torch has one, the same
        values as the unfused pow / mean / rsqrt / mul), then the style's weight."""
        if self.style != "gemma" and x.dtype == torch.float32 == self.weight.dtype:  # one op, the same math
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.style == "gemma":
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.style == "fp32":  # gpt-oss: the weight applied before the cast
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """Llama 4's weightless q/k norm: x / rms(x) over the last dim, in fp32, back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
