"""Sampling parameters (shaped like vLLM's) and the sampler, which runs on the rank that holds the logits.

Sampling is reproducible whatever the CP size or batch: the random draw of output token k of a request uses a
generator seeded from (request seed, k), so any rank can take it and a preempted request resamples identically.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the output (not included in the text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each chosen token
    top_logprobs: int = 0  # also the k most likely tokens at each step (implies logprobs)
    prompt_logprobs: bool = False  # log-probability of each prompt token (first is None); disables prefix reuse

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """What the rank holding a request's last new token must do with its logits (a small typed message)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int  # the request's seed (a random one when the user gave none)
    step: int  # index of the output token being sampled
    top_logprobs: int  # 0: only the chosen token's log-probability

    @classmethod
    def of(cls, params: SamplingParams, seed: int, step: int) -> "SampleSpec":
        return cls(params.temperature, params.top_p, params.top_k, seed, step, params.top_logprobs)


def sample(logits: torch.Tensor, spec: SampleSpec) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """logits [vocab] → (token id, its log-probability under the model's unmodified distribution, top-k list)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if spec.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        scores = logits / spec.temperature
        if spec.top_k:
            kth = torch.topk(scores, min(spec.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        if spec.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            drop = probs.cumsum(-1) - probs >= spec.top_p  # keep the smallest nucleus
            scores[order[drop]] = -torch.inf
        gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2 ** 63))
        token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen))
    top: tuple[tuple[int, float], ...] = ()
    if spec.top_logprobs:
        vals, idx = torch.topk(logprobs, spec.top_logprobs)
        top = tuple(zip(idx.tolist(), vals.tolist()))
    return token, float(logprobs[token]), top
