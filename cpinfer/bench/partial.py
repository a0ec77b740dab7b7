"""Partial-prefill TTFT, pass-KV vs pass-Q, over a grid of new (T) and cached (P) tokens (`cpinfer bench partial`).

For each strategy a fresh `LLM` (CP=N, one thread per rank, strategy forced) prefills one P+1-token turn 1 per P;
each turn 2 is the first P tokens of that prompt followed by T fresh tokens that diverge at once, so exactly P
tokens are reused every time (the engine truncates the cached sequence back to P before extending it). Also shows
what the paper's heuristic (Alg. 5, `choose_strategy`) picks and whether that was the faster one (§3.4).
"""
from __future__ import annotations

import argparse
import statistics

from cpinfer.bench import common as C

STRATEGIES = ("pass-kv", "pass-q")
TIE = 0.03  # a pick within 3% of the faster strategy counts as a tie (run-to-run noise here is about that)


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _turn2(base: list[int], p: int, t: int, vocab: int, seed: int) -> list[int]:
    """base[:p] + t fresh tokens whose first differs from base[p], so the reusable prefix is exactly p."""
    fresh = C.random_prompt(t, vocab, seed)
    if fresh[0] == base[p]:
        fresh[0] = 3 + (base[p] - 3 + 1) % (vocab - 3)
    return base[:p] + fresh


