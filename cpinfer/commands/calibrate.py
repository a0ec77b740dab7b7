"""`cpinfer calibrate`: measure this cluster's compute, links and pass-KV/pass-Q grid; write a hardware profile."""
from __future__ import annotations

import argparse
import json
import os
import sys

EPILOG = """examples:
  cpinfer calibrate --cp 2 --device cpu --out profiles/this-machine.json   # spawn 2 local ranks (CPU, gloo)
  cpinfer calibrate --cp 2 --quick                                   # a few seconds, print only
  torchrun --nnodes 4 --nproc-per-node 1 ... -m cpinfer calibrate --cp 4 --device cuda --out gtt.json
Then: LLM(..., hardware_profile="profiles/this-machine.json") or cpinfer plan --hardware profiles/this-machine.json
See docs/calibration.md for what each number means."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure compute, SendRecv/All2All and pass-KV vs pass-Q; write a hardware profile",
        description="Measure the CP group: attention FLOP/s vs block length, ring SendRecv and All2All time vs\n"
                    "message size, and ring pass-KV vs pass-Q on a (T, P) grid; fit App. D's h(T, P); write a\n"
                    "HardwareProfile JSON (plus <name>.measurements.json with the raw numbers).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpinfer.device import ATTENTION_BACKENDS, DEVICES, DTYPES

    p.add_argument("--cp", type=int, metavar="N", required=True, help="CP ranks to measure (>= 2)")
    p.add_argument("--out", metavar="FILE", help="write the profile here (and FILE's stem + .measurements.json)")
    p.add_argument("--quick", action="store_true", help="small sweeps (seconds; for tests and smoke checks)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (CUDA when a GPU is visible, default), cpu (gloo) or cuda (NCCL, one GPU per rank)")
    p.add_argument("--heads", type=int, metavar="H", default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, metavar="HKV", default=2, help="key/value heads (default 2)")
    p.add_argument("--head-dim", type=int, metavar="D", default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="element type: auto = bfloat16 on cuda, float32 on cpu, as the engine (default auto)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="the attention kernel to measure: auto = cpu-flash on cpu; on cuda the first usable of "
                        "flash-attn, torch-cudnn, torch-flash (after their probes) and triton (default auto)")
    p.add_argument("--threads-per-rank", type=int, metavar="K", default=1, help="torch threads per CPU rank (1)")
    p.add_argument("--repeat", type=int, metavar="R", help="timed runs per measurement (default 3, --quick 2)")
    p.add_argument("--rounds", type=int, metavar="K", help="passes over the grid (default 2, --quick 1)")
    p.add_argument("--max-context", type=int, metavar="TOKENS", help="skip grid cells with T + P above this "
                   "(default 20480, --quick 2560)")
    p.add_argument("--base", metavar="NAME_OR_PATH", help="profile the unmeasured fields come from "
                   "(default cpu-gloo on cpu, h100-gtt on cuda)")
    p.add_argument("--name", help="profile name (default calibrated-<device>-<backend>-cp<N>)")
    p.add_argument("--peak-tflops", type=float, metavar="TF", help="spec-sheet C for Alg. 1/5 (default: best "
                   "rate measured)")
    p.add_argument("--peak-gbs", type=float, metavar="GB", help="spec-sheet link BW for Alg. 1/5 (default: best "
                   "SendRecv rate measured)")
    p.add_argument("--json", action="store_true", help="also print the profile and fit as one JSON line (last)")


def config_from_args(args):
    from cpinfer.device import resolve_device, resolve_dtype
    from cpinfer.perf.calibrate import CalibrationConfig

    if args.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be >= 1, got {args.threads_per_rank}")
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--peak-gbs", args.peak_gbs)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    extra = {k: v for k in ("repeat", "rounds", "max_context") if (v := getattr(args, k)) is not None}
    device = resolve_device(args.device)  # ValueError naming CUDA when it is asked for and missing
    extra |= dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, device=device,
                  dtype=resolve_dtype(args.dtype, device), attention_backend=args.attention_backend)
    return CalibrationConfig.quick(args.cp, **extra) if args.quick else CalibrationConfig(args.cp, **extra)


def run(args) -> int:
    from cpinfer.perf import calibrate as cal

    cfg = config_from_args(args)
    base = args.base or ("cpu-gloo" if cfg.device == "cpu" else "h100-gtt")
    cal.load_hardware_profile(base)  # fail on a bad --base before starting ranks
    with _ranks(cfg, args.threads_per_rank) as pool:
        driver = getattr(pool, "is_driver", True)
        record = cal.run_calibration(pool, cfg, log=_progress if driver else None)
    if not driver:
        return 0
    side = cal.sidecar_path(args.out).name if args.out else ""
    profile = cal.build_profile(record, base, args.name, args.peak_tflops, args.peak_gbs, side)
    print(format_summary(record, profile))
    if args.out:
        written = cal.write_calibration(record, profile, args.out)
        print(f"\nwrote {args.out} (load with hardware_profile={args.out!r}) and {written}")
    else:
        print("\nnot written: pass --out FILE to save the profile")
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "empirical": record["empirical"], "out": args.out}))
    return 0


def _progress(msg: str) -> None:
    print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _ranks(cfg, threads: int):
    """Local ranks (WorkerPool), or, when started by torchrun, this process as one rank of the running group."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _TorchrunRanks(cfg, threads)
    import torch

    from cpinfer.launch import WorkerPool

    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.cp:
        raise ValueError(f"--device cuda --cp {cfg.cp} starts {cfg.cp} local ranks, one GPU each, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible; across nodes, start it with torchrun "
                         "(or --device cpu)")
    return WorkerPool(cfg.cp, backend=cfg.backend, threads_per_rank=threads, timeout_s=600, device=cfg.device)


