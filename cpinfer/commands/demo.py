"""`cpinfer demo`: a real conversation about a long real document — the project's own README and docs — with the
embedded SmolLM2-135M-Instruct, served at CP=1 and at CP=N on local ranks (full prefill by ring pass-KV, the
second turn a partial prefill on the persistent KV shards, decode by pass-Q; paper §3.3-3.6). At CP=N the engine
decides per turn whether spreading the new tokens over the ranks pays (it prints the prediction). PASS only when
CP=N produces CP=1's tokens and log-probabilities (fp32 by default; in 16-bit types within a looser tolerance, and a
divergence is accepted only where CP=1's two best tokens were a near tie). A second stage checks CP attention
itself against one device, on CPU ranks.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cpinfer.attention.local import local_attention
from cpinfer.bench.attention import positive_int, prefill_layout, rank_attention_output
from cpinfer.cp import STRATEGIES
from cpinfer.device import add_arguments as add_device_arguments
from cpinfer.device import resolve_device, resolve_dtype
from cpinfer.launch import WorkerPool

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ("In two sentences: what is cpinfer, and what problem does it solve?",
             "Which two ring attention variants does it choose between, and when is each one better?")
LOGPROB_TOL = 1e-4
LOGPROB_TOL_16BIT = 0.25  # bf16 / fp16: CP=N sums attention in another order; rounding moves log-probs this much


# ---------------------------------------------------------------- stage 1: a real conversation, CP=1 vs CP=N

def document_files() -> list[Path]:
    """The project's own README and docs, in reading order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def build_document(tokenizer, max_tokens: int, files: list[Path] | None = None) -> tuple[str, int]:
    """(text, tokens): whole paragraphs of `files` in order while they fit in `max_tokens` tokens."""
    files = [f for f in (files or document_files()) if f.is_file()]
    if not files:
        raise ValueError(f"no document found (looked for README.md and docs/*.md under {REPO}); pass --document")
    paragraphs = [p for f in files for p in f.read_text().split("\n\n") if p.strip()]
    lengths = [len(tokenizer(p + "\n\n", add_special_tokens=False)["input_ids"]) for p in paragraphs]
    keep = np.cumsum(lengths) <= max_tokens
    text = "\n\n".join(p for p, k in zip(paragraphs, keep) if k)
    return text, len(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclasses.dataclass
class TurnResult:
    cp: int
    turn: int
    prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    ttft_s: float
    ttit_s: list[float]
    prefill: str            # the strategies of this turn's prefill steps, e.g. "pass-kv (full-prefill)"
    decode: str
    kv_tokens_per_rank: list[int]   # every cached token on each rank after this turn (all sequences)
    top_gaps: list[float] | None = None  # log p(best) - log p(second best) per output token (16-bit runs)
    placement: str = "-"            # where this turn's new tokens went, e.g. "spread" or "local"
    why: str = ""                   # the placement's prediction, when the cost model decided


def _strategy(steps: list[dict], phase: str) -> str:
    names = sorted({f"{s['strategy']} ({s['method']})" for s in steps if s["phase"] == phase})
    return ", ".join(names) or "-"


def _answer_text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def run_conversation(llm, cp: int, document: str, questions=QUESTIONS, max_tokens: int = 48,
                     top_gaps: bool = False) -> list[TurnResult]:
    """One chat turn per question on `llm` (greedy); turn k+1's prompt extends turn k's, so its KV is reused.
    top_gaps: also record each output token's margin over the second best (to recognise near ties)."""
    from cpinfer import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, top_logprobs=2 if top_gaps else 0)
    messages: list[dict] = []
    results = []
    for turn, question in enumerate(questions, 1):
        content = f"Read this document.\n\n{document}\n\nQuestion: {question}" if turn == 1 else question
        messages.append({"role": "user", "content": content})
        print(f"[CP={cp}] turn {turn}: {question}", flush=True)
        out = llm.chat(messages, params)[0]
        m = out.metrics
        text = _answer_text(llm.tokenizer, out.token_ids)
        messages.append({"role": "assistant", "content": text})
        first = m["steps"][0]
        results.append(TurnResult(cp, turn, len(out.prompt_token_ids), out.num_cached_tokens, list(out.token_ids),
                                  list(out.logprobs), text, m["ttft_s"], list(m["ttit_s"]),
                                  _strategy(m["steps"], "prefill"), _strategy(m["steps"], "decode"),
                                  list(llm.cache_stats()["kv_tokens_per_rank"]),
                                  [_gap(t) for t in out.top_logprobs] if top_gaps else None, first["placement"],
                                  _why(first, len(out.prompt_token_ids) - out.num_cached_tokens, max_tokens)))
    return results


