"""Per-token decode time at short and medium contexts: cpinfer CP1 and CP-N vs Hugging Face `generate` on the same
cores in the same run (`cpinfer bench decode-overhead`).

At these contexts attention is cheap, so the step time is the engine's host overhead: scheduling, the driver ↔ rank
messages, per-layer planning and the ring collectives. Batch 1, greedy; every process (HF, each rank) runs
`--threads` threads (default 1: a decode step is too small for intra-op threads to pay off on a shared machine).
`--placement` (default auto) is the engine's; with it a short request stays on one rank and decodes without a ring,
and on CPU a lone request goes to rank 0, which runs inside the driver process: its steps send no message at all.

`--floor` measures instead the embedded model (or `--model`) at CP1 against its floor taken in the same run — every
Linear applied to one token plus the context's K/V read once — and where the rest of a step goes (`decode_floor.py`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cpinfer.bench import common as C


def engine_ttit(model_dir, cp: int, context: int, steps: int, vocab: int, threads: int,
                hw: dict | None = None, placement: str = "auto") -> tuple[float, str]:
    """(median decode step, where the request's keys were: "local (rank r)" | "spread")."""
    from cpinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=threads, placement=placement,
             max_kv_tokens_per_rank=C.kv_capacity(context + steps + 64), **(hw or {})) as llm:
        llm.generate(C.random_prompt(64, vocab, seed=999), SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        out = llm.generate(C.random_prompt(context, vocab, seed=0), params, use_tqdm=False)[0]
    # the first step after the prefill is a warm-up
    last = out.metrics["steps"][-1]
    where = last["placement"]
    if where == "local" and cp > 1:  # rank 0 runs in the driver process: its steps need no message
        where += f" (rank {int(np.argmax(last['new_tokens_per_rank']))})"
    return statistics.median(out.metrics["ttit_s"][1:]), where


class _TokenClock:
    """A `generate` streamer that only timestamps each token as transformers emits it."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_ttit(model_dir, context: int, steps: int, vocab: int, threads: int, hw: dict | None = None) -> float:
    """Median gap between consecutive tokens of transformers' `generate` (greedy, KV cache), after a warm-up, on
    the engine's device and dtype (`hw`; default CPU fp32)."""
    import torch
    import transformers

    device, dtype = (hw or {}).get("device", "cpu"), getattr(torch, (hw or {}).get("dtype", "float32"))
    torch.set_num_threads(threads)
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.tensor([C.random_prompt(context, vocab, seed=0)], device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:, :64], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        clock = _TokenClock()
        model.generate(ids, max_new_tokens=steps + 2, min_new_tokens=steps + 2, streamer=clock, **kw)
    gaps = [b - a for a, b in zip(clock.times[2:], clock.times[3:])]  # [0] is the prompt, [1] the first token
    return statistics.median(gaps)


def measure(args) -> dict:
    cfg = C.model_config(args, max(args.context) + args.steps + 1024)
    model_dir = C.random_model("bench-decode-model", **cfg)
    rows = {}
    hw = C.hardware(args)
    for ctx in args.context:
        hf = hf_ttit(model_dir, ctx, args.steps, args.vocab, args.threads, hw)
        per_cp = {str(n): engine_ttit(model_dir, n, ctx, args.steps, args.vocab, args.threads, hw, args.placement)
                  for n in args.cp}
        rows[str(ctx)] = {"hf_s": hf, "cp_s": {n: t for n, (t, _) in per_cp.items()},
                          "placement": {n: p for n, (_, p) in per_cp.items()}}
    return {"bench": "decode-overhead", "command": command_line(args) + C.hardware_flags(hw),
            "model": C.shape_text(cfg, hw), "steps": args.steps, "threads": args.threads,
            "placement": args.placement, "rows": rows}


def format_report(res: dict) -> str:
    cps = list(next(iter(res["rows"].values()))["cp_s"])
    head = ["context", "HF generate (ms)"] + [f"CP{n} (ms)" for n in cps] + [f"CP{n} / HF" for n in cps[:1]]
    head += [f"CP{n} / CP{cps[0]}" for n in cps[1:]] + [f"CP{n} placement" for n in cps[1:]]
    rows = []
    for ctx, r in res["rows"].items():
        base = r["cp_s"][cps[0]]
        where = r.get("placement", {})
        rows.append([ctx, f"{1000 * r['hf_s']:.2f}"] + [f"{1000 * r['cp_s'][n]:.2f}" for n in cps]
                    + [f"{base / r['hf_s']:.2f}"] + [f"{r['cp_s'][n] / base:.2f}" for n in cps[1:]]
                    + [where.get(n, "-") for n in cps[1:]])
    return "\n".join([f"Per-token decode time, batch 1, greedy, {res['model']}; median over {res['steps']} steps; "
                      f"{res['threads']} thread(s) per process (HF, each rank); placement "
                      f"{res.get('placement', 'shard')}:", "", C.fmt_table(head, rows)])


def command_line(args) -> str:
    return (f"cpinfer bench decode-overhead --cp {','.join(map(str, args.cp))} "
            f"--context {','.join(map(str, args.context))} --steps {args.steps} --placement {args.placement}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--context", type=C.cp_sizes, default=None, metavar="T,T",
                        help="cached tokens before decoding (default: 200,4000; 256,3000 with --floor)")
    parser.add_argument("--steps", type=C.positive_int, default=32, help="decode steps timed (default: 32)")
    parser.add_argument("--threads", type=C.positive_int, default=None,
                        help="threads of HF and of each rank (default: 1; 2 with --floor)")
    parser.add_argument("--placement", choices=["auto", "shard", "local"], default="auto",
                        help="the engine's placement of the request's KV (default: auto)")
    C.add_model_arguments(parser, hidden=256, layers=4, heads=8, kv_heads=2, ffn=768, vocab=1024)
    parser.add_argument("--floor", action="store_true",
                        help="CP1 decode of a real model against its floor measured in the same run (every Linear "
                             "applied to one token + the context's K/V read once), with where the rest goes; "
                             "default context 256,3000, 2 threads")
    parser.add_argument("--model", default=None,
                        help="--floor: the model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--floor-reps", type=C.positive_int, default=20,
                        help="--floor: timed passes over the Linears before and after each context (default: 20)")
    parser.add_argument("--profile-steps", type=C.positive_int, default=8,
                        help="--floor: decode steps under the profiler per context (default: 8)")
    C.add_common_arguments(parser)


def run(args) -> int:
    args.context = args.context or ([256, 3000] if args.floor else [200, 4000])
    args.threads = args.threads or (2 if args.floor else 1)
    if args.floor:
        from cpinfer.bench import decode_floor

        return C.run_measured(args, decode_floor.measure, decode_floor.format_report, "decode-floor",
                              "CPU decode against its floor (embedded model, CP1)")
    if args.model is not None:
        raise ValueError("--model goes with --floor (the HF comparison builds a random model of --hidden ...)")
    key = "decode-overhead" if args.placement == "shard" else f"decode-overhead-{args.placement}"
    return C.run_measured(args, measure, format_report, key,
                          f"Engine decode overhead vs Hugging Face generate, placement {args.placement}")
