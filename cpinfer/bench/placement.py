"""Adaptive placement: when CP spreads a request and when it keeps it on one rank (`cpinfer bench placement`).

Three parts, each measured side by side in one run (`--parts`, default all):
  e2e    one request of --context tokens (default 4000 and 65536) with a 48-token answer on the `bench decode` model:
         TTFT, TTIT and TTFT + 48 x TTIT at CP1 and at CP2 with placement auto, shard and local;
  burst  --requests distinct prompts of --prompt tokens, --output tokens each, submitted together, on the embedded
         model: output tokens/s of CP1 (1 thread), CP1 (2 threads), CP2 auto and CP2 shard (1 thread per rank);
  long   one --long-token prompt alone, then submitted first with the same burst, at CP2 auto with a
         --budget-token forward budget (chunked prefill): its TTFT both times, its placement, the burst's TTFT p50.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from cpinfer.bench import common as C

PARTS = ("e2e", "burst", "long")
PLACEMENT_RUNS = ("auto", "shard", "local")


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no prefix shared), ids above the special tokens."""
    return [[random.Random(seed * 100003 + i).randrange(100, vocab) for _ in range(length)] for i in range(count)]


def _ttit(out) -> float:
    return statistics.median(out.metrics["ttit_s"][1:] or out.metrics["ttit_s"])  # the first step is a warm-up


def _where(outs) -> str:
    kinds = [o.metrics["steps"][0]["placement"] for o in outs]
    return ", ".join(f"{kinds.count(k)} {k}" for k in ("local", "spread") if k in kinds)


# ---------------------------------------------------------------- e2e: one request, auto vs shard vs local

