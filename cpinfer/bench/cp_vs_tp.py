"""Prefill latency of CP2 vs TP2 vs CP1 on this machine, with the share of time in communication (paper Fig. 6).

Each layout serves a full prefill (TTFT) of a random Llama-3-shaped model, one thread per rank. Scaling ratio
τ1/τ2 = TTFT(CP1) / TTFT(layout). Communication: ring SendRecv time exposed in attention (CP) vs the all-reduce
after the row-parallel linears (TP), as a share of TTFT, measured on the ranks.
"""
from __future__ import annotations

import argparse
import statistics

from cpinfer.bench import common as C

LAYOUTS = (("CP1", 1, 1), ("CP2", 2, 1), ("TP2", 1, 2))


def comm_probe(ctx) -> dict:
    """On a rank: seconds spent in ring waits and TP all-reduce since the last probe (then reset)."""
    from cpinfer.tensor_parallel import RowParallelLinear

    worker = ctx.state["runner"]
    allreduce = 0.0
    for m in worker.model.modules():
        if isinstance(m, RowParallelLinear):
            allreduce += m.comm_s
            m.comm_s = 0.0
    ring, worker.ring_wait_s = worker.ring_wait_s, 0.0
    return {"allreduce_s": allreduce, "ring_wait_s": ring}


def time_layout(model_dir, cp: int, tp: int, tokens: int, vocab: int, repeat: int, hw: dict | None = None) -> dict:
    from cpinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # prefill only: comm and TTFT align
    with LLM(str(model_dir), context_parallel_size=cp, tensor_parallel_size=tp, threads_per_rank=1,
             placement="shard", max_kv_tokens_per_rank=C.kv_capacity(2 * (tokens // cp + 1) + 1024),
             **(hw or {})) as llm:
        llm.generate(C.random_prompt(min(tokens, 512), vocab, seed=999), params, use_tqdm=False)  # warm-up
        llm.engine._pool.run(comm_probe)
        ttft, comm = [], []
        for i in range(repeat):
            out = llm.generate(C.random_prompt(tokens, vocab, seed=i), params, use_tqdm=False)[0]
            ttft.append(out.metrics["ttft_s"])
            probes = llm.engine._pool.run(comm_probe)
            comm.append(max(p["allreduce_s"] + p["ring_wait_s"] for p in probes))
    return {"ttft_s": statistics.median(ttft), "comm_s": statistics.median(comm)}


def measure(args) -> dict:
    cfg = C.model_config(args, max(args.tokens) + 1024)
    model_dir = C.random_model("bench-model", **cfg)
    rows, hw = [], C.hardware(args)
    for t in args.tokens:
        base = None
        for name, cp, tp in LAYOUTS:
            r = time_layout(model_dir, cp, tp, t, args.vocab, args.repeat, hw)
            base = base or r["ttft_s"]
            rows.append({"tokens": t, "layout": name, "ttft_s": r["ttft_s"], "scaling": base / r["ttft_s"],
                         "comm_share": r["comm_s"] / r["ttft_s"]})
    command = "cpinfer bench cp-vs-tp --tokens " + ",".join(map(str, args.tokens)) + C.hardware_flags(hw)
    return {"rows": rows, "shape": C.shape_text(cfg, hw), "command": command}


def format_report(res: dict) -> str:
    table = [[str(r["tokens"]), r["layout"], f"{r['ttft_s']:.3f}", f"{r['scaling']:.2f}",
              f"{100 * r['comm_share']:.1f}%"] for r in res["rows"]]
    return (f"model: {res['shape']}; one thread per rank; comm = exposed ring SendRecv (CP) or all-reduce (TP)\n"
            + C.fmt_table(["tokens", "layout", "TTFT (s)", "τ1/τN", "comm share"], table))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=lambda s: [C.positive_int(x) for x in s.split(",")],
                        default=[4096, 8192, 16384], help="comma-separated prompt lengths (default: 4096,8192,16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=2, help="timed prefills per layout (median)")
    C.add_model_arguments(parser, hidden=1024, layers=2, heads=8, kv_heads=2, ffn=2816, vocab=4096)
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "cp-vs-tp", "CP2 vs TP2 prefill (`bench cp-vs-tp`)")
