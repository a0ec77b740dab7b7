"""The rank-side sampler is total: any logits (NaN, ±inf, huge), any valid parameters, a logit bias and a grammar
mask give an allowed token with a non-NaN log-probability; only a mask that allows nothing is a `SamplingError`.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpinfer.engine.sampling import (GREEDY_EPS, SampleSpec, SamplingError, SamplingParams, allowed_mask, greedy_rows,
                                     plain_greedy, sample)

VALUES = st.one_of(st.floats(-1e4, 1e4), st.sampled_from([math.nan, math.inf, -math.inf, 3.0e38, -3.0e38]))


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    words = (len(allowed) + 31) // 32
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[:len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").copy()


@st.composite
def cases(draw):
    vocab = draw(st.integers(1, 70))
    logits = torch.tensor(draw(st.lists(VALUES, min_size=vocab, max_size=vocab)), dtype=torch.float32)
    temperature = draw(st.one_of(st.just(0.0), st.floats(1e-45, 1e-3), st.floats(1e-3, 2.0)))
    top_p = draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0, exclude_min=False)))
    top_k = draw(st.integers(0, vocab + 3))
    bias = tuple(draw(st.lists(st.tuples(st.integers(0, vocab - 1), st.floats(-100, 100)), max_size=4)))
    allowed = None
    if draw(st.booleans()):
        allowed = np.array(draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab)), dtype=bool)
        allowed[draw(st.integers(0, vocab - 1))] = True  # at least one token allowed
    spec = SampleSpec(temperature, top_p, top_k, draw(st.integers(-2 ** 63, 2 ** 63 - 1)), draw(st.integers(0, 10 ** 6)),
                      draw(st.integers(0, 20)), bias, None if allowed is None else _bitmask(allowed))
    return logits, spec, allowed


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_sampler_is_total(case):
    logits, spec, allowed = case
    token, logprob, top = sample(logits, spec)
    assert 0 <= token < logits.numel()
    assert not math.isnan(logprob) and logprob <= 1e-6
    if allowed is not None:
        assert allowed[token], (token, allowed)
    assert len(top) == min(spec.top_logprobs, logits.numel())
    assert all(not math.isnan(lp) for _, lp in top)
    # reproducible: the same (seed, step) draws the same token
    assert sample(logits, spec)[0] == token


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 70).flatmap(lambda v: st.lists(st.lists(VALUES, min_size=v, max_size=v), min_size=1,
                                                      max_size=6)))
def test_greedy_rows_are_each_rows_sample(rows):
    """A decode batch's plain greedy rows in one pass: each row's token and log-probability the same bits as
    `sample` of that row alone (NaN, +-inf, ties, rows with nothing finite)."""
    logits = torch.tensor(rows, dtype=torch.float32)
    spec = SampleSpec(0.0, 1.0, 0, 1, 0, 0)
    assert plain_greedy(spec)
    got = greedy_rows(logits)
    want = [sample(row, spec)[:2] for row in logits]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == b or (math.isinf(a) and math.isinf(b) and a < 0 and b < 0), (got, want)


def test_plain_greedy_is_only_the_plain_argmax():
    base = SampleSpec(0.0, 1.0, 0, 1, 0, 0)
    assert plain_greedy(base) and plain_greedy(dataclasses.replace(base, temperature=GREEDY_EPS / 2, top_p=0.5))
    for other in (dict(temperature=0.7), dict(top_logprobs=2), dict(logit_bias=((1, 2.0),)), dict(suppress=(3,)),
                  dict(allowed=_bitmask(np.ones(8, dtype=bool))), dict(output=np.array([1])),
                  dict(prompt=np.array([2]))):
        assert not plain_greedy(dataclasses.replace(base, **other)), other


def test_tiny_temperature_is_greedy_and_nan_never_wins():
    logits = torch.tensor([1.0, 5.0, math.nan, 2.0])
    for t in (0.0, 1e-39, GREEDY_EPS / 2):
        assert sample(logits, SampleSpec(t, 1.0, 0, 1, 0, 0))[0] == 1
    assert SamplingParams(temperature=1e-39).greedy
    token, lp, _ = sample(torch.tensor([math.inf, 0.0, math.inf]), SampleSpec(0.7, 1.0, 0, 3, 0, 0))
    assert token in (0, 2) and not math.isnan(lp)


def test_logit_bias_and_mask_steer_the_choice():
    logits = torch.tensor([0.0, 10.0, 0.0, 0.0])
    assert sample(logits, SampleSpec(0.0, 1.0, 0, 0, 0, 0, ((1, -100.0), (3, 5.0))))[0] == 3
    mask = _bitmask(np.array([True, False, True, False]))
    torch.testing.assert_close(allowed_mask(mask, 4), torch.tensor([True, False, True, False]))
    assert sample(logits, SampleSpec(0.0, 1.0, 0, 0, 0, 0, (), mask))[0] in (0, 2)
    # the reported log-probability stays the model's own (bias and mask do not change it)
    _, lp, _ = sample(logits, SampleSpec(0.0, 1.0, 0, 0, 0, 0, ((1, -100.0), (3, 5.0))))
    torch.testing.assert_close(lp, float(torch.log_softmax(logits, -1)[3]))


def test_a_mask_that_allows_nothing_is_this_requests_error():
    with pytest.raises(SamplingError, match="allows no next token"):
        sample(torch.zeros(40), SampleSpec(1.0, 1.0, 0, 0, 0, 0, (), np.zeros(2, dtype=np.int32)))


@pytest.mark.parametrize("bad", [{"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan},
                                 {"seed": 2 ** 64}, {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)},
                                 {"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                                 {"repetition_penalty": math.inf}, {"min_p": 1.5}, {"min_tokens": 17},
                                 {"min_tokens": -1}])
def test_invalid_params_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---------------------------------------------------------------- vLLM's penalties, min_p and min_tokens
def _reference_scores(logits: list[float], spec: SampleSpec) -> list[float]:
    """A plain, loop-by-token statement of vLLM's order: suppressed stop tokens → -inf, then per token the
    repetition penalty (if in prompt or output: positive / r, else * r), minus frequency × count, minus presence."""
    out = list(spec.output) if spec.output is not None else []
    prompt = set(spec.prompt.tolist()) if spec.prompt is not None else set()
    scores = []
    for t, x in enumerate(logits):
        if t in spec.suppress:
            x = -math.inf
        count = out.count(t)
        if t in prompt or count:
            x = x / spec.repetition if x > 0 else x * spec.repetition
        x -= spec.frequency * count
        x -= spec.presence * (1.0 if count else 0.0)
        scores.append(x)
    return scores


def _reference_probs(scores: list[float], spec: SampleSpec) -> list[float]:
    """Temperature, then min_p against the most likely token's probability, then top-k and top-p, renormalized."""
    m = max(scores)
    probs = [math.exp((x - m) / spec.temperature) for x in scores]
    total = sum(probs)
    probs = [p / total for p in probs]
    keep = [p >= spec.min_p * max(probs) for p in probs]
    if spec.top_k:
        kth = sorted((p for p, k in zip(probs, keep) if k), reverse=True)[min(spec.top_k, sum(keep)) - 1]
        keep = [k and p >= kth for p, k in zip(probs, keep)]
    if spec.top_p < 1:
        kept = sorted(((p, t) for t, (p, k) in enumerate(zip(probs, keep)) if k), reverse=True)
        norm = sum(p for p, _ in kept)
        acc, nucleus = 0.0, set()
        for p, t in kept:
            if acc >= spec.top_p and nucleus:
                break
            nucleus.add(t)
            acc += p / norm
        keep = [t in nucleus for t in range(len(probs))]
    z = sum(p for p, k in zip(probs, keep) if k)
    return [p / z if k else 0.0 for p, k in zip(probs, keep)]