def one_request(model_dir, cp: int, placement: str, context: int, answer: int, vocab: int) -> dict:
    from cpinfer import LLM, SamplingParams

    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=1, placement=placement,
             max_kv_tokens_per_rank=C.kv_capacity(context + answer + 512)) as llm:
        llm.generate(C.random_prompt(256, vocab, seed=999), SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        out = llm.generate(C.random_prompt(context, vocab, seed=0),
                           SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    ttft, ttit = out.metrics["ttft_s"], _ttit(out)
    return {"ttft_s": ttft, "ttit_s": ttit, "e2e_s": ttft + answer * ttit, "placement": _where([out]),
            "decision": out.metrics["steps"][0].get("placement_inputs")}


def measure_e2e(args) -> dict:
    cfg = C.model_config(args, max(args.context) + args.answer + 1024)
    model_dir = C.random_model("bench-decode-model", **cfg)
    rows = {}
    for ctx in args.context:
        runs = {"CP1": one_request(model_dir, 1, "auto", ctx, args.answer, args.vocab)}
        for placement in PLACEMENT_RUNS:
            runs[f"CP2 {placement}"] = one_request(model_dir, 2, placement, ctx, args.answer, args.vocab)
        rows[str(ctx)] = runs
    return {"model": C.shape_text(cfg), "answer": args.answer, "rows": rows}


def format_e2e(res: dict) -> str:
    a = res["answer"]
    head = ["context", "run", "placement", "TTFT (s)", "TTIT (ms)", f"TTFT + {a} x TTIT (s)", "vs best of shard/local"]
    rows, notes = [], []
    for ctx, runs in res["rows"].items():
        best = min(runs["CP2 shard"]["e2e_s"], runs["CP2 local"]["e2e_s"])
        for name, r in runs.items():
            rel = f"{r['e2e_s'] / best:.3f}" if name.startswith("CP2") else "-"
            rows.append([ctx, name, r["placement"], f"{r['ttft_s']:.2f}", f"{1000 * r['ttit_s']:.1f}",
                         f"{r['e2e_s']:.2f}", rel])
        auto = runs["CP2 auto"]
        notes.append(f"{ctx} tokens: auto / best = {auto['e2e_s'] / best:.3f}; CP2 auto TTIT / CP1 TTIT = "
                     f"{auto['ttit_s'] / runs['CP1']['ttit_s']:.2f}; auto predicted {_prediction(auto)}")
    return "\n".join([f"One request, {a}-token answer, {res['model']}; 1 thread per rank; TTIT = median step:", "",
                      C.fmt_table(head, rows), "", *notes])


def _prediction(run: dict) -> str:
    d = run.get("decision") or {}
    if "local_s" not in d:
        return "-"
    return f"local {d['local_s']:.2f} s vs spread {d['spread_s']:.2f} s -> {d['placement']}"


# ---------------------------------------------------------------- burst: many short requests at once

def burst(model, cp: int, threads: int, placement: str, prompts, output: int, budget=None, first=None) -> dict:
    """Submit `first` (if any) then `prompts` together; wall time, output tokens/s, TTFTs, placements."""
    from cpinfer import LLM, SamplingParams

    longest = max(len(p) for p in prompts + ([first] if first else []))
    capacity = C.kv_capacity(sum(len(p) + output for p in prompts) + (len(first) + output if first else 0))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    with LLM(model, context_parallel_size=cp, threads_per_rank=threads, placement=placement,
             max_kv_tokens_per_rank=capacity, max_model_len=longest + output + 64,
             max_num_batched_tokens=budget) as llm:
        llm.generate(_prompts(1, 64, llm.config.vocab_size, seed=7), SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        alone = None
        if first is not None:  # the long prompt alone first (a different one of the same length: no cache hit)
            other = _prompts(1, len(first), llm.config.vocab_size, seed=11)[0]
            alone = llm.generate([other], params, use_tqdm=False)[0]
        t0 = time.perf_counter()
        outs = llm.generate(([first] if first else []) + prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    short = outs[1:] if first else outs
    res = {"wall_s": wall, "output_tok_s": sum(len(o.token_ids) for o in short) / wall,
           "ttft_p50_s": statistics.median(o.metrics["ttft_s"] for o in short), "placement": _where(short)}
    if first is not None:
        res.update(long_ttft_s=outs[0].metrics["ttft_s"], long_alone_ttft_s=alone.metrics["ttft_s"],
                   long_placement=_where([outs[0]]), long_alone_placement=_where([alone]),
                   wall_s=wall, output_tok_s=sum(len(o.token_ids) for o in outs) / wall)
    return res


def _embedded() -> tuple[str, int]:
    """The embedded model's folder and vocabulary size."""
    from cpinfer.model.config import ModelConfig
    from cpinfer.model.resolve import resolve_model

    model = str(resolve_model(None))
    return model, ModelConfig.from_pretrained(model).vocab_size


def measure_burst(args) -> dict:
    model, vocab = _embedded()
    prompts = _prompts(args.requests, args.prompt, vocab, seed=1)
    runs = {}
    for name, cp, threads, placement in (("CP1, 1 thread", 1, 1, "auto"), ("CP1, 2 threads", 1, 2, "auto"),
                                         ("CP2 auto, 1 thread per rank", 2, 1, "auto"),
                                         ("CP2 shard, 1 thread per rank", 2, 1, "shard")):
        runs[name] = burst(model, cp, threads, placement, prompts, args.output)
    return {"requests": args.requests, "prompt": args.prompt, "output": args.output, "runs": runs}


def format_burst(res: dict) -> str:
    head = ["run", "placement", "wall (s)", "output tokens/s", "TTFT p50 (s)"]
    rows = [[name, r["placement"], f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}", f"{r['ttft_p50_s']:.1f}"]
            for name, r in res["runs"].items()]
    runs = res["runs"]
    auto = runs["CP2 auto, 1 thread per rank"]["output_tok_s"]
    return "\n".join([
        f"{res['requests']} distinct prompts of {res['prompt']} tokens, {res['output']} output tokens each, submitted "
        "together, SmolLM2-135M-Instruct (embedded), fp32, greedy:", "", C.fmt_table(head, rows), "",
        f"CP2 auto / CP1 1 thread: {auto / runs['CP1, 1 thread']['output_tok_s']:.2f}x; CP2 auto / CP1 2 threads: "
        f"{auto / runs['CP1, 2 threads']['output_tok_s']:.2f}x; CP2 auto / CP2 shard: "
        f"{auto / runs['CP2 shard, 1 thread per rank']['output_tok_s']:.2f}x"])


# ---------------------------------------------------------------- long: one long prompt with the burst

def measure_long(args) -> dict:
    model, vocab = _embedded()
    prompts = _prompts(args.requests, args.prompt, vocab, seed=1)
    long = _prompts(1, args.long, vocab, seed=3)[0]
    r = burst(model, 2, 1, "auto", prompts, args.output, budget=args.budget, first=long)
    return {"requests": args.requests, "prompt": args.prompt, "output": args.output, "long": args.long,
            "budget": args.budget, "run": r}


def format_long(res: dict) -> str:
    r = res["run"]
    head = ["", "TTFT of the long prompt (s)", "its placement", "short requests' TTFT p50 (s)"]
    rows = [["alone", f"{r['long_alone_ttft_s']:.1f}", r["long_alone_placement"], "-"],
            [f"submitted first, with the {res['requests']} short ones", f"{r['long_ttft_s']:.1f}",
             r["long_placement"], f"{r['ttft_p50_s']:.1f} ({r['placement']})"]]
    return "\n".join([
        f"One {res['long']}-token prompt, then with {res['requests']} x {res['prompt']}-token prompts, "
        f"{res['output']} output tokens each, CP2 auto, 1 thread per rank, budget {res['budget']} tokens per "
        "forward, SmolLM2-135M-Instruct:", "", C.fmt_table(head, rows), "",
        f"long prompt TTFT with the burst / alone: {r['long_ttft_s'] / r['long_alone_ttft_s']:.3f}"])


# ---------------------------------------------------------------- the command

def measure(args) -> dict:
    res = {"bench": "placement", "command": command_line(args), "parts": list(args.parts)}
    for part, fn in (("e2e", measure_e2e), ("burst", measure_burst), ("long", measure_long)):
        if part in args.parts:
            res[part] = fn(args)
    return res


def format_report(res: dict) -> str:
    out = []
    for part, fn in (("e2e", format_e2e), ("burst", format_burst), ("long", format_long)):
        if part in res:
            out += [fn(res[part]), ""]
    return "\n".join(out).rstrip()


def command_line(args) -> str:
    cmd = f"cpinfer bench placement --parts {','.join(args.parts)}"
    if "e2e" in args.parts:
        cmd += f" --context {','.join(map(str, args.context))} --answer {args.answer}"
    if "burst" in args.parts or "long" in args.parts:
        cmd += f" --requests {args.requests} --prompt {args.prompt} --output {args.output}"
    if "long" in args.parts:
        cmd += f" --long {args.long} --budget {args.budget}"
    return cmd


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"parts must be a comma-separated subset of {','.join(PARTS)}, got {text!r}")
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=_parts, default=list(PARTS), metavar="P,P",
                        help=f"which parts to run (default: {','.join(PARTS)})")
    parser.add_argument("--context", type=C.cp_sizes, default=[4000, 65536], metavar="T,T",
                        help="e2e: prompt tokens (default: 4000,65536)")
    parser.add_argument("--answer", type=C.positive_int, default=48, help="e2e: answer tokens (default: 48)")
    parser.add_argument("--requests", type=C.positive_int, default=32, help="burst: requests (default: 32)")
    parser.add_argument("--prompt", type=C.positive_int, default=500, help="burst: prompt tokens (default: 500)")
    parser.add_argument("--output", type=C.positive_int, default=32, help="burst: output tokens (default: 32)")
    parser.add_argument("--long", type=C.positive_int, default=16384, help="long: prompt tokens (default: 16384)")
    parser.add_argument("--budget", type=C.positive_int, default=8192,
                        help="long: max_num_batched_tokens (default: 8192)")
    C.add_model_arguments(parser, hidden=256, layers=2, heads=4, kv_heads=2, ffn=768, vocab=1024)
    C.add_common_arguments(parser)


def run(args) -> int:
    key = "placement" if list(args.parts) == list(PARTS) else "placement-" + "-".join(args.parts)  # a part re-run
    return C.run_measured(args, measure, format_report, key,  # gets its own doc section beside the full run's
                          f"Adaptive placement: auto vs shard vs local ({', '.join(args.parts)})")
