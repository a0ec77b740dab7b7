"""End-to-end prefill TTFT of the engine, CP-N vs CP-1 with one thread per rank (`cpinfer bench prefill`).

Each CP size serves one full prefill (TTFT) of a random Llama-3-shaped model on a fresh `LLM`; parallel
efficiency is T_1 / (N * T_N) (paper §5, Fig. 7). A side row times Hugging Face `LlamaForCausalLM` (sdpa, fp32,
no_grad, last-token logits only) on the same checkpoint with one thread, against cpinfer CP1.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpinfer.bench import common as C


def time_engine(model_dir, cp: int, tokens: int, vocab: int, repeat: int, hw: dict | None = None) -> dict:
    """Median TTFT of `repeat` full prefills (each a new prompt, so no prefix is reused) after a short warm-up."""
    from cpinfer import LLM, SamplingParams

    # max_tokens=2: TTFT is taken at the end of the prefill either way, and a request that has decoded once is
    # released to the prefix cache on every engine version (ones ending inside their prefill were not, before 336da01).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=1, placement="shard",  # the ring's scaling
             max_kv_tokens_per_rank=C.kv_capacity(2 * (tokens // cp + 1) + 1024), **(hw or {})) as llm:
        llm.generate(C.random_prompt(min(tokens, 512), vocab, seed=999), params, use_tqdm=False)  # warm-up
        ttft, steps = [], None
        for i in range(repeat):
            out = llm.generate(C.random_prompt(tokens, vocab, seed=i), params, use_tqdm=False)[0]
            ttft.append(out.metrics["ttft_s"])
            steps = out.metrics["steps"]
    return {"ttft_s": statistics.median(ttft), "runs_s": ttft, "strategy": steps[0]["strategy"],
            **({"mla_form": steps[0]["mla"]["form"]} if "mla" in steps[0] else {})}


def time_hf(model_dir, tokens: int, vocab: int, repeat: int, hw: dict | None = None) -> dict:
    """Median forward time of transformers' LlamaForCausalLM (sdpa) with one thread, last-token logits, on the
    engine's device and dtype (`hw`; default CPU fp32)."""
    import transformers

    device, dtype = (hw or {}).get("device", "cpu"), getattr(torch, (hw or {}).get("dtype", "float32"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                              attn_implementation="sdpa").to(device).eval()
        times = []
        with torch.no_grad():
            model(torch.tensor([C.random_prompt(min(tokens, 512), vocab, seed=999)], device=device), logits_to_keep=1)
            for i in range(repeat):
                ids = torch.tensor([C.random_prompt(tokens, vocab, seed=i)], device=device)  # [1, tokens]
                sync()
                t0 = time.perf_counter()
                model(ids, logits_to_keep=1)
                sync()
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {"ttft_s": statistics.median(times), "runs_s": times}


def measure(args) -> dict:
    cfg = C.model_config(args, args.tokens + 1024)
    model_dir = C.random_model("bench-model", **cfg)
    hw = C.hardware(args)
    engine = {str(n): time_engine(model_dir, n, args.tokens, args.vocab, args.repeat, hw) for n in args.cp}
    base = min(args.cp)
    t_base = engine[str(base)]["ttft_s"]
    res = {"bench": "prefill", "command": command_line(args, hw), "tokens": args.tokens, "model": C.shape_text(cfg, hw),
           "repeat": args.repeat, "baseline_cp": base, "engine": engine,
           "efficiency": {n: base * t_base / (int(n) * e["ttft_s"]) for n, e in engine.items()}}
    if not args.no_hf:
        hf = time_hf(model_dir, args.tokens, args.vocab, args.repeat, hw)
        cp1 = engine["1"]["ttft_s"] if "1" in engine else time_engine(model_dir, 1, args.tokens, args.vocab,
                                                                      args.repeat, hw)["ttft_s"]
        res["hf"] = {**hf, "cpinfer_cp1_s": cp1, "speedup_vs_hf": hf["ttft_s"] / cp1}
    return res


def format_report(res: dict) -> str:
    out = [f"Full prefill of {res['tokens']} tokens, TTFT, {res['model']}; 1 thread per rank; "
           f"median of {res['repeat']}:", ""]
    b = res["baseline_cp"]
    eff = "efficiency T1/(N·T_N)" if b == 1 else f"efficiency {b}·T{b}/(N·T_N)"
    rows = [[n, e["strategy"], f"{e['ttft_s']:.2f}", f"{res['efficiency'][n]:.3f}"] for n, e in res["engine"].items()]
    out.append(C.fmt_table(["CP", "strategy", "TTFT (s)", eff], rows))
    if "hf" in res:
        hf = res["hf"]
        out += ["", "Single process, 1 thread: Hugging Face transformers vs cpinfer CP1 (same checkpoint):", ""]
        out.append(C.fmt_table(["engine", "TTFT (s)", "speed vs HF"],
                               [["transformers LlamaForCausalLM (sdpa)", f"{hf['ttft_s']:.2f}", "1.00"],
                                ["cpinfer CP1", f"{hf['cpinfer_cp1_s']:.2f}", f"{hf['speedup_vs_hf']:.2f}"]]))
    return "\n".join(out)


def command_line(args, hw: dict) -> str:
    cmd = f"cpinfer bench prefill --cp {','.join(map(str, args.cp))} --tokens {args.tokens} --repeat {args.repeat}"
    shape = (("hidden", 1024), ("layers", 2), ("heads", 8), ("kv_heads", 2), ("ffn", 2816), ("vocab", 4096))
    for name, default in shape:
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd + (" --no-hf" if args.no_hf else "") + C.hardware_flags(hw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--tokens", type=C.positive_int, default=16384, help="prompt length (default: 16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=1, help="timed prefills after a warm-up (default: 1)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers row")
    C.add_model_arguments(parser, hidden=1024, layers=2, heads=8, kv_heads=2, ffn=2816, vocab=4096)
    C.add_common_arguments(parser)


def run(args) -> int:
    return C.run_measured(args, measure, format_report, f"prefill-{args.tokens}",
                          lambda res: f"Engine prefill, {args.tokens} tokens, CP {', '.join(res['engine'])}")
