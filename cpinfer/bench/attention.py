"""CP-N vs CP-1 scaling of exact causal attention, and pass-KV vs pass-Q vs all-gather (`cpinfer bench attention`).

Full prefill of one sequence, sharded load-balanced (paper §3.5.1) over N ranks of one thread each; reports the
parallel efficiency T_1 / (N * T_N) and, per ring step, compute vs exposed communication (§3.5.2). A second table
times the three strategies at partial-prefill points (T new tokens on P cached ones, §3.5.3 / §3.4). With
`--window W` and / or `--chunk C` it instead compares a sliding window of W keys, chunked attention of C positions
(Llama 4's local layers), or both, against full causal attention at each CP size: time, and the share of ring
steps, pair messages, bytes and attention tiles the local plan skips.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.local import CAUSAL
from cpinfer.cp import STRATEGIES, plan_from_metadata
from cpinfer.cp.sharding import shard_prefill
from cpinfer.launch import WorkerPool

DOC_PATH = Path("docs/benchmarks.md")
_WINDOW_TIMEOUT_S = 3 * 3600  # a rank may spend minutes in one full-causal run of a long sequence on a busy CPU
# Partial-prefill points as (new, cached) fractions of --tokens: 1024+15360, 4096+12288, 16384+0, 64+16320 at 16K.
PARTIAL_FRACTIONS = ((1 / 16, 15 / 16), (1 / 4, 3 / 4), (1.0, 0.0), (1 / 256, 255 / 256))


# ---------------------------------------------------------------- layout: which tokens live on which rank

@dataclasses.dataclass(frozen=True)
class RankLayout:
    """One rank's tokens of a prefill batch. Queries are the new tokens, K/V are cached + new tokens.

    q_index: rows of the global query tensor [sum T_i, H, D] (-1 = padding); kv_index: rows of the global K/V
    tensor [sum (P_i + T_i), Hkv, D], which holds each sequence's cached tokens followed by its new ones.
    """

    q_index: np.ndarray
    q_seq: np.ndarray
    q_pos: np.ndarray
    kv_index: np.ndarray
    kv_seq: np.ndarray
    kv_pos: np.ndarray


def prefill_layout(new_lens, cached_lens, num_ranks: int) -> list[RankLayout]:
    """Per-rank layout of a (partial) prefill: new tokens sharded with `shard_prefill(new, N, cached)`, and the
    cached tokens where an earlier load-balanced full prefill of them left them (the persistent KV of §3.3)."""
    new_lens, cached_lens = [int(t) for t in new_lens], [int(p) for p in cached_lens]
    kv_off = np.cumsum([0] + [p + t for p, t in zip(cached_lens, new_lens)])
    new = shard_prefill(new_lens, num_ranks, cached_lens)
    cached_ids = [i for i, p in enumerate(cached_lens) if p > 0]
    old = shard_prefill([cached_lens[i] for i in cached_ids], num_ranks, seq_ids=cached_ids) if cached_ids else None
    layouts = []
    for r in range(num_ranks):
        parts = [new.shards[r]] if old is None else [old.shards[r], new.shards[r]]
        kv_seq = np.concatenate([sh.seq[sh.valid] for sh in parts])
        kv_pos = np.concatenate([sh.pos[sh.valid] for sh in parts])
        sh = new.shards[r]
        layouts.append(RankLayout(sh.index, sh.seq, sh.pos, kv_off[kv_seq] + kv_pos, kv_seq, kv_pos))
    return layouts


def _plan(ctx, layouts: list[RankLayout], strategy: str, window: int | None = None, chunk: int | None = None):
    return plan_from_metadata([(lay.q_seq, lay.q_pos) for lay in layouts],
                              [(lay.kv_seq, lay.kv_pos) for lay in layouts],
                              group=ctx.group, rank=ctx.rank, world=ctx.world_size, strategy=strategy, window=window,
                              chunk=chunk)


# ---------------------------------------------------------------- rank side (module level: sent to the pool)

def rank_time_attention(ctx, layouts, heads, kv_heads, head_dim, strategies, repeat, seed=0, window=None,
                        chunk=None):
    """Time `plan.run` on this rank's random shard: one warm-up, then `repeat` runs, each after a barrier.

    Returns {strategy: [{"time_s", "cpu_share", "steps": [{"step", "compute_s", "wait_s"}, ...]}, ...]}, where
    cpu_share = process CPU time / wall time (well below 1: the rank was descheduled). The plan is built once
    outside the timed region, as the engine builds it once per forward for all layers.
    """
    lay = layouts[ctx.rank]
    gen = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    q = torch.randn(len(lay.q_seq), heads, head_dim, generator=gen)  # [Lq, H, D]
    k = torch.randn(len(lay.kv_seq), kv_heads, head_dim, generator=gen)  # [Lkv, Hkv, D]
    v = torch.randn(len(lay.kv_seq), kv_heads, head_dim, generator=gen)
    results = {}
    for strategy in strategies:
        plan = _plan(ctx, layouts, strategy, window, chunk)
        plan.run(q, k, v)
        runs = []
        for _ in range(repeat):
            steps: list[dict] = []
            dist.barrier(group=ctx.group)
            t0, c0 = time.perf_counter(), time.process_time()
            plan.run(q, k, v, timings=steps)
            wall = time.perf_counter() - t0
            runs.append({"time_s": wall, "cpu_share": (time.process_time() - c0) / wall, "steps": steps})
        results[strategy] = runs
    return results


def rank_attention_output(ctx, layouts, q, k, v, strategy):
    """This rank's slice of the global q [sum T, H, D] and k/v [sum (P+T), Hkv, D] → its output [Lq, H, D]."""
    lay = layouts[ctx.rank]
    q_rows = torch.from_numpy(np.where(lay.q_index >= 0, lay.q_index, 0))
    kv_rows = torch.from_numpy(lay.kv_index)
    qr = q.index_select(0, q_rows).masked_fill_(torch.from_numpy(lay.q_index < 0)[:, None, None], 0.0)
    return _plan(ctx, layouts, strategy).run(qr, k.index_select(0, kv_rows), v.index_select(0, kv_rows))


