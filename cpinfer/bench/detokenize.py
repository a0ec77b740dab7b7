"""Host time per step to turn a new token into text, at short and long outputs (`cpinfer bench detokenize`).

Side by side on the embedded model's tokenizer: decoding the whole output every step (what the engine did before
its output processor) against the incremental detokenizer of `cpinfer/engine/output.py` (each step decodes the new
token and a few before it). The output is real text (this package's README, tokenized) with a stop string that
never matches, so the stop-string search runs every step as in serving.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from cpinfer.bench import common as C


def _output_tokens(tok, n: int) -> list[int]:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text() if readme.exists() else "The quick brown fox jumps over the lazy dog. 🦜 café 日本語 "
    ids = tok.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


def whole_decode_s(tok, ids: list[int], at: int, steps: int) -> float:
    """Median seconds of one step that decodes the whole output (`at` tokens) and searches it for a stop string."""
    times = []
    for k in range(at - steps, at):
        t0 = time.perf_counter()
        text = tok.decode(ids[:k + 1], skip_special_tokens=True)
        text.find("\x00never\x00")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def incremental_s(tok, ids: list[int], at: int, steps: int) -> float:
    """Median host detokenize seconds of the output processor's steps `at - steps` ... `at`."""
    from cpinfer.engine.batch import SampleResult
    from cpinfer.engine.output import OutputProcessor
    from cpinfer.engine.request import Request
    from cpinfer.engine.sampling import SamplingParams

    proc = OutputProcessor(tok, (), {"prompt_tokens": 0, "generation_tokens": 0})
    req = Request("bench", [0], SamplingParams(max_tokens=at + 1, stop=["\x00never\x00"]), seed=0)
    times = []
    for k in range(at):
        host = {}
        proc.take_token(req, SampleResult(0, ids[k], 0.0, ()), 0.0, host)
        if k >= at - steps:
            times.append(host["detokenize_s"])
    return statistics.median(times)


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from cpinfer.model.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    ids = _output_tokens(tok, max(args.lengths))
    rows = []
    for n in args.lengths:
        rows.append({"tokens": n, "whole_ms": 1e3 * whole_decode_s(tok, ids, n, args.steps),
                     "incremental_ms": 1e3 * incremental_s(tok, ids, n, args.steps)})
    return {"bench": "detokenize", "rows": rows, "steps": args.steps,
            "command": f"cpinfer bench detokenize --lengths {' '.join(map(str, args.lengths))} --steps {args.steps}"}


def format_report(res: dict) -> str:
    rows = res["rows"]
    lines = ["| output tokens | whole decode per step (before) | incremental per step (after) | before / after |",
             "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['whole_ms']:.3f} ms | {r['incremental_ms']:.3f} ms | "
                     f"{r['whole_ms'] / r['incremental_ms']:.1f}x |")
    first, last = rows[0], rows[-1]
    lines += ["", f"Incremental, {last['tokens']:,} vs {first['tokens']:,} tokens: "
              f"{last['incremental_ms'] / first['incremental_ms']:.2f}x (flat is 1.00x); whole decode: "
              f"{last['whole_ms'] / first['whole_ms']:.1f}x. Median of {res['steps']} steps ending at each length."]
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="model whose tokenizer is used (default: the embedded one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 4000], help="output lengths in tokens")
    parser.add_argument("--steps", type=int, default=50, help="steps timed at each length (median)")
    C.add_common_arguments(parser)


def run(args) -> int:
    if min(args.lengths) <= args.steps:
        raise SystemExit(f"--steps ({args.steps}) must be below every --lengths value ({min(args.lengths)})")
    return C.run_measured(args, measure, format_report, "detokenize", "Detokenizing: host time per step")
