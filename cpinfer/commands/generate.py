"""`cpinfer generate`: one prompt through a model on N context-parallel ranks, local or over several nodes
(--nnodes; a thin layer over `LLM.generate` / `LLM.chat`). The model is a Hugging Face folder, a .gguf file
(converted once), a Hugging Face Hub id (downloaded once) or, by default, the embedded SmolLM2-135M-Instruct. The ranks run on the GPUs when CUDA is available (bfloat16), else on the CPU
(float32); see --device / --dtype. Prints the completion (text when the model has a tokenizer, token ids
otherwise), the time to first token, the time between tokens and the strategy chosen for each phase.
"""
from __future__ import annotations

import argparse
import json

from cpinfer import multinode
from cpinfer.bench.attention import positive_int
from cpinfer.commands.model_args import (HelpFormatter, add_model_arguments, add_pd_arguments,
                                         add_speculative_argument, engine_model_kwargs, resolve_args)
from cpinfer.device import add_arguments as add_device_arguments


def _token_ids(text: str) -> list[int]:
    """argparse type for --prompt-ids: comma-separated non-negative integers."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (e.g. 1,2,3), got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative token ids, got {text!r}")
    return ids


def _probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _summary(out, strategy_steps: list[dict]) -> dict:
    m = out.metrics
    first = strategy_steps[0] if strategy_steps else {}
    placement = {"placement": first.get("placement"), **first.get("placement_inputs", {})}
    by_phase: dict[str, list[str]] = {}
    for s in strategy_steps:
        name = f"{s['strategy']} ({s['method']})"
        by_phase.setdefault(s["phase"], [])
        if name not in by_phase[s["phase"]]:
            by_phase[s["phase"]].append(name)
    ttit = m["ttit_s"]
    return {"prompt_tokens": len(out.prompt_token_ids), "token_ids": out.token_ids, "text": out.text,
            "logprobs": out.logprobs, "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens,
            "ttft_s": m["ttft_s"], "ttit_s": ttit, "ttit_mean_s": sum(ttit) / len(ttit) if ttit else None,
            "strategy": {k: ", ".join(v) for k, v in by_phase.items()}, "placement": placement,
            "new_tokens_per_rank": first.get("new_tokens_per_rank"), "spec": m.get("spec"), "pd": m.get("pd")}


def _placement_line(p: dict, cp: int) -> str:
    """Where the request's KV went, and why (the prediction when the cost model decided)."""
    where = "spread over the CP ranks" if p.get("placement") == "spread" else \
        ("one rank" if cp > 1 else "one rank (CP=1)")
    if "local_s" in p:
        return (f"{where} (predicted {p['local_s']:.2f} s on one rank vs {p['spread_s']:.2f} s spread, "
                "prefill and decode)")
    return f"{where} ({p.get('method', 'decode')})" if p.get("method") else where