# ---------------------------------------------------------------- driver side

def summarize(per_rank: list[list[dict]]) -> dict:
    """Per-rank run lists → {"time_s": median over runs of the slowest rank, "steps": per-step max over ranks,
    "cpu_share": lowest over ranks}. Steps and CPU share come from the run whose time is the median."""
    times = [max(runs[i]["time_s"] for runs in per_rank) for i in range(len(per_rank[0]))]
    mid = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    steps = []
    for j, step in enumerate(per_rank[0][mid]["steps"]):
        steps.append({"step": step["step"],
                      "compute_s": max(runs[mid]["steps"][j]["compute_s"] for runs in per_rank),
                      "wait_s": max(runs[mid]["steps"][j]["wait_s"] for runs in per_rank)})
    return {"time_s": statistics.median(times), "runs_s": times, "steps": steps,
            "cpu_share": min(runs[mid]["cpu_share"] for runs in per_rank)}


def partial_points(tokens: int) -> list[tuple[int, int]]:
    """(T new, P cached) points with T + P = tokens, as in `PARTIAL_FRACTIONS`."""
    points = []
    for fnew, _ in PARTIAL_FRACTIONS:
        t = max(1, round(tokens * fnew))
        if (t, tokens - t) not in points:
            points.append((t, tokens - t))
    return points


def _area(it) -> int:
    """Query-key pairs a kernel call visits: a causal square only its lower triangle, a masked tile all of it."""
    h, w = it.q1 - it.q0, it.k1 - it.k0
    return h * (h + 1) // 2 if it.kind == CAUSAL else h * w


def window_stats(layouts: list[RankLayout], window: int | None, strategy: str, heads: int, kv_heads: int,
                 head_dim: int, elem_bytes: int = 4, chunk: int | None = None) -> dict:
    """What the windowed / chunked plan skips against the full causal one (host-side plans, no ranks needed):
    transfer steps with no message for any rank, point-to-point messages, bytes moved, attention tiles (query-key
    pairs)."""
    n = len(layouts)
    q_meta = [(lay.q_seq, lay.q_pos) for lay in layouts]
    kv_meta = [(lay.kv_seq, lay.kv_pos) for lay in layouts]

    def plans(w, c):
        return [plan_from_metadata(q_meta, kv_meta, group=None, rank=r, world=n, strategy=strategy, window=w,
                                   chunk=c) for r in range(n)]

    full, win = plans(None, None), plans(window, chunk)
    if strategy == "pass-q":  # queries out, partials (out | lse, fp32) back
        row_bytes = heads * head_dim * elem_bytes + heads * (head_dim + 1) * 4
        full_rows = n * (n - 1) * full[0].max_q
    else:  # packed K and V
        row_bytes = 2 * kv_heads * head_dim * elem_bytes
        full_rows = n * (n - 1) * full[0].max_send
    routes = win[0].routes
    pairs = [(s, r) for s in range(n) for r in range(n) if s != r]
    moved = sum(routes.count(s, r) for s, r in pairs)
    work = [sum(_area(it) for p in ps for step in p.steps for it in step) for ps in (full, win)]
    share = (lambda skipped, total: skipped / total if total else 0.0)  # noqa: E731
    return {"steps": n - 1, "steps_skipped": len(routes.empty_steps()),
            "messages": len(pairs), "messages_skipped": sum(routes.count(s, r) == 0 for s, r in pairs),
            "bytes_full": full_rows * row_bytes, "bytes_window": moved * row_bytes,
            "bytes_skipped_share": share(full_rows - moved, full_rows),
            "tiles_full": work[0], "tiles_window": work[1], "tiles_skipped_share": share(work[0] - work[1], work[0])}


