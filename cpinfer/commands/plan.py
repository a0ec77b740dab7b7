"""`cpinfer plan`: predict TTFT (pass-KV and pass-Q), the heuristic's choice, TTIT and memory for a deployment."""
from __future__ import annotations

import argparse
import dataclasses
import json

from cpinfer.cp.heuristics import METHODS
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.implementations import IMPLEMENTATIONS
from cpinfer.perf.model_catalog import ALIASES, MODELS
from cpinfer.perf.models import DTYPE_BYTES, WEIGHT_FORMATS
from cpinfer.perf.planner import parse_token_count

EPILOG = """examples:
  # the paper's 1M prefill (77 s on CP16 x TP8 GTT), with the per-component breakdown and its parameters
  cpinfer plan --model llama3-405b --hardware h100-gtt --weights fp8-ffn --cp 16 --tp 8 \\
               --prompt-tokens 1m --explain
  # a persistent-KV turn: 6400 new tokens on 121600 cached, CP4 (pass-KV vs pass-Q tipping point, §4.2.4)
  cpinfer plan --model llama3-405b --hardware h100-gtt --weights fp8-ffn --cp 4 --tp 8 \\
               --prompt-tokens 6400 --cached-tokens 121600
  # smallest CP meeting a 10 s TTFT at 128K on 80 GB H100 SXM nodes, and the command that starts it
  cpinfer plan --model llama3-405b --hardware h100-sxm --weights fp8-ffn --tp 8 --prompt-tokens 128k \\
               --sweep --ttft-target 10
  # Gemma 3 27B at 128K on 4 H200 x TP2: its 52 sliding-window layers (1024 keys) cost little attention
  cpinfer plan --model gemma-3-27b --hardware h200 --cp 4 --tp 2 --prompt-tokens 131072
  # prefill 1M on CP16 x TP8, decode on a separate CP2 x TP8 group: KV transfer (bandwidth stated) and TTIT
  cpinfer plan --model llama3-405b --hardware h100-gtt --weights fp8-ffn --cp 16 --tp 8 --prompt-tokens 1m \
               --kv-cache-dtype fp8 --pd-decode-cp 2
  # n-gram speculative decoding, 4 drafted tokens accepted at 0.7 each, at the paper's CP4 decode at 128K
  cpinfer plan --model llama3-405b --hardware h100-gtt --weights fp8-ffn --cp 4 --tp 8 --prompt-tokens 128k \
               --spec-tokens 4 --spec-acceptance 0.7
  # your cluster: a profile measured by `cpinfer calibrate --out my.json`
  cpinfer plan --model path/to/config.json --hardware my.json --cp 2 --prompt-tokens 16384

Token counts take vLLM's suffixes: 128k = 128,000, 128K = 131,072, 1m = 1,000,000, 1M = 1,048,576.
Every plan ends with the exact command that starts it (one node: `cpinfer serve ...`; several: the torchrun line
each node runs). Numbers are predictions of the cost model in cpinfer/cp/cost_model.py and cpinfer/perf. Five h100-gtt parameters
are fitted to the paper's public statements; docs/planning.md lists them, the statements, and leave-one-out errors."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="predict TTFT / TTIT / memory of a CP x TP deployment",
        description="Predict one forward pass of context-parallel inference on CP x TP devices: TTFT for ring\n"
                    "pass-KV and pass-Q with a breakdown, the pass-KV/pass-Q heuristic's choice, decode TTIT and\n"
                    "memory per device. With --sweep, find the smallest CP size meeting --ttft-target.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = sorted(n for n in MODELS if n not in ALIASES)
    p.add_argument("--model", metavar="NAME_OR_PATH", required=True,
                   help=f"catalog model ({', '.join(names)}) or path to a Hugging Face config.json (Llama, "
                        "Mistral, Qwen2/2.5, Qwen3, Gemma 3 layouts; sliding-window layers are read from it; the "
                        "hybrids Qwen3-Next / Qwen3.5 / Kimi Linear: their linear_attention layers)")
    p.add_argument("--hardware", metavar="NAME_OR_PATH", required=True,
                   help=f"hardware profile ({', '.join(sorted(HARDWARE))}) or path to a JSON profile; h100-gtt / "
                        "h100-gti are the paper's 96 GB clusters, h100-sxm (80 GB), h200 (141 GB) and b200 (180 GB) "
                        "are NVIDIA datasheet figures")
    p.add_argument("--gpu-memory-gib", type=float, metavar="GIB",
                   help="device memory in GiB, instead of the profile's (e.g. 94 for an H100 NVL)")
    p.add_argument("--cp", type=int, metavar="N",
                   help="CP size N: ranks of the ring, one TP group each (required without --sweep)")
    p.add_argument("--tp", type=int, metavar="K", default=1,
                   help="TP size per CP rank, devices per TP group (default 1)")
    p.add_argument("--prompt-tokens", metavar="T", required=True,
                   help="T: new tokens per sequence to prefill (the prompt, or the new turn); 128k, 1m, 1M as vLLM")
    p.add_argument("--cached-tokens", metavar="P", default="0",
                   help="P: tokens per sequence already in the KV cache (partial prefill; default 0 = full prefill)")
    p.add_argument("--batch", type=int, metavar="B", default=1,
                   help="B: identical sequences in the batch (default 1)")
    p.add_argument("--weights", metavar="FORMAT", default="bf16",
                   help=f"weight format: {', '.join(WEIGHT_FORMATS)} (default bf16; fp8-ffn is the paper's "
                        "row-wise FP8 FFN)")
    p.add_argument("--act-dtype", metavar="DTYPE", default="bf16",
                   help=f"activation and Q/K/V message dtype: {', '.join(DTYPE_BYTES)} (default bf16)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", metavar="DTYPE", default="auto",
                   help=f"KV cache dtype: auto (= --act-dtype), {', '.join(DTYPE_BYTES)}, fp8_e4m3 or "
                        "fp8_per_token: cpinfer's FP8 KV caches (fp8 = fp8_e4m3: e4m3 with a static scale per layer "
                        "and KV head; fp8_per_token: + one fp32 scale per token and KV head): their bytes in memory, "
                        "in every pass-KV ring message and in the attention reads (default auto)")
    p.add_argument("--method", metavar="METHOD", default="alg5", choices=METHODS,
                   help="pass-KV/pass-Q heuristic: alg1 (Eq. 1-2), alg5 (App. C, with All2All; default), both "
                        "with the profile's achieved attention rate and SendRecv bandwidth as C and BW; empirical "
                        "(App. D), simulator (cost model), decode, or force pass-kv / pass-q")
    p.add_argument("--implementation", metavar="NAME", default="cpinfer", choices=tuple(IMPLEMENTATIONS),
                   help="whose ring to predict: cpinfer (default: fp32 partial outputs, unpadded decode, decode "
                        "SendRecv overlapped) or paper (bf16 partials, padded decode, SendRecv after each step)")
    p.add_argument("--json", action="store_true", help="print one JSON object on one line instead of the table")
    p.add_argument("--explain", action="store_true",
                   help="also print, per component (GEMM, attention, SendRecv, All2All, all-reduce, ...), how it is "
                        "computed and every hardware parameter it used, with its value and source")
    p.add_argument("--sweep", action="store_true",
                   help="try CP = 1..--max-cp and report the smallest that fits in memory and meets --ttft-target")
    p.add_argument("--ttft-target", type=float, metavar="SECONDS",
                   help="TTFT target in seconds (required with --sweep)")
    p.add_argument("--max-cp", type=int, metavar="N", default=64, help="largest CP size --sweep tries (default 64)")
    p.add_argument("--pd-decode-cp", type=int, metavar="M",
                   help="prefill on CP-N x TP (--cp) and decode on separate groups of CP-M x TP: adds the KV "
                        "transfer (bytes, bandwidth, total and exposed time) and the decode group's TTIT and memory "
                        "against decoding on the prefill group")
    p.add_argument("--pd-decode-groups", type=int, metavar="K", default=None,
                   help="decode groups with --pd-decode-cp (default 1); the batch is spread over them")
    p.add_argument("--spec-tokens", type=int, metavar="K",
                   help="speculative decoding: K drafted tokens verified in one ring step (needs --spec-acceptance); "
                        "predicts the verify step, tokens per step and the decode tokens/s gain")
    p.add_argument("--spec-acceptance", type=float, metavar="A",
                   help="the chance that one drafted token is accepted, in [0, 1) (with --spec-tokens)")
    p.add_argument("--checkpoint", metavar="PATH_OR_ID",
                   help="what the printed command serves (default: the config's folder, or the catalog model's "
                        "Hugging Face repository, its FP8 one for an FP8 weight format when published)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port in the printed command (default 8000)")
    p.set_defaults(func=run)


def hardware(args):
    """The --hardware profile, its device memory replaced by --gpu-memory-gib when given."""
    from cpinfer.perf.hardware import load_hardware_profile

    hw = load_hardware_profile(args.hardware)
    if args.gpu_memory_gib is None:
        return hw
    if not args.gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib must be positive, got {args.gpu_memory_gib}")
    gb = args.gpu_memory_gib * (1 << 30) / 1e9
    return dataclasses.replace(hw, mem_gb=gb, sources={**hw.sources, "mem_gb": f"--gpu-memory-gib "
                                                                              f"{args.gpu_memory_gib:g} ({gb:.1f} GB)"})


def _ending(args, plan, verdict) -> tuple[list[str], dict]:
    """What every plan ends with: the deciding constraint and the launch command, as text lines and JSON."""
    from cpinfer.perf.launch import launch_command

    lines = [f"decided   {verdict.text}"]
    out = {"decision": verdict.to_dict()}
    if plan is not None:
        pd = None if args.pd_decode_cp is None else (args.pd_decode_cp, args.pd_decode_groups or 1)
        launch = launch_command(plan, args.checkpoint, args.port, args.hardware, pd, args.spec_tokens)
        lines += launch.lines()
        out["launch"] = launch.to_dict()
    return lines, out


def check_extensions(args) -> None:
    """P/D and speculation flags: complete, in range, and not with --sweep (before any model is built)."""
    from cpinfer.perf.speculative import check_acceptance
    from cpinfer.utils import check_positive

    if args.pd_decode_groups is not None and args.pd_decode_cp is None:
        raise ValueError("--pd-decode-groups needs --pd-decode-cp M (the decode groups' CP size)")
    if args.pd_decode_cp is not None:
        check_positive(args.pd_decode_cp, "--pd-decode-cp")
        check_positive(args.pd_decode_groups or 1, "--pd-decode-groups")
    if (args.spec_tokens is None) != (args.spec_acceptance is None):
        raise ValueError("--spec-tokens K and --spec-acceptance A go together: K drafted tokens per verify step, "
                         "each accepted with probability A in [0, 1)")
    if args.spec_tokens is not None:
        check_positive(args.spec_tokens, "--spec-tokens")
        check_acceptance(args.spec_acceptance, "--spec-acceptance")
    if args.sweep and (args.pd_decode_cp is not None or args.spec_tokens is not None):
        raise ValueError("--sweep sizes one colocated CP group; give --cp N to plan --pd-decode-cp or --spec-tokens")


def _extensions(args, plan) -> tuple[list[str], dict]:
    """The P/D and speculation parts of a plan, as text blocks and JSON."""
    from cpinfer.perf import pd as pd_plan
    from cpinfer.perf import speculative

    text, out = [], {}
    dep, batch = plan.deployment, plan.workload.batch
    if args.pd_decode_cp is not None:
        pd = pd_plan.plan_pd(plan, args.pd_decode_cp, args.pd_decode_groups or 1)
        text.append(pd_plan.format_pd(pd))
        out["pd"] = pd.to_dict()
        dep, batch = pd.decode, pd.batch_per_group
    if args.spec_tokens is not None:
        spec = speculative.plan_spec(dep, plan.workload.context_tokens, args.spec_tokens, args.spec_acceptance, batch)
        text.append(speculative.format_spec(spec, dep, plan.workload.context_tokens))
        out["spec"] = dict(spec.to_dict(), cp=dep.cp, tp=dep.tp)
    return text, out


def run(args) -> int:
    from cpinfer.perf import planner, report  # imported on use: keeps `cpinfer --help` fast

    check_extensions(args)
    work = planner.Workload(parse_token_count(args.prompt_tokens, "--prompt-tokens"),
                            parse_token_count(args.cached_tokens, "--cached-tokens"), args.batch)
    kv_dtype = args.act_dtype if args.kv_dtype == "auto" else args.kv_dtype
    if args.sweep:
        if args.ttft_target is None:
            raise ValueError("--sweep needs --ttft-target SECONDS")
        base = planner.build_deployment(args.model, hardware(args), 1, args.tp, args.weights, args.act_dtype,
                                        kv_dtype, args.implementation)
        rows, plan = planner.sweep_cp(base, work, args.ttft_target, args.max_cp, args.method)
        memory = planner.make_plan(base, work, args.method).memory
        verdict = planner.sweep_verdict(rows, plan, args.ttft_target, memory.usable_gb, memory.weights_gb)
        lines, ending = _ending(args, plan, verdict)
        if args.json:
            out = plan.to_dict() if plan else {}
            out.update(ttft_target_s=args.ttft_target, smallest_cp=plan.deployment.cp if plan else None,
                       sweep=[vars(r) for r in rows], **ending)
            print(json.dumps(out))
        else:
            print(report.format_sweep(rows, args.ttft_target, plan))
            if plan:
                print("\n" + report.format_plan(plan))
                if args.explain:
                    print("\n" + report.format_explain(plan))
            print("\n".join(lines))
        return 0 if plan else 1
    if args.cp is None:
        raise ValueError("--cp is required (or use --sweep with --ttft-target)")
    dep = planner.build_deployment(args.model, hardware(args), args.cp, args.tp, args.weights, args.act_dtype,
                                   kv_dtype, args.implementation)
    plan = planner.make_plan(dep, work, args.method)
    lines, ending = _ending(args, plan, planner.plan_verdict(plan, args.ttft_target))
    extra_text, extra = _extensions(args, plan)
    if args.json:
        out = plan.to_dict()
        out.update(ending, **extra)
        if args.explain:
            hw = dep.hardware
            out["parameters"] = {k: dict(value=getattr(hw, k), source=hw.sources.get(k, "")) for k in hw.sources
                                 if k != "empirical"}
        if args.ttft_target is not None:
            out["meets_ttft_target"] = plan.chosen_ttft_s <= args.ttft_target
        print(json.dumps(out))
    else:
        print(report.format_plan(plan))
        if args.explain:
            print("\n" + report.format_explain(plan))
        for block in extra_text:
            print("\n" + block)
        if args.ttft_target is not None:
            met = plan.chosen_ttft_s <= args.ttft_target
            print(f"target    TTFT <= {args.ttft_target:g} s: {'met' if met else 'NOT met'}")
        print("\n".join(lines))
    return 0
