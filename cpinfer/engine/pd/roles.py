"""The roles of a prefill / decode world (paper §4.3: CP for prefill, decoupled from decode): their sizes and ranks
(`PDConfig`, `RoleRanks`), what P/D refuses to combine with, and each role's KV capacity once its ranks measured."""
from __future__ import annotations

import dataclasses

from cpinfer.engine.spec_decode.config import SpeculativeConfig
from cpinfer.launch import WorkerPool
from cpinfer.utils import get_logger

log = get_logger()


@dataclasses.dataclass(frozen=True)
class PDConfig:
    """The roles of a prefill / decode world: CP-N prefill and K decode groups of CP-M, all with TP ranks each."""

    prefill_cp: int
    decode_cp: int
    decode_groups: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("prefill_cp", "decode_cp", "decode_groups", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                what = {"prefill_cp": "context_parallel_size", "decode_cp": "pd_decode_cp",
                        "decode_groups": "pd_decode_groups", "tp": "tensor_parallel_size"}[name]
                raise ValueError(f"{what} must be a positive integer, got {v!r}")

    @property
    def roles(self) -> list[tuple[int, int, int]]:
        """(cp, tp, first global rank) of every group, prefill first."""
        out = [(self.prefill_cp, self.tp, 0)]
        for g in range(self.decode_groups):
            out.append((self.decode_cp, self.tp, (self.prefill_cp + g * self.decode_cp) * self.tp))
        return out

    @property
    def world_size(self) -> int:
        return (self.prefill_cp + self.decode_groups * self.decode_cp) * self.tp

    @property
    def cp_ranks(self) -> int:
        return self.prefill_cp + self.decode_groups * self.decode_cp


def check_pd_args(kwargs: dict) -> None:
    """What P/D cannot combine with, refused before anything starts."""
    if kwargs.get("placement", "auto") == "local":
        raise ValueError("placement 'local' cannot be combined with pd_decode_cp: the decode group lays out a request's "
                         "K/V itself; use placement 'auto' or 'shard'")
    SpeculativeConfig.parse(kwargs.get("speculative_config"))  # a draft model runs on the decode groups only


def role_capacities(capacities: list[int | None], infos: list[dict], ranks: list[list[int]]) -> list[int]:
    """Each role's KV tokens per rank: as given, or (None: measured) the smallest its own ranks reported, so every
    rank of a group holds the same number of slots; the roles differ (their profiles and devices do)."""
    return [c if c is not None else min(infos[r]["kv_capacity"] for r in rs) for c, rs in zip(capacities, ranks)]


def log_role_capacities(groups: list, infos: list[dict], views: list[RoleRanks]) -> None:
    """Each role's KV cache at start (groups: its `GroupEngine`s): measured (with its profile and its ranks' limits)
    or given."""
    gib = float(1 << 30)
    for g, v in zip(groups, views):
        cap, per_token = g.kv.capacity_per_rank, infos[v.ranks[0]]["kv_bytes_per_token"]
        if g.sizing is None:
            log.info("KV cache: %s group: %d tokens per rank (%.2f GiB each)", g.role, cap, cap * per_token / gib)
            continue
        m = infos[v.ranks[0]]["memory"]
        log.info("KV cache: %s group: %d tokens per rank (%.2f GiB each), from gpu_memory_utilization %.2f of %.1f GiB "
                 "per GPU after the weights and a profiling forward of %d tokens per rank peaked at %.2f GiB (rank "
                 "%d); per-rank limits %s", g.role, cap, cap * per_token / gib, g.sizing["utilization"],
                 m["total"] / gib, g.sizing["tokens"], m["peak"] / gib, v.ranks[0],
                 [infos[r]["kv_capacity"] for r in v.ranks])


class RoleRanks:
    """A group's ranks inside the world's pool, with the `run` interface `LLMEngine` calls between steps."""

    driver_rank = False

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.pool: WorkerPool | None = None  # set once the world has started

    @property
    def dead_reason(self) -> str | None:
        return None if self.pool is None else self.pool.dead_reason

    def run(self, fn, *args, **kwargs) -> list:
        answers = self.pool.run_some(fn, [args if r in self.ranks else None for r in range(self.pool.world_size)],
                                     kwargs)
        return [answers[r] for r in self.ranks]

    def close(self, force: bool = False) -> None:  # the P/D engine closes the world
        pass