def measure_window(args) -> dict:
    """Full causal vs a sliding window and / or chunked attention over the same load-balanced prefill, one pool per
    CP size."""
    shape = (args.heads, args.kv_heads, args.head_dim)
    window, chunk = args.window, getattr(args, "chunk", None)
    rows = []
    for n in args.cp:
        layouts = prefill_layout([args.tokens], [0], n)
        with WorkerPool(n, threads_per_rank=1, timeout_s=_WINDOW_TIMEOUT_S) as pool:  # full causal at 32K+ is slow
            full = summarize([r[args.strategy] for r in
                              pool.run(rank_time_attention, layouts, *shape, [args.strategy], args.repeat)])
            win = summarize([r[args.strategy] for r in
                             pool.run(rank_time_attention, layouts, *shape, [args.strategy], args.repeat, 0,
                                      window, chunk)])
        rows.append({"cp": n, "full_s": full["time_s"], "window_s": win["time_s"],
                     "full_runs_s": full["runs_s"], "window_runs_s": win["runs_s"],
                     "cpu_share": min(full["cpu_share"], win["cpu_share"]),
                     **window_stats(layouts, window, args.strategy, *shape, chunk=chunk)})
    return {"bench": "attention-window" if chunk is None else "attention-chunk", "command": command_line(args),
            "tokens": args.tokens, "window": window, "chunk": chunk, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": "float32", "strategy": args.strategy, "repeat": args.repeat,
            "rows": rows}


def local_kind(res: dict) -> str:
    """"window W", "chunk C" or "chunk C + window W": what the local plan restricts."""
    parts = ([f"chunk {res['chunk']}"] if res.get("chunk") else []) + (
        [f"window {res['window']}"] if res.get("window") else [])
    return " + ".join(parts)


def format_window_report(res: dict) -> str:
    shape = f"H={res['heads']}, Hkv={res['kv_heads']}, D={res['head_dim']}, fp32, 1 thread per rank"
    what = [f"a sliding window of {res['window']} keys"] if res.get("window") else []
    what = ([f"chunked attention of {res['chunk']} positions"] if res.get("chunk") else []) + what
    out = [f"{' with '.join(what).capitalize()} vs full causal attention: full prefill of {res['tokens']} "
           f"tokens, {res['strategy']} ({shape}); median of {res['repeat']}, slowest rank. Skipped shares are "
           "of the full causal plan's transfer steps, point-to-point messages, bytes and attention tiles "
           "(query-key pairs visited).", ""]
    rows = [[r["cp"], f"{r['full_s']:.3f}", f"{r['window_s']:.3f}", f"{r['full_s'] / r['window_s']:.2f}x",
             f"{r['steps_skipped']}/{r['steps']}", f"{r['messages_skipped']}/{r['messages']}",
             f"{100 * r['bytes_skipped_share']:.1f}% ({r['bytes_window'] / 2**20:.1f} of "
             f"{r['bytes_full'] / 2**20:.1f} MiB)", f"{100 * r['tiles_skipped_share']:.1f}%",
             f"{r['cpu_share']:.2f}"] for r in res["rows"]]
    out.append(_fmt_table(["CP", "full causal (s)", f"{local_kind(res)} (s)", "speed-up", "steps skipped",
                           "messages skipped", "bytes skipped", "tiles skipped", "CPU share (min rank)"], rows))
    return "\n".join(out)


