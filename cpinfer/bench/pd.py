"""Prefill and decode groups (`cpinfer bench pd`): the same ranks colocated (CP N+M, whole or chunked prefill) vs
P/D (prefill CP N, decode CP M), on a mixed workload — long prompts arriving while several chats decode: the chats'
inter-token time (p50 / p99) while the long prompts are in the system, the long prompts' TTFT, and the K/V
transfer time against the prefill time.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from cpinfer.bench import common as C


def run_once(model_dir, args, hw: dict, pd: bool, budget: int | None) -> dict:
    """One engine on the workload: chats start decoding, then a long prompt arrives every `gap_s` seconds."""
    from cpinfer import LLM, SamplingParams

    world = args.cp + args.decode_cp
    kw = dict(context_parallel_size=args.cp, pd_decode_cp=args.decode_cp) if pd else \
        dict(context_parallel_size=world)
    threads = max(1, (os.cpu_count() or 1) // world)
    tokens = args.tokens + 64 * args.chats + 4096
    with LLM(str(model_dir), threads_per_rank=threads, max_kv_tokens_per_rank=C.kv_capacity(tokens),
             max_num_batched_tokens=budget, **kw, **(hw or {})) as llm:
        llm.generate(C.random_prompt(128, args.vocab, seed=9), SamplingParams(max_tokens=2), use_tqdm=False)
        eng = llm.engine
        chat = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)  # aborted once the long ones end
        for c in range(args.chats):
            eng.add_request(f"chat{c}", C.random_prompt(64, args.vocab, seed=100 + c), chat)
        t_start = time.perf_counter()
        arrivals = [t_start + 0.5 + i * args.gap_s for i in range(args.longs)]
        done: dict = {}
        added = 0
        while len([k for k in done if k.startswith("long")]) < args.longs:
            now = time.perf_counter()
            while added < args.longs and now >= arrivals[added]:
                eng.add_request(f"long{added}", C.random_prompt(args.tokens, args.vocab, seed=added),
                                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                added += 1
            done.update({o.request_id: o for o in eng.step() if o.finished})
        t_end = time.perf_counter()
        chats = [eng.requests[f"chat{c}"] for c in range(args.chats) if f"chat{c}" in eng.requests]
        for r in chats:
            eng.abort(r.request_id)
        while eng.has_unfinished_requests():
            eng.step()
    gaps = []
    for r in chats:  # gaps that ended while long prompts were in the system
        m = r.metrics
        times = m["first_token_time"] + np.cumsum(m["ttit_s"])
        keep = (times >= arrivals[0]) & (times <= t_end)
        gaps.extend(np.asarray(m["ttit_s"])[keep].tolist())
    longs = [done[f"long{i}"] for i in range(args.longs)]
    out = {"ttit_p50_ms": 1000 * float(np.percentile(gaps, 50)) if gaps else None,
           "ttit_p99_ms": 1000 * float(np.percentile(gaps, 99)) if gaps else None,
           "ttit_samples": len(gaps), "ttft_s": [o.metrics["ttft_s"] for o in longs], "window_s": t_end - arrivals[0],
           "ttit_series": sorted(gaps)}
    if pd:
        out["prefill_s"] = [o.metrics["pd"]["prefill_s"] for o in longs]
        out["transfer_s"] = [o.metrics["pd"].get("transfer_s", 0.0) for o in longs]
        out["transfer_bytes"] = [o.metrics["pd"].get("transfer_bytes", 0) for o in longs]
        # the part of the transfer left after the first token (the rest overlapped the prompt's last forward)
        out["transfer_exposed_s"] = [o.metrics["pd"].get("transfer_exposed_s", 0.0) for o in longs]
    return out


def measure(args) -> dict:
    cfg = C.model_config(args, args.tokens + 8192)
    model_dir = C.random_model("bench-decode-model", **cfg)
    hw = C.hardware(args)
    runs = {"colocated": run_once(model_dir, args, hw, False, None),
            "colocated-chunked": run_once(model_dir, args, hw, False, args.budget),
            "pd": run_once(model_dir, args, hw, True, None)}
    return {"bench": "pd", "command": command_line(args) + C.hardware_flags(hw), "model": C.shape_text(cfg, hw),
            "cp": args.cp, "decode_cp": args.decode_cp, "tokens": args.tokens, "chats": args.chats,
            "longs": args.longs, "budget": args.budget, "runs": runs}


def format_report(res: dict) -> str:
    n, m = res["cp"], res["decode_cp"]
    names = {"colocated": f"colocated CP{n + m}", "colocated-chunked": f"colocated CP{n + m}, chunks of "
             f"{res['budget']}", "pd": f"P/D CP{n} -> CP{m}"}
    rows = []
    for key, r in res["runs"].items():
        ttft = r["ttft_s"]
        rows.append([names[key], f"{r['ttit_p50_ms']:.1f}" if r["ttit_p50_ms"] is not None else "-",
                     f"{r['ttit_p99_ms']:.1f}" if r["ttit_p99_ms"] is not None else "-", r["ttit_samples"],
                     f"{float(np.mean(ttft)):.2f}", f"{max(ttft):.2f}"])
    pd = res["runs"]["pd"]
    lines = [f"{res['chats']} chats decoding while {res['longs']} prompts of {res['tokens']} tokens arrive, "
             f"{res['model']}, {n + m} ranks in all:", "",
             C.fmt_table(["engine", "chat TTIT p50 (ms)", "chat TTIT p99 (ms)", "gaps", "long TTFT mean (s)",
                          "long TTFT max (s)"], rows), "",
             f"P/D transfer per long prompt: {np.mean(pd['transfer_bytes']) / (1 << 20):.1f} MiB, sent layer by "
             f"layer from inside the prompt's last prefill forward; {np.mean(pd['transfer_s']) * 1000:.1f} ms from "
             f"that forward's start to the last row received, of which "
             f"{np.mean(pd.get('transfer_exposed_s', [0.0])) * 1000:.1f} ms after the first token (exposed), against "
             f"a prefill (arrival to first token) of {np.mean(pd['prefill_s']):.2f} s"]
    return "\n".join(lines)


def plot(res: dict, path) -> None:
    """The chats' inter-token times (sorted) of each engine, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, r in res["runs"].items():
        s = np.asarray(r["ttit_series"]) * 1000
        if len(s):
            ax.plot(np.linspace(0, 100, len(s)), s, label=key)
    ax.set_xlabel("percentile of the chats' inter-token gaps")
    ax.set_ylabel("TTIT (ms)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def command_line(args) -> str:
    return (f"cpinfer bench pd --cp {args.cp} --decode-cp {args.decode_cp} --tokens {args.tokens} --chats "
            f"{args.chats} --longs {args.longs} --gap-s {args.gap_s} --budget {args.budget}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.positive_int, default=2, help="prefill CP size of the P/D run (default: 2)")
    parser.add_argument("--decode-cp", type=C.positive_int, default=1, help="decode CP size (default: 1)")
    parser.add_argument("--tokens", type=C.positive_int, default=4096, help="long prompts' tokens (default: 4096)")
    parser.add_argument("--chats", type=C.positive_int, default=3, help="decoding chats (default: 3)")
    parser.add_argument("--longs", type=C.positive_int, default=3, help="long prompts (default: 3)")
    parser.add_argument("--gap-s", type=float, default=1.0, help="seconds between long prompts (default: 1)")
    parser.add_argument("--budget", type=C.positive_int, default=512,
                        help="max_num_batched_tokens of the chunked colocated run (default: 512)")
    parser.add_argument("--plot", type=str, default=None, metavar="PNG", help="write the TTIT plot here")
    C.add_model_arguments(parser, hidden=256, layers=4, heads=8, kv_heads=2, ffn=768, vocab=1024)
    C.add_common_arguments(parser)


def run(args) -> int:
    def measure_and_plot(a):
        res = measure(a)
        if a.plot:
            plot(res, a.plot)
        return res

    return C.run_measured(args, measure_and_plot, format_report, "pd", "Prefill and decode groups vs colocated")