def run(args) -> int:
    from cpinfer import LLM, SamplingParams
    from cpinfer.device import check_arguments, engine_kwargs

    check_arguments(args)  # CUDA asked for and missing: exit 2 now, before the model or any rank
    kwargs = dict(context_parallel_size=args.cp, tensor_parallel_size=args.tp,
                  max_kv_tokens_per_rank=args.max_kv_tokens_per_rank, max_model_len=args.max_model_len,
                  strategy=args.strategy, placement=args.placement, hardware_profile=args.hardware_profile,
                  threads_per_rank=args.threads_per_rank, enable_prefix_caching=args.enable_prefix_caching,
                  speculative_config=args.speculative_config, **engine_kwargs(args))
    if args.pd_decode_cp is not None:  # prefill and decode on separate groups of ranks
        kwargs.update(pd_decode_cp=args.pd_decode_cp, pd_decode_groups=args.pd_decode_groups)
    node = multinode.spec_from_args(args, kwargs)  # bad multi-node flags fail before the model is read
    if args.prompt is None and args.prompt_ids is None and not args.headless:
        raise ValueError("give the prompt as --prompt TEXT or --prompt-ids IDS (only --headless nodes run without "
                         "one)")
    if args.chat and args.prompt is None and not args.headless:
        raise ValueError("--chat needs --prompt TEXT (the user message), not --prompt-ids")
    # a bad path, an unsupported GGUF or a Hub id missing offline fails here, before any rank starts
    model, tokenizer = resolve_args(args)
    kwargs.update(engine_model_kwargs(args, tokenizer))
    if node is not None and node.headless:  # this node's ranks only: the driver on node 0 runs the prompt
        return multinode.run_headless(node, str(model), kwargs)
    if args.hardware_profile is not None:
        from cpinfer.perf.hardware import load_hardware_profile

        load_hardware_profile(args.hardware_profile)  # a bad name fails here, before any rank starts
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k or 0, seed=args.seed, logprobs=True, ignore_eos=args.ignore_eos)
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    node_ranks = None if node is None else multinode.start_driver(node, str(model), kwargs)
    try:
        with LLM(str(model), **kwargs) as llm:
            if args.chat:
                out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
            else:
                out = llm.generate(prompt, params)[0]
            hw = {"device": llm.engine.args.device, "dtype": llm.engine.args.dtype,
                  "attention_backend": llm.engine.attention_backend}
    finally:
        if node_ranks is not None:  # this node's other ranks leave the ended world
            node_ranks.close()
    res = _summary(out, out.metrics["steps"])
    res.update(cp=args.cp, device=hw["device"], dtype=hw["dtype"], attention_backend=hw["attention_backend"])
    if res["text"] is not None:
        print(res["text"])
    else:
        print("token ids:", " ".join(map(str, res["token_ids"])))
    ttit = "n/a" if res["ttit_mean_s"] is None else f"{1000 * res['ttit_mean_s']:.1f} ms"
    print(f"prompt {res['prompt_tokens']} tokens, {len(res['token_ids'])} generated ({res['finish_reason']}); "
          f"CP={args.cp} on {res['device']} ({res['dtype']}, {res['attention_backend']} attention); "
          f"TTFT {res['ttft_s']:.3f} s; mean TTIT {ttit}")
    print("strategy: " + "; ".join(f"{k} → {v}" for k, v in res["strategy"].items()))
    print("placement: " + _placement_line(res["placement"], args.cp))
    if res["spec"]:  # speculative decoding
        sp = res["spec"]
        print(f"speculation: {sp['num_draft_tokens']} drafted in {sp['num_drafts']} verify steps, "
              f"{sp['num_accepted_tokens']} accepted ({100 * sp['acceptance_rate']:.0f}%, "
              f"{sp['mean_accepted_length']:.2f} per step)")
    if res["pd"]:  # prefill and decode groups
        pd = res["pd"]
        print(f"prefill/decode: prefill CP {args.cp} in {pd.get('prefill_s', 0.0):.3f} s; "
              f"{pd.get('transfer_tokens', 0)} tokens' K/V ({pd.get('transfer_bytes', 0) / (1 << 20):.2f} MiB) to "
              f"decode group {pd.get('decode_group', 0)} (CP {args.pd_decode_cp}) in "
              f"{1000 * pd.get('transfer_s', 0.0):.1f} ms")
    if args.json:
        print(json.dumps(res))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate from a checkpoint on N local CP ranks", description=__doc__,
        formatter_class=HelpFormatter, usage="%(prog)s [MODEL] (--prompt TEXT | --prompt-ids IDS) [options]")
    add_model_arguments(parser, "Hugging Face checkpoint folder of a supported family (docs/models.md: "
                                "config.json + *.safetensors, + tokenizer files to accept --prompt text), a .gguf "
                                "file (converted once into $CPINFER_CACHE) or a Hugging Face Hub id (org/name); "
                                "default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--cp", "--context-parallel-size", dest="cp", type=positive_int, default=1,
                        help="context-parallel ranks (local processes, one GPU each on CUDA)")
    parser.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tp", type=positive_int, default=1,
                        help="tensor-parallel ranks per CP rank")
    add_pd_arguments(parser)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse K/V across requests (only matters with several prompts)")
    prompt = parser.add_mutually_exclusive_group()  # one of them is required, except on --headless nodes
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer)")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="1,2,3", help="prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true",
                        help="send --prompt as a user message through the model's chat template")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens to generate at most")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest prompt + output in tokens (default: the model's max_position_embeddings; "
                             "a larger value is allowed, with a warning that quality is not guaranteed there)")
    parser.add_argument("--temperature", type=_non_negative, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens "
                        "(default: all)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    parser.add_argument("--strategy", choices=["auto", "pass-kv", "pass-q"], default="auto",
                        help="ring variant: auto = pass-KV for full prefill, the paper's heuristic (Alg. 5) for "
                             "partial prefill, pass-Q for decode; or force one for every phase")
    parser.add_argument("--placement", choices=["auto", "shard", "local"], default="auto",
                        help="where the request's KV goes: auto = one rank unless spreading over the CP ranks pays "
                             "(cost model), shard = 2N-sharded over all ranks, local = one rank")
    parser.add_argument("--max-kv-tokens-per-rank", type=positive_int, default=None,
                        help="KV-cache capacity of each rank in tokens (default: CUDA: what "
                             "--gpu-memory-utilization leaves after the weights and a profiling forward; CPU: a "
                             "share of RAM)")
    parser.add_argument("--hardware-profile", default=None, metavar="NAME",
                        help="hardware profile of the strategy and placement cost models (default: cpu-gloo on CPU)")
    parser.add_argument("--threads-per-rank", type=positive_int, default=None,
                        help="torch threads per rank (default: cores / CP)")
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON object on the last line")
    add_speculative_argument(parser)
    add_device_arguments(parser)
    multinode.add_arguments(parser)
    parser.set_defaults(func=run)