def measure(args) -> dict:
    """Spawn one pool per CP size (one at a time), run the scaling and partial-prefill timings, return the results."""
    shape = (args.heads, args.kv_heads, args.head_dim)
    points = [] if args.no_partial else partial_points(args.tokens)
    sizes = sorted(set(args.cp) | ({args.partial_cp} if points else set()))
    scaling, partial = {}, []
    for n in sizes:
        with WorkerPool(n, threads_per_rank=1) as pool:
            if n in args.cp:
                layouts = prefill_layout([args.tokens], [0], n)
                out = pool.run(rank_time_attention, layouts, *shape, [args.strategy], args.repeat)
                scaling[n] = summarize([r[args.strategy] for r in out])
            for t, p in (points if n == args.partial_cp else []):
                layouts = prefill_layout([t], [p], n)
                out = pool.run(rank_time_attention, layouts, *shape, list(STRATEGIES), args.repeat)
                row = {"new": t, "cached": p, "cp": n}
                for s in STRATEGIES:
                    sm = summarize([r[s] for r in out])
                    row[s] = sm["time_s"]
                    row[s + " exposed comm"] = sum(st["wait_s"] for st in sm["steps"])
                partial.append(row)
    base = min(scaling) if scaling else None
    efficiency = {str(n): base * scaling[base]["time_s"] / (n * s["time_s"]) for n, s in scaling.items()}
    return {"bench": "attention", "command": command_line(args), "tokens": args.tokens,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float32",
            "strategy": args.strategy, "repeat": args.repeat, "baseline_cp": base, "efficiency": efficiency,
            "time_s": {str(n): s["time_s"] for n, s in scaling.items()},
            "runs_s": {str(n): s["runs_s"] for n, s in scaling.items()},
            "cpu_share": {str(n): s["cpu_share"] for n, s in scaling.items()},
            "steps": {str(n): s["steps"] for n, s in scaling.items()},
            "partial": partial}


# ---------------------------------------------------------------- report

def _fmt_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (readable as plain text too)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_report(res: dict) -> str:
    shape = f"H={res['heads']}, Hkv={res['kv_heads']}, D={res['head_dim']}, fp32, 1 thread per rank"
    out = [f"Causal full prefill, {res['tokens']} tokens, {res['strategy']} ({shape}); "
           f"median of {res['repeat']}, slowest rank:", ""]
    b = res["baseline_cp"]
    rows = [[n, f"{t:.3f}", f"{res['efficiency'][n]:.3f}", f"{res['cpu_share'][n]:.2f}"]
            for n, t in res["time_s"].items()]
    eff = "efficiency T1/(N·T_N)" if b == 1 else f"efficiency {b}·T{b}/(N·T_N)"
    out.append(_fmt_table(["CP", "time (s)", eff, "CPU share (min rank)"], rows))
    out += ["", "Per ring step (max over ranks): compute vs exposed communication (wait after compute):", ""]
    rows = [[n, st["step"], f"{st['compute_s']:.3f}", f"{st['wait_s']:.4f}"]
            for n, steps in res["steps"].items() for st in steps]
    out.append(_fmt_table(["CP", "step", "compute (s)", "exposed comm (s)"], rows))
    if res["partial"]:
        cp = res["partial"][0]["cp"]
        out += ["", f"Partial prefill at CP{cp}: T new tokens on P cached tokens, time in s "
                    "(exposed comm in parentheses):", ""]
        rows = [[p["new"], p["cached"], f"{p['cached'] / (p['new'] + p['cached']):.3f}"]
                + [f"{p[s]:.3f} ({p[s + ' exposed comm']:.3f})" for s in STRATEGIES]
                + [min(STRATEGIES, key=p.__getitem__)] for p in res["partial"]]
        out.append(_fmt_table(["T", "P", "miss rate P/(T+P)", *STRATEGIES, "fastest"], rows))
    return "\n".join(out)


def machine_info() -> dict:
    """What the numbers were measured on: cores, CPU model, torch version, date and load average."""
    cpu = platform.processor() or platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"nproc": nproc, "cpu": cpu, "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_avg": [round(x, 2) for x in load]}


class ForeignCPU:
    """CPU time other processes used while a block ran: busy time of the machine (/proc/stat) minus this process
    and its reaped children (the pools are closed inside the block). Linux only; None elsewhere."""

    def __enter__(self) -> "ForeignCPU":
        self.start, self.wall = self._sample(), time.perf_counter()
        self.seconds = self.share = None
        return self

    def __exit__(self, *exc) -> None:
        end, wall = self._sample(), time.perf_counter() - self.wall
        if self.start is not None and end is not None:
            self.seconds = max(0.0, (end[0] - self.start[0]) - (end[1] - self.start[1]))
            self.share = self.seconds / (wall * (os.cpu_count() or 1))

    @staticmethod
    def _sample() -> tuple[float, float] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        return busy, own


