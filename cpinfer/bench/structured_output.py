"""Structured output cost (`cpinfer bench structured-output`): the token mask per output token with llguidance (the
engine's library) and, when installed, xgrammar, on the model's tokenizer; and decode time per token with and
without a JSON-schema constraint through the engine (the embedded SmolLM2-135M-Instruct by default).

The mask is computed on the driver and applied on the rank that samples (docs/serving.md); this reports what that
costs next to a decode step, side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from cpinfer.bench import common as C

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
DOCUMENT = {"title": "Context Parallelism for Scalable Million-Token Inference", "year": 2025,
            "tags": ["ring attention", "pass-KV", "pass-Q", "persistent KV cache", "load balancing"] * 3}


def _llguidance(tok, vocab: int, eos: list[int], ids: list[int], reps: int) -> dict:
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    per_token, compile_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            m.compute_bitmask()
            m.consume_token(t)
        per_token.append((time.perf_counter() - t0) / len(ids))
        assert not m.is_error(), m.get_error()
    return {"tokenizer_s": setup, "schema_s": min(compile_s), "per_token_s": min(per_token)}


def _xgrammar(tok, vocab: int, ids: list[int], reps: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), cache_enabled=False)
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per_token, compile_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        m = xgr.GrammarMatcher(compiled)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            assert m.accept_token(t)
        per_token.append((time.perf_counter() - t0) / len(ids))
    return {"tokenizer_s": setup, "schema_s": min(compile_s), "per_token_s": min(per_token)}


def _decode(model, cp: int, tokens: int, grammar: str | None) -> float:
    """Median time per output token (after the first) of one greedy request, with or without the grammar."""
    from cpinfer import LLM, SamplingParams

    with LLM(model, context_parallel_size=cp, max_model_len=1024) as llm:
        msgs = [{"role": "user", "content": "Describe the paper as JSON with title, year and tags."}]
        prompt = llm.encode_chat(msgs)
        llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                    grammar=grammar), use_tqdm=False)[0]
    return statistics.median(out.metrics["ttit_s"]), len(out.token_ids)


def measure(args) -> dict:
    from cpinfer.engine.startup import load_tokenizer
    from cpinfer.engine.structured import json_schema_grammar
    from cpinfer.model.config import ModelConfig
    from cpinfer.model.resolve import resolve_model

    path = str(resolve_model(args.model))
    tok, cfg = load_tokenizer(path), ModelConfig.from_pretrained(path)
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    libs = {"llguidance": _llguidance(tok, cfg.vocab_size, list(cfg.eos_token_ids), ids, args.reps)}
    xg = _xgrammar(tok, cfg.vocab_size, ids, args.reps)
    if xg is not None:
        libs["xgrammar"] = xg
    free, n_free = _decode(path, args.cp, args.tokens, None)
    constrained, n_con = _decode(path, args.cp, args.tokens, json_schema_grammar(SCHEMA))
    return {"bench": "structured-output", "command": command_line(args), "model": args.model or "embedded",
            "cp": args.cp, "doc_tokens": len(ids), "libraries": libs,
            "decode": {"free_s": free, "constrained_s": constrained, "free_tokens": n_free,
                       "constrained_tokens": n_con, "ratio": constrained / free}}


def format_report(res: dict) -> str:
    rows = [[name, f"{r['tokenizer_s']:.2f}", f"{1e3 * r['schema_s']:.1f}", f"{1e3 * r['per_token_s']:.3f}"]
            for name, r in res["libraries"].items()]
    d = res["decode"]
    lines = [f"Token mask + advance over a {res['doc_tokens']}-token JSON document ({res['model']} tokenizer, best "
             "of the repetitions):", "",
             C.fmt_table(["library", "tokenizer setup (s)", "schema setup (ms)", "per token (ms)"], rows), "",
             f"Decode at CP{res['cp']} ({res['model']} model, greedy): median time per token "
             f"{1e3 * d['free_s']:.1f} ms free ({d['free_tokens']} tokens) vs {1e3 * d['constrained_s']:.1f} ms "
             f"with the JSON schema ({d['constrained_tokens']} tokens): constrained / free = {d['ratio']:.3f}"]
    if "xgrammar" in res["libraries"]:
        lib = res["libraries"]
        lines.append(f"per-token mask, llguidance / xgrammar: "
                     f"{lib['llguidance']['per_token_s'] / lib['xgrammar']['per_token_s']:.1f}x")
    return "\n".join(lines)


def command_line(args) -> str:
    parts = ["cpinfer bench structured-output", f"--cp {args.cp}", f"--tokens {args.tokens}"]
    if args.model:
        parts.append(f"--model {args.model}")
    return " ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint with a tokenizer (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--cp", type=C.positive_int, default=1, help="context-parallel ranks for the decode part")
    parser.add_argument("--tokens", type=C.positive_int, default=48, help="output tokens per decode measurement")
    parser.add_argument("--reps", type=C.positive_int, default=5, help="repetitions of the mask measurement")
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "structured-output",
                          "Structured output: token-mask cost and constrained decode")
