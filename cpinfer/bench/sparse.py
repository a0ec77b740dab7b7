"""DeepSeek sparse attention against dense MLA attention under CP (`cpinfer bench sparse`): one layer's attention,
end to end, at the end of a long context — a chunk of new tokens (chunked / partial prefill) and one decode token.

Each rank holds its share of the context's latent rows and indexer keys (blocks of 64 positions dealt round-robin)
and runs the engine's own code for one forward's layer: dense, `BatchAttention.run` (pass-Q over the ranks, the MLA
form the engine would pick by FLOPs, `engine/mla_form.py`); sparse, `SparseAttention.run` (the indexer's scores of
every key, each rank's top-k, the candidates exchanged, attention over the selected latent rows, the merge). The
work column counts attention FLOPs by formula over every rank: dense as `mla_form.attention_flops`; sparse as the
indexer's 2 x heads x dim per (query, visible key) plus absorbed attention over each query's top-k.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist

from cpinfer.bench import common as C

BLOCK = 64  # positions per block dealt to the ranks


def _batch(context: int, new: int, world: int):
    """A ForwardBatch of one sequence: `new` tokens at the end of `context`, the cache before them dealt to the
    ranks in blocks; and every rank's cached positions (slots 0..n-1 in position order)."""
    from cpinfer.engine.batch import ForwardBatch, SeqInput

    cached = context - new
    owner = (np.arange(context) // BLOCK) % world
    cached_pos = [np.nonzero(owner[:cached] == r)[0] for r in range(world)]
    ranks = owner[cached:]
    slots = np.zeros(new, dtype=np.int64)
    for r in range(world):
        mine = np.nonzero(ranks == r)[0]
        slots[mine] = len(cached_pos[r]) + np.arange(len(mine))
    runs = tuple(np.array([[0, len(p)]] if len(p) else np.zeros((0, 2)), dtype=np.int64) for p in cached_pos)
    seq = SeqInput(token_ids=np.zeros(new, dtype=np.int64), start=cached, ranks=ranks, slots=slots, ctx_runs=runs,
                   sample=None, spread=world > 1)
    return ForwardBatch(seqs=(seq,), strategy="pass-q" if world > 1 else "local",
                        phase="decode" if new == 1 else "prefill"), cached_pos


def rank_time(ctx, shape: dict, context: int, new: int, repeat: int) -> dict:
    """This rank's seconds for one layer's dense and sparse attention (median of `repeat` after a warm-up)."""
    from cpinfer.attention.step import HeadLayout
    from cpinfer.engine.attention import BatchAttention, SlotPositions
    from cpinfer.engine.mla_form import choose_form
    from cpinfer.engine.sparse_attention import SparseAttention
    from cpinfer.model.config_parts import MLAConfig
    from cpinfer.model.indexer import IndexerRows

    torch.set_num_threads(1)
    world, rank = ctx.world_size, ctx.rank
    batch, cached_pos = _batch(context, new, world)
    s = batch.seqs[0]
    cap = context // world + 2 * BLOCK
    sp = SlotPositions(world, cap)
    for r in range(world):
        sp.pos[r, :len(cached_pos[r])] = cached_pos[r]
    sp.record(batch)
    mla = MLAConfig(kv_lora_rank=shape["rank"], qk_nope_head_dim=shape["nope"], qk_rope_head_dim=shape["rope"],
                    v_head_dim=shape["v"])
    h, width = shape["heads"], mla.key_width
    gen = torch.Generator().manual_seed(rank)
    store_k = torch.randn(cap + 1, 1, width, generator=gen)
    store_index = torch.randn(cap + 1, shape["index_dim"], generator=gen)
    plan = BatchAttention(batch, rank, world, ctx.group, None, ctx.device, sp)
    nq = int(plan.nq[rank])
    form = choose_form(mla, h, [(s.start, new, s.spread)], world, batch.strategy).form
    w_b = torch.randn(h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, generator=gen) * 0.05

    def expand(rows):  # latent rows [N, 1, D] -> per-head k [N, H, nope + rope], v [N, H, v] (kv_b_proj)
        c, kr = rows[:, 0].split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = (c @ w_b.T).view(rows.shape[0], h, -1)
        return torch.cat((kv[..., :mla.qk_nope_head_dim], kr[:, None].expand(-1, h, -1)), -1), \
            kv[..., mla.qk_nope_head_dim:]

    expanded = form == "expanded"
    dq = mla.qk_head_dim if expanded else width
    layout = HeadLayout(h, h if expanded else 1, dq, torch.float32)
    plan.prepare(layout, [None], store_k.shape[0], [None], True, expanded=expanded).upload()
    q = torch.randn(nq, h, dq, generator=gen)
    q_abs = torch.randn(nq, h, width, generator=gen)
    k_new = store_k[torch.as_tensor(plan.slots)]
    hi, di = shape["index_heads"], shape["index_dim"]
    rows = IndexerRows(torch.randn(nq, hi, di, generator=gen), torch.rand(nq, hi, generator=gen) * hi ** -0.5,
                       store_index[torch.as_tensor(plan.slots)], di ** -0.5)
    scale = mla.qk_head_dim ** -0.5

    def dense():
        plan.run(q, k_new, k_new[..., :mla.kv_lora_rank], store_k, store_k[..., :mla.kv_lora_rank], scale,
                 expand=expand if expanded else None)

    per_forward = SparseAttention(plan, sp, shape["topk"], ctx.device)  # once per forward, as the engine does

    def sparse():
        per_forward.run(q_abs, store_k, store_index, rows, scale, mla.kv_lora_rank)

    out = {"form": form}
    for name, fn in (("dense", dense), ("sparse", sparse)):
        times = []
        for i in range(repeat + 1):  # (the first: warm-up)
            if world > 1:
                dist.barrier(group=ctx.group)
            t0 = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    return out


def work(shape: dict, context: int, new: int, world: int, form: str) -> dict:
    """Attention FLOPs of the layer over every rank, dense (in `form`) and sparse (indexer + top-k attention)."""
    from cpinfer.engine.mla_form import attention_flops, forward_shape
    from cpinfer.model.config_parts import MLAConfig

    mla = MLAConfig(kv_lora_rank=shape["rank"], qk_nope_head_dim=shape["nope"], qk_rope_head_dim=shape["rope"],
                    v_head_dim=shape["v"])
    start = context - new
    pairs, queries, rows = forward_shape([(start, new, world > 1)], world, "pass-q")
    dense = attention_flops(mla, shape["heads"], pairs, queries, rows)[form]
    selected = sum(min(shape["topk"], start + i + 1) for i in range(new))
    sparse = attention_flops(mla, shape["heads"], selected, queries, 0)["absorbed"]
    sparse += pairs * 2 * shape["index_heads"] * shape["index_dim"]
    return {"dense": dense, "sparse": sparse}


def measure(args) -> dict:
    from cpinfer.launch import WorkerPool

    shape = {k: getattr(args, k) for k in DEFAULTS}
    rows = []
    for n in args.cp:
        with WorkerPool(n, threads_per_rank=1, timeout_s=3600) as pool:
            for context in args.context:
                for new in (args.new, 1):
                    per_rank = pool.run(rank_time, shape, context, new, args.repeat)
                    form = per_rank[0]["form"]
                    row = {"context": context, "new": new, "cp": n, "form": form,
                           "dense_s": max(r["dense"] for r in per_rank),
                           "sparse_s": max(r["sparse"] for r in per_rank), "work": work(shape, context, new, n, form)}
                    row["speedup"] = row["dense_s"] / row["sparse_s"]
                    row["work_ratio"] = row["work"]["dense"] / row["work"]["sparse"]
                    rows.append(row)
    return {"bench": "sparse", "command": command_line(args), "shape": shape, "repeat": args.repeat, "rows": rows}


def format_report(res: dict) -> str:
    s = res["shape"]
    head = (f"One layer's attention at the end of a context, dense MLA vs DeepSeek sparse attention (top-{s['topk']}); "
            f"MLA {s['heads']} heads, latent {s['rank']} + rope {s['rope']}, nope {s['nope']}, v {s['v']}; indexer "
            f"{s['index_heads']} heads x {s['index_dim']}; CPU, fp32, 1 thread a rank, median of {res['repeat']}:")
    rows = [[r["context"], r["new"], r["cp"], r["form"], f"{r['work']['dense'] / 1e9:.3g}",
             f"{r['work']['sparse'] / 1e9:.3g}", f"{r['work_ratio']:.1f}x", f"{r['dense_s'] * 1e3:.1f}",
             f"{r['sparse_s'] * 1e3:.1f}", f"{r['speedup']:.1f}x"] for r in res["rows"]]
    return "\n".join([head, "", C.fmt_table(["context", "new tokens", "CP", "dense form", "dense GFLOP",
                                             "sparse GFLOP", "work ratio", "dense ms", "sparse ms", "speed-up"],
                                            rows)])


DEFAULTS = dict(heads=16, rank=512, rope=64, nope=128, v=128, index_heads=8, index_dim=128, topk=2048)


def command_line(args) -> str:
    cmd = (f"cpinfer bench sparse --cp {','.join(map(str, args.cp))} --context "
           f"{','.join(map(str, args.context))} --new {args.new} --repeat {args.repeat}")
    for name, default in DEFAULTS.items():
        if getattr(args, name) != default:
            cmd += f" --{name.replace('_', '-')} {getattr(args, name)}"
    return cmd


def _lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 2:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of context lengths >= 2 (e.g. "
                                         f"16384,65536), got {text!r}")
    return lengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cp", type=C.cp_sizes, default=[1, 2], metavar="N,N", help="CP sizes (default: 1,2)")
    parser.add_argument("--context", type=_lengths, default=[16384, 65536], metavar="N,N",
                        help="context lengths (default: 16384,65536)")
    parser.add_argument("--new", type=C.positive_int, default=256,
                        help="new tokens of the prefill chunk (a decode token is timed too; default: 256)")
    parser.add_argument("--repeat", type=C.positive_int, default=1, help="timed runs after a warm-up (default: 1)")
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=C.positive_int, default=default,
                            help=f"{name} (default: {default})")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    parser.add_argument("--write-doc", nargs="?", const=C.DOC_PATH, type=C.Path, metavar="FILE",
                        help=f"replace (or append) this run's section in FILE (default: {C.DOC_PATH})")


def run(args) -> int:
    if args.new >= min(args.context):
        raise SystemExit(f"--new {args.new} must be below every context length ({min(args.context)})")
    return C.run_measured(args, measure, format_report, "sparse",
                          lambda res: f"DeepSeek sparse attention vs dense MLA, contexts "
                                      f"{', '.join(map(str, args.context))}, CP {', '.join(map(str, args.cp))}")