def command_line(args) -> str:
    cmd = (f"cpinfer bench attention --cp {','.join(map(str, args.cp))} --tokens {args.tokens} "
           f"--heads {args.heads} --kv-heads {args.kv_heads} --head-dim {args.head_dim} --repeat {args.repeat}")
    if args.strategy != "pass-kv":
        cmd += f" --strategy {args.strategy}"
    if getattr(args, "chunk", None):
        cmd += f" --chunk {args.chunk}"
    if getattr(args, "window", None):
        cmd += f" --window {args.window}"
    if getattr(args, "chunk", None) or getattr(args, "window", None):
        return cmd
    if args.no_partial:
        cmd += " --no-partial"
    elif args.partial_cp != 2:
        cmd += f" --partial-cp {args.partial_cp}"
    return cmd


def write_doc_section(path: Path, key: str, body: str) -> None:
    """Replace the section between this key's markers in `path` (or append it); other sections stay as they are."""
    begin, end = f"<!-- bench:{key} begin -->", f"<!-- bench:{key} end -->"
    section = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def machine_line(machine: dict) -> str:
    share = machine.get("foreign_cpu_share")
    foreign = "n/a" if share is None else f"{100 * share:.1f}%"
    return (f"Machine: {machine['nproc']} cores ({machine['cpu']}), torch {machine['torch']}, {machine['date']}; "
            f"load average {machine['load_avg_before']} before, {machine['load_avg']} after; "
            f"CPU time taken outside the benchmark during the run: {foreign} of the machine.")


def window_doc_body(res: dict) -> str:
    cps = ", ".join(str(r["cp"]) for r in res["rows"])
    title = "Chunked attention" if res.get("chunk") else "Sliding-window attention"
    return "\n".join([f"### {title}, {res['tokens']} tokens, {local_kind(res)}, CP {cps}", "",
                      "```", res["command"], "```", "", machine_line(res["machine"]), "",
                      format_window_report(res), ""])


def doc_body(res: dict) -> str:
    return "\n".join([f"### Attention, {res['tokens']} tokens, CP {', '.join(res['time_s'])}", "",
                      "```", res["command"], "```", "", machine_line(res["machine"]), "", format_report(res), ""])


# ---------------------------------------------------------------- CLI

def positive_int(text: str) -> int:
    """argparse type: a positive integer, or a clear error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _cp_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive CP sizes (e.g. 1,2), got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=_cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--tokens", type=positive_int, default=16384, help="sequence length (default: 16384)")
    parser.add_argument("--heads", type=positive_int, default=8, help="query heads (default: 8)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (default: 2)")
    parser.add_argument("--head-dim", type=positive_int, default=128, help="head dimension (default: 128)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs after a warm-up (default: 3)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="pass-kv", help="strategy of the scaling table and of --window")
    parser.add_argument("--partial-cp", type=positive_int, default=2,
                        help="CP size of the pass-KV / pass-Q / all-gather partial-prefill table (default: 2)")
    parser.add_argument("--no-partial", action="store_true", help="skip the partial-prefill table")
    parser.add_argument("--window", type=positive_int, metavar="W",
                        help="instead of the tables above: a sliding window of W keys vs full causal attention at "
                             "each --cp size (time, and the ring steps, messages, bytes and tiles skipped)")
    parser.add_argument("--chunk", type=positive_int, metavar="C",
                        help="like --window, for chunked attention of C positions (a query sees only keys of its own "
                             "chunk, Llama 4); with --window, both rules")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--write-doc", nargs="?", const=DOC_PATH, type=Path, metavar="FILE",
                        help=f"replace (or append) this run's section in FILE (default: {DOC_PATH})")


def run(args) -> int:
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    local = bool(args.window or getattr(args, "chunk", None))
    if local and args.strategy == "all-gather":
        raise ValueError("--window / --chunk compare the ring strategies: use --strategy pass-kv or pass-q")
    before = [round(x, 2) for x in os.getloadavg()]
    with ForeignCPU() as foreign:
        res = measure_window(args) if local else measure(args)
    res["machine"] = machine = machine_info()
    machine["load_avg_before"] = before
    machine["foreign_cpu_share"] = foreign.share
    print(format_window_report(res) if local else format_report(res))
    print(f"\n{machine_line(machine)}")
    if foreign.share is not None and foreign.share > 0.05:
        print(f"warning: other processes used {100 * foreign.share:.0f}% of the machine during the run; "
              "the timings are disturbed", file=sys.stderr)
    if args.write_doc and local:
        key = f"attention-window-{args.tokens}-{args.window}" if not res["chunk"] else \
            f"attention-chunk-{args.tokens}-{res['chunk']}" + (f"-window-{args.window}" if args.window else "")
        write_doc_section(args.write_doc, key, window_doc_body(res))
    elif args.write_doc:
        write_doc_section(args.write_doc, f"attention-{args.tokens}", doc_body(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res))
    return 0
