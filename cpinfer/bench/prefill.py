"""End-to-end prefill TTFT of the engine, CP-N vs CP-1 with one thread per rank (`cpinfer bench prefill`).

Each CP size serves one full prefill (TTFT) of a random Llama-3-shaped model on a fresh `LLM`; parallel
efficiency is T_1 / (N * T_N) (paper §5, Fig. 7). A side row times Hugging Face `LlamaForCausalLM` (sdpa, fp32,
no_grad, last-token logits only) on the same checkpoint with one thread, against cpinfer CP1.

`--family qwen3_5`: a random Qwen3.5-shaped hybrid instead (three Gated DeltaNet layers to one gated attention
layer, at the depth given), with the recurrent layers' summary exchange timed on every rank
(`engine/recurrent.ExchangeTimer`: the all-reduces themselves, and apart from them the wait for the slowest rank)
and, per CP size > 1, one layer's exchange as the engine does it (an all-reduce of every shard's map) against an
all-gather of the same maps and a relay of one state along the ranks, timed on the same process group.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from cpinfer.bench import common as C


def time_engine(model_dir, cp: int, tokens: int, vocab: int, repeat: int, hw: dict | None = None,
                hybrid: bool = False) -> dict:
    """Median TTFT of `repeat` full prefills (each a new prompt, so no prefix is reused) after a short warm-up.
    `hybrid`: the recurrent exchanges are timed on every rank during the timed prefills (`exchange`: per rank,
    seconds per prefill) and, with CP > 1, compared with the alternatives (`exchange_probe`)."""
    from cpinfer import LLM, SamplingParams

    # max_tokens=2: TTFT is taken at the end of the prefill either way, and a request that has decoded once is
    # released to the prefix cache on every engine version (ones ending inside their prefill were not, before 336da01).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    capacity = C.kv_capacity(2 * (tokens // cp + 1) + 1024)
    extra_kw = {}
    if hybrid:  # one request at a time: few state slots, whose bytes come out of the KV capacity (added back here)
        extra_kw = {"max_num_seqs": HYBRID_SEQS}
        capacity = C.kv_capacity(capacity + state_tokens(model_dir, HYBRID_SEQS, (hw or {}).get("dtype", "float32")))
    with LLM(str(model_dir), context_parallel_size=cp, threads_per_rank=1, placement="shard",  # the ring's scaling
             max_kv_tokens_per_rank=capacity, **extra_kw, **(hw or {})) as llm:
        llm.generate(C.random_prompt(min(tokens, 512), vocab, seed=999), params, use_tqdm=False)  # warm-up
        if hybrid:
            llm.engine._pool.run(exchange_timer, True)
        ttft, steps = [], None
        for i in range(repeat):
            out = llm.generate(C.random_prompt(tokens, vocab, seed=i), params, use_tqdm=False)[0]
            ttft.append(out.metrics["ttft_s"])
            steps = out.metrics["steps"]
        extra = {}
        if hybrid:  # (the decode step's exchanges are in too: rows of one token, next to nothing)
            timers = llm.engine._pool.run(exchange_timer, False)
            extra["exchange"] = [{k: v / repeat for k, v in t.items()} for t in timers]
            if cp > 1:
                extra["exchange_probe"] = llm.engine._pool.run(exchange_probe, 2 * cp - 1)[0]
    return {"ttft_s": statistics.median(ttft), "runs_s": ttft, "strategy": steps[0]["strategy"],
            **({"mla_form": steps[0]["mla"]["form"]} if "mla" in steps[0] else {}), **extra}


HYBRID_SEQS = 2  # max_num_seqs of a hybrid's engine here (its state cache: 2 x this + 64 slots)


def state_tokens(model_dir, max_num_seqs: int, dtype: str) -> int:
    """KV tokens per rank a hybrid's state cache is worth (what the engine takes out of max_kv_tokens_per_rank)."""
    import torch

    from cpinfer.engine import hybrid
    from cpinfer.engine.kv.store import KVStore, KVWidths
    from cpinfer.model.config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    elem = torch.finfo(getattr(torch, dtype)).bits // 8
    token = KVStore.bytes_per_token(config.num_kv_layers, config.cached_kv_heads, KVWidths.of(config), elem, "auto")
    return -(-hybrid.state_bytes(config, elem, max_num_seqs) // token)


def exchange_timer(ctx, on: bool) -> dict:
    """On a rank: switch the recurrent exchanges' timer on (a fresh one) or off; what the previous one counted."""
    from cpinfer.engine import recurrent

    old = recurrent.EXCHANGE_TIMER
    recurrent.EXCHANGE_TIMER = recurrent.ExchangeTimer() if on else None
    return {} if old is None else old.to_dict()


def exchange_probe(ctx, shards: int, repeat: int = 20) -> dict:
    """On every rank of the CP group, one recurrent layer's summary exchange three ways (median seconds of
    `repeat`): the engine's all-reduce of `shards` maps (zeros but this rank's; a sequence's first two shards' as
    their end states alone, as the engine ships them), an all-gather of each rank's share of the maps, and a relay
    of one state (rank r receives from r - 1, composes, sends to r + 1: N - 1 hops in a row).
    Sizes from the model's first recurrent layer; rank 0's answer is the one reported."""
    import torch
    import torch.distributed as dist

    runner = ctx.state["runner"]
    group, n, rank = runner.groups.cp_group, runner.groups.config.cp, runner.groups.cp_rank
    mixer = next(layer.linear_attn for layer in runner.model.model.layers if getattr(layer, "recurrent", False))
    h, dk, dv = mixer.state_shape
    per_map = h * dk * (dk + dv)
    maps = torch.zeros(min(shards, 2) * h * dk * dv + max(shards - 2, 0) * per_map)
    share = torch.zeros(-(-shards // n), per_map)
    gathered = torch.zeros(n * share.shape[0], per_map)
    state = torch.zeros(h, dk, dv)
    ranks = dist.get_process_group_ranks(group)

    def relay():
        if rank > 0:
            dist.recv(state, src=ranks[rank - 1], group=group)
        if rank < n - 1:
            dist.send(state, dst=ranks[rank + 1], group=group)

    ways = {"all_reduce": lambda: dist.all_reduce(maps, group=group),
            "all_gather": lambda: dist.all_gather_single(gathered, share, group=group), "relay": relay}
    out = {"bytes": {"all_reduce": maps.numel() * 4, "all_gather": gathered.numel() * 4, "relay": state.numel() * 4}}
    for name, fn in ways.items():
        times = []
        for _ in range(repeat):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name + "_s"] = statistics.median(times)
    return out


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


def hybrid_config(args, cfg: dict) -> dict:
    """A Qwen3.5-shaped (`qwen3_5_text`) config of the benchmark's shape: every fourth layer gated attention, the
    others Gated DeltaNet with --linear-key-heads / --linear-value-heads heads of --linear-head-dim."""
    if args.linear_value_heads % args.linear_key_heads:
        raise ValueError(f"--linear-value-heads ({args.linear_value_heads}) must be a multiple of "
                         f"--linear-key-heads ({args.linear_key_heads})")
    layers = cfg["num_hidden_layers"]
    return {**cfg, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            "linear_num_key_heads": args.linear_key_heads, "linear_num_value_heads": args.linear_value_heads,
            "linear_key_head_dim": args.linear_head_dim, "linear_value_head_dim": args.linear_head_dim,
            "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "rope_theta": 10_000_000.0}


def measure(args) -> dict:
    cfg = C.model_config(args, args.tokens + 1024)
    hybrid = args.family == "qwen3_5"
    if hybrid:
        cfg = hybrid_config(args, cfg)
    model_dir = C.random_model("bench-hybrid" if hybrid else "bench-model", **cfg)
    hw = C.hardware(args)
    engine = {str(n): time_engine(model_dir, n, args.tokens, args.vocab, args.repeat, hw, hybrid) for n in args.cp}
    base = min(args.cp)
    t_base = engine[str(base)]["ttft_s"]
    model = C.shape_text(cfg, hw)
    if hybrid:
        linear = sum(t == "linear_attention" for t in cfg["layer_types"])
        model = (f"Qwen3.5-shaped: {linear} Gated DeltaNet ({args.linear_key_heads} key / {args.linear_value_heads} "
                 f"value heads x {args.linear_head_dim}) + {cfg['num_hidden_layers'] - linear} gated attention "
                 f"layers; " + model)
    res = {"bench": "prefill", "command": command_line(args, hw), "tokens": args.tokens, "model": model,
           "repeat": args.repeat, "baseline_cp": base, "engine": engine, "family": args.family,
           "efficiency": {n: base * t_base / (int(n) * e["ttft_s"]) for n, e in engine.items()}}
    if not args.no_hf and not hybrid:
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
    exchanges = {n: e for n, e in res["engine"].items() if int(n) > 1 and "exchange" in e}
    if exchanges:
        out += ["", "Recurrent summary exchange per prefill (all-reduces of the maps and conv halos, and the states "
                    "relayed to this rank, per rank; the wait for the slowest rank timed apart, before each "
                    "all-reduce, and the wait for each relayed state):", ""]
        rows = []
        for n, e in exchanges.items():
            for r, x in enumerate(e["exchange"]):
                rows.append([n, r, f"{x['calls']:.0f}", f"{x.get('relays', 0):.0f}", f"{x['bytes'] / 1e6:.2f}",
                             f"{x['exchange_s']:.3f}", f"{x['exchange_s'] / e['ttft_s']:.1%}", f"{x['wait_s']:.3f}",
                             f"{x['wait_s'] / e['ttft_s']:.1%}"])
        out.append(C.fmt_table(["CP", "rank", "all-reduces", "relays in", "MB", "exchange (s)", "of TTFT",
                                "wait (s)", "of TTFT"], rows))
        out += ["", "One layer's map exchange three ways on the same ranks (median of 20):", ""]
        rows = [[n, way.replace("_", "-"), f"{p['bytes'][way] / 1e6:.3f}", f"{p[way + '_s'] * 1e3:.2f}"]
                for n, e in exchanges.items() for p in [e["exchange_probe"]] for way in p["bytes"]]
        out.append(C.fmt_table(["CP", "exchange", "MB", "ms"], rows))
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
    if args.family != "llama":
        cmd += f" --family {args.family}"
        shape += (("linear_key_heads", 2), ("linear_value_heads", 4), ("linear_head_dim", 64))
    for name, default in shape:
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd + (" --no-hf" if args.no_hf else "") + C.hardware_flags(hw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--tokens", type=C.positive_int, default=16384, help="prompt length (default: 16384)")
    parser.add_argument("--repeat", type=C.positive_int, default=1, help="timed prefills after a warm-up (default: 1)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers row (a hybrid "
                                                             "has none)")
    parser.add_argument("--family", choices=("llama", "qwen3_5"), default="llama",
                        help="the random model: Llama-3-shaped (default), or qwen3_5: a Qwen3.5-shaped hybrid, 3 "
                             "Gated DeltaNet layers to 1 gated attention layer, with its recurrent summary "
                             "exchange timed")
    parser.add_argument("--linear-key-heads", type=C.positive_int, default=2,
                        help="qwen3_5: Gated DeltaNet key heads (default: 2)")
    parser.add_argument("--linear-value-heads", type=C.positive_int, default=4,
                        help="qwen3_5: Gated DeltaNet value heads, a multiple of the key heads (default: 4)")
    parser.add_argument("--linear-head-dim", type=C.positive_int, default=64,
                        help="qwen3_5: Gated DeltaNet key and value head size (default: 64)")
    C.add_model_arguments(parser, hidden=1024, layers=2, heads=8, kv_heads=2, ffn=2816, vocab=4096)
    C.add_common_arguments(parser)


def run(args) -> int:
    hybrid = "" if args.family == "llama" else f"-{args.family}"
    return C.run_measured(args, measure, format_report, f"prefill{hybrid}-{args.tokens}",
                          lambda res: f"Engine prefill{' of a ' + args.family + ' hybrid' if hybrid else ''}, "
                                      f"{args.tokens} tokens, CP {', '.join(res['engine'])}")
