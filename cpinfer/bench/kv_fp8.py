"""FP8 KV cache against the full-precision one on a real model (`cpinfer bench kv-fp8`): error, capacity, time.

On the embedded SmolLM2 (or `--model`): a document of the project's docs as the prompt, greedy answer, at CP 1 with
`kv_cache_dtype` auto, fp8 (static scales) and fp8_per_token — the max |Δ log-prob| teacher-forced over the prompt and
the full-precision answer, and the greedy tokens' agreement; prefill time and decode step time of each (and at
`--cp`); bytes per token, KV tokens per GiB and bytes per pass-KV ring step per token, and the capacity engines report
in `cache_stats()` on the same memory; and a pass key hidden in the middle of a haystack of each `--passkey-tokens`
length, asked for at CP `--cp` with the full-precision cache and each FP8 format (whether FP8 still finds what full
precision finds). Then CP N against CP 1 with each cache on a long seeded random prompt and the document (prompt
log-probs): FP8 rounds K/V that differ by fp32 noise across CP sizes into whole e4m3 steps, so CP N is not bitwise
CP 1 — the report puts its |Δ| beside each format's own error against full precision (`cp_agreement`).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from cpinfer.bench import common as C

_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def _engine(model_dir, cp: int, kvd: str, capacity: int, hw: dict):
    from cpinfer import LLM

    kw = {k: v for k, v in hw.items() if k != "kv_cache_dtype"}
    return LLM(str(model_dir), context_parallel_size=cp, kv_cache_dtype=kvd, placement="shard",
               max_kv_tokens_per_rank=C.kv_capacity(capacity), max_num_batched_tokens=2048, **kw)


FP8_MODES = ("fp8", "fp8_per_token")


def accuracy_and_time(model_dir, prompt: list[int], cps: list[int], max_tokens: int, hw: dict) -> dict:
    """Greedy answers of the full-precision cache and each FP8 format at each CP size, then each FP8 cache
    teacher-forced on the full-precision answer (prompt log-probs over prompt + answer)."""
    from cpinfer import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True)
    runs, forced = {}, {}
    for cp in cps:
        for kvd in ("auto",) + FP8_MODES:
            with _engine(model_dir, cp, kvd, len(prompt) // cp + 2 * max_tokens + 1024, hw) as llm:
                llm.generate([prompt[:64]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
                out = llm.generate([prompt], greedy, use_tqdm=False)[0]
                stats = llm.engine.cache_stats()
                if cp == cps[0]:
                    full = prompt + (runs[(cp, "auto")]["tokens"] if kvd != "auto" else out.token_ids)[:-1]
                    o = llm.generate([full], SamplingParams(max_tokens=1, prompt_logprobs=True, top_logprobs=1,
                                                            temperature=0.0), use_tqdm=False)[0]
                    top = [max(d, key=d.get) for d in o.prompt_top_logprobs[1:]]
                    forced[kvd] = (o.prompt_logprobs[1:], top)
            runs[(cp, kvd)] = {"tokens": out.token_ids, "prefill_s": out.metrics["ttft_s"],
                               "ttit_s": statistics.median(out.metrics["ttit_s"][1:]),
                               "bytes_per_token": stats["kv_bytes_per_token"],
                               "capacity_per_rank": stats["kv_capacity_per_rank"]}
    errors = {}
    for kvd in FP8_MODES:
        a, b = np.asarray(forced["auto"][0]), np.asarray(forced[kvd][0])
        delta = np.abs(a - b)
        answer = delta[len(prompt) - 1:]
        ta, tb = runs[(cps[0], "auto")]["tokens"], runs[(cps[0], kvd)]["tokens"]
        errors[kvd] = {
            "max_dlogprob": float(delta.max()), "mean_dlogprob": float(delta.mean()),
            "max_dlogprob_answer": float(answer.max()) if len(answer) else 0.0,
            "top1_agreement": float(np.mean(np.asarray(forced["auto"][1]) == np.asarray(forced[kvd][1]))),
            "greedy_agreement": float(np.mean([x == y for x, y in zip(ta, tb)])),
            "first_divergence": next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))}
    return {"errors": errors, "runs": {f"{cp}/{kvd}": r for (cp, kvd), r in runs.items()}}


def prompt_logprobs(llm, prompts: list[list[int]]) -> list[np.ndarray]:
    """Teacher-forced log-probs of each prompt's tokens 1.. (one request at a time: no batching effect)."""
    from cpinfer import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=True, temperature=0.0)
    return [np.asarray(llm.generate([p], params,
                                    use_tqdm=False)[0].prompt_logprobs[1:], dtype=np.float64) for p in prompts]


