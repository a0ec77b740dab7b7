"""Sampling parameters (shaped like vLLM's) and the sampler, which runs on the rank that holds the logits.

Sampling is reproducible whatever the CP size or batch: the random draw of output token k of a request uses a
generator seeded from (request seed, k), so any rank can take it and a preempted request resamples identically.
Penalties (`presence_penalty`, `frequency_penalty`, `repetition_penalty`), `min_p` and `min_tokens` follow vLLM's
semantics and order: grammar mask, logit bias and the `min_tokens` stop-token mask, then the penalties on the
logits, then greedy argmax, or temperature → min_p → top-k → top-p → the draw.

The sampler is total: any logits (NaN, ±inf included) and any valid parameters give a token, unless the request's
own constraints (its grammar mask, its logit bias) leave no token allowed; that is a `SamplingError` for that
request alone, never for the forward. After the bias, the masks and the penalties the scores are cleaned once
(`_clean`: NaN → -inf, +inf → the largest float), so no parameter value can reach the draw as NaN or +inf.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow the scores
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
_NEG = -math.inf
_FMAX = torch.finfo(torch.float32).max


class SamplingError(ValueError):
    """A request's own sampling cannot proceed (e.g. its constraints allow no token): it fails alone."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_EPS) → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the output (not included in the text), looked for only in the
    # text after the first min_tokens tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # log-probability of each chosen token
    top_logprobs: int = 0  # also the k most likely tokens at each step (implies logprobs); <= max_logprobs
    prompt_logprobs: bool = False  # log-probability of each prompt token (first is None), and its `top_logprobs`
    # most likely tokens when that is set; the prompt is recomputed, never taken from the prefix cache (requests
    # of the same prompt in flight together copy the first's: LLMEngine._prompt_logprobs_source)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    grammar: str | None = None  # an llguidance grammar (JSON) the output must follow (docs/serving.md)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every token already output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0  # > 0: logits of prompt and output tokens divided (if > 0) or multiplied by it
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely (after temperature)
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many tokens
    skip_special_tokens: bool = True  # special tokens are left out of the output text
    include_stop_str_in_output: bool = False  # keep the stop string (or the stop / EOS token's text) in the text

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0 (the engine bounds it: max_logprobs), "
                             f"got {self.top_logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = tuple((int(t), float(b)) for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                                      else self.logit_bias))
        if any(t < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in bias):
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {bias[:8]!r}")
        object.__setattr__(self, "logit_bias", bias)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be an llguidance grammar as a JSON string")
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {m!r}")

    @property
    def penalized(self) -> bool:
        """Sampling reads the tokens so far (the output; the prompt too for the repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """What the rank holding a request's last new token must do with its logits (a small typed message)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int  # the request's seed (a random one when the user gave none)
    step: int  # index of the output token being sampled
    top_logprobs: int  # 0: only the chosen token's log-probability
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed: np.ndarray | None = None  # [ceil(V/32)] int32 bitmask of the tokens the request's grammar allows
    min_p: float = 0.0
    suppress: tuple[int, ...] = ()  # tokens that may not come yet (stop tokens before min_tokens)
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    output: np.ndarray | None = None  # [k] int64 output tokens so far (penalized requests only)
    prompt: np.ndarray | None = None  # [u] int64 distinct prompt tokens (repetition penalty only)

    @classmethod
    def of(cls, params: SamplingParams, seed: int, step: int, allowed: np.ndarray | None = None,
           suppress: tuple[int, ...] = (), output: np.ndarray | None = None,
           prompt: np.ndarray | None = None) -> "SampleSpec":
        return cls(params.temperature, params.top_p, params.top_k, seed, step, params.top_logprobs,
                   params.logit_bias, allowed, params.min_p, suppress, params.presence_penalty,
                   params.frequency_penalty, params.repetition_penalty, output, prompt)


