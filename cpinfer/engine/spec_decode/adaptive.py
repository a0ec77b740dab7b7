"""Per-request speculation state: its acceptance statistics and the rule that picks how many tokens it drafts next.

The rule (docs/engine.md, "Speculative decoding"): with a per-token acceptance rate a (an exponential average of
accepted / drafted over its verify steps), a step drafting k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on
average and costs about 1 + c k plain decode steps, c being one more row's share of a decode step, measured by
`StepCost` (VERIFY_TOKEN_COST until it has measured). The request drafts the k in [1, K] of the largest
E(k) / (1 + c k); when even that gain is below 1 it pauses (decodes plainly) for a number of steps that doubles each
time (8, 16, ... 64), then tries again with k = 1. The engine's requests pick k among `draft_sizes` (1, 2, 4, ...,
K): the widths the static decode path captures.
"""
from __future__ import annotations

import dataclasses

VERIFY_TOKEN_COST = 0.1  # one more verified row, as a share of a plain decode step (ring and KV read paid once)
EMA = 0.3  # weight of the latest verify step in the acceptance average
PRIOR = 0.7  # the acceptance assumed before the first verify step
PAUSE_FIRST, PAUSE_MAX = 8, 64


class StepCost:
    """The engine's decode forwards timed against their rows (new tokens: 1 per plain decode, k+1 per verify): an
    exponentially weighted least-squares line seconds = alpha + beta * rows. `row_share(n)` is one more row's cost
    as a share of a plain decode forward of n rows."""

    DECAY = 0.98  # weight of older forwards per new one (about the last 50 count)
    MIN_FORWARDS = 8

    def __init__(self):
        self.n = 0
        self.w = self.x = self.y = self.xx = self.xy = 0.0  # weighted sums

    def add(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds
        self.n += 1

    def row_share(self, rows: int) -> float:
        if self.n < self.MIN_FORWARDS:
            return VERIFY_TOKEN_COST
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:  # rows hardly varied yet: no slope to read
            return VERIFY_TOKEN_COST
        beta = max(0.0, (self.xy / self.w - mx * my) / var)
        alpha = my - beta * mx
        plain = alpha + beta * max(1, rows)
        return VERIFY_TOKEN_COST if plain <= 0 else beta / plain


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step of k drafts emits on average at per-token acceptance a (accepted prefix + 1)."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def draft_sizes(k_max: int) -> tuple[int, ...]:
    """The draft lengths a request picks among: 1, 2, 4, 8, ... below k_max, and k_max. The static decode path
    captures one graph per (sequences, k + 1) bucket (`decode_graph.py`), so a handful of widths keeps the graphs
    few; every path uses the same sizes, so a request's steps do not depend on which path runs them."""
    return tuple(sorted({1 << i for i in range(k_max.bit_length()) if 1 << i < k_max} | {k_max}))


def verify_widths(k_max: int) -> tuple[int, ...]:
    """The rows (k + 1) of a verify sequence of each draft size: the static path's captured verify widths."""
    return tuple(k + 1 for k in draft_sizes(k_max))


def best_k(a: float, k_max: int, cost: float = VERIFY_TOKEN_COST,
           sizes: tuple[int, ...] | None = None) -> tuple[int, float]:
    """(k in `sizes` (None: [1, k_max]) of the largest expected gain over plain decoding, that gain)."""
    gains = [(expected_tokens(a, k) / (1.0 + cost * k), k) for k in (sizes or range(1, k_max + 1))]
    gain, k = max(gains)
    return k, gain


@dataclasses.dataclass
class SpecState:
    """One request's speculation: its next k, pause, and counters (its `metrics["spec"]`)."""

    k_max: int
    acceptance: float = PRIOR
    pause: int = 0  # plain decode steps left before it speculates again
    next_pause: int = PAUSE_FIRST
    num_drafts: int = 0  # verify steps with at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens the verify steps emitted (accepted + the target's own)
    last_drafted: int = 0  # the latest verify step's drafted / accepted tokens (the proposer's `verified` hook)
    last_accepted: int = 0
    cost: float = VERIFY_TOKEN_COST  # the row cost its last decision used
    sizes: tuple[int, ...] | None = None  # the draft lengths it picks among (`draft_sizes`; None: every k <= k_max)

    @classmethod
    def of(cls, k_max: int) -> "SpecState":
        """An engine request's state: k among `draft_sizes(k_max)`."""
        return cls(k_max, sizes=draft_sizes(k_max))

    def next_k(self, cost: float = VERIFY_TOKEN_COST) -> int:
        """Tokens to draft this step (0: decode plainly); cost: one more verified row's share of a decode step."""
        self.cost = cost
        if self.pause > 0:
            self.pause -= 1
            return 0 if self.pause > 0 else 1  # the pause's last step probes with one draft
        k, gain = best_k(self.acceptance, self.k_max, cost, self.sizes)
        if gain < 1.0:
            self.pause, self.next_pause = self.next_pause, min(PAUSE_MAX, 2 * self.next_pause)
            return 0
        return k

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        """A verify step of `drafted` tokens kept `accepted` of them and emitted `emitted` tokens in all."""
        self.num_drafts += 1
        self.last_drafted, self.last_accepted = drafted, accepted
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        self.acceptance = (1 - EMA) * self.acceptance + EMA * (accepted / drafted)
        if best_k(self.acceptance, self.k_max, self.cost, self.sizes)[1] >= 1.0:
            self.next_pause = PAUSE_FIRST

    def metrics(self) -> dict:
        d = self.num_draft_tokens
        return {"num_drafts": self.num_drafts, "num_draft_tokens": d, "num_accepted_tokens": self.num_accepted_tokens,
                "num_emitted_tokens": self.num_emitted_tokens,
                "acceptance_rate": self.num_accepted_tokens / d if d else 0.0,
                "mean_accepted_length": self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0}