def _stats(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a - b)
    return {"mean": float(d.mean()), "max": float(d.max())}


def error_summary(lp: dict, cp: int, modes: tuple = FP8_MODES) -> dict:
    """`lp[(kvd, cp)]` = one prompt's log-probs → per FP8 format of `modes`: its error against full precision at CP 1
    ("vs_full") and CP `cp` against CP 1 with that cache ("cp_vs_cp1"); full precision's own CP N vs CP 1 beside
    them ("auto")."""
    out = {"auto": {"cp_vs_cp1": _stats(lp[("auto", cp)], lp[("auto", 1)])}}
    for kvd in modes:
        out[kvd] = {"vs_full": _stats(lp[(kvd, 1)], lp[("auto", 1)]),
                    "cp_vs_cp1": _stats(lp[(kvd, cp)], lp[(kvd, 1)])}
    return out


def cp_agreement(model_dir, prompts: dict[str, list[int]], cp: int, hw: dict, modes: tuple = FP8_MODES) -> dict:
    """Per named prompt, `error_summary` of the full-precision cache and the FP8 formats `modes` at CP 1 and CP `cp`
    (placement shard: every prompt spread over the CP ranks)."""
    lp = {}
    longest = max(len(p) for p in prompts.values())
    for kvd in ("auto",) + modes:
        for n in (1, cp):
            with _engine(model_dir, n, kvd, longest // n + 1024, hw) as llm:
                for name, got in zip(prompts, prompt_logprobs(llm, list(prompts.values()))):
                    lp[(name, kvd, n)] = got
    return {name: {"tokens": len(p), **error_summary({k[1:]: v for k, v in lp.items() if k[0] == name}, cp, modes)}
            for name, p in prompts.items()}


# a DeepSeek-V3-shaped attention (kv_lora_rank 512, rotary 64, nope 128, v 128) in a small random model
MLA_SHAPE = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=512,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                 vocab_size=1024, max_position_embeddings=4096, kv_lora_rank=512, qk_rope_head_dim=64,
                 qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=256, n_routed_experts=0, rope_theta=10000.0)


def mla_agreement(tokens: int, cp: int, hw: dict) -> dict:
    """`cp_agreement` of a seeded random prompt on the random MLA model (`MLA_SHAPE`), static-scale FP8 only (the
    per-token format is refused for MLA)."""
    model_dir = C.random_model("bench-kv-fp8-mla", **MLA_SHAPE)
    prompt = C.random_prompt(tokens, MLA_SHAPE["vocab_size"], seed=0)
    return {"cp": cp, "prompts": cp_agreement(model_dir, {f"random ({tokens} tokens, seed 0)": prompt}, cp, hw,
                                              ("fp8",))}