def _gap(top: dict) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def _why(step: dict, new_tokens: int, max_tokens: int) -> str:
    """The placement's reason in words: the predicted time to finish the turn on one rank vs spread."""
    d = step.get("placement_inputs", {})
    if "local_s" not in d:
        reasons = {"forced": "forced by --placement", "capacity": "no single rank had room"}
        return reasons.get(d.get("method"), "its keys already span ranks")
    return (f"{new_tokens} new tokens + up to {max_tokens} decode steps: predicted {d['local_s']:.2f} s on one rank "
            f"vs {d['spread_s']:.2f} s spread over the ranks")


def placement_rule(placer, max_tokens: int) -> str:
    """When this engine spreads a new prompt over its ranks, in words, from its own cost model."""
    if placer.mode != "auto":
        return f"placement {placer.mode}: every request {'spreads' if placer.mode == 'shard' else 'stays on one rank'}"
    t = placer.crossover(max_tokens)
    if t is None:
        return "placement auto: every new prompt stays on one rank (spreading never pays on this hardware profile)"
    return (f"placement auto: with up to {max_tokens} answer tokens, a new prompt of {t} tokens or more spreads over "
            f"the ranks; a shorter one stays whole on the least-loaded rank (no ring, no collective)")


def run_engine_demo(cp: int = 2, model=None, doc_tokens: int = 3000, max_tokens: int = 48,
                    document_paths: list[Path] | None = None, threads_per_rank: int | None = None,
                    placement: str = "auto", **hardware) -> tuple[list[TurnResult], int]:
    """The conversation at CP=1 and, if cp > 1, at CP=cp, each on a fresh `LLM` (by default with the same cores:
    cores / N threads per rank). `hardware`: device, dtype, attention_backend, share_gpus, enforce_eager,
    kv_cache_dtype (`LLM` arguments).
    Returns (turns of CP=1 then of CP=cp, document tokens)."""
    from transformers import AutoTokenizer

    from cpinfer import LLM
    from cpinfer.model.resolve import resolve_model

    model_dir = resolve_model(model)
    document, n_doc = build_document(AutoTokenizer.from_pretrained(str(model_dir)), doc_tokens, document_paths)
    print(f"document: {n_doc} tokens of the project's README and docs", flush=True)
    results = []
    for n in sorted({1, cp}):
        t0 = time.perf_counter()
        threads = threads_per_rank or max(1, _cores() // n)
        with LLM(str(model_dir), context_parallel_size=n, threads_per_rank=threads, placement=placement,
                 max_kv_tokens_per_rank=_capacity(n_doc, max_tokens), **hardware) as llm:
            a = llm.engine.args
            print(f"[CP={n}] {n} rank(s) on {a.device} ({a.dtype}, {llm.engine.attention_backend} attention), "
                  f"{threads} thread(s) each, started in {time.perf_counter() - t0:.1f} s", flush=True)
            if n > 1:
                print(f"[CP={n}] {placement_rule(llm.engine.kv.placer, max_tokens)}", flush=True)
            results += run_conversation(llm, n, document, max_tokens=max_tokens, top_gaps=a.dtype != "float32")
    return results, n_doc


def _capacity(doc_tokens: int, max_tokens: int) -> int:
    """KV tokens per rank: the whole conversation fits on one rank, with room for the template and questions."""
    return (doc_tokens + 2 * max_tokens + 512 + 255) // 256 * 256


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compare_turns(results: list[TurnResult], tol: float = LOGPROB_TOL) -> tuple[bool, list[str]]:
    """CP=N turns against the CP=1 turns: identical tokens and log-probabilities within `tol`. Where CP=1 recorded
    its top-2 margins (16-bit runs), tokens may part where that margin was below `tol` (a near tie that rounding
    can flip); the log-probabilities are then compared up to that token."""
    base = {r.turn: r for r in results if r.cp == 1}
    lines, ok = [], True
    for r in results:
        if r.cp == 1:
            continue
        ref = base[r.turn]
        same = r.token_ids == ref.token_ids
        n = min(len(r.logprobs), len(ref.logprobs))
        part = next((i for i, (a, b) in enumerate(zip(r.token_ids, ref.token_ids)) if a != b), None)
        tie = part is not None and ref.top_gaps is not None and part < len(ref.top_gaps) and ref.top_gaps[part] < tol
        if tie:
            n = part
        err = max((abs(a - b) for a, b in zip(r.logprobs[:n], ref.logprobs[:n])), default=0.0)
        good = (same or tie) and err <= tol
        ok &= good
        what = ("tokens identical" if same else
                f"tokens part at output token {part} after a near tie (CP=1 margin {ref.top_gaps[part]:.3f})" if tie
                else f"tokens DIFFER (CP=1 {ref.token_ids} vs CP={r.cp} {r.token_ids})")
        lines.append(f"{'PASS' if good else 'FAIL'}: turn {r.turn}, CP={r.cp} vs CP=1: {what}, "
                     f"max |logprob diff| = {err:.1e} (tolerance {tol:.0e})")
    return ok, lines


def format_turns(results: list[TurnResult]) -> str:
    header = ["CP", "turn", "prompt", "cached", "prefill strategy", "decode strategy", "placement", "TTFT (s)",
              "TTIT mean (ms)", "output", "KV tokens / rank"]
    rows = []
    for r in results:
        ttit = 1000 * sum(r.ttit_s) / len(r.ttit_s) if r.ttit_s else float("nan")
        rows.append([r.cp, r.turn, r.prompt_tokens, r.num_cached_tokens, r.prefill, r.decode, r.placement,
                     f"{r.ttft_s:.3f}", f"{ttit:.1f}", len(r.token_ids), r.kv_tokens_per_rank])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, row)) for row in [header, *rows])


