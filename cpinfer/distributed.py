"""CP × TP layout (paper §4.1): TP inside a node, CP across nodes, one CP group per TP index.

Global rank = cp_rank * tp + tp_rank, so the tp ranks of one "node" are consecutive. Each CP group holds the
ranks with the same TP index — the same KV heads — and runs its own ring; each TP group is one node and
all-reduces after the row-parallel linears. `ParallelConfig` validates itself; `build_groups` creates every
group once, in the same order on every rank, and callers pass the groups down explicitly.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("cp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} size must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(cp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    def rank_of(self, cp_rank: int, tp_rank: int) -> int:
        """The global rank at (cp_rank, tp_rank) (`coords`' inverse)."""
        return cp_rank * self.tp + tp_rank

    def check_model(self, n_heads: int, n_kv_heads: int) -> None:
        """TP must split the query heads evenly, and either split the KV heads or replicate them evenly."""
        if n_heads % self.tp:
            raise ValueError(f"tensor_parallel_size {self.tp} must divide the number of attention heads ({n_heads})")
        if n_kv_heads % self.tp and self.tp % n_kv_heads:
            raise ValueError(f"tensor_parallel_size {self.tp} must divide the number of key/value heads "
                             f"({n_kv_heads}) or be a multiple of it (KV heads are then replicated)")

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(f"context_parallel_size × tensor_parallel_size = {self.cp} × {self.tp} = "
                             f"{self.world_size}, but the launched world has {world_size} processes")


@dataclasses.dataclass
class ParallelGroups:
    config: ParallelConfig
    rank: int
    cp_rank: int
    tp_rank: int
    cp_group: object
    tp_group: object  # None when tp == 1


def build_groups(config: ParallelConfig, rank: int, world_group, timeout_s: float = 300.0) -> ParallelGroups:
    """Create all CP and TP groups (collective over the world: every rank calls this in the same order)."""
    config.check_world(dist.get_world_size(world_group) if world_group is not None else 1)  # None: one process
    cp_rank, tp_rank = config.coords(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    cp_group = tp_group = None
    if config.tp == 1:
        cp_group = world_group
    else:
        for t in range(config.tp):  # CP groups: one per TP index
            g = dist.new_group([config.rank_of(c, t) for c in range(config.cp)], timeout=timeout)
            if t == tp_rank:
                cp_group = g
        for c in range(config.cp):  # TP groups: one per node
            g = dist.new_group([config.rank_of(c, t) for t in range(config.tp)], timeout=timeout)
            if c == cp_rank:
                tp_group = g
    return ParallelGroups(config, rank, cp_rank, tp_rank, cp_group, tp_group)


def build_role_groups(roles: list[tuple[ParallelConfig, int]], rank: int, timeout_s: float = 300.0) -> ParallelGroups:
    """Prefill and decode groups in one world: `roles` = (its CP × TP config, its first global rank) for every role,
    in the same order on every rank. Each role's CP and TP groups are made over its own ranks (global rank =
    offset + cp_rank * tp + tp_rank), every rank creating every group in the same order (`dist.new_group` is
    collective over the world); returns the groups of the role `rank` belongs to, with role-local coordinates."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    for config, offset in roles:
        cp_of, tp_of = {}, {}
        for t in range(config.tp):  # CP groups: one per TP index
            cp_of[t] = dist.new_group([offset + config.rank_of(c, t) for c in range(config.cp)], timeout=timeout)
        if config.tp > 1:
            for c in range(config.cp):  # TP groups: one per node
                tp_of[c] = dist.new_group([offset + config.rank_of(c, t) for t in range(config.tp)], timeout=timeout)
        if offset <= rank < offset + config.world_size:
            cp_rank, tp_rank = config.coords(rank - offset)
            mine = ParallelGroups(config, rank, cp_rank, tp_rank, cp_of[tp_rank], tp_of.get(cp_rank))
    if mine is None:
        raise ValueError(f"rank {rank} belongs to no role of {[(c.cp, c.tp, o) for c, o in roles]}")
    return mine