def allowed_mask(bitmask: np.ndarray, vocab: int) -> torch.Tensor:
    """[ceil(V/32)] int32 bitmask (bit j of word i = token 32 i + j) → [vocab] bool."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), bitorder="little")
    mask = np.zeros(vocab, dtype=bool)
    n = min(vocab, len(bits))
    mask[:n] = bits[:n].astype(bool)
    return torch.from_numpy(mask)


def _processed(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """Finite-or--inf scores: NaN → -inf, +inf → the largest float, then the bias, the grammar mask, the held-back
    stop tokens and the penalties, cleaned once more."""
    scores = _clean(logits.float())
    vocab = scores.numel()
    if spec.logit_bias:
        ids = torch.tensor([t for t, _ in spec.logit_bias if t < vocab], dtype=torch.long)
        vals = torch.tensor([b for t, b in spec.logit_bias if t < vocab], dtype=torch.float32)
        scores = scores.index_add(0, ids, vals) if len(ids) else scores
    ok = torch.ones(vocab, dtype=torch.bool)  # [vocab] the tokens the request may take now
    if spec.allowed is not None:
        ok = allowed_mask(spec.allowed, vocab)
        if not bool(ok.any()):
            raise SamplingError("the output constraint (response_format / tools) allows no next token")
    grammar_ok = ok.clone()
    if spec.suppress:
        ok[torch.tensor([t for t in spec.suppress if t < vocab], dtype=torch.long)] = False
    scores = _clean(penalize(scores.masked_fill(~ok, _NEG), spec))  # the one check after bias, masks, penalties
    if bool(torch.isneginf(scores).all()):  # nothing finite: every allowed token is equally likely
        ok = ok if bool(ok.any()) else grammar_ok  # held-back stop tokens only when nothing else is allowed
        scores = torch.zeros_like(scores).masked_fill(~ok, _NEG)
    return scores


def penalize(scores: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """vLLM's penalties on [vocab] scores: the repetition penalty on every token of the prompt or the output so far
    (a positive score divided by it, a negative one multiplied), then frequency × count and presence × seen
    subtracted for the output's tokens."""
    if spec.output is None and spec.prompt is None:
        return scores
    vocab = scores.numel()
    out = torch.as_tensor(spec.output if spec.output is not None else np.zeros(0, np.int64), dtype=torch.long)
    counts = torch.bincount(out[out < vocab], minlength=vocab).float()  # [vocab]
    if spec.repetition != 1.0:
        seen = counts > 0
        if spec.prompt is not None:
            prompt = torch.as_tensor(spec.prompt, dtype=torch.long)
            seen[prompt[prompt < vocab]] = True
        scores = _repeat(scores, seen, spec.repetition)
    if spec.frequency:
        scores = scores - spec.frequency * counts
    if spec.presence:
        scores = scores - spec.presence * (counts > 0).float()
    return scores


def _repeat(scores: torch.Tensor, seen: torch.Tensor, r: float) -> torch.Tensor:
    """The repetition penalty on the [vocab] scores of the seen tokens: positive / r, negative * r, zero and -inf
    kept. A tiny r (1e-45, 5e-324 round to float32 denormals or 0) overflows positive scores to +inf, a huge one
    (1e300 is inf in float32) negative scores to -inf: their order is kept (the largest original score of those
    alone gets the larger float, the others one half the float range below it, which no draw picks beside it)."""
    scaled = torch.where(scores > 0, scores / r, torch.where(scores < 0, scores * r, scores))
    scaled = torch.where(torch.isneginf(scores) | ~seen, scores, scaled)  # -inf * 0 would be NaN
    for big, win, lose in ((torch.isposinf(scaled), _FMAX, _FMAX / 2),  # tiny r: positive / r overflows
                           (torch.isneginf(scaled) & ~torch.isneginf(scores), -_FMAX / 2, -_FMAX)):  # huge r
        if bool(big.any()):  # the order survives: the largest original score alone gets `win`
            best = scores[big].max()
            scaled = torch.where(big, torch.where(scores == best, win, lose), scaled)
    return scaled


def _clean(scores: torch.Tensor) -> torch.Tensor:
    """NaN → -inf (never chosen), +inf → the largest float: every score is finite or -inf."""
    return torch.nan_to_num(scores, nan=_NEG, posinf=_FMAX, neginf=_NEG)


