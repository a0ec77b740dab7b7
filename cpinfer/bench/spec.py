"""Speculative decoding with prompt lookup (`cpinfer bench spec`): decode tokens/s per request with and without
`speculative_config={"method": "ngram", ...}` at CP1 and CP2 on the embedded SmolLM2-135M-Instruct (by default), on
two workloads: answers that quote the prompt (extract, repeat or edit a passage of the document `cpinfer demo`
reads: the project's README and docs) and free-form chat. Also the acceptance rate, accepted tokens per verify
step, and whether speculation left the greedy tokens unchanged (it must).

Each request runs alone (greedy), so its decode tokens/s is its own: (output tokens - 1) / (last token time -
first token time). A workload's speedup is the median over its requests of spec / plain. `--verify decode,prefill`
runs the speculative engine once per verify path (`spec_verify`: drafts as decode rows, or as a partial prefill)
against the same plain run, side by side.
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

from cpinfer.bench import common as C

# Targets on this CPU (docs/benchmarks.md): speculation must pay where answers quote the prompt (2x) and
# must not cost where they do not (never below plain decoding).
TARGETS = {"quoting": 2.0, "chat": 1.0}
CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for someone learning to play the piano? Explain each briefly.",
    "Describe a walk through a forest in autumn, as a letter to a friend.",
    "Why do cats purr? Give a friendly explanation for a child.",
    "Plan a relaxed one-day visit to a small coastal town.",
    "Write a limerick about a forgetful robot, then explain the joke.",
)
MIN_PASSAGE_WORDS = 30


def passages(document: str) -> list[str]:
    """The prose paragraphs of the document (outside code blocks; no headings, tables or lists) of at least
    MIN_PASSAGE_WORDS words."""
    prose, in_code = [], False
    for p in document.split("\n\n"):
        fenced = p.count("```") % 2 == 1
        text = p.lstrip()
        starts = text[:1].isalnum() or (text.startswith(("`", "**")) and not text.startswith("```"))
        if not in_code and not fenced and "```" not in p and starts and len(p.split()) >= MIN_PASSAGE_WORDS:
            prose.append(p.strip())
        in_code ^= fenced
    if not prose:
        raise ValueError("the document has no prose paragraph of at least "
                         f"{MIN_PASSAGE_WORDS} words to quote; give a longer --doc-tokens")
    return prose


def quoting_messages(document: str, count: int) -> list[list[dict]]:
    """`count` conversations whose answers quote the prompt: extract / repeat / edit over the document's passages,
    each (passage, task) pair once until all are used."""
    prose, out = passages(document), []
    for i in range(count):
        passage = prose[i % len(prose)]
        start = " ".join(passage.split()[:6])
        kind = (i % len(prose) + i // len(prose)) % 3  # round r gives passage p task (p + r) mod 3
        if kind == 0:
            text = (f"Read this document.\n\n{document}\n\nQuote, word for word, the whole paragraph of the document "
                    f"that begins with \"{start}\". Output only the paragraph.")
        elif kind == 1:
            text = f"Repeat the following passage exactly, with no comment:\n\n{passage}"
        else:
            text = ("Rewrite the following passage with every occurrence of \"cpinfer\" replaced by \"the engine\"; "
                    f"change nothing else and output only the passage:\n\n{passage}")
        out.append([{"role": "user", "content": text}])
    return out


def chat_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(count)]


def build_workloads(tokenizer, doc_tokens: int, requests: int) -> dict[str, list[list[int]]]:
    """{"quoting": prompts, "chat": prompts}, each `requests` token-id prompts under the model's chat template."""
    from cpinfer.commands.demo import build_document
    from cpinfer.engine.llm import encode_chat

    document, _ = build_document(tokenizer, doc_tokens)
    return {"quoting": [encode_chat(tokenizer, m) for m in quoting_messages(document, requests)],
            "chat": [encode_chat(tokenizer, m) for m in chat_messages(requests)]}


def spec_config(args) -> dict:
    """The engine's speculative_config for this run (vLLM's keys)."""
    return {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}