def passkey(model_dir, tokens: int, cp: int, hw: dict, kvd: str = "fp8") -> dict:
    """A 5-digit key in the middle of ~`tokens` tokens of filler; the chat asks for it; greedy 12 tokens."""
    from transformers import AutoTokenizer

    from cpinfer import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    key = str(random.Random(tokens).randint(10000, 99999))
    per = len(tok(_FILLER, add_special_tokens=False)["input_ids"])
    half = _FILLER * max(1, (tokens - 120) // (2 * per))
    text = (f"There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n{half}"
            f"The pass key is {key}. Remember it. {key} is the pass key.\n{half}\nWhat is the pass key?")
    chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    ids += tok("The pass key is", add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    with _engine(model_dir, cp, kvd, len(ids) // cp + 1024, hw) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    answer = tok.decode(out.token_ids)
    return {"tokens": len(ids), "cp": cp, "kv_cache_dtype": kvd, "key": key, "answer": answer,
            "found": key in answer, "seconds": time.perf_counter() - t0, "prefill_s": out.metrics["ttft_s"]}


def capacity_rows(model_dir) -> list[list]:
    """Per token: bytes (all layers, K and V), tokens per GiB, and bytes one token adds to a pass-KV message per
    layer — for fp32, bf16 and both FP8 formats."""
    from cpinfer.engine.kv import fp8 as kv_fp8
    from cpinfer.model import ModelConfig

    c = ModelConfig.from_pretrained(model_dir)
    rows = []
    for name, elem, kvd in (("float32", 4, "auto"), ("bfloat16", 2, "auto"), ("fp8 (e4m3, static scales)", 1, "fp8"),
                            ("fp8_per_token (e4m3 + fp32 scale a row)", 1, "fp8_per_token")):
        row = kv_fp8.row_bytes(c.head_dim, elem, kvd)
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * row
        rows.append([name, per_token, f"{(1 << 30) // per_token:,}", 2 * c.num_key_value_heads * row])
    for r in rows:
        r.append(f"{rows[1][1] / r[1]:.2f}")
    return rows


def capacity_from_memory(model_dir, tokens_fp32: int = 4096) -> list[list]:
    """What `cache_stats()` reports when the capacity comes from memory: one CP-1 engine per KV format on the same
    share of host RAM (`kv_memory_fraction`, enough for `tokens_fp32` fp32 tokens), nothing generated."""
    import os

    from cpinfer import LLM
    from cpinfer.engine.kv import fp8 as kv_fp8
    from cpinfer.model import ModelConfig

    c = ModelConfig.from_pretrained(model_dir)
    fp32_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * kv_fp8.row_bytes(c.head_dim, 4)
    fraction = tokens_fp32 * fp32_bytes / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    rows = []
    for dtype, kvd in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("float32", "fp8_per_token")):
        with LLM(str(model_dir), dtype=dtype, kv_cache_dtype=kvd, kv_memory_fraction=fraction,
                 threads_per_rank=1) as llm:
            st = llm.cache_stats()
        rows.append([f"{dtype} / {kvd}", st["kv_bytes_per_token"], f"{st['kv_capacity_per_rank']:,}",
                     st["kv_capacity_per_rank"]])
    bf16 = rows[1][3]
    for r in rows:
        r[3] = f"{r[3] / bf16:.2f}"
    return rows


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from cpinfer.commands.demo import build_document
    from cpinfer.model.resolve import resolve_model

    model_dir = resolve_model(args.model)
    hw = C.hardware(args)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text, _ = build_document(tok, args.doc_tokens)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    res = {"bench": "kv-fp8", "command": command_line(args) + C.hardware_flags(hw), "model": str(args.model or
           "SmolLM2-135M-Instruct (embedded)"), "doc_tokens": len(prompt), "capacity": capacity_rows(model_dir),
           "cache_stats": capacity_from_memory(model_dir)}
    res["accuracy"] = accuracy_and_time(model_dir, prompt, sorted({1, args.cp}), args.max_tokens, hw)
    if args.cp > 1:
        rng = np.random.default_rng(0)
        prompts = {f"random ({args.random_tokens} tokens, seed 0)": rng.integers(3, tok.vocab_size,
                                                                                args.random_tokens).tolist(),
                   f"document ({len(prompt)} tokens)": prompt}
        res["cp_agreement"] = {"cp": args.cp, "prompts": cp_agreement(model_dir, prompts, args.cp, hw)}
        if args.mla_tokens:
            res["cp_agreement_mla"] = mla_agreement(args.mla_tokens, args.cp, hw)
    res["passkey"] = [passkey(model_dir, n, args.cp, hw, kvd) for n in args.passkey_tokens
                      for kvd in ("auto",) + FP8_MODES]
    return res


def format_report(res: dict) -> str:
    acc, modes = res["accuracy"], list(res["accuracy"]["errors"])
    err = acc["errors"]

    def row(label, key, fmt):
        return [label] + [fmt.format(err[m][key]) for m in modes]

    out = [f"{res['model']}, a {res['doc_tokens']}-token document of the project's docs, greedy answer:", "",
           C.fmt_table(["FP8 KV vs full precision"] + modes, [
               row("max \\|Δ log-prob\\|, teacher-forced (prompt + answer)", "max_dlogprob", "{:.3f}"),
               row("mean \\|Δ log-prob\\|", "mean_dlogprob", "{:.4f}"),
               row("max \\|Δ log-prob\\| over the answer", "max_dlogprob_answer", "{:.3f}"),
               row("greedy (top-1) token agreement, teacher-forced", "top1_agreement", "{:.3f}"),
               row("free-running greedy tokens equal (position by position)", "greedy_agreement", "{:.3f}"),
               row("first differing free-running greedy token", "first_divergence", "{}")]), "",
           "KV cache per token and per pass-KV ring step (bytes; one token, every KV head):", "",
           C.fmt_table(["KV dtype", "bytes / token (all layers)", "tokens / GiB", "ring bytes / token / layer",
                        "tokens vs bf16"], res["capacity"]), "",
           "`cache_stats()` of CP-1 engines given the same share of host RAM (`kv_memory_fraction`), one per "
           "dtype / KV format:", "",
           C.fmt_table(["dtype / kv_cache_dtype", "kv_bytes_per_token", "kv_capacity_per_rank", "vs bf16"],
                       res["cache_stats"]), "",
           "Time on this machine (prefill = TTFT of the document; decode = median step), and the engine's own "
           "`cache_stats()`:", "",
           C.fmt_table(["CP / KV", "prefill (s)", "decode step (ms)", "bytes / token", "KV tokens / rank"],
                       [[k, f"{r['prefill_s']:.2f}", f"{1000 * r['ttit_s']:.1f}", r["bytes_per_token"],
                         f"{r['capacity_per_rank']:,}"] for k, r in acc["runs"].items()])]
    if res.get("cp_agreement"):
        out += ["", cp_agreement_report(res["cp_agreement"])]
    if res.get("cp_agreement_mla"):
        out += ["", "The same on multi-head latent attention: a random-weight model with DeepSeek-V3's attention "
                    "shape (kv_lora_rank 512, rotary 64, 8 heads of nope 128 / v 128, 4 layers, hidden 512), the "
                    "latent cache in `fp8` (static scales):", "", cp_agreement_report(res["cp_agreement_mla"])]
    if res.get("passkey"):
        out += ["", "A pass key in the middle of a haystack, asked for at CP "
                    f"{res['passkey'][0]['cp']} (greedy, 12 tokens):", "",
                C.fmt_table(["prompt tokens", "KV", "key", "found", "answer", "prefill (s)"],
                            [[p["tokens"], p["kv_cache_dtype"], p["key"], "yes" if p["found"] else "**no**",
                              repr(p["answer"]).replace("|", "\\|"), f"{p['prefill_s']:.0f}"]
                             for p in res["passkey"]])]
    return "\n".join(out)


def cp_agreement_report(agr: dict) -> str:
    """One row per prompt and KV cache: its error against full precision at CP 1, and CP N against CP 1."""
    n, rows = agr["cp"], []
    for name, r in agr["prompts"].items():
        for kvd in [k for k in r if k != "tokens"]:
            full, cp = r[kvd].get("vs_full"), r[kvd]["cp_vs_cp1"]
            rows.append([name, kvd] + ["-" if full is None else f"{full[s]:.3g}" for s in ("mean", "max")]
                        + [f"{cp[s]:.3g}" for s in ("mean", "max")])
    return "\n".join([f"CP {n} against CP 1 with the same cache, beside the cache's own error against full precision "
                      "(prompt log-probs, placement shard):", "",
                      C.fmt_table(["prompt", "KV", "vs full: mean \\|Δ\\|", "vs full: max \\|Δ\\|",
                                   f"CP {n} vs CP 1: mean \\|Δ\\|", f"CP {n} vs CP 1: max \\|Δ\\|"], rows)])


def command_line(args) -> str:
    cmd = (f"cpinfer bench kv-fp8 --cp {args.cp} --doc-tokens {args.doc_tokens} --max-tokens {args.max_tokens} "
           f"--random-tokens {args.random_tokens} --mla-tokens {args.mla_tokens} --passkey-tokens {','.join(map(str, args.passkey_tokens)) or 0}")
    return cmd + (f" --model {args.model}" if args.model else "")


def _lengths(text: str) -> list[int]:
    """"7000,8000" -> [7000, 8000]; "0" -> [] (no pass-key check)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"token counts must be >= 0, got {text!r}")
    return [v for v in values if v > 0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--cp", type=C.positive_int, default=2, help="CP size beside CP 1 (default: 2)")
    parser.add_argument("--doc-tokens", type=C.positive_int, default=2000, help="document tokens (default: 2000)")
    parser.add_argument("--max-tokens", type=C.positive_int, default=48, help="greedy answer tokens (default: 48)")
    parser.add_argument("--random-tokens", type=C.positive_int, default=1200,
                        help="length of the seeded random prompt of the CP N vs CP 1 comparison (default: 1200)")
    parser.add_argument("--mla-tokens", type=int, default=1200,
                        help="length of the random prompt of the CP N vs CP 1 comparison on a random MLA model "
                             "(0: skip; default: 1200)")
    parser.add_argument("--passkey-tokens", type=_lengths, default=[2000, 8000],
                        help="comma-separated haystack lengths of the pass-key check at --cp, each run with the "
                             "full-precision cache and both FP8 formats (0: skip; default: 2000,8000)")
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, "kv-fp8", "FP8 KV cache vs full precision (SmolLM2)")
