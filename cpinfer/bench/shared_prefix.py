"""Shared-prefix workload: R questions on one long document arriving together, with and without prefix caching
(`cpinfer bench shared-prefix`).

With prefix caching the document's K/V is computed once, stored once (sharded over the CP ranks), and read by every
request (the radix tree over the sharded cache); without it, every request prefills and stores its own copy, as an
engine without shared persistent KV would. Reports end-to-end time, its ratio, and KV tokens stored per rank.
"""
from __future__ import annotations

import argparse
import os
import time

from cpinfer.bench import common as C


def run_workload(model_dir, cp: int, doc: int, requests: int, max_tokens: int, vocab: int, sharing: bool,
                 hw: dict | None = None) -> dict:
    from cpinfer import LLM, SamplingParams

    document = C.random_prompt(doc, vocab, seed=1)
    prompts = [document + C.random_prompt(16, vocab, seed=100 + i) for i in range(requests)]
    capacity = C.kv_capacity(-(-(requests * (doc + 16 + max_tokens)) // cp) + 1024)
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=max(1, (os.cpu_count() or 1) // cp),
             max_kv_tokens_per_rank=capacity, enable_prefix_caching=sharing, **(hw or {})) as llm:
        llm.generate(C.random_prompt(128, vocab, seed=9), SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        before = sum(llm.cache_stats()["kv_tokens_per_rank"])
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        elapsed = time.perf_counter() - t0
        stats = llm.cache_stats()
    return {"e2e_s": elapsed, "kv_tokens_per_rank": stats["kv_tokens_per_rank"],
            "kv_tokens_added": sum(stats["kv_tokens_per_rank"]) - before,
            "cached_tokens": [o.num_cached_tokens for o in outs], "tokens": [o.token_ids for o in outs]}


def measure(args) -> dict:
    cfg = C.model_config(args, args.doc + 1024)
    model_dir = C.random_model("bench-decode-model", **cfg)
    hw = C.hardware(args)
    on = run_workload(model_dir, args.cp, args.doc, args.requests, args.max_tokens, args.vocab, True, hw)
    off = run_workload(model_dir, args.cp, args.doc, args.requests, args.max_tokens, args.vocab, False, hw)
    return {"bench": "shared-prefix", "command": command_line(args) + C.hardware_flags(hw),
            "model": C.shape_text(cfg, hw), "cp": args.cp,
            "doc": args.doc, "requests": args.requests, "max_tokens": args.max_tokens,
            "sharing": {k: v for k, v in on.items() if k != "tokens"},
            "no_sharing": {k: v for k, v in off.items() if k != "tokens"},
            "speedup": off["e2e_s"] / on["e2e_s"], "same_tokens": on["tokens"] == off["tokens"]}


def format_report(res: dict) -> str:
    rows = []
    for name, key in (("prefix caching on", "sharing"), ("prefix caching off", "no_sharing")):
        r = res[key]
        rows.append([name, f"{r['e2e_s']:.2f}", r["kv_tokens_added"], r["kv_tokens_per_rank"],
                     f"{sum(r['cached_tokens'])}"])
    return "\n".join([
        f"{res['requests']} requests on one {res['doc']}-token document (+16-token question each), arriving "
        f"together, {res['max_tokens']} greedy tokens each, CP{res['cp']}, {res['model']}:", "",
        C.fmt_table(["", "end-to-end (s)", "KV tokens stored", "KV tokens per rank", "prompt tokens reused"], rows),
        "", f"speed-up from sharing the document: {res['speedup']:.2f}x; identical outputs: {res['same_tokens']}"])


def command_line(args) -> str:
    return (f"cpinfer bench shared-prefix --cp {args.cp} --doc {args.doc} --requests {args.requests} "
            f"--max-tokens {args.max_tokens}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size (default: 2)")
    parser.add_argument("--doc", type=C.positive_int, default=8192, help="document tokens (default: 8192)")
    parser.add_argument("--requests", type=C.positive_int, default=8, help="questions (default: 8)")
    parser.add_argument("--max-tokens", type=C.positive_int, default=8, help="tokens per answer (default: 8)")
    C.add_model_arguments(parser, hidden=256, layers=4, heads=8, kv_heads=2, ffn=768, vocab=1024)
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "shared-prefix", "Shared document, prefix caching on vs off")
