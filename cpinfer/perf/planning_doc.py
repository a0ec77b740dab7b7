"""Regenerate the tables and worked examples of docs/planning.md from the model (`python -m cpinfer.perf.planning_doc
docs/planning.md`): fitted parameters, statements, leave-one-out (from `fit.py`), the §4.2.4 miss-rate grid.

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
from cpinfer.perf.planner import Workload, choose
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


SECTIONS = {"parameters": fit.parameter_table, "statements": fit.statement_table,
            "leave-one-out": lambda: fit.loo_table(fit.leave_one_out()), "miss-rate-grid": miss_rate_grid}
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
