"""`cpinfer demo`: context-parallel attention on N CPU ranks against the single-device result.

A multi-turn batch of three sequences (a full prefill, then a partial prefill on the persistent KV shards) runs
with ring pass-KV, ring pass-Q and all-gather; each must match one device's attention over the same tensors.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpinfer.attention.local import local_attention
from cpinfer.bench.attention import positive_int, prefill_layout, rank_attention_output
from cpinfer.cp import STRATEGIES
from cpinfer.launch import WorkerPool

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


def run(args) -> int:
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    print(f"Context-parallel attention, CP{args.cp} vs one device: 3 sequences, H={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, fp32")
    rows = run_attention_demo(args.cp, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    print(format_rows(rows, args.cp))
    return 0 if all(r.ok for r in rows) else 1


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="CP attention on local CPU ranks vs one device (PASS/FAIL)",
                                   description=__doc__)
    parser.add_argument("--cp", type=positive_int, default=2, help="number of CP ranks (default: 2)")
    parser.add_argument("--heads", type=positive_int, default=8, help="query heads (default: 8)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (default: 2)")
    parser.add_argument("--head-dim", type=positive_int, default=64, help="head dimension (default: 64)")
    parser.set_defaults(func=run)
