"""Block shapes of ring attention under load-balanced sharding (paper §3.5.1-3.5.3), for the cost model.

One sequence of T new tokens (after P cached ones) is padded to 2N equal chunks of c = ceil(T / 2N) tokens;
rank i holds new chunks i and 2N-1-i and about P/N cached tokens. Cached keys precede every new token, so they
are visible to all new queries; between new chunks a and b, a query chunk sees all of b when a > b, the causal
triangle when a == b, and nothing when a < b.
"""
from __future__ import annotations

from dataclasses import dataclass

from cpinfer.utils import ceil_div, check_positive


@dataclass(frozen=True)
class RingShape:
    n: int          # CP ranks
    new: int        # T, new tokens of the sequence
    cached: int     # P, cached tokens of the sequence

    def __post_init__(self) -> None:
        check_positive(self.n, "CP size")
        check_positive(self.new, "new tokens")
        if self.cached < 0:
            raise ValueError(f"cached tokens must be >= 0, got {self.cached}")

    @property
    def chunk(self) -> int:  # c, padded chunk length
        return ceil_div(self.new, 2 * self.n)

    @property
    def q_tokens(self) -> int:  # new tokens (queries) per rank, padding included
        return 2 * self.chunk

    @property
    def padding(self) -> int:  # padded tokens over the whole sequence
        return 2 * self.n * self.chunk - self.new

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.n - 1 - rank

    def cached_on(self, rank: int) -> int:
        """Cached tokens on `rank`: the earlier load-balanced turns left them spread evenly."""
        return self.cached // self.n + (rank < self.cached % self.n)

    def kv_tokens(self, rank: int) -> int:
        return self.cached_on(rank) + self.q_tokens

    @property
    def max_kv_tokens(self) -> int:  # pass-KV messages are padded to the longest rank (Alg. 2)
        return ceil_div(self.cached, self.n) + self.q_tokens

    def _chunk_pairs(self, qa: int, kb: int) -> int:
        c = self.chunk
        if qa > kb:
            return c * c
        return c * (c + 1) // 2 if qa == kb else 0

    def visible_pairs(self, q_rank: int, kv_rank: int) -> int:
        """(query, key) pairs computed when q_rank's queries meet kv_rank's keys."""
        new = sum(self._chunk_pairs(a, b) for a in self.chunks_of(q_rank) for b in self.chunks_of(kv_rank))
        return new + self.q_tokens * self.cached_on(kv_rank)

    def total_pairs(self) -> int:
        return sum(self.visible_pairs(q, k) for q in range(self.n) for k in range(self.n))
