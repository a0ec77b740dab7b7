"""Regenerate the tables and worked examples of docs/planning.md from the model (`python -m cpinfer.perf.planning_doc
docs/planning.md`): fitted parameters, statements, leave-one-out (from `fit.py`), the §4.2.4 miss-rate grid, the
prefill/decode-groups table, the speculative-decoding table and the hybrid (Qwen3.5) table.

A generated section sits between <!-- begin:NAME --> and <!-- end:NAME -->; a worked example is the fenced block
after <!-- plan: ARGS -->, rewritten with `cpinfer plan ARGS` and what it prints.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

from cpinfer.perf import fit
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf import pd, speculative
from cpinfer.perf.planner import Workload, build_deployment, choose, make_plan
from cpinfer.perf.statements import K128, dep, ttft

GRID = (1280, 2560, 3200, 4000, 6400, 12800, 19200, 32000, 64000, 128000)  # T, with P + T = 128000 (§4.2.4)
METHODS = ("alg1", "alg5", "simulator")


def miss_rate_grid() -> str:
    """Markdown: CP4 x TP8 Llama3-405B on h100-gtt (the paper's implementation), T + P = 128000: TTFT of both
    strategies with pass-Q's All2All and per-step share, and each heuristic's pick."""
    hw = HARDWARE["h100-gtt"]
    lines = ["| T | miss rate | pass-KV (s) | pass-Q (s) | KV / Q | pass-KV exposed SendRecv (s) | pass-Q All2All (s) "
             "| ring-step cost (s) | " + " | ".join(METHODS) + " |", "|---" * (8 + len(METHODS)) + "|"]
    for t in GRID:
        kv, q = ttft(hw, 4, t, K128 - t, "pass-kv"), ttft(hw, 4, t, K128 - t, "pass-q")
        picks = [choose(dep(hw, 4), Workload(t, K128 - t), m).strategy for m in METHODS]
        lines.append(f"| {t} | {t / K128:.2%} | {kv.seconds:.3f} | {q.seconds:.3f} | {kv.seconds / q.seconds:.3f} | "
                     f"{kv.breakdown['sendrecv_exposed']:.3f} | {q.breakdown['all2all']:.3f} | "
                     f"{q.breakdown['ring_steps']:.3f} | " + " | ".join(picks) + " |")
    return "\n".join(lines)


PD_LENGTHS = (128_000, 256_000, 512_000, 1_000_000)  # the paper's 128K ... 1M (§4.1 counts)
SPEC_K = (1, 2, 3, 4, 6, 8)
SPEC_ALPHAS = (0.3, 0.5, 0.7, 0.8, 0.9)


def pd_table() -> str:
    """Markdown: Llama3-405B FP8 (fp8-ffn) on h100-gtt, prefill CP16 x TP8, decode on one CP1 or CP2 x TP8 group,
    bf16 and FP8 KV cache: TTFT, the KV transfer (bytes into a decode device, total, exposed), TTIT against
    decoding on the prefill group, and whether the decode group holds the context."""
    lines = ["| tokens | KV cache | decode | TTFT CP16 (s) | GB into a decode device | transfer (s) | exposed (ms) "
             "| TTIT (ms) | TTIT colocated CP16 (ms) | decode device GB | fits |", "|---" * 11 + "|"]
    for kv in ("bf16", "fp8"):
        base = build_deployment("llama3-405b", "h100-gtt", 16, 8, "fp8-ffn", "bf16", kv)
        for tokens in PD_LENGTHS:
            plan = make_plan(base, Workload(tokens))
            for m in (1, 2):
                p = pd.plan_pd(plan, m)
                t = p.transfer
                lines.append(f"| {tokens} | {kv} | CP{m} x TP8 | {plan.chosen_ttft_s:.2f} | "
                             f"{t.receiver_bytes / 1e9:.2f} | {t.seconds:.3f} | {t.exposed_s * 1e3:.2f} | "
                             f"{p.ttit.seconds * 1e3:.1f} | {p.colocated_ttit.seconds * 1e3:.1f} | "
                             f"{p.memory.total_gb:.1f} | {'yes' if p.memory.fits else 'no'} |")
    return "\n".join(lines)


def spec_table() -> str:
    """Markdown: n-gram speculation at the paper's CP4 x TP8 decode of Llama3-405B FP8 at 128K (h100-gtt, both
    rings): the verify step as a decode step against a decode step, the break-even acceptance and the gain at several
    acceptances; then the same verify step as an eager partial prefill through the prefill ring."""
    lines = ["| ring | k | decode (ms) | verify (ms) | verify / decode | break-even acceptance | " +
             " | ".join(f"gain at {a:g}" for a in SPEC_ALPHAS) + " | as partial prefill (ms) | its break-even "
             "| its gain at 0.7 |", "|---" * (9 + len(SPEC_ALPHAS)) + "|"]
    for impl in ("paper", "cpinfer"):
        d = build_deployment("llama3-405b", "h100-gtt", 4, 8, "fp8-ffn", implementation=impl)
        for k in SPEC_K:
            plans = [speculative.plan_spec(d, K128, k, a) for a in SPEC_ALPHAS]
            p0, at07 = plans[0], plans[SPEC_ALPHAS.index(0.7)]
            be, bp = p0.breakeven, p0.breakeven_partial
            lines.append(f"| {impl} | {k} | {p0.decode.seconds * 1e3:.2f} | {p0.verify.seconds * 1e3:.2f} "
                         f"| {p0.cost_ratio:.3f} | {'none' if be is None else f'{be:.3f}'} | " +
                         " | ".join(f"{p.gain:.2f}x" for p in plans) +
                         f" | {p0.verify_partial.seconds * 1e3:.1f} | {'none' if bp is None else f'{bp:.3f}'} "
                         f"| {at07.gain_partial:.2f}x |")
    return "\n".join(lines)


HYBRID_LENGTHS = (131_072, 262_144, 524_288, 1_000_000)
HYBRID_CP = (4, 8, 16)


def hybrid_table() -> str:
    """Markdown: Qwen3.5-397B-A17B FP8 on H200 x TP8 at CP4/8/16 and 128K ... 1M tokens (one request): TTFT (pass-KV,
    the full prefill's choice), the recurrent layers' and the summary exchange's shares, TTIT, and memory per device
    (K/V of the 15 attention layers, the request's recurrent state)."""
    lines = ["| tokens | CP x TP | TTFT (s) | recurrent layers | summary exchange (MB / layer, share) | TTIT (ms) "
             "| KV GB / device | state GB / device | GB / device | fits |", "|---" * 10 + "|"]
    for tokens in HYBRID_LENGTHS:
        for cp in HYBRID_CP:
            plan = make_plan(build_deployment("qwen3.5-397b-a17b", "h200", cp, 8, "fp8"), Workload(tokens))
            e, m = plan.ttft["pass-kv"], plan.memory
            lines.append(f"| {tokens} | CP{cp} x TP8 | {e.seconds:.2f} | {e.breakdown['recurrence']:.3f} s "
                         f"({e.breakdown['recurrence'] / e.seconds:.1%}) | {e.detail['exchange_mb_per_layer']:.1f} MB, "
                         f"{e.breakdown['summary_exchange']:.3f} s ({e.breakdown['summary_exchange'] / e.seconds:.1%})"
                         f" | {plan.ttit.seconds * 1e3:.1f} | {m.kv_gb:.2f} | {m.state_gb:.3f} | {m.total_gb:.1f} "
                         f"| {'yes' if m.fits else 'no'} |")
    return "\n".join(lines)


SECTIONS = {"parameters": fit.parameter_table, "statements": fit.statement_table,
            "leave-one-out": lambda: fit.loo_table(fit.leave_one_out()), "miss-rate-grid": miss_rate_grid,
            "pd-table": pd_table, "spec-table": spec_table, "hybrid-table": hybrid_table}
EXAMPLE = re.compile(r"<!-- plan: (.+?) -->\n```\n.*?```", re.S)


def write_doc(path: str | Path) -> list[str]:
    """Regenerate every marked section and worked example of `path` in place; return what was rewritten."""
    path = Path(path)
    text, done = path.read_text(), []
    for name, make in SECTIONS.items():
        begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"{path}: no {begin} ... {end} section to regenerate")
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{make()}\n{end}{rest.split(end, 1)[1]}"
        done.append(name)
    done += [f"example: cpinfer plan {args}" for args in EXAMPLE.findall(text)]
    path.write_text(EXAMPLE.sub(lambda m: _example(m.group(1)), text))
    return done


def _example(args: str) -> str:
    """`cpinfer plan ARGS` and what it prints, as the fenced block of a worked example."""
    from cpinfer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *shlex.split(args)])
    return f"<!-- plan: {args} -->\n```\n$ cpinfer plan {args}\n{out.getvalue()}```"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpinfer.perf.planning_doc", description=__doc__.splitlines()[0])
    parser.add_argument("path", metavar="PATH", help="the file whose marked tables and worked examples to regenerate "
                                                     "(docs/planning.md)")
    for what in write_doc(parser.parse_args(argv).path):
        print(f"regenerated {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
