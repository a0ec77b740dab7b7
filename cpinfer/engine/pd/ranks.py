"""What the P/D driver runs on its ranks (paper §4.3): each rank's model runner for its role, its KV store once the
roles are sized, and one call of a group (cache operations, the transfer orders of `kv/transfer.py`, the forward
with the prompt sends riding it, then the receives that are in)."""
from __future__ import annotations

import os
import pickle
import time

import torch

from cpinfer.attention.autoselect import chosen
from cpinfer.attention.backends import resolve_name
from cpinfer.distributed import ParallelConfig, build_role_groups
from cpinfer.engine import model_runner as MR
from cpinfer.engine.kv.transfer import TransferOrders, apply_orders, transfers_of


def init_role_runner(ctx, roles: list[tuple[int, int, int]], model_path: str, dtype: str,
                     capacities: list[int | None], attention_backend: str | None = None, decode: dict | None = None,
                     kv_cache_dtype: str = "auto", load_format: str = "auto", sizings: list[dict | None] | None = None
                     ) -> dict:
    """Every rank: build every role's CP / TP groups (roles = (cp, tp, first global rank) each, prefill first), then
    this rank's model runner over its role's groups. With its role's capacity, allocate its KV store now; with None
    (CUDA), measure instead as `model_runner.init_runner` does, with its role's own profile
    (`sizings[role]` = {"tokens", "utilization", "ranks_per_device", "block"}): the answer's `kv_capacity` is what
    this rank could hold; the driver then calls `allocate_role_kv` with each role's smallest."""
    ctx.state.pop("draft", None)  # a draft model belongs to the runner it was loaded beside (`load_draft`)
    groups = build_role_groups([(ParallelConfig(cp, tp), offset) for cp, tp, offset in roles], ctx.rank)
    role = next(i for i, (cp, tp, offset) in enumerate(roles) if offset <= ctx.rank < offset + cp * tp)
    sizing = None if capacities[role] is not None else sizings[role]
    probe = None
    if sizing is not None:
        probe = MR.MemoryProbe(ctx.device, shared=sizing["ranks_per_device"] > 1)
        probe.start()
    t0 = time.perf_counter()
    runner = MR.ModelRunner(ctx, model_path, getattr(torch, dtype), groups.config, attention_backend, decode,
                            kv_cache_dtype, load_format, groups=groups)
    t1 = time.perf_counter()
    runner.backend = resolve_name(attention_backend, ctx.device, layout=runner.layout)
    ctx.state["runner"] = runner
    ctx.state["pd_role"] = role
    choice = chosen(ctx.device, runner.layout, None)
    info = {"pid": os.getpid(), "attention_backend": runner.backend, "load_s": t1 - t0, "role": role,
            "kv_bytes_per_token": runner.kv_bytes_per_token,
            "attention_timings_ms": dict(choice.timings_ms) if choice is not None else {}}
    if sizing is None:
        runner.allocate_kv(capacities[role])
        return info
    info.update(MR.measure_kv(runner, probe, sizing))  # this role's largest forward on one of its ranks
    return info


def allocate_role_kv(ctx, capacities: list[int]) -> None:
    """Every rank: its KV store at its role's capacity (after `init_role_runner` measured)."""
    ctx.state["runner"].allocate_kv(capacities[ctx.state["pd_role"]])


def role_call(ctx, orders: TransferOrders, batch: bytes | None, cache_ops: tuple = ()):
    """One call of a group's rank: tier cache operations decided before the orders (a segment evicted to make room
    for received rows is copied down first), the transfer orders, then the forward when there is one — whose layers
    post the prompt sends riding it as each is written — then the receives that are in. Returns (RankResult or
    None, transfer figures: bytes sent, per transfer id the messages / bytes posted here and how many of them from
    inside the forward, the transfers complete here `recv_bytes`, those failed here `failed`)."""
    runner = ctx.state["runner"]
    events = runner.apply_cache_ops(cache_ops) if cache_ops else ()
    figures = apply_orders(ctx, runner, orders) if orders else {}
    rt = transfers_of(ctx, runner)
    riding = [s for s in orders.sends if s.in_forward]
    keeps = rt.keeps(riding)
    layers = runner.store.k.shape[0]
    posted: set[int] = set()
    if riding and batch is not None:
        def written(layer: int) -> None:  # layer's rows of this forward are in the store: its messages go now
            if layer not in posted:  # (once, should a model attend with a layer twice)
                rt.post_sends(riding, keeps, (layer,), figures, inside=True)
                posted.add(layer)
        runner.on_kv_written = written
    draft = ctx.state.get("draft")  # a decode group's draft model mirrors its forwards (`spec_decode/draft_runner`)
    try:
        forward = pickle.loads(batch) if batch is not None else None
        if forward is not None and draft is not None:
            draft.mirror(forward)
        result = runner.execute(forward) if forward is not None else None
    finally:
        runner.on_kv_written = None
    if riding:  # a rank idle in the forward, or a path without the per-layer hook: every layer left, now
        rt.post_sends(riding, keeps, [layer for layer in range(layers) if layer not in posted], figures)
    rt.post_state_sends([s for s in orders.state_sends if s.in_forward], figures)  # final once the forward is done
    t0 = time.perf_counter()
    done, failed = rt.settle(orders.wait)
    figures.update(recv_bytes=done, failed=failed, recv_wait_s=time.perf_counter() - t0, tier_events=events,
                   recv_pending=len(rt.recvs))
    return result, figures
