"""Decode step time (TTIT) with a long cached context, CP-N vs CP-1 (`cpinfer bench decode`).

Each CP size prefills one `--context`-token prompt on a fresh `LLM` (one thread per rank), then decodes `--steps`
tokens with ring pass-Q decode (paper §3.6, Alg. 4); the KV cache of the context is split over the N ranks, so
each rank reads 1/N of it per step. The default model is small so that attention over the cache dominates a step.
"""
from __future__ import annotations

import argparse
import statistics

from cpinfer.bench import common as C


def time_decode(model_dir, cp: int, context: int, steps: int, vocab: int, hw: dict | None = None) -> dict:
    from cpinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=1, placement="shard",  # context split
             max_kv_tokens_per_rank=C.kv_capacity(-(-context // cp) + steps + 512), **(hw or {})) as llm:
        llm.generate(C.random_prompt(256, vocab, seed=999), SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        out = llm.generate(C.random_prompt(context, vocab, seed=0), params, use_tqdm=False)[0]
    ttit = out.metrics["ttit_s"][1:]  # the first step after prefill is a warm-up
    decode = [s for s in out.metrics["steps"] if s["phase"] == "decode"]
    return {"ttit_s": statistics.median(ttit), "ttit_runs_s": ttit, "prefill_s": out.metrics["ttft_s"],
            "strategy": decode[0]["strategy"] if decode else "-"}


def measure(args) -> dict:
    cfg = C.model_config(args, args.context + args.steps + 1024)
    model_dir = C.random_model("bench-decode-model", **cfg)
    hw = C.hardware(args)
    per_cp = {str(n): time_decode(model_dir, n, args.context, args.steps, args.vocab, hw) for n in args.cp}
    base = per_cp[str(min(args.cp))]["ttit_s"]
    return {"bench": "decode", "command": command_line(args) + C.hardware_flags(hw), "context": args.context,
            "steps": args.steps, "model": C.shape_text(cfg, hw), "baseline_cp": min(args.cp), "cp": per_cp,
            "ratio": {n: r["ttit_s"] / base for n, r in per_cp.items()}}


def format_report(res: dict) -> str:
    out = [f"Decode with {res['context']} cached tokens, {res['model']}; 1 thread per rank; TTIT = median over "
           f"{res['steps']} steps (first step after the prefill dropped):", ""]
    b = res["baseline_cp"]
    rows = [[n, r["strategy"], f"{1000 * r['ttit_s']:.1f}", f"{res['ratio'][n]:.2f}", f"{r['prefill_s']:.1f}"]
            for n, r in res["cp"].items()]
    out.append(C.fmt_table(["CP", "decode strategy", "TTIT (ms)", f"TTIT / TTIT(CP{b})", "prefill (s)"], rows))
    return "\n".join(out)


def command_line(args) -> str:
    cmd = f"cpinfer bench decode --cp {','.join(map(str, args.cp))} --context {args.context} --steps {args.steps}"
    shape = (("hidden", 256), ("layers", 2), ("heads", 4), ("kv_heads", 2), ("ffn", 768), ("vocab", 1024))
    for name, default in shape:
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--context", type=C.positive_int, default=65536,
                        help="cached tokens before decoding (default: 65536)")
    parser.add_argument("--steps", type=C.positive_int, default=16, help="decode steps timed (default: 16)")
    C.add_model_arguments(parser, hidden=256, layers=2, heads=4, kv_heads=2, ffn=768, vocab=1024)
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, f"decode-{args.context}",
                          lambda res: f"Engine decode, {args.context} cached tokens, CP {', '.join(res['cp'])}")