def format_placements(results: list[TurnResult]) -> str:
    """Why each CP=N turn's new tokens stayed on one rank or spread over the ranks."""
    lines = [f"[CP={r.cp}] turn {r.turn}: {'spread over the ranks' if r.placement == 'spread' else 'one rank'} — "
             f"{r.why}" for r in results if r.cp > 1]
    if lines:
        lines.append("cpinfer keeps a request on one rank (no ring, no collective) unless the compute spreading "
                     "saves beats the ring's cost (per-layer message latency on every later forward); "
                     "--placement shard|local forces either.")
    return "\n".join(lines)


def format_answers(results: list[TurnResult]) -> str:
    return "\n".join(f"[CP={r.cp}] answer {r.turn}: {r.text}" for r in results)


# ---------------------------------------------------------------- stage 2: CP attention vs one device

# Two turns of a 3-sequence conversation batch: (new tokens, cached tokens) per sequence.
DEFAULT_TURNS = (("full prefill", (1800, 1000, 300), (0, 0, 0)),
                 ("partial prefill", (200, 57, 1), (1800, 1000, 300)))


@dataclasses.dataclass(frozen=True)
class DemoRow:
    case: str
    strategy: str
    max_abs_err: float
    ok: bool


def _reference(q, k, v, new_lens, cached_lens) -> torch.Tensor:
    """Single-device attention over the global tensors: q [sum T, H, D], k/v [sum (P+T), Hkv, D] → [sum T, H, D]."""
    q_seq = np.repeat(np.arange(len(new_lens)), new_lens)
    q_pos = np.concatenate([np.arange(p, p + t) for t, p in zip(new_lens, cached_lens)])
    kv_seq = np.repeat(np.arange(len(new_lens)), [t + p for t, p in zip(new_lens, cached_lens)])
    kv_pos = np.concatenate([np.arange(p + t) for t, p in zip(new_lens, cached_lens)])
    out, _ = local_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos)
    return out


def run_attention_demo(num_ranks: int = 2, turns=DEFAULT_TURNS, heads: int = 8, kv_heads: int = 2,
                       head_dim: int = 64, tol: float = 1e-4, seed: int = 0,
                       pool: WorkerPool | None = None) -> list[DemoRow]:
    """Run every turn with every strategy on `num_ranks` ranks (a pool of that size is spawned unless given)
    and compare with the single-device result. Returns one row per (turn, strategy); fp32 throughout."""
    gen = torch.Generator().manual_seed(seed)
    own_pool = pool is None
    pool = WorkerPool(num_ranks, threads_per_rank=1) if own_pool else pool
    rows = []
    try:
        for case, new_lens, cached_lens in turns:
            total = sum(new_lens) + sum(cached_lens)
            q = torch.randn(sum(new_lens), heads, head_dim, generator=gen)  # [sum T, H, D]
            k = torch.randn(total, kv_heads, head_dim, generator=gen)  # [sum (P+T), Hkv, D]
            v = torch.randn(total, kv_heads, head_dim, generator=gen)
            ref = _reference(q, k, v, new_lens, cached_lens)
            layouts = prefill_layout(new_lens, cached_lens, pool.world_size)
            for strategy in STRATEGIES:
                outs = pool.run(rank_attention_output, layouts, q, k, v, strategy)
                full = torch.full_like(ref, float("nan"))
                for lay, out in zip(layouts, outs):
                    real = lay.q_index >= 0
                    full[torch.from_numpy(lay.q_index[real])] = out[torch.from_numpy(real)].float()
                err = float((full - ref).abs().max())  # nan (a token nobody computed) fails the check below
                rows.append(DemoRow(f"{case} {sum(new_lens)}+{sum(cached_lens)}", strategy, err, err <= tol))
    finally:
        if own_pool:
            pool.close()
    return rows