def time_strategy(model_dir, cp: int, strategy: str, grid: list[tuple[int, int]], vocab: int, repeat: int,
                  hw: dict | None = None) -> dict:
    """{(T, P): median turn-2 TTFT} for one forced strategy, all on one LLM instance."""
    from cpinfer import LLM, SamplingParams

    # max_tokens=2: TTFT is taken at the end of the prefill either way, and a request that has decoded once is
    # released to the prefix cache on every engine version (ones ending inside their prefill were not, before 336da01).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ps = sorted({p for _, p in grid})
    need = sum(p + 1 + max(t for t, q in grid if q == p) for p in ps)
    times = {}
    with LLM(str(model_dir), context_parallel_size=cp, strategy=strategy, threads_per_rank=1, placement="shard",
             max_kv_tokens_per_rank=C.kv_capacity(-(-need // cp) + 1024), **(hw or {})) as llm:
        for p in ps:
            base = C.random_prompt(p + 1, vocab, seed=p)
            llm.generate(base, params, use_tqdm=False)  # turn 1: P+1 prompt tokens (+1 output) cached
            for t in sorted(t for t, q in grid if q == p):
                runs = []
                for i in range(repeat + 1):  # the first is a warm-up for this shape
                    out = llm.generate(_turn2(base, p, t, vocab, seed=1000 * t + i), params, use_tqdm=False)[0]
                    if out.num_cached_tokens != p:
                        raise RuntimeError(f"turn 2 reused {out.num_cached_tokens} tokens, expected {p}")
                    runs.append(out.metrics["ttft_s"])
                times[(t, p)] = statistics.median(runs[1:])
    return times


def measure(args) -> dict:
    from cpinfer.cp.heuristics import choose_strategy
    from cpinfer.perf.hardware import load_hardware_profile

    cfg = C.model_config(args, max(args.cached) + max(args.new) + 1024)
    model_dir = C.random_model("bench-model", **cfg)
    grid = [(t, p) for p in args.cached for t in args.new]
    hw = C.hardware(args)
    per = {s: time_strategy(model_dir, args.cp, s, grid, args.vocab, args.repeat, hw) for s in STRATEGIES}
    rows = []
    for t, p in grid:
        choice = choose_strategy(t, p, args.cp, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                 head_dim=args.hidden // args.heads,
                                 elem_bytes=4 if hw["dtype"] == "float32" else 2,
                                 hardware=load_hardware_profile(args.hardware_profile),
                                 method="alg5")
        kv, q = per["pass-kv"][(t, p)], per["pass-q"][(t, p)]
        fastest = "pass-kv" if kv <= q else "pass-q"
        rows.append({"T": t, "P": p, "miss_rate": t / (t + p), "pass-kv_s": kv, "pass-q_s": q, "fastest": fastest,
                     "heuristic": choice.strategy, "heuristic_right": choice.strategy == fastest,
                     "loss_if_wrong": max(kv, q) / min(kv, q) - 1 if choice.strategy != fastest else 0.0})
    return score({"bench": "partial", "command": command_line(args) + C.hardware_flags(hw), "cp": args.cp,
                  "model": C.shape_text(cfg, hw),
                  "repeat": args.repeat, "hardware_profile": args.hardware_profile, "rows": rows})


def score(res: dict) -> dict:
    """Add the share of points where the heuristic picked the faster strategy, strictly and up to a tie."""
    rows = res["rows"]
    res["heuristic_accuracy"] = sum(r["heuristic_right"] for r in rows) / len(rows)
    res["heuristic_within_tie"] = sum(r["loss_if_wrong"] <= TIE for r in rows) / len(rows)
    return res


def format_report(res: dict) -> str:
    out = [f"Turn-2 TTFT at CP{res['cp']} (T new tokens on P cached), {res['model']}; 1 thread per rank; median of "
           f"{res['repeat']} after a warm-up; heuristic = Alg. 5 on profile {res['hardware_profile']}:", ""]
    rows = [[r["T"], r["P"], f"{r['miss_rate']:.3f}", f"{r['pass-kv_s']:.3f}", f"{r['pass-q_s']:.3f}",
             f"{r['pass-kv_s'] / r['pass-q_s']:.2f}", r["fastest"], r["heuristic"],
             _verdict(r)] for r in res["rows"]]
    out.append(C.fmt_table(["T", "P", "T/(T+P)", "pass-KV (s)", "pass-Q (s)", "KV/Q", "fastest", "heuristic",
                            "heuristic right?"], rows))
    out.append(f"\nHeuristic picked the faster strategy in {100 * res['heuristic_accuracy']:.0f}% of the points, and "
               f"one within {100 * TIE:.0f}% of it in {100 * res['heuristic_within_tie']:.0f}%.")
    return "\n".join(out)


def _verdict(row: dict) -> str:
    if row["heuristic_right"]:
        return "yes"
    loss = f"+{100 * row['loss_if_wrong']:.1f}%"
    return f"tie ({loss})" if row["loss_if_wrong"] <= TIE else f"no ({loss})"


def command_line(args) -> str:
    cmd = (f"cpinfer bench partial --cp {args.cp} --new {','.join(map(str, args.new))} "
           f"--cached {','.join(map(str, args.cached))} --repeat {args.repeat}")
    shape = (("hidden", 1024), ("layers", 2), ("heads", 8), ("kv_heads", 2), ("ffn", 2816), ("vocab", 4096))
    for name, default in shape:
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd + (f" --hardware-profile {args.hardware_profile}" if args.hardware_profile != "cpu-gloo" else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size (default: 2)")
    parser.add_argument("--new", type=_csv_ints, default=[64, 512, 2048], metavar="T,T",
                        help="new tokens of turn 2 (default: 64,512,2048)")
    parser.add_argument("--cached", type=_csv_ints, default=[4096, 16384], metavar="P,P",
                        help="cached tokens reused by turn 2 (default: 4096,16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=3, help="timed turn-2 runs per point (default: 3)")
    parser.add_argument("--hardware-profile", default="cpu-gloo", help="profile for the heuristic (default: cpu-gloo)")
    C.add_model_arguments(parser, hidden=1024, layers=2, heads=8, kv_heads=2, ffn=2816, vocab=4096)
    C.add_common_arguments(parser)


def run(args) -> int:
    if args.cp < 2:
        raise ValueError("--cp must be at least 2: with one rank there is nothing to pass")
    return C.run_measured(args, measure, format_report, f"partial-cp{args.cp}",
                          f"Engine partial prefill, pass-KV vs pass-Q, CP{args.cp}")