@st.composite
def penalty_cases(draw):
    vocab = draw(st.integers(2, 40))
    logits = draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab, unique=True))  # fp32 as the sampler
    output = np.array(draw(st.lists(st.integers(0, vocab - 1), max_size=12)), dtype=np.int64)
    prompt = np.unique(np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)), dtype=np.int64))
    repetition = draw(st.sampled_from([1.0, 0.5, 1.3, 2.0]))
    suppress = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=2, unique=True)))
    spec = SampleSpec(draw(st.sampled_from([0.0, 0.7, 1.0, 1.5])), draw(st.sampled_from([1.0, 0.9, 0.5])),
                      draw(st.integers(0, 5)), draw(st.integers(0, 2 ** 40)), draw(st.integers(0, 50)), 0,
                      min_p=draw(st.sampled_from([0.0, 0.05, 0.3])), suppress=suppress,
                      presence=draw(st.floats(-2, 2)), frequency=draw(st.floats(-2, 2)), repetition=repetition,
                      output=output, prompt=prompt if repetition != 1.0 else None)
    return logits, spec


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(penalty_cases())
def test_penalties_min_p_and_min_tokens_match_the_reference(case):
    """The sampler's token: the argmax of the reference scores when greedy, else the draw that the seeded generator
    makes from the reference distribution (the same generator as the sampler's)."""
    logits, spec = case
    assume = len([x for t, x in enumerate(logits) if t not in spec.suppress])
    if not assume:
        return
    scores = _reference_scores(logits, spec)
    token, lp, _ = sample(torch.tensor(logits), spec)
    assert token not in spec.suppress
    torch.testing.assert_close(lp, float(torch.log_softmax(torch.tensor(logits), -1)[token]))  # the model's own
    if spec.temperature == 0:  # the argmax, or a tie with it after the penalties' float32 rounding
        assert scores[token] >= max(scores) - 1e-5 * max(1.0, abs(max(scores)))
        return
    probs = _reference_probs(scores, spec)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + spec.step) % (2 ** 63))
    ref = int(torch.multinomial(torch.tensor(probs, dtype=torch.float32), 1, generator=gen))
    assert token == ref and probs[token] > 0