def format_rows(rows: list[DemoRow], num_ranks: int) -> str:
    lines = [f"{'case (new+cached tokens)':<28} {'strategy':<11} {'max abs err vs CP1':>18}  result"]
    for r in rows:
        lines.append(f"{r.case:<28} {r.strategy:<11} {r.max_abs_err:>18.2e}  {'PASS' if r.ok else 'FAIL'}")
    verdict = "all match" if all(r.ok for r in rows) else "MISMATCH"
    lines.append(f"CP{num_ranks} vs single device: {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command

def run(args) -> int:
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    for path in args.document or ():
        if not path.is_file():
            raise ValueError(f"--document {path}: no such file")
    from cpinfer.model.resolve import DEFAULT_MODEL_NAME

    name = args.model or f"{DEFAULT_MODEL_NAME} (embedded default)"
    device = resolve_device(args.device)  # CUDA asked for and missing: exit 2 now, before any rank
    dtype = resolve_dtype(args.dtype, device)
    print(f"Stage 1: a two-turn chat about a long document with {name}, CP=1 vs CP={args.cp}, {device}, {dtype}, "
          f"greedy, up to {args.max_tokens} tokens per answer", flush=True)
    t0 = time.perf_counter()
    results, _ = run_engine_demo(args.cp, args.model, args.doc_tokens, args.max_tokens, args.document,
                                 args.threads_per_rank, args.placement, device=device, dtype=dtype,
                                 attention_backend=args.attention_backend, share_gpus=args.share_gpus,
                                 enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype)
    print(format_answers(results))
    print(format_turns(results))
    print(format_placements(results))
    ok, lines = compare_turns(results, LOGPROB_TOL if dtype == "float32" else LOGPROB_TOL_16BIT)
    print("\n".join(lines) if lines else "(CP=1 only: nothing to compare)")
    print(f"stage 1: {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.skip_attention:
        print(f"\nStage 2: context-parallel attention, CP{args.cp} vs one device: 3 sequences, H={args.heads}, "
              f"Hkv={args.kv_heads}, D={args.head_dim}, fp32", flush=True)
        rows = run_attention_demo(args.cp, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
        print(format_rows(rows, args.cp))
        ok &= all(r.ok for r in rows)
    print("demo: PASS" if ok else "demo: FAIL (CP results differ from the single-rank results)",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="a real two-turn chat about the project's docs at CP=1 vs CP=N, "
                                   "then CP attention vs one device (PASS/FAIL)", description=__doc__)
    parser.add_argument("--cp", type=positive_int, default=2, help="number of CP ranks (default: 2)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="Hugging Face folder or .gguf file of a chat model of a supported family "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--doc-tokens", type=positive_int, default=3000,
                        help="document length in tokens at most (whole paragraphs; default: 3000)")
    parser.add_argument("--document", type=Path, action="append", metavar="FILE",
                        help="text file(s) to read instead of the project's README and docs (repeatable)")
    parser.add_argument("--max-tokens", type=positive_int, default=48,
                        help="greedy output tokens per answer at most (default: 48)")
    parser.add_argument("--threads-per-rank", type=positive_int, default=None,
                        help="torch threads per rank (default: cores / N, the same cores for every CP size)")
    parser.add_argument("--placement", choices=["auto", "shard", "local"], default="auto",
                        help="CP=N: auto = spread a turn over the ranks only when it pays (default), shard = "
                             "always, local = never")
    parser.add_argument("--skip-attention", action="store_true", help="skip stage 2 (CP attention vs one device)")
    parser.add_argument("--heads", type=positive_int, default=8, help="stage 2: query heads (default: 8)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="stage 2: key/value heads (default: 2)")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="stage 2: head dimension (default: 64)")
    add_device_arguments(parser, dtype_default="float32", dtype_help=(
        "stage 1's weights, activations and KV cache (default: %(default)s, whose results CP=N must reproduce to "
        f"{LOGPROB_TOL:g}; auto = bfloat16 on CUDA, float32 on CPU; 16-bit types are compared within "
        f"{LOGPROB_TOL_16BIT:g} and may part only after a near tie)"), memory=False)
    parser.set_defaults(func=run)