def _draw(scores: torch.Tensor, spec: SampleSpec) -> int:
    """Temperature, min-p, top-k, top-p, then one draw from the seeded generator (scores have a finite maximum)."""
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2 ** 63))
    return int(torch.multinomial(target_probs(scores, spec), 1, generator=gen))


def target_probs(scores: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """[vocab] processed scores (finite maximum) → the distribution a non-greedy draw samples from: temperature,
    min-p, top-k, top-p applied (speculative decoding's acceptance rule reads the same distribution)."""
    scores = scores - scores.max()  # every score <= 0: no overflow whatever the temperature
    scores = torch.where(torch.isneginf(scores), scores, scores / spec.temperature)  # -inf / inf would be NaN
    if spec.min_p > 0:  # the most likely token has score 0: keep p >= min_p * p_max, i.e. score >= log(min_p)
        scores = scores.masked_fill(scores < math.log(spec.min_p), _NEG)
    if spec.top_k:
        kth = torch.topk(scores, min(spec.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, _NEG)
    if spec.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs >= spec.top_p  # keep the smallest nucleus (its first token always)
        drop[0] = False
        scores[order[drop]] = _NEG
    return torch.softmax(scores, dim=-1)


def sample(logits: torch.Tensor, spec: SampleSpec) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """logits [vocab] → (token id, its log-probability under the model's unmodified distribution, top-k list).

    Log-probabilities are of the raw logits (NaN read as -inf); a token the model gives no probability has -inf.
    """
    raw, scores = scores_of(logits, spec)
    token = int(torch.argmax(scores)) if spec.temperature < GREEDY_EPS else _draw(scores, spec)
    return (token,) + token_logprobs(raw, token, spec)


def plain_greedy(spec: SampleSpec) -> bool:
    """Greedy over the raw logits with only the chosen token's log-probability: `greedy_rows` takes it."""
    return spec.temperature < GREEDY_EPS and not spec.top_logprobs and _plain(spec)


def greedy_rows(logits: torch.Tensor) -> list[tuple[int, float]]:
    """[n, vocab] logits of n `plain_greedy` sequences → per row what `sample` gives for that row alone (token, its
    log-probability), in one pass over the rows instead of n: the same argmax (the first maximal index) and the
    same log-softmax along the vocabulary."""
    raw = _clean(logits.float())
    tokens = torch.argmax(raw, dim=-1)
    lps = torch.log_softmax(raw, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return [(t, _NEG if math.isnan(lp) else lp) for t, lp in zip(tokens.tolist(), lps.tolist())]


def scores_of(logits: torch.Tensor, spec: SampleSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[vocab] logits → (raw: NaN → -inf, +inf → the largest float; scores: the processed ones a draw or argmax
    reads, with a finite maximum for a draw)."""
    raw = _clean(logits.float())
    scores = raw if _plain(spec) else _processed(logits, spec)
    if spec.temperature >= GREEDY_EPS and scores is raw and bool(torch.isneginf(raw).all()):
        scores = torch.zeros_like(raw)  # nothing finite: every token equally likely
    return raw, scores  # a plain greedy spec's scores: an argmax over -inf only is token 0, as before


def token_logprobs(raw: torch.Tensor, token: int, spec: SampleSpec) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log p(token), the top_logprobs list) under the model's unmodified distribution (raw, cleaned logits)."""
    if not spec.top_logprobs:  # the chosen token's alone; NaN iff no logit is finite (raw holds no NaN / +inf)
        lp = float(torch.log_softmax(raw, dim=-1)[token])
        return _NEG if math.isnan(lp) else lp, ()
    logprobs = torch.log_softmax(raw, dim=-1) if bool(torch.isfinite(raw).any()) else torch.full_like(raw, _NEG)
    vals, idx = torch.topk(logprobs, min(spec.top_logprobs, logprobs.numel()))
    return float(logprobs[token]), tuple(zip(idx.tolist(), vals.tolist()))


def _plain(spec: SampleSpec) -> bool:
    """No bias, output constraint, suppressed token or penalty: the scores are the raw logits (NaN → -inf)."""
    return (not spec.logit_bias and spec.allowed is None and not spec.suppress and spec.output is None
            and spec.prompt is None)
