"""Where the (query, key) pairs of one sequence's ring attention fall under load-balanced sharding (§3.5.1-§3.5.3),
per ring step and rank, with an optional sliding window and / or attention chunk: the geometry `cost_model.py`
prices.

T new tokens after P cached ones are padded to 2N chunks of c = ceil(T / 2N); rank i holds new chunks i and 2N-1-i
and about P/N cached tokens spread evenly over the cached positions (earlier turns were sharded the same way).
Rank r's queries meet rank s's keys at ring step (r - s) mod N; pass-KV and pass-Q meet the same pairs there.
Pure integer arithmetic, no torch: the heuristic and the engine call it per forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cpinfer.utils import ceil_div, check_positive


@dataclass(frozen=True)
class RingShape:
    n: int           # N, CP ranks the sequence spans
    new: int         # T, new tokens of the sequence
    cached: int      # P, cached tokens of the sequence
    window: int = 0  # sliding window W (key j visible to query i only if i - j < W); 0: none
    attention_chunk: int = 0  # chunked attention C (key j visible to query i only if i // C == j // C); 0: none

    def __post_init__(self) -> None:
        check_positive(self.n, "CP size")
        check_positive(self.new, "new tokens")
        for what in ("cached", "window", "attention_chunk"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{what} tokens must be a non-negative integer, got {value!r}")

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

    def visible_pairs(self, q_rank: int, kv_rank: int) -> float:
        """(query, key) pairs computed when q_rank's queries meet kv_rank's keys (padding rows included, as the
        kernels compute them); fractional only for the cached part of a windowed or chunked layer (an even
        spread)."""
        c, w = self.chunk, self.window
        if self.attention_chunk:
            return self._chunked_pairs(q_rank, kv_rank)
        new = sum(_band_pairs(a * c, c, b * c, c, w) for a in self.chunks_of(q_rank) for b in self.chunks_of(kv_rank))
        if not w:
            return new + self.q_tokens * self.cached_on(kv_rank)
        # query at new offset t sees the cached positions [P + t - W + 1, P): clamp(W - 1 - t, 0, P) of them,
        # of which kv_rank holds its share
        seen = sum(_clamp_sum(w - (a + 1) * c, w - 1 - a * c, self.cached) for a in self.chunks_of(q_rank))
        return new + (seen * self.cached_on(kv_rank) / self.cached if self.cached else 0)

    def _chunked_pairs(self, q_rank: int, kv_rank: int) -> float:
        """visible_pairs under an attention chunk, at absolute positions (new token t sits at P + t)."""
        c, w, big_c, p = self.chunk, self.window, self.attention_chunk, self.cached
        new = sum(_chunk_band_pairs(p + a * c, c, p + b * c, c, w, big_c)
                  for a in self.chunks_of(q_rank) for b in self.chunks_of(kv_rank))
        seen = sum(_cached_seen(p + a * c, c, p, w, big_c) for a in self.chunks_of(q_rank))
        return new + (seen * self.cached_on(kv_rank) / p if p else 0)

    def step_pairs(self, step: int) -> float:
        """Pairs of the slowest rank at ring step `step` (every rank computes one block per step)."""
        if not self.window and not self.attention_chunk:
            c = self.chunk  # closed form: 2c^2 new pairs off the diagonal step, 2c^2 + c on it
            return 2 * c * c + (c if step == 0 else 0) + self.q_tokens * ceil_div(self.cached, self.n)
        return _windowed_step_pairs(self, step)

    def total_pairs(self) -> float:
        return sum(self.visible_pairs(q, k) for q in range(self.n) for k in range(self.n))


@lru_cache(maxsize=4096)
def _windowed_step_pairs(ring: RingShape, step: int) -> float:
    return max(ring.visible_pairs(r, (r - step) % ring.n) for r in range(ring.n))


def _band_pairs(q0: int, nq: int, k0: int, nk: int, window: int) -> int:
    """Pairs (i, j), i in [q0, q0+nq), j in [k0, k0+nk), with 0 <= i - j (< window when window > 0)."""
    if nq <= 0 or nk <= 0:
        return 0
    future = _at_most(q0, nq, k0, nk, -1)           # pairs with j > i
    upto = nq * nk if not window else _at_most(q0, nq, k0, nk, window - 1)
    return upto - future


def _chunk_pieces(q0: int, nq: int, chunk: int):
    """[lo, hi) pieces of the positions [q0, q0 + nq) cut at multiples of `chunk`."""
    lo = q0
    while lo < q0 + nq:
        hi = min(q0 + nq, (lo // chunk + 1) * chunk)
        yield lo, hi
        lo = hi


def _chunk_band_pairs(q0: int, nq: int, k0: int, nk: int, window: int, chunk: int) -> int:
    """_band_pairs restricted to pairs in one chunk: each query piece against the keys of its own chunk."""
    total = 0
    for lo, hi in _chunk_pieces(q0, nq, chunk):
        start = lo // chunk * chunk
        ka, kb = max(k0, start), min(k0 + nk, start + chunk)
        total += _band_pairs(lo, hi - lo, ka, kb - ka, window)
    return total


def _cached_seen(q0: int, nq: int, cached: int, window: int, chunk: int) -> int:
    """Cached keys (positions [0, cached)) the queries at positions [q0, q0 + nq) >= cached see under the chunk (and
    the window): per query min(cached - chunk start, window - 1 - (query - cached)), clamped at 0."""
    total = 0
    for lo, hi in _chunk_pieces(q0, nq, chunk):
        room = cached - lo // chunk * chunk  # cached keys in the query's chunk
        if room <= 0:
            continue
        if not window:
            total += room * (hi - lo)
        else:  # query p sees clamp(cached + window - 1 - p, 0, room)
            total += _clamp_sum(cached + window - hi, cached + window - 1 - lo, room)
    return total


def _at_most(q0: int, nq: int, k0: int, nk: int, d: int) -> int:
    """#{(i, j): i - j <= d}: for each i, the keys j >= i - d, i.e. clamp(k0 + nk + d - i, 0, nk)."""
    top = k0 + nk + d
    return _clamp_sum(top - (q0 + nq - 1), top - q0, nk)


def _clamp_sum(lo: int, hi: int, cap: int) -> int:
    """sum of clamp(x, 0, cap) over the integers x in [lo, hi]."""
    if hi < lo:
        return 0
    return _clamp_prefix(hi, cap) - _clamp_prefix(lo - 1, cap)


def _clamp_prefix(x: int, cap: int) -> int:
    """sum of clamp(v, 0, cap) over the integers v <= x."""
    if x <= 0:
        return 0
    if x <= cap:
        return x * (x + 1) // 2
    return cap * (cap + 1) // 2 + (x - cap) * cap
