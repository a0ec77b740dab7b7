"""Sampling parameters (shaped like vLLM's) and the sampler that runs on the driver."""
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
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each chosen token
    prompt_logprobs: bool = False  # log-probability of each prompt token (first is None); disables prefix reuse

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """logits [vocab] fp32 → (token id, its log-probability under the model's unmodified distribution)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        scores = logits.float() / params.temperature
        if params.top_k:
            kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        if params.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_scores, dim=-1) >= params.top_p  # keep the smallest nucleus
            scores[order[drop]] = -torch.inf
        token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
    return token, float(logprobs[token])
