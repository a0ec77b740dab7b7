"""The table of `scripts/vs_vllm.sh` from its `vllm bench serve` results (issue 51's rows); --write-doc puts it into
docs/benchmarks.md between the `bench:vs-vllm` markers."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

BEGIN, END = "<!-- bench:vs-vllm begin -->", "<!-- bench:vs-vllm end -->"


def _load(out: Path, server: str, run: str) -> dict | None:
    p = out / f"{server}-{run}.json"
    return json.loads(p.read_text()) if p.exists() else None


def rows(out: Path, server: str) -> dict:
    """workload -> (value, unit, higher is better) for one server; missing runs are left out."""
    r = {}
    long = _load(out, server, "long")
    if long and long.get("completed", 0) == 2:
        order = sorted(range(2), key=lambda i: long["start_times"][i])  # the cold request first
        cold, warm = order
        r["cold"] = (1000 * long["ttfts"][cold], "ms", False)
        r["cold_itl"] = (1000 * statistics.mean(long["itls"][cold]), "ms", False)
        r["warm"] = (1000 * long["ttfts"][warm], "ms", False)
        r["prompt_lens"] = long["input_lens"]
    for run in ("c4", "c16"):
        d = _load(out, server, run)
        if d and d.get("completed"):
            r[run] = (d["output_throughput"], "tok/s", True)
    b1 = _load(out, server, "b1")
    if b1 and b1.get("completed"):
        r["b1"] = (b1["mean_tpot_ms"], "ms", False)
    return r


LABELS = [("cold", "cold ~3,100-token prompt (3,000 shared + 100): TTFT"),
          ("cold_itl", "its decode, mean ITL at ~3.1K context"),
          ("warm", "the same 3,000 + another 100 tokens (prefix reused): TTFT"),
          ("c4", "16 x (500 in, 128 out) (--quick: 8 x (500, 32)), concurrency 4: output tokens/s"),
          ("c16", "same, concurrency 16: output tokens/s"),
          ("b1", "batch-1 decode at a 256-token context: ms/token (mean TPOT)")]


def _cell(v) -> str:
    return "—" if v is None else f"{v[0]:.1f} {v[1]}"


def _speed(a, b) -> str:
    """a's speed over b's (each (value, unit, higher is better)), or a dash."""
    if not (a and b and a[0] > 0 and b[0] > 0):
        return "—"
    return f"{(a[0] / b[0]) if a[2] else (b[0] / a[0]):.2f}x"


def agreement(out: Path, server: str) -> str:
    """How many of `server`'s greedy completions equal vLLM's, per run (the texts of `vllm bench serve
    --save-detailed`); a completion that differs only in a trailing U+FFFD (a last token that is an incomplete UTF-8
    sequence: cpinfer streams the replacement character, vLLM leaves it out) is counted apart."""
    parts = []
    for run in ("long", "c4", "c16", "b1"):
        a, b = _load(out, server, run), _load(out, "vllm", run)
        ours, theirs = (a or {}).get("generated_texts"), (b or {}).get("generated_texts")
        if not ours or not theirs or len(ours) != len(theirs):
            continue
        same = sum(x == y for x, y in zip(ours, theirs))
        near = sum(x != y and x.rstrip("\ufffd") == y.rstrip("\ufffd") for x, y in zip(ours, theirs))
        parts.append(f"{run} {same}/{len(ours)}" + (f" (+{near} but a trailing U+FFFD)" if near else ""))
    return ", ".join(parts) or "no texts to compare"


def table(out: Path, args) -> str:
    ours, cp2, theirs = rows(out, "cpinfer"), rows(out, "cpinfer-cp2"), rows(out, "vllm")
    lines = ["| workload | cpinfer | vLLM CPU | cpinfer / vLLM speed | cpinfer CP2 (shard) | CP2 / vLLM speed |",
             "|---|---|---|---|---|---|"]
    for key, text in LABELS:
        a, b, c = ours.get(key), theirs.get(key), cp2.get(key)
        lines.append(f"| {text} | {_cell(a)} | {_cell(b)} | {_speed(a, b)} | {_cell(c)} | {_speed(c, b)} |")
    lens = ours.get("prompt_lens") or theirs.get("prompt_lens")
    quick = " --quick" if args.quick else ""
    half = max(1, args.threads // 2)
    head = (f"`bash scripts/vs_vllm.sh --threads {args.threads}{quick}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f"): the servers all up on 127.0.0.1 (an idle one uses no CPU), each row run on each in turn, cpinfer "
            f"and vLLM swapping places from row to row; the embedded SmolLM2-135M-Instruct folder in float32 on "
            f"{args.threads} threads (cpinfer: `serve --cp 1 --threads-per-rank {args.threads} --dtype float32`; "
            f"cpinfer CP2: `serve --cp 2 --placement shard --threads-per-rank {half}`, every request spread over "
            f"both ranks; vLLM CPU {args.vllm_version}: `vllm serve --dtype float32`, VLLM_CPU_OMP_THREADS_BIND over "
            f"{args.threads} cores), one client: `vllm bench serve --backend openai` (streaming completions, "
            f"temperature 0, ignore_eos, random prompts of seed 51; long prompts {lens} tokens). Load average "
            f"{args.load_before} before, {args.load_after} after: under load every number is indicative "
            "(a quiet machine is the one to judge the targets on).")
    same = (f"Greedy completions equal to vLLM's: cpinfer {agreement(out, 'cpinfer')}; cpinfer CP2 "
            f"{agreement(out, 'cpinfer-cp2')}.")
    return head + "\n\n" + "\n".join(lines) + "\n\n" + same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--load-before", default="?")
    ap.add_argument("--load-after", default="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", type=int, default=0)
    ap.add_argument("--vllm-version", default="?")
    ap.add_argument("--write-doc", type=Path, default=None)
    args = ap.parse_args()
    text = table(args.out, args)
    print(text)
    if args.write_doc is not None:
        doc = args.write_doc.read_text()
        block = f"{BEGIN}\n### cpinfer vs vLLM's CPU build, side by side (`scripts/vs_vllm.sh`)\n\n{text}\n{END}"
        if BEGIN in doc:
            doc = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
        else:
            doc = doc.rstrip("\n") + "\n\n" + block + "\n"
        args.write_doc.write_text(doc)


if __name__ == "__main__":
    main()
