"""Measure a running CP group and build a calibrated HardwareProfile (`cpinfer calibrate`; paper §3.4, App. C, D).

Rank-side functions (sent to a `WorkerPool`, or called in place under torchrun) time local attention, GEMM and
memory copies, ring SendRecv and All2All against message size, and ring pass-KV vs pass-Q on a (T, P) grid. The
driver fits latency + bytes/bandwidth to the links and App. D's h(T, P) to the grid, and fills a profile whose
unmeasured fields come from a base profile. Raw measurements go to a sidecar JSON next to the profile.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.attention.backends import resolve_name
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.hardware_profile import UNITS, HardwareProfile
from cpinfer.timing import resolve
from cpinfer.utils import check_positive

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGIES = ("pass-kv", "pass-q")
FORMAT = "cpinfer-calibration/1"
KiB, MiB = 1 << 10, 1 << 20
MIN_CELL_S, MAX_RUNS = 0.25, 30  # short grid cells repeat until ~0.25 s per strategy (best-of-many beats jitter)


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """What to measure. Full defaults take about a minute on 2 CPU ranks; `quick()` shrinks every sweep."""

    cp: int
    heads: int = 8                 # query heads of the attention measured (model-like GQA shape)
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "float32"
    device: str = "cpu"            # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    attention_backend: str = "auto"  # the kernel the engine will use ("auto": cpu-flash on CPU, triton / flash-attn)
    repeat: int = 3                # timed runs per measurement (after one warm-up)
    rounds: int = 2                # passes over the grid, each with fresh tensors (decorrelates slow spells)
    grid_new: tuple = (64, 256, 1024, 4096)              # T of the grid
    grid_miss: tuple = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02)  # T / (T + P) of the grid
    max_context: int = 20480       # grid cells with T + P above this are skipped
    block_lens: tuple = (256, 1024, 4096)                 # local attention block lengths (Lq = Lkv)
    message_bytes: tuple = tuple(4 * KiB * 4 ** i for i in range(8))  # 4 KiB ... 64 MiB
    gemm_size: int = 2048          # M = N = K of the GEMM timed for the compute peak

    def __post_init__(self) -> None:
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 2:
            raise ValueError(f"--cp must be an integer >= 2 (calibration measures the links between ranks), "
                             f"got {self.cp!r}")
        for name in ("heads", "kv_heads", "head_dim", "repeat", "rounds", "max_context", "gemm_size"):
            check_positive(getattr(self, name), name.replace("_", "-"))
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv-heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < 1:
            raise ValueError("device 'cuda' requested but no CUDA device is visible")
        resolve_name(self.attention_backend, torch.device(self.device), probe=False)  # ValueError naming what is
        # allowed (torch-flash's probe runs on the ranks' devices)
        if any(not 0 < r <= 1 for r in self.grid_miss):
            raise ValueError(f"grid miss rates must be in (0, 1], got {self.grid_miss}")
        if not self.cells():
            raise ValueError(f"no grid cell fits max-context {self.max_context}")

    @classmethod
    def quick(cls, cp: int, **kw) -> "CalibrationConfig":
        """A few seconds: small blocks, three message sizes, a 6-cell grid (enough to fit h)."""
        small = dict(repeat=2, rounds=1, grid_new=(32, 128), grid_miss=(1.0, 0.25, 0.05), max_context=2560,
                     block_lens=(128, 512), message_bytes=(4 * KiB, 256 * KiB, 4 * MiB), gemm_size=512)
        return cls(cp, **(small | kw))

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def cells(self) -> list[tuple[int, int]]:
        """Grid cells (T, P) with P = T (1 - r) / r rounded, T + P <= max_context, in (T, P) order."""
        out = {(t, round(t * (1 - r) / r)) for t in self.grid_new for r in self.grid_miss}
        return sorted((t, p) for t, p in out if t + p <= self.max_context)


# ---------------------------------------------------------------- rank side (module level: sent to the pool)

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(ctx, fn, repeat: int) -> list[float]:
    """Seconds of fn() on this rank for each of `repeat` runs; all ranks start each run together."""
    fn()
    _sync(ctx.device)
    times = []
    for _ in range(repeat):
        dist.barrier(group=ctx.cpu_group)
        t0 = time.perf_counter()
        fn()
        _sync(ctx.device)
        times.append(time.perf_counter() - t0)
    return times


def local_attention_fn(cfg: CalibrationConfig, device, length: int, causal: bool):
    """(q, k, v) → out through the backend the engine uses (`cfg.attention_backend` on `device`), planned once:
    one sequence of `length` queries and keys, causal or every key visible."""
    from cpinfer.attention.backends import LocalAttention

    seq, pos = np.zeros(length, dtype=np.int64), np.arange(length, dtype=np.int64)
    q_pos = pos if causal else np.full(length, length, dtype=np.int64)
    step = LocalAttention(seq, q_pos, seq, pos, backend=cfg.attention_backend, device=device,
                          scale=cfg.head_dim ** -0.5)
    return lambda q, k, v: step(q, k, v)


def rank_compute(ctx, cfg: CalibrationConfig) -> dict:
    """Local attention per block length (causal and not) through the engine's backend and dtype, a square GEMM, a
    memory copy, one tiny op's dispatch."""
    dev, dt, gen = ctx.device, DTYPES[cfg.dtype], torch.Generator().manual_seed(ctx.rank)
    out = {"attention": {}}
    for length in cfg.block_lens:
        q = torch.randn(length, cfg.heads, cfg.head_dim, generator=gen).to(dev, dt)         # [L, H, D]
        kv = torch.randn(2, length, cfg.kv_heads, cfg.head_dim, generator=gen).to(dev, dt)  # K, V [L, Hkv, D]
        for causal in (False, True):
            attend = local_attention_fn(cfg, dev, length, causal)
            out["attention"][f"{length}/{int(causal)}"] = _timed(ctx, lambda: attend(q, kv[0], kv[1]), cfg.repeat)
    a = torch.randn(cfg.gemm_size, cfg.gemm_size, generator=gen).to(dev, dt)
    out["gemm"] = _timed(ctx, lambda: a @ a, cfg.repeat)
    big = torch.empty(64 * MiB // 4, dtype=torch.float32, device=dev)                    # 64 MiB
    copy = torch.empty_like(big)
    out["copy"] = _timed(ctx, lambda: copy.copy_(big), cfg.repeat)
    small = torch.ones(8, device=dev)
    out["dispatch"] = _timed(ctx, lambda: [small.add(1.0) for _ in range(200)], cfg.repeat)
    return out


def rank_sendrecv(ctx, cfg: CalibrationConfig) -> dict:
    """One ring step per run (send to rank+1, receive from rank-1 with batch_isend_irecv), per message size."""
    from cpinfer.cp.ring import RingComm

    ring, out = RingComm(ctx.group), {}
    for nbytes in cfg.message_bytes:
        send = torch.zeros(nbytes // 4, dtype=torch.float32, device=ctx.device)
        recv = torch.empty_like(send)

        def step():
            ring.start(send, recv)
            ring.wait()
        out[nbytes] = _timed(ctx, step, max(cfg.repeat, 10))
    return out


def rank_all2all(ctx, cfg: CalibrationConfig) -> dict:
    """`all_to_all_single` with `bytes` to and from every peer, per message size (the pass-Q merge, App. C)."""
    out = {}
    for nbytes in cfg.message_bytes:
        send = torch.zeros(ctx.world_size, nbytes // 4, dtype=torch.float32, device=ctx.device)
        recv = torch.empty_like(send)
        out[nbytes] = _timed(ctx, lambda: dist.all_to_all_single(recv, send, group=ctx.group), max(cfg.repeat, 10))
    return out


def rank_overlap(ctx, cfg: CalibrationConfig) -> dict:
    """Attention alone, one ring SendRecv alone, and both at once (transfer posted, attention, wait): how much of
    the transfer the ring actually hides (on CPU the transfer runs on the cores that compute)."""
    from cpinfer.cp.ring import RingComm

    length, nbytes = min(1024, max(cfg.block_lens)), min(16 * MiB, max(cfg.message_bytes))
    gen, dev, dt = torch.Generator().manual_seed(ctx.rank), ctx.device, DTYPES[cfg.dtype]
    q = torch.randn(length, cfg.heads, cfg.head_dim, generator=gen).to(dev, dt)         # [L, H, D]
    kv = torch.randn(2, length, cfg.kv_heads, cfg.head_dim, generator=gen).to(dev, dt)  # [2, L, Hkv, D]
    send = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
    recv, ring = torch.empty_like(send), RingComm(ctx.group)
    backend = local_attention_fn(cfg, dev, length, causal=False)

    def attend():
        backend(q, kv[0], kv[1])

    def transfer():
        ring.start(send, recv)
        ring.wait()

    def both():
        ring.start(send, recv)
        attend()
        ring.wait()
    return {"length": length, "bytes": nbytes, "attention": _timed(ctx, attend, cfg.repeat),
            "sendrecv": _timed(ctx, transfer, cfg.repeat), "both": _timed(ctx, both, cfg.repeat)}


def cell_layout(new: int, cached: int, n: int) -> list[tuple[np.ndarray, ...]]:
    """Per rank (q_seq, q_pos, kv_seq, kv_pos) of one sequence: T new tokens sharded 2N-chunk (§3.5.1) after P
    cached ones, which an earlier load-balanced prefill left on the ranks (the persistent KV of §3.3)."""
    from cpinfer.cp.sharding import shard_prefill

    fresh = shard_prefill([new], n, [cached]).shards
    old = shard_prefill([cached], n).shards if cached else None
    out = []
    for r, sh in enumerate(fresh):
        parts = [sh] if old is None else [old[r], sh]
        kv_seq = np.concatenate([p.seq[p.valid] for p in parts])
        kv_pos = np.concatenate([p.pos[p.valid] for p in parts])
        out.append((sh.seq, sh.pos, kv_seq, kv_pos))
    return out


def rank_cell(ctx, cfg: CalibrationConfig, new: int, cached: int, seed: int = 0) -> dict:
    """Ring pass-KV and pass-Q on one (T, P) cell, interleaved run by run: seconds and exposed wait per run.
    `seed` picks the random Q/K/V (each round of the grid gets fresh tensors)."""
    from cpinfer.cp import plan_from_metadata

    layout = cell_layout(new, cached, ctx.world_size)
    q_seq, _, kv_seq, _ = layout[ctx.rank]
    gen, dev, dt = torch.Generator().manual_seed(1000 * seed + ctx.rank), ctx.device, DTYPES[cfg.dtype]
    q = torch.randn(len(q_seq), cfg.heads, cfg.head_dim, generator=gen).to(dev, dt)         # [Lq, H, D]
    kv = torch.randn(2, len(kv_seq), cfg.kv_heads, cfg.head_dim, generator=gen).to(dev, dt)  # [2, Lkv, Hkv, D]
    plans = {s: plan_from_metadata([(a[0], a[1]) for a in layout], [(a[2], a[3]) for a in layout],
                                   group=ctx.group, rank=ctx.rank, world=ctx.world_size, strategy=s,
                                   backend=cfg.attention_backend)
             for s in STRATEGIES}
    out = {s: [] for s in STRATEGIES} | {f"{s}/wait": [] for s in STRATEGIES}
    first = {s: _run_plan(ctx, plans[s], q, kv) for s in STRATEGIES}  # warm-up; its time sizes the loop below
    runs = _agreed_runs(ctx, cfg.repeat, max(t for t, _ in first.values()))
    for rep in range(runs):
        for s in STRATEGIES if rep % 2 else STRATEGIES[::-1]:
            seconds, wait = _run_plan(ctx, plans[s], q, kv)
            out[s].append(seconds)
            out[f"{s}/wait"].append(wait)
    return out


def _run_plan(ctx, plan, q, kv) -> tuple[float, float]:
    """(seconds, seconds spent waiting for the ring) of one `plan.run`, started together on all ranks."""
    timings: list = []
    dist.barrier(group=ctx.cpu_group)
    t0 = time.perf_counter()
    plan.run(q, kv[0], kv[1], timings=timings)
    _sync(ctx.device)
    return time.perf_counter() - t0, sum(t["wait_s"] for t in resolve(timings))  # CUDA: event spans


def _agreed_runs(ctx, repeat: int, seconds: float) -> int:
    """Runs per strategy: `repeat`, or more for short cells (about MIN_CELL_S of runs, at most MAX_RUNS), the same
    count on every rank (the runs are collective)."""
    mine = torch.tensor([max(repeat, min(MAX_RUNS, math.ceil(MIN_CELL_S / max(seconds, 1e-6))))])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=ctx.cpu_group)
    return int(mine)


def rank_host(ctx, cfg: CalibrationConfig) -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    if ctx.device.type == "cuda":
        mem = torch.cuda.get_device_properties(ctx.device).total_memory
    return {"host": socket.gethostname(), "threads": torch.get_num_threads(), "mem_bytes": mem,
            "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else _cpu_name(),
            "attention_backend": resolve_name(cfg.attention_backend, ctx.device)}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor()
    except OSError:
        return platform.processor()


# ---------------------------------------------------------------- driver: combine ranks, fit, build the profile

def slowest(per_rank: list[list[float]], best: bool = True) -> float:
    """A run's time is its slowest rank's (runs start together); return the fastest run (`best`: other users of a
    shared machine only ever add time) or the median run (links, where the spread is part of the cost)."""
    runs = np.max(np.asarray(per_rank, dtype=float), axis=0)
    return float(runs.min() if best else statistics.median(runs))


def fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bytes/s) of t = latency + bytes / bandwidth, least squares on relative error, latency >= 0."""
    x = np.asarray([b for b, _ in points], dtype=float)
    t = np.asarray([s for _, s in points], dtype=float)
    a = np.stack([1 / t, x / t], axis=1)
    lat, inv_bw = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    if inv_bw <= 0:  # flat: no bandwidth term visible; fall back to the largest message's rate
        return float(t.min()), float(x.max() / t[x.argmax()])
    if lat < 0:      # bandwidth alone: t = bytes / bandwidth
        return 0.0, float(np.sum(x * x / t ** 2) / np.sum(x / t))
    return float(lat), float(1 / inv_bw)


def attention_flops(length: int, causal: bool, heads: int, head_dim: int) -> float:
    """4 * visible (query, key) pairs * head_dim * heads (paper Table 3); causal counts the diagonal."""
    pairs = length * (length + 1) / 2 if causal else length * length
    return 4.0 * pairs * head_dim * heads


def run_calibration(pool, cfg: CalibrationConfig, log=None) -> dict:
    """Every measurement on `pool` (WorkerPool-like: `run(fn, *args)` → per-rank results); returns the record."""
    log = log or (lambda msg: None)
    started, load_before = time.perf_counter(), _load_average()
    hosts = pool.run(rank_host, cfg)
    log("compute: attention blocks, GEMM, memory copy")
    compute = pool.run(rank_compute, cfg)
    log("links: ring SendRecv and All2All")
    sendrecv, all2all = pool.run(rank_sendrecv, cfg), pool.run(rank_all2all, cfg)
    overlap = pool.run(rank_overlap, cfg)
    cells, runs = cfg.cells(), {}
    for rnd in range(cfg.rounds):  # round after round, so a slow spell of the machine hits every cell a little
        for i, (t, p) in enumerate(cells):
            log(f"grid round {rnd + 1}/{cfg.rounds}, cell {i + 1}/{len(cells)}: T={t} P={p}")
            got = pool.run(rank_cell, cfg, t, p, rnd)
            runs[t, p] = got if rnd == 0 else [{k: v + g[k] for k, v in r.items()} for r, g in zip(runs[t, p], got)]
    grid = [_grid_row(t, p, runs[t, p]) for t, p in cells]
    floor = pool.run(rank_cell, dataclasses.replace(cfg, repeat=max(cfg.repeat, 5)), 8 * cfg.cp, 0)
    record = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": dataclasses.asdict(cfg),
        "hosts": hosts,
        "compute": _compute_summary(compute, cfg),
        "sendrecv": _link_summary(sendrecv, 1),
        "all2all": _link_summary(all2all, cfg.cp - 1),
        "overlap": _overlap_summary(overlap),
        "ring_step_us": slowest([r["pass-kv"] for r in floor]) / cfg.cp * 1e6,
        "grid": grid,
    }
    record["empirical"] = fit_grid(grid)
    record["seconds"], record["load_average"] = time.perf_counter() - started, [load_before, _load_average()]
    return record


def _load_average() -> float | None:
    """1-minute load average of the driver's host (timings on a busy shared machine are suspect)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _compute_summary(per_rank: list[dict], cfg: CalibrationConfig) -> dict:
    attention = []
    for key in per_rank[0]["attention"]:
        length, causal = (int(v) for v in key.split("/"))
        sec = slowest([r["attention"][key] for r in per_rank])
        attention.append(dict(length=length, causal=bool(causal), seconds=sec,
                              tflops=attention_flops(length, bool(causal), cfg.heads, cfg.head_dim) / sec / 1e12))
    gemm_s = slowest([r["gemm"] for r in per_rank])
    return {"attention": attention,
            "gemm_tflops": 2.0 * cfg.gemm_size ** 3 / gemm_s / 1e12,
            "copy_gbs": 2 * 64 * MiB / slowest([r["copy"] for r in per_rank]) / 1e9,  # read + write
            "dispatch_us": slowest([r["dispatch"] for r in per_rank]) / 200 * 1e6}


def _link_summary(per_rank: list[dict], peers: int) -> dict:
    """Per size: time and achieved GB/s; fit of t = latency + peers * bytes / BW (BW per rank, per direction)."""
    points = [(int(b), slowest([r[b] for r in per_rank], best=False)) for b in per_rank[0]]
    lat, bw = fit_link([(peers * b, s) for b, s in points])
    return {"points": [dict(bytes=b, seconds=s, gbs=peers * b / s / 1e9) for b, s in points],
            "latency_us": lat * 1e6, "gbs": bw / 1e9, "best_gbs": max(peers * b / s for b, s in points) / 1e9}


def _overlap_summary(per_rank: list[dict]) -> dict:
    """hidden: the fraction of the transfer's time that running it under attention saved (1 = fully hidden)."""
    t = {k: slowest([r[k] for r in per_rank]) for k in ("attention", "sendrecv", "both")}
    hidden = (t["attention"] + t["sendrecv"] - t["both"]) / t["sendrecv"]
    return dict(length=per_rank[0]["length"], bytes=per_rank[0]["bytes"], attention_s=t["attention"],
                sendrecv_s=t["sendrecv"], both_s=t["both"], hidden=min(1.0, max(0.0, hidden)))


def _grid_row(t: int, p: int, per_rank: list[dict]) -> dict:
    row = dict(T=t, P=p, miss_rate=t / (t + p))
    for s in STRATEGIES:
        row[f"{s}_s"] = slowest([r[s] for r in per_rank])
        row[f"{s}_wait_s"] = slowest([r[f"{s}/wait"] for r in per_rank])
        row[f"{s}_runs"] = np.max([r[s] for r in per_rank], axis=0).tolist()  # slowest rank, per run
    row["faster"] = "pass-kv" if row["pass-kv_s"] <= row["pass-q_s"] else "pass-q"
    return row


def fit_grid(grid: list[dict]) -> dict | None:
    """App. D h(T, P) fitted to the grid (ln of pass-Q / pass-KV time); None when the grid cannot determine it."""
    from cpinfer.cp.heuristics import empirical_h, fit_empirical

    points = [(r["T"], r["P"], r["pass-kv_s"], r["pass-q_s"]) for r in grid]
    try:
        coeffs = fit_empirical(points)
    except ValueError:
        return None
    agree = sum((empirical_h(t, p, coeffs) > 0) == (kv <= q) for t, p, kv, q in points)
    return dict(alpha=coeffs[0], beta=coeffs[1], gamma=coeffs[2], in_sample_agreement=agree / len(points))


def build_profile(record: dict, base="cpu-gloo", name: str | None = None, peak_tflops: float | None = None,
                  peak_gbs: float | None = None, sidecar: str = "") -> HardwareProfile:
    """The calibrated profile: measured fields from `record`, the rest (and their sources) from `base`.

    C (peak_tflops) and BW (inter_gbs_peak), the numbers Alg. 1 / Alg. 5 use, default to the best rates measured
    here (the achieved C and BW the paper's footnote tunes towards); pass spec-sheet peaks to override.
    """
    base_hw = load_hardware_profile(base)
    cfg, comp, link = record["config"], record["compute"], record["sendrecv"]
    causal = [a for a in comp["attention"] if a["causal"]]
    attn = max(causal, key=lambda a: a["length"])["tflops"]
    ref_len = max(a["length"] for a in causal)
    l0 = attention_overhead_tokens([(a["length"], a["tflops"]) for a in causal])
    best = max([comp["gemm_tflops"]] + [a["tflops"] for a in comp["attention"]])
    peak = max(peak_tflops or best, attn, comp["gemm_tflops"])
    bw_peak = max(peak_gbs or link["best_gbs"], link["gbs"])
    hosts = {h["host"] for h in record["hosts"]}
    where = f"measured by cpinfer calibrate on CP{cfg['cp']} ({record['created']}{sidecar and ', ' + sidecar})"
    measured = dict(
        peak_tflops=(peak, f"{where}: best of GEMM {cfg['gemm_size']}^3 and attention TF/s per rank"
                     if peak_tflops is None else "given with --peak-tflops"),
        attn_tflops=(attn, f"{where}: causal attention, {max(a['length'] for a in causal)} tokens, "
                     f"{cfg['heads']}/{cfg['kv_heads']} heads, D={cfg['head_dim']}, {cfg['dtype']}, "
                     f"{record['hosts'][0].get('attention_backend', 'cpu-flash')} kernel"),
        gemm_efficiency=(min(1.0, comp["gemm_tflops"] / peak), f"{where}: GEMM TF/s / peak_tflops"),
        mem_tbps=(comp["copy_gbs"] / 1e3, f"{where}: 64 MiB copy, read + write bytes per second"),
        mem_efficiency=(1.0, f"{where}: mem_tbps is itself an achieved rate"),
        inter_gbs_peak=(bw_peak, f"{where}: best SendRecv GB/s over message sizes"
                        if peak_gbs is None else "given with --peak-gbs"),
        inter_gbs=(link["gbs"], f"{where}: ring SendRecv, fit of latency + bytes / BW"),
        inter_latency_us=(link["latency_us"], f"{where}: ring SendRecv, fit of latency + bytes / BW"),
        attn_ref_tokens=(float(ref_len), f"{where}: the causal block attn_tflops was measured on"),
        attn_overhead_tokens=(l0, f"{where}: fit of the causal attention rate vs block length (cost model "
                              "A_inf * (L/2) / (L/2 + L0), cpinfer.perf.costs)"),
        ring_step_us=(record.get("ring_step_us", record.get("ring_step_floor_us")),
                      f"{where}: pass-KV of {8 * cfg['cp']} tokens / CP steps"),
        comm_overlap=(record["overlap"]["hidden"], f"{where}: share of a {record['overlap']['bytes'] >> 20} MiB "
                      f"SendRecv hidden under {record['overlap']['length']}-token attention"),
    )
    if len(hosts) == 1:  # one node: the ring's link is the intra-node link, and the only one there is to measure
        measured |= dict(intra_gbs=(link["gbs"], measured["inter_gbs"][1]),
                         inter_coll_gbs=(link["gbs"], measured["inter_gbs"][1]),
                         intra_latency_us=(link["latency_us"], measured["inter_latency_us"][1]),
                         devices_per_node=(cfg["cp"], f"{where}: ranks on this host (one node)"))
    if cfg["device"] == "cpu":
        measured |= dict(kernel_overhead_us=(comp["dispatch_us"], f"{where}: eager dispatch of one tiny op"),
                         mem_gb=(record["hosts"][0]["mem_bytes"] / 1e9 / cfg["cp"], f"{where}: host RAM / ranks"))
    else:
        measured |= dict(mem_gb=(record["hosts"][0]["mem_bytes"] / 1e9, f"{where}: device memory"))
    values = {k: getattr(base_hw, k) for k in UNITS} | {k: v for k, (v, _) in measured.items()}
    sources = {k: f"not measured: from {base_hw.name} ({base_hw.sources.get(k, '')})" for k in UNITS}
    sources |= {k: s for k, (_, s) in measured.items()}
    emp = record.get("empirical")
    empirical = (emp["alpha"], emp["beta"], emp["gamma"]) if emp else None
    if emp:
        sources["empirical"] = (f"{where}: App. D h(T, P) fitted to {len(record['grid'])} (T, P) cells, "
                                f"sign agrees on {emp['in_sample_agreement']:.0%}")
    default = f"calibrated-{cfg['device']}-{'nccl' if cfg['device'] == 'cuda' else 'gloo'}-cp{cfg['cp']}"
    return HardwareProfile(name=name or default, kind="calibrated", empirical=empirical, sources=sources, **values)


def attention_overhead_tokens(points: list[tuple[int, float]]) -> float:
    """L0 of the attention cost model from (causal block length L, TF/s) points: 1/rate = (1 + L0 / (L/2)) / A_inf
    is linear in 2/L; least squares, clamped at 0 (no short-block slowdown seen)."""
    if len(points) < 2:
        return 0.0
    x = np.asarray([2.0 / length for length, _ in points])
    y = np.asarray([1.0 / rate for _, rate in points])
    slope, intercept = np.polyfit(x, y, 1)
    if intercept <= 0 or slope <= 0:
        return 0.0
    return float(slope / intercept)


def sidecar_path(profile_path: str | Path) -> Path:
    """Where the raw measurements of a profile written by `cpinfer calibrate` live: `<stem>.measurements.json`."""
    p = Path(profile_path)
    return p.with_name(p.stem + ".measurements.json")


def write_calibration(record: dict, profile: HardwareProfile, path: str | Path) -> Path:
    """Write the profile to `path` (loadable by `load_hardware_profile`) and the record next to it; return the
    sidecar's path."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    side = sidecar_path(path)
    side.write_text(json.dumps(record | {"profile": path.name}, indent=1) + "\n")
    return side


def load_calibration(profile_path: str | Path) -> tuple[dict, HardwareProfile]:
    """(measurement record, profile) of a profile written by `cpinfer calibrate`."""
    import json

    side = sidecar_path(profile_path)
    if not side.is_file():
        raise ValueError(f"{profile_path}: no measurements next to it ({side.name}); was it written by "
                         "`cpinfer calibrate --out`?")
    record = json.loads(side.read_text())
    if record.get("format") != FORMAT:
        raise ValueError(f"{side}: not a {FORMAT} record (format {record.get('format')!r})")
    return record, load_hardware_profile(profile_path)


# ---------------------------------------------------------------- plain-text tables (calibrate, bench heuristic)

def table(header: list[str], rows: list[list], left: tuple[int, ...] = (0,)) -> str:
    """Fixed-width plain-text table; columns in `left` left-aligned, the others (numbers) right-aligned."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])
