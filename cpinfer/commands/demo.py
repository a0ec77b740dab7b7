"""`cpinfer demo`: a two-turn long-context conversation on a random Llama-3-shaped model, served at CP=1 and at
CP=N on local CPU ranks (full prefill with ring pass-KV, partial prefill on the persistent KV shards, pass-Q decode);
CP=N must produce CP=1's tokens and log-probabilities. A second stage checks CP attention itself: a multi-turn batch
of three sequences with ring pass-KV, ring pass-Q and all-gather against one device's attention.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import torch

from cpinfer.attention.local import local_attention
from cpinfer.bench.attention import positive_int, prefill_layout, rank_attention_output
from cpinfer.bench.common import random_model, random_prompt
from cpinfer.cp import STRATEGIES
from cpinfer.launch import WorkerPool

# Two turns of a 3-sequence conversation batch: (new tokens, cached tokens) per sequence.
DEFAULT_TURNS = (("full prefill", (1800, 1000, 300), (0, 0, 0)),
                 ("partial prefill", (200, 57, 1), (1800, 1000, 300)))


@dataclasses.dataclass(frozen=True)
class DemoRow:
    case: str
    strategy: str
    max_abs_err: float
    ok: bool


def _reference(q, k, v, new_lens, cached_lens) -> torch.Tensor:
    """Single-device attention over the global tensors: q [sum T, H, D], k/v [sum (P+T), Hkv, D] → [sum T, H, D]."""
    q_seq = np.repeat(np.arange(len(new_lens)), new_lens)
    q_pos = np.concatenate([np.arange(p, p + t) for t, p in zip(new_lens, cached_lens)])
    kv_seq = np.repeat(np.arange(len(new_lens)), [t + p for t, p in zip(new_lens, cached_lens)])
    kv_pos = np.concatenate([np.arange(p + t) for t, p in zip(new_lens, cached_lens)])
    out, _ = local_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos)
    return out


def run_attention_demo(num_ranks: int = 2, turns=DEFAULT_TURNS, heads: int = 8, kv_heads: int = 2,
                       head_dim: int = 64, tol: float = 1e-4, seed: int = 0,
                       pool: WorkerPool | None = None) -> list[DemoRow]:
    """Run every turn with every strategy on `num_ranks` ranks (a pool of that size is spawned unless given)
    and compare with the single-device result. Returns one row per (turn, strategy); fp32 throughout."""
    gen = torch.Generator().manual_seed(seed)
    own_pool = pool is None
    pool = WorkerPool(num_ranks, threads_per_rank=1) if own_pool else pool
    rows = []
    try:
        for case, new_lens, cached_lens in turns:
            total = sum(new_lens) + sum(cached_lens)
            q = torch.randn(sum(new_lens), heads, head_dim, generator=gen)  # [sum T, H, D]
            k = torch.randn(total, kv_heads, head_dim, generator=gen)  # [sum (P+T), Hkv, D]
            v = torch.randn(total, kv_heads, head_dim, generator=gen)
            ref = _reference(q, k, v, new_lens, cached_lens)
            layouts = prefill_layout(new_lens, cached_lens, pool.world_size)
            for strategy in STRATEGIES:
                outs = pool.run(rank_attention_output, layouts, q, k, v, strategy)
                full = torch.full_like(ref, float("nan"))
                for lay, out in zip(layouts, outs):
                    real = lay.q_index >= 0
                    full[torch.from_numpy(lay.q_index[real])] = out[torch.from_numpy(real)].float()
                err = float((full - ref).abs().max())  # nan (a token nobody computed) fails the check below
                rows.append(DemoRow(f"{case} {sum(new_lens)}+{sum(cached_lens)}", strategy, err, err <= tol))
    finally:
        if own_pool:
            pool.close()
    return rows


def format_rows(rows: list[DemoRow], num_ranks: int) -> str:
    lines = [f"{'case (new+cached tokens)':<28} {'strategy':<11} {'max abs err vs CP1':>18}  result"]
    for r in rows:
        lines.append(f"{r.case:<28} {r.strategy:<11} {r.max_abs_err:>18.2e}  {'PASS' if r.ok else 'FAIL'}")
    verdict = "all match" if all(r.ok for r in rows) else "MISMATCH"
    lines.append(f"CP{num_ranks} vs single device: {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------- stage 1: the engine, CP=1 vs CP=N

# The demo model: Llama-3-shaped (GQA 4:1, SwiGLU, RoPE theta 500000), small enough for a few thousand tokens on 2 cores.
DEMO_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=1024, max_position_embeddings=16384, rope_theta=500000.0)
EXTRA_TOKENS = 200  # new user tokens of turn 2


@dataclasses.dataclass
class TurnResult:
    cp: int
    turn: int
    prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    ttft_s: float
    ttit_s: list[float]
    prefill: str  # "pass-kv (full-prefill)"
    decode: str
    new_tokens_per_rank: list[int]
    kv_tokens_per_rank: list[int]


def _strategy(metrics: dict, phase: str) -> str:
    steps = [s for s in metrics["steps"] if s["phase"] == phase]
    if not steps:
        return "-"
    names = sorted({f"{s['strategy']} ({s['method']})" for s in steps})
    return ", ".join(names)


def _turn(llm, cp: int, turn: int, prompt: list[int], max_tokens: int, expect_cached: int) -> TurnResult:
    from cpinfer import SamplingParams

    print(f"[CP={cp}] turn {turn}: prefilling {len(prompt) - expect_cached} tokens "
          f"({expect_cached} expected from the cache) ...", flush=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    m = out.metrics
    seq = out.seq_id  # the cached sequence this turn extended
    return TurnResult(cp, turn, len(prompt), out.num_cached_tokens, out.token_ids, out.logprobs, m["ttft_s"],
                      m["ttit_s"], _strategy(m, "prefill"), _strategy(m, "decode"), m["new_tokens_per_rank"],
                      llm.layout.tokens_per_rank(seq))


def run_engine_demo(cp: int = 2, prompt_tokens: int = 4000, max_tokens: int = 16, extra_tokens: int = EXTRA_TOKENS,
                    seed: int = 0, model_dir=None) -> list[TurnResult]:
    """Two greedy turns (turn 2 = turn 1's prompt + output + `extra_tokens` new ones) at CP=1 and, if cp > 1, at
    CP=cp, each on a fresh `LLM`. Returns the turns of CP=1 followed by those of CP=cp."""
    from cpinfer import LLM
    from cpinfer.engine.kv_manager import BLOCK

    from cpinfer.model.config import ModelConfig

    model_dir = model_dir or random_model("demo-model", seed=seed, **DEMO_MODEL)
    vocab = ModelConfig.from_pretrained(str(model_dir)).vocab_size
    first = random_prompt(prompt_tokens, vocab, seed)
    capacity = -(-(prompt_tokens + extra_tokens + 2 * max_tokens + 4 * BLOCK) // BLOCK) * BLOCK
    results = []
    for n in sorted({1, cp}):
        t0 = time.perf_counter()
        threads = max(1, _cores() // n)  # the same cores for every CP size
        with LLM(str(model_dir), context_parallel_size=n, max_kv_tokens_per_rank=capacity,
                 threads_per_rank=threads) as llm:
            print(f"[CP={n}] {n} rank(s) x {threads} thread(s) started in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            one = _turn(llm, n, 1, first, max_tokens, 0)
            second = first + one.token_ids + random_prompt(extra_tokens, vocab, seed + 1)
            # the last output token was never fed through the model, so its K/V is not cached
            results += [one, _turn(llm, n, 2, second, max_tokens, len(first) + len(one.token_ids) - 1)]
    return results


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compare_turns(results: list[TurnResult], tol: float = 1e-4) -> tuple[bool, list[str]]:
    """CP=N turns against the CP=1 turns: identical tokens and log-probabilities within `tol`."""
    base = {r.turn: r for r in results if r.cp == 1}
    lines, ok = [], True
    for r in results:
        if r.cp == 1:
            continue
        ref = base[r.turn]
        same = r.token_ids == ref.token_ids
        n = min(len(r.logprobs), len(ref.logprobs))
        err = max((abs(a - b) for a, b in zip(r.logprobs[:n], ref.logprobs[:n])), default=0.0)
        good = same and err <= tol
        ok &= good
        what = "tokens identical" if same else f"tokens DIFFER (CP=1 {ref.token_ids} vs CP={r.cp} {r.token_ids})"
        lines.append(f"{'PASS' if good else 'FAIL'}: turn {r.turn}, CP={r.cp} vs CP=1: {what}, "
                     f"max |logprob diff| = {err:.1e} (tolerance {tol:.0e})")
    return ok, lines


def format_turns(results: list[TurnResult]) -> str:
    header = ["CP", "turn", "prompt", "cached", "prefill strategy", "decode strategy", "TTFT (s)",
              "TTIT mean (ms)", "new tokens / rank", "KV tokens / rank"]
    rows = []
    for r in results:
        ttit = 1000 * sum(r.ttit_s) / len(r.ttit_s) if r.ttit_s else float("nan")
        rows.append([r.cp, r.turn, r.prompt_tokens, r.num_cached_tokens, r.prefill, r.decode, f"{r.ttft_s:.3f}",
                     f"{ttit:.1f}", r.new_tokens_per_rank, r.kv_tokens_per_rank])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, row)) for row in [header, *rows])


def run(args) -> int:
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.prompt_tokens + EXTRA_TOKENS + 2 * args.max_tokens > DEMO_MODEL["max_position_embeddings"]:
        raise ValueError(f"--prompt-tokens + {EXTRA_TOKENS} + 2 * --max-tokens must be at most "
                         f"{DEMO_MODEL['max_position_embeddings']} (the demo model's context)")
    shape = ", ".join(f"{k}={v}" for k, v in DEMO_MODEL.items())
    print(f"Stage 1: two-turn conversation, CP=1 vs CP={args.cp}, random Llama-3-shaped model ({shape}), fp32, "
          f"greedy; turn 1 = {args.prompt_tokens} prompt tokens, turn 2 = turn 1 + its output + {EXTRA_TOKENS} "
          f"new tokens; {args.max_tokens} output tokens each", flush=True)
    results = run_engine_demo(args.cp, args.prompt_tokens, args.max_tokens)
    print(format_turns(results))
    ok, lines = compare_turns(results)
    print("\n".join(lines) if lines else "(CP=1 only: nothing to compare)")
    if not args.skip_attention:
        print(f"\nStage 2: context-parallel attention, CP{args.cp} vs one device: 3 sequences, H={args.heads}, "
              f"Hkv={args.kv_heads}, D={args.head_dim}, fp32", flush=True)
        rows = run_attention_demo(args.cp, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
        print(format_rows(rows, args.cp))
        ok &= all(r.ok for r in rows)
    print("demo: PASS" if ok else "demo: FAIL (CP results differ from the single-rank results)",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="two-turn long-context conversation at CP=1 vs CP=N, then CP "
                                   "attention vs one device (PASS/FAIL)", description=__doc__)
    parser.add_argument("--cp", type=positive_int, default=2, help="number of CP ranks (default: 2)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=4000,
                        help="turn-1 prompt length in tokens (default: 4000)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="greedy output tokens per turn (default: 16)")
    parser.add_argument("--skip-attention", action="store_true", help="skip stage 2 (CP attention vs one device)")
    parser.add_argument("--heads", type=positive_int, default=8, help="stage 2: query heads (default: 8)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="stage 2: key/value heads (default: 2)")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="stage 2: head dimension (default: 64)")
    parser.set_defaults(func=run)
