"""The limits efficiency is measured against, as arithmetic (no GPU needed): the prefill FLOP count of the paper's
App. A and MFU, the decode memory floor (weights + KV bytes over a bandwidth), and their report lines. The GPU
check's parts (c) and (d) time the engine; these functions say what the times mean.
"""
from __future__ import annotations

import dataclasses

import torch

from cpinfer.model.config import ModelConfig
from cpinfer.timing import median_seconds


def prefill_flops(params: int, tokens: int, layers: int, q_dim: int, batch: int = 1) -> dict[str, float]:
    """FLOPs of a causal prefill of `batch` sequences of `tokens` tokens, as the paper's App. A counts them:
    GEMM = 2 x W x T x B (W parameters, 2 FLOPs per multiply-add) and ATTN = 1/2 x 4 x B x T^2 x D x layers (1/2:
    the causal mask; 4: two batched matmuls, 2 FLOPs each), with D the query width (heads x head_dim: the model
    dimension of a Llama)."""
    for name, v in (("params", params), ("tokens", tokens), ("layers", layers), ("q_dim", q_dim), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    gemm = 2.0 * params * tokens * batch
    attn = 0.5 * 4.0 * batch * float(tokens) ** 2 * q_dim * layers
    return {"gemm": gemm, "attn": attn, "total": gemm + attn}


def model_params(config: ModelConfig) -> int:
    """W: every parameter of the model (tied embeddings counted once), as App. A counts a model's size."""
    from cpinfer.model.loader import build_model  # late: the loader imports the model package

    return sum(p.numel() for p in build_model(config).parameters())  # meta tensors: no memory


def config_prefill_flops(config: ModelConfig, tokens: int, batch: int = 1) -> dict[str, float]:
    """`prefill_flops` for a model config (W from its parameters, D = heads x head_dim)."""
    return prefill_flops(model_params(config), tokens, config.num_hidden_layers,
                         config.num_attention_heads * config.head_dim, batch)


def decode_weight_bytes(config: ModelConfig, elem_bytes: int) -> int:
    """Bytes of weights one decode step must read: every parameter, except an untied input embedding (a step
    gathers one row of it per sequence)."""
    from cpinfer.model.loader import build_model

    model = build_model(config)
    skip = 0 if config.tie_word_embeddings else model.model.embed_tokens.weight.numel()
    return (sum(p.numel() for p in model.parameters()) - skip) * elem_bytes


def kv_bytes(config: ModelConfig, context: int, elem_bytes: int, batch: int = 1) -> int:
    """K/V bytes `batch` sequences of `context` cached tokens hold (what one decode step reads once)."""
    per_token = config.num_hidden_layers * config.num_key_value_heads * 2 * config.head_dim * elem_bytes
    return per_token * context * batch


def decode_floor_s(weight_bytes: int, kv_total_bytes: int, bandwidth: float) -> float:
    """The memory floor of one decode step: weights and K/V read once each, at `bandwidth` bytes/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return (weight_bytes + kv_total_bytes) / bandwidth


@dataclasses.dataclass(frozen=True)
class PrefillEfficiency:
    """One prefill's efficiency: its FLOPs over its TTFT against a peak (the datasheet's) and a GEMM rate
    (measured in the same run), both in TFLOP/s."""

    flops: float
    ttft_s: float
    peak_tflops: float | None  # None: the device is not in the catalog
    gemm_tflops: float

    def __post_init__(self) -> None:
        if self.flops <= 0 or self.ttft_s <= 0 or self.gemm_tflops <= 0:
            raise ValueError(f"flops, ttft_s and gemm_tflops must be positive, got {self.flops}, {self.ttft_s}, "
                             f"{self.gemm_tflops}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive or None, got {self.peak_tflops}")

    @property
    def tflops(self) -> float:
        return self.flops / self.ttft_s / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation against the dense peak."""
        return None if self.peak_tflops is None else self.tflops / self.peak_tflops

    @property
    def of_gemm(self) -> float:
        return self.tflops / self.gemm_tflops


def verdict(name: str, value: float, limit: float, unit: str = "", at_least: bool = False) -> str:
    """A target as one report line (not an assertion): 'PASS: name value <= limit' (`at_least`: >=) or 'FAIL:
    name value > limit' (<)."""
    ok = value >= limit if at_least else value <= limit
    sign = (">=" if ok else "<") if at_least else ("<=" if ok else ">")
    return f"{'PASS' if ok else 'FAIL'}: {name} {value:.3g}{unit} {sign} {limit:.3g}{unit}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def secs(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def prefill_table(rows: list[dict]) -> list[list[str]]:
    """Report rows from dicts {model, tokens, ttft_s, flops, peak_tflops, gemm_tflops, hf_ttft_s (None: not run /
    did not fit)}: TTFT, TFLOP/s, MFU vs the peak and vs the GEMM, Hugging Face's TTFT and the ratio."""
    out = []
    for r in rows:
        e = PrefillEfficiency(r["flops"], r["ttft_s"], r["peak_tflops"], r["gemm_tflops"])
        hf = r.get("hf_ttft_s")
        out.append([r["model"], str(r["tokens"]), secs(e.ttft_s), f"{r['flops'] / 1e15:.2f}", f"{e.tflops:.0f}",
                    pct(e.mfu), pct(e.of_gemm), secs(hf), "-" if hf is None else f"{hf / e.ttft_s:.2f}"])
    return out


PREFILL_HEADER = ["model", "tokens", "TTFT (s)", "PFLOP (App. A)", "TFLOP/s", "MFU (peak)", "of GEMM",
                  "HF TTFT (s)", "HF / cpinfer"]


def copy_bandwidth(nbytes: int = 1 << 31, repeat: int = 10, device: str = "cuda") -> float:
    """Bytes/s of a large device-to-device copy on `device` (bytes read + bytes written, median of `repeat`
    event-timed copies after a warm-up), from random data."""
    n = nbytes // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)  # random, never zeros
    dst = torch.empty_like(src)
    return 2.0 * nbytes / median_seconds(lambda: dst.copy_(src), repeat, device, warmup=2)


def gemm_rate(n: int = 8192, repeat: int = 10, device: str = "cuda", dtype=torch.bfloat16) -> float:
    """TFLOP/s of an n x n x n matrix product (bf16 unless told) on `device` (random operands, median of timed runs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2.0 * n ** 3 / median_seconds(lambda: torch.mm(a, b), repeat, device, warmup=2) / 1e12