class _TorchrunRanks:
    """Runs each measurement in place on this rank and all-gathers the per-rank results (rank 0 reports)."""

    def __init__(self, cfg, threads: int):
        import datetime

        import torch
        import torch.distributed as dist

        from cpinfer.launch import RankContext

        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.cp:
            raise ValueError(f"--cp {cfg.cp} but torchrun started {world} processes; they must match")
        timeout = datetime.timedelta(seconds=600)
        torch.set_num_threads(threads)
        device = torch.device("cpu")
        if cfg.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(cfg.backend, timeout=timeout)
        cpu = dist.group.WORLD if cfg.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.ctx = RankContext(dist.get_rank(), world, dist.group.WORLD, cpu, device, {})
        self.is_driver = self.ctx.rank == 0

    def run(self, fn, *args):
        import torch.distributed as dist

        results = [None] * self.ctx.world_size
        dist.all_gather_object(results, fn(self.ctx, *args), group=self.ctx.cpu_group)
        return results

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


# ---------------------------------------------------------------- the summary it prints

def format_summary(record: dict, profile) -> str:
    cfg, host = record["config"], record["hosts"][0]
    head = (f"calibrated CP{cfg['cp']} ({cfg['device']}, {'nccl' if cfg['device'] == 'cuda' else 'gloo'}, "
            f"{host.get('attention_backend', 'cpu-flash')} attention) on "
            f"{len({h['host'] for h in record['hosts']})} host(s), {host['device_name'] or 'unknown device'}; "
            f"{cfg['heads']}/{cfg['kv_heads']} heads, D={cfg['head_dim']}, {cfg['dtype']}, "
            f"{host['threads']} thread(s)/rank; {record['created']}, took {record['seconds']:.0f} s")
    parts = [head, _compute(record), _links(record), _grid(record), _profile(record, profile)]
    return "\n\n".join(parts)


