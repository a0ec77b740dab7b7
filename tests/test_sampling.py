"""The rank-side sampler is total: any logits (NaN, ±inf, huge), any valid parameters, a logit bias and a grammar
mask give an allowed token with a non-NaN log-probability; only a mask that allows nothing is a `SamplingError`.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpinfer.engine.sampling import GREEDY_EPS, SampleSpec, SamplingError, SamplingParams, allowed_mask, sample

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
                                 {"seed": 2 ** 64}, {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}])
def test_invalid_params_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
