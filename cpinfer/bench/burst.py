"""A burst of long prompts (`cpinfer bench burst`): N prompts of T tokens arrive at once; the time to first token of
each under per-step token budgets (`max_num_batched_tokens`: none, the default, others), and of one such prompt
alone under each budget.

Without a budget one forward prefills every waiting prompt whole, so every first token comes at the end of the
whole burst; with one, the oldest prompts' chunks go first (running requests before waiting ones), so first tokens
arrive one after another. One engine (the embedded model unless --model) serves every budget in turn: its
scheduler's budget is set between runs, prefix caching is off and every prompt is fresh, so nothing is reused.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from cpinfer.bench import common as C


def _budgets(text: str) -> list[int | None]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "none":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"budgets are positive integers or 'none', got {part!r}")
    return out


def _first_tokens(eng, prompts: list[list[int]], tag: str) -> list[float]:
    """Submit `prompts` at once, step until each has its first token: seconds from the submission to it, each."""
    from cpinfer import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    seen: dict[str, float] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.token_ids and out.request_id not in seen:
                seen[out.request_id] = time.perf_counter() - t0
    return [seen[f"{tag}-{i}"] for i in range(len(prompts))]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(args) -> dict:
    from cpinfer import LLM
    from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

    hw = C.hardware(args)
    model = args.model
    threads = max(1, (os.cpu_count() or 1) // args.cp)
    kv = C.kv_capacity(-(-args.burst * (args.tokens + 8) // args.cp) + 1024)
    runs = []
    with LLM(model, context_parallel_size=args.cp, threads_per_rank=threads, max_kv_tokens_per_rank=kv,
             enable_prefix_caching=False, **hw) as llm:
        eng = llm.engine
        vocab = eng.config.vocab_size
        seed = iter(range(10_000, 1_000_000))
        _first_tokens(eng, [C.random_prompt(256, vocab, next(seed))], "warm")
        for budget in args.budgets:
            eng.scheduler.config = dataclasses.replace(eng.scheduler.config, max_num_batched_tokens=budget)
            single = [_first_tokens(eng, [C.random_prompt(args.tokens, vocab, next(seed))], "one")[0]
                      for _ in range(args.repeats)]
            burst = _first_tokens(eng, [C.random_prompt(args.tokens, vocab, next(seed)) for _ in range(args.burst)],
                                  "burst")
            runs.append({"budget": budget, "default": budget == DEFAULT_MAX_NUM_BATCHED_TOKENS,
                         "single_ttft_s": statistics.median(single), "single_runs_s": single,
                         "burst_ttft_s": burst, "p50": _pct(burst, 0.5), "p90": _pct(burst, 0.9), "max": max(burst)})
    base = next((r for r in runs if r["budget"] is None), runs[0])
    for r in runs:
        r["single_vs_none"] = r["single_ttft_s"] / base["single_ttft_s"]
    return {"bench": "burst", "command": command_line(args) + C.hardware_flags(hw),
            "model": model or "the embedded SmolLM2-135M-Instruct", "cp": args.cp, "tokens": args.tokens,
            "burst": args.burst, "default_budget": DEFAULT_MAX_NUM_BATCHED_TOKENS, "runs": runs,
            "hardware": C.hardware_text(hw)}


def format_report(res: dict) -> str:
    rows = []
    for r in res["runs"]:
        name = "none (whole prompts)" if r["budget"] is None else str(r["budget"])
        rows.append([name + (" (default)" if r["default"] else ""), f"{r['p50']:.1f}", f"{r['p90']:.1f}",
                     f"{r['max']:.1f}", f"{min(r['burst_ttft_s']):.1f}", f"{r['single_ttft_s']:.2f}",
                     f"{r['single_vs_none']:.3f}"])
    return "\n".join([
        f"{res['burst']} prompt{'s' if res['burst'] != 1 else ''} of {res['tokens']} tokens at once, CP{res['cp']}, {res['model']}, "
        f"{res['hardware']}: time to first token per request (s), and of one such prompt alone (median of the "
        "repeats):", "",
        C.fmt_table(["max_num_batched_tokens", "burst TTFT p50", "p90", "max", "first", "single TTFT",
                     "single / none"], rows)])


def command_line(args) -> str:
    budgets = ",".join("none" if b is None else str(b) for b in args.budgets)
    model = f" --model {args.model}" if args.model else ""
    return (f"cpinfer bench burst --cp {args.cp} --tokens {args.tokens} --burst {args.burst} --budgets {budgets} "
            f"--repeats {args.repeats}{model}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size (default: 2)")
    parser.add_argument("--tokens", type=C.positive_int, default=3000, help="tokens per prompt (default: 3000)")
    parser.add_argument("--burst", type=C.positive_int, default=8, help="prompts arriving at once (default: 8)")
    parser.add_argument("--budgets", type=_budgets, default=[None, DEFAULT_MAX_NUM_BATCHED_TOKENS],
                        help="max_num_batched_tokens values to compare, 'none' for no bound (default: "
                             f"none,{DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--repeats", type=C.positive_int, default=3,
                        help="single-prompt runs per budget (default: 3)")
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2)")
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "burst",
                          lambda res: f"Burst of {res['burst']} x {res['tokens']}-token prompts: TTFT by step budget")