def _compute(record: dict) -> str:
    from cpinfer.perf.calibrate import table

    comp, cfg = record["compute"], record["config"]
    att = {(a["length"], a["causal"]): a["tflops"] for a in comp["attention"]}
    rows = [[n, f"{att[n, False]:.4f}", f"{att[n, True]:.4f}"] for n in sorted({n for n, _ in att})]
    return "\n".join(["Compute per rank, all ranks busy (TF/s):",
                      table(["block L", "attention", "causal attention"], rows),
                      f"GEMM {cfg['gemm_size']}^3: {comp['gemm_tflops']:.4f} TF/s; 64 MiB copy: "
                      f"{comp['copy_gbs']:.1f} GB/s; one tiny eager op: {comp['dispatch_us']:.1f} us"])


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _links(record: dict) -> str:
    from cpinfer.perf.calibrate import table

    sr, a2a, o = record["sendrecv"], record["all2all"], record["overlap"]
    rows = [[_size(p["bytes"]), f"{p['seconds'] * 1e6:.0f}", f"{p['gbs']:.2f}", f"{q['seconds'] * 1e6:.0f}",
             f"{q['gbs']:.2f}"] for p, q in zip(sr["points"], a2a["points"])]
    return "\n".join([
        f"Links: ring SendRecv (per rank, each direction) and All2All ({record['config']['cp'] - 1} peer(s)), "
        "median time per message:",
        table(["bytes", "SendRecv us", "GB/s", "All2All us", "GB/s"], rows),
        f"fit t = latency + bytes/BW: SendRecv {sr['latency_us']:.0f} us + {sr['gbs']:.2f} GB/s; All2All "
        f"{a2a['latency_us']:.0f} us + {a2a['gbs']:.2f} GB/s; ring step {_ring_step_us(record):.0f} us",
        f"overlap: a {_size(o['bytes'])} SendRecv ({o['sendrecv_s'] * 1e3:.1f} ms) posted before attention of "
        f"{o['length']} tokens ({o['attention_s'] * 1e3:.1f} ms) finished with it in {o['both_s'] * 1e3:.1f} ms: "
        f"{o['hidden']:.0%} of the transfer hidden"])


def _ring_step_us(record: dict) -> float:
    return record.get("ring_step_us", record.get("ring_step_floor_us", 0.0))  # older records: the old name


def _grid(record: dict) -> str:
    from cpinfer.perf.calibrate import table

    rows = [[r["T"], r["P"], f"{r['miss_rate']:.3f}", f"{r['pass-kv_s']:.4f}", f"{r['pass-q_s']:.4f}",
             f"{r['pass-kv_s'] / r['pass-q_s']:.3f}", f"{r['pass-kv_wait_s']:.4f}", f"{r['pass-q_wait_s']:.4f}",
             r["faster"]] for r in record["grid"]]
    emp = record.get("empirical")
    fit = (f"App. D fit: h = {emp['alpha']:.3f} ln T + {emp['beta']:.3f} ln(T/(T+P)) + {emp['gamma']:.3f}; its "
           f"sign matches the faster strategy on {emp['in_sample_agreement']:.0%} of the cells (in sample)"
           if emp else "App. D fit: not determined (the grid must vary in both T and T/(T+P))")
    return "\n".join([
        "Ring pass-KV vs pass-Q, one sequence of T new tokens on P cached ones (s, slowest rank, best of "
        f">= {record['config']['repeat'] * record['config'].get('rounds', 1)} runs; wait = time blocked on the ring):",
        table(["T", "P", "T/(T+P)", "pass-KV", "pass-Q", "KV/Q", "KV wait", "Q wait", "faster"], rows), fit])


def _profile(record: dict, hw) -> str:
    from cpinfer.cp.heuristics import heuristic_rates, kv_token_threshold, miss_rate_threshold
    from cpinfer.perf.calibrate import DTYPES

    cfg = record["config"]
    (c, bw), e = heuristic_rates(hw, cfg["cp"]), DTYPES[cfg["dtype"]].itemsize
    t_min = float(kv_token_threshold(cfg["cp"], c, bw, cfg["heads"], cfg["kv_heads"], e))
    slope = cfg["cp"] * c * e / (4 * bw)  # Eq. 5: threshold = 2 N_KV / N_H - T / slope
    return (f"Profile {hw.name!r}: peak_tflops {hw.peak_tflops:.4f} TF/s, attn_tflops {hw.attn_tflops:.4f} "
            f"at {hw.attn_ref_tokens:.0f} tokens (L0 {hw.attn_overhead_tokens:.0f}; C = {c / 1e12:.4f} on long "
            f"blocks), inter_gbs_peak {hw.inter_gbs_peak:.2f} GB/s, BW = ring SendRecv {bw / 1e9:.2f}, latency "
            f"{hw.inter_latency_us:.0f} us, memory {hw.mem_tbps * 1e3:.1f} GB/s\n"
            f"Alg. 5 on it, CP{cfg['cp']}, {cfg['heads']}/{cfg['kv_heads']} heads, {e}-byte elements: pass-KV when "
            f"T >= {t_min:.0f} (Eq. 2) or T/(T+P) >= {float(miss_rate_threshold(cfg['heads'], cfg['kv_heads'])):.3f}"
            f" - T/{slope:.0f} (Eq. 5)")
