"""How often each pass-KV / pass-Q rule picks a strategy within 2% of the faster one on this machine's grid.

The grid is the (T, P) cells of a `cpinfer calibrate` run (`--profile FILE` with its measurements next to it), or
measured here. Rules: Alg. 1 and Alg. 5 (paper §3.4, App. C) on the calibrated profile, App. D's h(T, P) fitted
leave-one-out (never scored on its own cell), and the cost-model simulator; baselines always pass-KV / pass-Q.
Beside the measured times it prints the simulator's predicted times of each cell on the same calibrated profile.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from cpinfer.cp.heuristics import choose_strategy, fit_empirical, heuristic_rates
from cpinfer.perf import calibrate as cal

DOC_PATH = Path("docs/benchmarks.md")
BEGIN, END = "<!-- heuristic-quality:start -->", "<!-- heuristic-quality:end -->"
SHORT = {"pass-kv": "KV", "pass-q": "Q"}


# ---------------------------------------------------------------- the rules and their score

def _choose(cell, cfg, profile, method, empirical=None) -> str:
    return choose_strategy(cell["T"], cell["P"], cfg["cp"], n_heads=cfg["heads"], n_kv_heads=cfg["kv_heads"],
                           head_dim=cfg["head_dim"], elem_bytes=cal.DTYPES[cfg["dtype"]].itemsize,
                           hardware=profile, method=method, empirical=empirical).strategy


def leave_one_out(grid: list[dict]) -> list[tuple[float, float, float] | None]:
    """For each cell, App. D coefficients fitted to every other cell (None where the rest cannot determine h)."""
    points = [(c["T"], c["P"], c["pass-kv_s"], c["pass-q_s"]) for c in grid]
    out = []
    for i in range(len(points)):
        try:
            out.append(fit_empirical(points[:i] + points[i + 1:]))
        except ValueError:
            out.append(None)
    return out


def with_ratio(profile, rho: float, cp: int):
    """`profile` with C / BW = rho flop per byte, C and BW as Alg. 1 / 5 read them (`heuristic_rates`: the
    attention rate and the ring link's SendRecv bandwidth; the rules depend on them only through the ratio),
    raising one from its measured value, never lowering either; GEMM rates unchanged."""
    c0, bw0 = heuristic_rates(profile, cp)
    up_c = max(1.0, rho * bw0 / c0)
    up_bw = max(1.0, c0 * up_c / rho / bw0)
    attn = profile.attn_tflops * up_c
    peak = max(profile.peak_tflops, attn)
    link = "inter_gbs" if cp > profile.devices_per_node else "intra_gbs"
    changes = {"attn_tflops": attn, "peak_tflops": peak, link: getattr(profile, link) * up_bw,
               "gemm_efficiency": min(1.0, profile.gemm_efficiency * profile.peak_tflops / peak)}
    if link == "inter_gbs":
        changes["inter_gbs_peak"] = max(profile.inter_gbs_peak, changes["inter_gbs"])
    return dataclasses.replace(profile, **changes)


def best_alg5(record: dict, profile, tolerance: float) -> tuple[float, list[str]]:
    """The C / BW ratio (the profile's, or 1e1 ... 1e7 flop/byte on a log grid) that makes Alg. 5 best on this
    very grid: an in-sample upper bound on what any calibration of C and BW (the paper's "fine-tune the
    thresholds") can give Alg. 5."""
    grid, cfg = record["grid"], record["config"]
    best = (-1, 0.0, [])
    c, bw = heuristic_rates(profile, cfg["cp"])
    measured = c / bw  # flop/byte of the profile itself
    for rho in [measured] + list(np.logspace(1, 7, 121)):
        hw = with_ratio(profile, float(rho), cfg["cp"])
        picks = [_choose(c, cfg, hw, "alg5") for c in grid]
        good = sum(is_good(c, s, tolerance) for c, s in zip(grid, picks))
        if good > best[0]:
            best = (good, float(rho), picks)
    return best[1], best[2]


def rule_picks(record: dict, profile, compare: dict, tolerance: float = 0.02) -> dict[str, list[str]]:
    """{rule label: strategy picked for each grid cell}."""
    grid, cfg = record["grid"], record["config"]
    loo = leave_one_out(grid)
    picks = {
        "Alg. 1 (Eq. 1-2)": [_choose(c, cfg, profile, "alg1") for c in grid],
        "Alg. 5 (Eq. 5) [engine default]": [_choose(c, cfg, profile, "alg5") for c in grid],
        "App. D h, leave-one-out": [_choose(c, cfg, profile, "empirical", e) if e else "pass-kv"
                                    for c, e in zip(grid, loo)],
        "simulator (cost model)": [_choose(c, cfg, profile, "simulator") for c in grid],
    }
    picks["Alg. 5, best C/BW (in-sample bound)"] = best_alg5(record, profile, tolerance)[1]
    for name, hw in compare.items():
        picks[f"Alg. 5 on {name}"] = [_choose(c, cfg, hw, "alg5") for c in grid]
    if record.get("empirical"):
        emp = record["empirical"]
        coeffs = (emp["alpha"], emp["beta"], emp["gamma"])
        picks["App. D h, in-sample (not a score)"] = [_choose(c, cfg, profile, "empirical", coeffs) for c in grid]
    picks["always pass-KV"] = ["pass-kv"] * len(grid)
    picks["always pass-Q"] = ["pass-q"] * len(grid)
    return picks


def simulated_times(record: dict, profile) -> list[dict]:
    """Per grid cell, the cost model's time of one ring-attention call for pass-KV and pass-Q on `profile` (the
    shared `cpinfer.cp.cost_model.ring_cost` that `cpinfer plan` and the "simulator" rule use), beside the
    measured times."""
    from cpinfer.cp.cost_model import STRATEGIES, AttnShape, ring_cost
    from cpinfer.cp.ring_shape import RingShape

    cfg = record["config"]
    shape = AttnShape(cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cal.DTYPES[cfg["dtype"]].itemsize)
    out = []
    for c in record["grid"]:
        ring = RingShape(cfg["cp"], c["T"], c["P"])
        t = {s: ring_cost(profile, shape, ring, s).total for s in STRATEGIES}
        out.append({"pass-kv_s": t["pass-kv"], "pass-q_s": t["pass-q"],
                    "error_kv": t["pass-kv"] / c["pass-kv_s"] - 1, "error_q": t["pass-q"] / c["pass-q_s"] - 1})
    return out


def is_good(cell: dict, strategy: str, tolerance: float) -> bool:
    """The picked strategy's time is within `tolerance` of the faster one's."""
    best = min(cell["pass-kv_s"], cell["pass-q_s"])
    return cell[f"{strategy}_s"] <= (1 + tolerance) * best


def score(record: dict, profile, tolerance: float = 0.02, compare: dict | None = None) -> dict:
    grid = record["grid"]
    partial = [i for i, c in enumerate(grid) if c["P"] > 0]
    rules = {}
    for name, picks in rule_picks(record, profile, compare or {}, tolerance).items():
        good = [is_good(c, s, tolerance) for c, s in zip(grid, picks)]
        rules[name] = dict(picks=picks, good=good, correct=sum(good), total=len(grid),
                           fraction=sum(good) / len(grid),
                           fraction_partial=sum(good[i] for i in partial) / len(partial) if partial else None,
                           missed=[(grid[i]["T"], grid[i]["P"]) for i, g in enumerate(good) if not g])
    sim = simulated_times(record, profile)
    errors = sorted(abs(e) for c in sim for e in (c["error_kv"], c["error_q"]))
    return dict(tolerance=tolerance, cells=len(grid), partial_cells=len(partial), profile=profile.name, rules=rules,
                simulated=sim, simulated_median_abs_error=errors[len(errors) // 2])


# ---------------------------------------------------------------- report

def format_report(record: dict, result: dict) -> str:
    grid, tol = record["grid"], result["tolerance"]
    rules = result["rules"]
    names = list(rules)
    head = ["T", "P", "T/(T+P)", "pass-KV s", "pass-Q s", "KV/Q", "sim KV s", "sim Q s", "sim KV/Q"] + \
        [f"r{i + 1}" for i in range(len(names))]
    rows = []
    for i, (c, m) in enumerate(zip(grid, result["simulated"])):
        marks = [SHORT[r["picks"][i]] + ("" if r["good"][i] else "*") for r in rules.values()]
        rows.append([c["T"], c["P"], f"{c['miss_rate']:.3f}", f"{c['pass-kv_s']:.4f}", f"{c['pass-q_s']:.4f}",
                     f"{c['pass-kv_s'] / c['pass-q_s']:.3f}", f"{m['pass-kv_s']:.4f}", f"{m['pass-q_s']:.4f}",
                     f"{m['pass-kv_s'] / m['pass-q_s']:.3f}"] + marks)
    summary = [[f"r{i + 1} {n}", f"{r['correct']}/{r['total']}", f"{r['fraction']:.0%}",
                "-" if r["fraction_partial"] is None else f"{r['fraction_partial']:.0%}",
                " ".join(f"({t},{p})" for t, p in r["missed"]) or "-"] for i, (n, r) in enumerate(rules.items())]
    return "\n".join([
        f"Grid: {len(grid)} cells ({result['partial_cells']} with P > 0) at CP{record['config']['cp']}; "
        f"profile {result['profile']!r}. A pick is good when its time is within {tol:.0%} of the faster one.",
        "",
        cal.table(head, rows),
        "(KV / Q: the rule's pick; * = more than "
        f"{tol:.0%} slower than the faster strategy. Full prefill, P = 0, is pass-KV for every rule. sim: the cost "
        f"model of `cpinfer plan` on this profile, one ring-attention call; median |error| "
        f"{result['simulated_median_abs_error']:.0%} over all cells and both strategies.)",
        "",
        cal.table(["rule", "good", "all cells", "P > 0", "misclassified (T, P)"], summary, left=(0, 4)),
    ])


def json_result(record: dict, result: dict) -> dict:
    rules = {n: {k: r[k] for k in ("correct", "total", "fraction", "fraction_partial", "missed")}
             for n, r in result["rules"].items()}
    grid = [{k: c[k] for k in ("T", "P", "miss_rate", "pass-kv_s", "pass-q_s")} for c in record["grid"]]
    return dict(bench="heuristic", tolerance=result["tolerance"], profile=result["profile"], cp=record["config"]["cp"],
                created=record["created"], load_average=record.get("load_average"), rules=rules, grid=grid,
                simulated=result["simulated"], simulated_median_abs_error=result["simulated_median_abs_error"])


def write_doc_section(path: Path, body: str) -> None:
    """Replace what lies between this benchmark's markers in `path` (re-read just now), or append the section."""
    section = f"{BEGIN}\n{body.rstrip()}\n{END}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def doc_body(record: dict, result: dict, profile, command: str) -> str:
    from cpinfer.cp.heuristics import kv_token_threshold

    load, host, cfg, o = record.get("load_average"), record["hosts"][0], record["config"], record["overlap"]
    machine = (f"Machine: {host['device_name']}, {os.cpu_count()} cores, {host['threads']} thread(s) per rank; "
               f"{record['created']}" + (f"; 1-min load average {load[0]} before the run, {load[1]} at its end "
                                         "(its own ranks included)" if load else ""))
    t_min = kv_token_threshold(cfg["cp"], profile.peak_tflops * 1e12, profile.inter_gbs_peak * 1e9, cfg["heads"],
                               cfg["kv_heads"], cal.DTYPES[cfg["dtype"]].itemsize)
    same_run = (f"Same run: C = {profile.peak_tflops:.3f} TF/s and BW = {profile.inter_gbs_peak:.2f} GB/s put "
                f"Eq. 2's pass-KV threshold at T >= {float(t_min):.0f} tokens; a {o['bytes'] >> 20} MiB SendRecv "
                f"posted before {o['attention_s'] * 1e3:.0f} ms of attention was {o['hidden']:.0%} hidden. "
                "How to read this: docs/calibration.md.")
    return "\n".join(["### Pass-KV / pass-Q heuristic quality", "", "```", command, "```", "", machine, "",
                      "```", format_report(record, result), "```", "", same_run])


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", metavar="FILE", help="a profile written by `cpinfer calibrate --out FILE` "
                        "(its FILE-stem.measurements.json holds the grid); default: measure here")
    parser.add_argument("--cp", type=int, default=2, metavar="N", help="CP ranks when measuring here (default 2)")
    parser.add_argument("--quick", action="store_true", help="measure a small grid (seconds)")
    parser.add_argument("--repeat", type=int, metavar="R", help="timed runs per cell and round when measuring here")
    parser.add_argument("--rounds", type=int, metavar="K", help="passes over the grid when measuring here")
    parser.add_argument("--max-context", type=int, metavar="TOKENS", help="largest T + P measured here")
    parser.add_argument("--tolerance", type=float, default=0.02, help="a pick within this fraction of the faster "
                        "time counts as good (default 0.02)")
    parser.add_argument("--compare", metavar="NAME_OR_PATH", default="cpu-gloo",
                        help="also score Alg. 5 on this profile (default cpu-gloo, the catalog estimate; '' for none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--write-doc", nargs="?", const=DOC_PATH, type=Path, metavar="FILE",
                        help=f"replace this benchmark's marked section in FILE (default {DOC_PATH})")


def _measure(args) -> tuple[dict, object]:
    from cpinfer.launch import WorkerPool

    extra = {k: v for k in ("repeat", "rounds", "max_context") if (v := getattr(args, k)) is not None}
    cfg = cal.CalibrationConfig.quick(args.cp, **extra) if args.quick else cal.CalibrationConfig(args.cp, **extra)
    with WorkerPool(cfg.cp, threads_per_rank=1, timeout_s=600) as pool:
        record = cal.run_calibration(pool, cfg, log=lambda m: print(f"[heuristic] {m}", file=sys.stderr))
    return record, cal.build_profile(record)


def command_line(args) -> str:
    parts = ["python -m cpinfer.bench.heuristic_quality"]
    parts += [f"--profile {args.profile}"] if args.profile else [f"--cp {args.cp}"] + (["--quick"] * args.quick)
    parts += [f"--{k.replace('_', '-')} {v}" for k in ("repeat", "rounds", "max_context")
              if (v := getattr(args, k)) is not None and not args.profile]
    return " ".join(parts + ([f"--tolerance {args.tolerance}"] if args.tolerance != 0.02 else []))


def run(args) -> int:
    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance must be in [0, 1), got {args.tolerance}")
    record, profile = cal.load_calibration(args.profile) if args.profile else _measure(args)
    compare = {args.compare: cal.load_hardware_profile(args.compare)} if args.compare else {}
    result = score(record, profile, args.tolerance, compare)
    print(format_report(record, result))
    if args.write_doc:
        write_doc_section(args.write_doc, doc_body(record, result, profile, command_line(args)))
        print(f"\nwrote the heuristic-quality section of {args.write_doc}")
    if args.json:
        print(json.dumps(json_result(record, result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpinfer.bench.heuristic_quality", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"heuristic_quality: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