def test_penalties_by_hand():
    """Numbers worked by hand: output [1, 1, 2], prompt {3}; r=2, frequency 0.5, presence 1."""
    logits = torch.tensor([1.0, 4.0, -2.0, 3.0, 0.5])
    spec = SampleSpec(0.0, 1.0, 0, 0, 0, 0, frequency=0.5, presence=1.0, repetition=2.0,
                      output=np.array([1, 1, 2]), prompt=np.array([3]))
    from cpinfer.engine.sampling import penalize
    expect = torch.tensor([1.0, 4.0 / 2 - 1.0 - 1.0, -2.0 * 2 - 0.5 - 1.0, 3.0 / 2, 0.5])
    torch.testing.assert_close(penalize(logits.clone(), spec), expect)
    assert sample(logits, spec)[0] == 3  # 1.5 beats 1.0 (token 0); token 1 fell to 0.0
    # min_tokens: the stop token (here 3) is suppressed, the next best (token 0) comes
    assert sample(logits, dataclasses.replace(spec, suppress=(3,)))[0] == 0


# ---------------------------------------------------------------- extreme values: every valid request samples
TINY = [5e-324, 1e-300, 1e-45, 1e-38, 1e-10]
EXTREME = {
    "repetition_penalty": st.sampled_from(TINY + [0.5, 1.0, 2.0, 100.0, 1e10, 1e300, 1.7e308]),
    "temperature": st.sampled_from([0.0, 5e-324, 1e-45, GREEDY_EPS, 1e-3, 1.0, 2.0, 1e10, 1e308]),
    "top_p": st.sampled_from(TINY + [0.5, 1.0]),
    "min_p": st.sampled_from([0.0] + TINY + [0.5, 1.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
}


@st.composite
def extreme_cases(draw):
    """Valid SamplingParams at the edges of their ranges (built through SamplingParams, so each is a value a
    request may send), with logits that hold NaN, ±inf and the float32 extremes, a bias, suppressed stop tokens and
    the tokens the penalties read."""
    vocab = draw(st.integers(1, 40))
    logits = torch.tensor(draw(st.lists(VALUES, min_size=vocab, max_size=vocab)), dtype=torch.float32)
    kwargs = {k: draw(v) for k, v in EXTREME.items()}
    bias = draw(st.lists(st.tuples(st.integers(0, vocab - 1), st.sampled_from([-100.0, -1e-45, 0.0, 100.0])),
                         max_size=3))
    params = SamplingParams(top_k=draw(st.integers(0, vocab + 2)), logit_bias=tuple(bias), seed=draw(st.integers(0, 9)),
                            top_logprobs=draw(st.integers(0, 3)), **kwargs)
    output = np.array(draw(st.lists(st.integers(0, vocab - 1), max_size=8)), dtype=np.int64)
    prompt = np.unique(np.array(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8)), dtype=np.int64))
    suppress = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=2, unique=True)))
    spec = SampleSpec.of(params, params.seed, len(output), None, suppress, output,
                         prompt if params.repetition_penalty != 1.0 else None)
    return logits, spec


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extreme_cases())
def test_extreme_sampling_values_always_give_a_valid_token(case):
    """No NaN / inf reaches the draw (the issue's repetition_penalty 1e-45, 5e-324, 1e-300 were a 500): a token in
    the vocabulary, not a suppressed one while another is possible, reproducible, with a real log-probability."""
    logits, spec = case
    token, lp, top = sample(logits, spec)
    assert 0 <= token < logits.numel()
    if len(spec.suppress) < logits.numel():
        assert token not in spec.suppress
    assert not math.isnan(lp) and lp <= 1e-6
    assert len(top) == min(spec.top_logprobs, logits.numel())
    assert sample(logits, spec)[0] == token


def test_tiny_repetition_penalty_keeps_the_order_of_seen_tokens():
    """r = 1e-45 (and 5e-324, which is 0 in float32): positive seen tokens overflow; the largest of them wins
    greedily and, sampled, takes all the probability; negative seen tokens go to -0 (not NaN)."""
    logits = torch.tensor([1.0, 3.0, 2.0, -4.0, 0.5])
    for r in (1e-45, 5e-324, 1e-300):
        spec = SampleSpec(0.0, 1.0, 0, 0, 0, 0, repetition=r, output=np.array([0, 2]), prompt=np.array([3]))
        assert sample(logits, spec)[0] == 2  # seen: 0 and 2 (positive, overflow), 3 (negative → -0)
        for seed in range(20):
            assert sample(logits, dataclasses.replace(spec, temperature=1.0, seed=seed))[0] == 2
