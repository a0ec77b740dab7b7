"""Chunked prefill (`cpinfer bench chunked-prefill`): TTFT of one long prompt prefilled whole vs in chunks of a
token budget — each chunk a persistent-KV partial prefill, pass-KV / pass-Q chosen per chunk — and the inter-token
gaps of a request that keeps decoding while the long prompt is prefilled.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from cpinfer.bench import common as C


def run_once(model_dir, cp: int, tokens: int, budget: int | None, vocab: int, hw: dict | None = None) -> dict:
    from cpinfer import LLM, SamplingParams

    long = C.random_prompt(tokens, vocab, seed=2)
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=max(1, (os.cpu_count() or 1) // cp),
             max_kv_tokens_per_rank=C.kv_capacity(-(-tokens // cp) + 2048), max_num_batched_tokens=budget,
             placement="shard", **(hw or {})) as llm:
        llm.generate(C.random_prompt(128, vocab, seed=9), SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        eng = llm.engine
        eng.add_request("chat", C.random_prompt(64, vocab, seed=3),
                        SamplingParams(max_tokens=2000 if budget else 4, temperature=0.0, ignore_eos=True))
        eng.step()
        eng.add_request("long", long, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        done, forwards = {}, []
        while "long" not in done:
            t0 = time.perf_counter()
            done.update({o.request_id: o for o in eng.step() if o.finished})
            forwards.append(time.perf_counter() - t0)
        chat = eng.requests["chat"] if "chat" in eng.requests else done["chat"]
        eng.abort("chat") if "chat" in eng.requests else None
        while eng.has_unfinished_requests():
            eng.step()
    out = done["long"]
    chunks = [s for s in out.metrics["steps"] if s["phase"] != "decode"]
    gaps = chat.metrics["ttit_s"]
    return {"ttft_s": out.metrics["ttft_s"], "chunks": len(chunks),
            "strategies": sorted({s["strategy"] for s in chunks}),
            "longest_forward_s": max(forwards), "decode_gap_max_s": max(gaps) if gaps else None, "decode_gap_median_s": statistics.median(gaps) if gaps else None}


def measure(args) -> dict:
    cfg = C.model_config(args, args.tokens + 4096)
    model_dir = C.random_model("bench-decode-model", **cfg)
    hw = C.hardware(args)
    whole = run_once(model_dir, args.cp, args.tokens, None, args.vocab, hw)
    chunked = run_once(model_dir, args.cp, args.tokens, args.budget, args.vocab, hw)
    chunk_s = chunked["ttft_s"] / max(1, chunked["chunks"])
    return {"bench": "chunked-prefill", "command": command_line(args) + C.hardware_flags(hw),
            "model": C.shape_text(cfg, hw), "cp": args.cp,
            "tokens": args.tokens, "budget": args.budget, "whole": whole, "chunked": chunked,
            "ttft_ratio": chunked["ttft_s"] / whole["ttft_s"], "mean_chunk_s": chunk_s,
            "gap_over_chunk": (chunked["decode_gap_max_s"] or 0) / chunk_s,
            "gap_over_longest_chunk": (chunked["decode_gap_max_s"] or 0) / chunked["longest_forward_s"]}


def format_report(res: dict) -> str:
    w, c = res["whole"], res["chunked"]
    rows = [["whole prompt", f"{w['ttft_s']:.2f}", w["chunks"], ", ".join(w["strategies"]), "-", "-"],
            [f"chunks of {res['budget']}", f"{c['ttft_s']:.2f}", c["chunks"], ", ".join(c["strategies"]),
             f"{1000 * c['decode_gap_median_s']:.0f}", f"{1000 * c['decode_gap_max_s']:.0f}"]]
    return "\n".join([
        f"TTFT of a {res['tokens']}-token prompt at CP{res['cp']}, {res['model']}, while another request decodes:", "",
        C.fmt_table(["prefill", "TTFT (s)", "forwards", "strategies", "decode gap p50 (ms)", "decode gap max (ms)"],
                    rows), "",
        f"chunked / whole TTFT: {res['ttft_ratio']:.3f}; longest decode gap / mean chunk time: "
        f"{res['gap_over_chunk']:.2f} (mean chunk {res['mean_chunk_s']:.2f} s; later chunks read more cached keys "
        f"and take longer); longest decode gap / longest chunk forward: {res['gap_over_longest_chunk']:.2f}"])


def command_line(args) -> str:
    return f"cpinfer bench chunked-prefill --cp {args.cp} --tokens {args.tokens} --budget {args.budget}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size (default: 2)")
    parser.add_argument("--tokens", type=C.positive_int, default=32768, help="prompt tokens (default: 32768)")
    parser.add_argument("--budget", type=C.positive_int, default=4096,
                        help="max_num_batched_tokens of the chunked run (default: 4096)")
    C.add_model_arguments(parser, hidden=256, layers=4, heads=8, kv_heads=2, ffn=768, vocab=1024)
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "chunked-prefill", "Chunked prefill beside a decoding request")