def run_engine(model: str, cp: int, speculative: dict | None, workloads: dict[str, list[list[int]]],
               max_tokens: int, hw: dict) -> dict[str, list[dict]]:
    """One engine at CP `cp`, with or without speculation, for every workload: each prompt generated alone,
    greedy. Per request: its tokens, its decode seconds (first to last token) and the engine's speculation
    counters (`metrics["spec"]`)."""
    from cpinfer import LLM, SamplingParams

    longest = max(len(p) for ps in workloads.values() for p in ps) + max_tokens + 16
    kw = dict(hw, speculative_config=speculative) if speculative else dict(hw)
    out: dict[str, list[dict]] = {}
    with LLM(model, context_parallel_size=cp, max_model_len=longest, **kw) as llm:
        first = next(iter(workloads.values()))[0]
        llm.generate([first[-8:]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        for name, prompts in workloads.items():
            out[name] = []
            for prompt in prompts:
                res = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
                out[name].append({"tokens": list(res.token_ids),
                                  "decode_s": float(sum(res.metrics.get("ttit_s", ()))),
                                  "spec": dict(res.metrics.get("spec") or {})})
    return out


def _tokens_per_s(row: dict) -> float:
    n = len(row["tokens"]) - 1
    return n / row["decode_s"] if n > 0 and row["decode_s"] > 0 else 0.0


def summarize(cp: int, workload: str, plain: list[dict], spec: list[dict], k: int, verify: str = "decode") -> dict:
    """One table row: median per-request tokens/s both ways, median speedup, acceptance over the workload."""
    ratios = [_tokens_per_s(s) / _tokens_per_s(p) for p, s in zip(plain, spec) if _tokens_per_s(p) > 0]
    drafted = sum(s["spec"].get("num_draft_tokens", 0) for s in spec)
    accepted = sum(s["spec"].get("num_accepted_tokens", 0) for s in spec)
    steps = sum(s["spec"].get("num_drafts", 0) for s in spec)
    return {"cp": cp, "workload": workload, "verify": verify, "requests": len(plain),
            "output_tokens": sum(len(p["tokens"]) for p in plain),
            "plain_tokens_per_s": statistics.median(_tokens_per_s(p) for p in plain),
            "spec_tokens_per_s": statistics.median(_tokens_per_s(s) for s in spec),
            "speedup": statistics.median(ratios) if ratios else 0.0,
            "drafted": drafted, "accepted": accepted, "verify_steps": steps,
            "acceptance": accepted / drafted if drafted else 0.0,
            "accepted_per_step": accepted / steps if steps else 0.0, "k": k,
            "identical": all(p["tokens"] == s["tokens"] for p, s in zip(plain, spec)),
            "target": TARGETS.get(workload)}


Runner = Callable[[str, int, "dict | None", dict, int, dict], dict]


def measure(args, runner: Runner | None = None) -> dict:
    """Both workloads at every CP size, plain then speculative; `runner` (default `run_engine`) runs one engine."""
    from transformers import AutoTokenizer

    from cpinfer.model.resolve import resolve_model

    path = str(resolve_model(args.model))
    hw = C.hardware(args)
    if args.placement != "auto":  # shard: every request spreads over the ranks (the ring, where the paths differ)
        hw = dict(hw, placement=args.placement)
    workloads = build_workloads(AutoTokenizer.from_pretrained(path), args.doc_tokens, args.requests)
    cfg, runner = spec_config(args), runner or run_engine
    rows = []
    for cp in args.cp:
        plain = runner(path, cp, None, workloads, args.tokens, hw)
        for verify in args.verify:
            spec = runner(path, cp, cfg, workloads, args.tokens, dict(hw, spec_verify=verify) if verify != "decode"
                          else hw)
            rows += [summarize(cp, name, plain[name], spec[name], args.k, verify) for name in workloads]
    return {"bench": "spec", "command": command_line(args), "model": args.model or "embedded",
            "hardware": C.hardware_text(hw), "speculative_config": cfg, "doc_tokens": args.doc_tokens,
            "prompt_tokens": {n: [len(p) for p in ps] for n, ps in workloads.items()}, "rows": rows}


def format_report(res: dict) -> str:
    rows = []
    for r in res["rows"]:
        target = r["target"]
        met = "" if target is None else f"{'met' if r['speedup'] >= target else 'NOT met'} (>= {target:g}x)"
        rows.append([f"CP{r['cp']}", r["workload"], r.get("verify", "decode"), str(r["requests"]), str(r["output_tokens"]),
                     f"{r['plain_tokens_per_s']:.1f}", f"{r['spec_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                     str(r["drafted"]), f"{r['acceptance']:.2f}" if r["drafted"] else "-",
                     f"{r['accepted_per_step']:.2f}" if r["verify_steps"] else "-", str(r["k"]),
                     "yes" if r["identical"] else "NO", met])
    lens = {n: f"{min(v)}-{max(v)}" for n, v in res["prompt_tokens"].items()}
    cfg = json.dumps(res["speculative_config"])
    return "\n".join([
        f"Model: {res['model']} ({res['hardware']}); speculative_config {cfg}; prompts of "
        + ", ".join(f"{n} {v} tokens" for n, v in lens.items()) + "; greedy, one request at a time.", "",
        C.fmt_table(["CP", "workload", "verify", "requests", "tokens out", "plain tok/s", "spec tok/s", "speedup", "drafted",
                     "acceptance", "accepted / step", "k", "same tokens", "target"], rows), "",
        "verify: how drafts were verified (decode: k+1 decode rows, pass-Q decode ring; prefill: a partial prefill, "
        "the ring chosen as for a mixed forward); tok/s: decode tokens per second of one request (median over the workload's requests); speedup: median of "
        "each request's spec / plain; drafted: tokens proposed by prompt lookup over the workload (none: nothing "
        "to verify); acceptance: accepted / drafted; accepted / step: accepted tokens per verify step; same tokens: "
        "speculation left every greedy output unchanged."])


def command_line(args) -> str:
    parts = ["cpinfer bench spec", f"--cp {','.join(str(c) for c in args.cp)}", f"--k {args.k}",
             f"--lookup-min {args.lookup_min}", f"--lookup-max {args.lookup_max}", f"--tokens {args.tokens}",
             f"--requests {args.requests}", f"--doc-tokens {args.doc_tokens}"]
    if args.verify != ["decode"]:
        parts.append(f"--verify {','.join(args.verify)}")
    if args.placement != "auto":
        parts.append(f"--placement {args.placement}")
    if args.model:
        parts.append(f"--model {args.model}")
    return " ".join(parts) + C.hardware_flags(C.hardware(args))


def _check(args) -> None:
    if args.lookup_min > args.lookup_max:
        raise ValueError(f"--lookup-min ({args.lookup_min}) must be <= --lookup-max ({args.lookup_max})")


def _verify_paths(text: str) -> list[str]:
    from cpinfer.engine.config import SPEC_VERIFY

    paths = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in paths if p not in SPEC_VERIFY]
    if not paths or bad or len(set(paths)) != len(paths):
        raise argparse.ArgumentTypeError(f"--verify takes distinct paths among {', '.join(SPEC_VERIFY)}, got {text!r}")
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint with a tokenizer and chat template (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--k", type=C.positive_int, default=4,
                        help="num_speculative_tokens: the most tokens drafted per step (default: 4)")
    parser.add_argument("--lookup-min", type=C.positive_int, default=2,
                        help="prompt_lookup_min: the shortest suffix looked up in the context (default: 2)")
    parser.add_argument("--lookup-max", type=C.positive_int, default=4,
                        help="prompt_lookup_max: the longest suffix looked up, tried first (default: 4)")
    parser.add_argument("--verify", type=_verify_paths, default=["decode"], metavar="PATH,PATH",
                        help="verify paths (spec_verify) to run side by side: decode, prefill (default: decode)")
    parser.add_argument("--placement", choices=("auto", "shard"), default="auto",
                        help="the engines' placement: auto (short requests stay on one rank: no ring) or shard "
                             "(every request spreads: its verify rows go around the ring) (default: auto)")
    parser.add_argument("--tokens", type=C.positive_int, default=96,
                        help="most output tokens per request (default: 96)")
    parser.add_argument("--requests", type=C.positive_int, default=6,
                        help="requests per workload (default: 6; quoting cycles extract / repeat / edit)")
    parser.add_argument("--doc-tokens", type=C.positive_int, default=1500,
                        help="tokens of the demo document the quoting prompts draw on (default: 1500)")
    C.add_common_arguments(parser)


def run(args) -> int:
    _check(args)
    return C.run_measured(args, measure, format_report, "spec",
                          "Speculative decoding with prompt lookup, with and without (`cpinfer bench spec`)")
