"""The placement policy without processes: the cost model it asks, and the decisions it makes from it (spread a
sequence over the CP ranks only when the compute saved beats the ring), on the embedded model's shape."""
import dataclasses

import numpy as np
import pytest

from cpinfer.engine.kv.placement import (SPREAD, UNPLACED, CostModel, ForwardLoad, Placer, Work, sequence_cost)
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.model_spec import ModelSpec

SMOL = ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_embeddings=True)  # the embedded model
GLOO = load_hardware_profile("cpu-gloo")


def placer(n=2, hw=GLOO, share=0.5):
    return Placer("auto", n, CostModel(SMOL, hw, n, compute_share=share))


def fast_links(hw=GLOO, factor=1000.0):
    """The same machine with links `factor` times faster (latency and bandwidth) than gloo on loopback."""
    return dataclasses.replace(hw, name="fast-links", inter_latency_us=hw.inter_latency_us / factor,
                               intra_latency_us=hw.intra_latency_us / factor, ring_step_us=hw.ring_step_us / factor,
                               inter_gbs=hw.inter_gbs * factor, inter_gbs_peak=hw.inter_gbs_peak * factor,
                               intra_gbs=hw.intra_gbs * factor)


def spreads(p, t, p_cached=0, decode=48, home=UNPLACED, load=None, later=0):
    return p.decide(Work(t, p_cached, later, decode), home, 0 if home < 0 else home, load).spread


def threshold(p, decode=48, home=UNPLACED):
    """The smallest prompt (to 1%) the policy spreads, by bisection (the decision is monotone in T)."""
    lo, hi = 1, 1 << 17
    assert spreads(p, hi, decode=decode, home=home) and not spreads(p, lo, decode=decode, home=home)
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if spreads(p, mid, decode=decode, home=home) else (mid, hi)
    return hi


def test_cost_model_halves_compute_and_charges_the_ring():
    m = CostModel(SMOL, GLOO, 2, compute_share=0.5)
    one, two = sequence_cost(m, 16384, 0, 1), sequence_cost(m, 16384, 0, 2)
    assert one.ring_latency_s == one.ring_bytes_s == 0  # one rank: no ring
    assert two.compute_s == pytest.approx(one.compute_s / 2, rel=0.02)  # 2N-chunk sharding splits the work
    assert two.ring_latency_s == pytest.approx(30 * (2 * GLOO.ring_step_us + GLOO.intra_latency_us) * 1e-6)
    dec1, dec2 = sequence_cost(m, 1, 65536, 1), sequence_cost(m, 1, 65536, 2)
    # one decode query visits the ranks in turn (pass-Q): no shorter attention, and the ring on top
    assert dec2.compute_s == pytest.approx(dec1.compute_s, rel=0.01) and dec2.ring_latency_s > 0
    assert dec2.total_s > dec1.total_s
    # a rank with all the cores computes twice as fast as one with half of them
    full = CostModel(SMOL, GLOO, 2, compute_share=1.0)
    assert sequence_cost(full, 4096, 0, 1).compute_s == pytest.approx(sequence_cost(m, 4096, 0, 1).compute_s / 2)


def test_short_requests_stay_local_long_ones_spread():
    p = placer()
    assert not spreads(p, 200) and not spreads(p, 500, decode=400)
    assert spreads(p, 4000) and spreads(p, 65536)
    # a longer answer makes the ring of every decode step count more: the threshold moves up
    assert threshold(p, decode=8) < threshold(p, decode=48) < threshold(p, decode=512)


def test_the_threshold_comes_from_the_hardware_not_a_constant():
    slow, fast = placer(), placer(hw=fast_links())
    assert threshold(fast) < threshold(slow) / 10  # cheap collectives: spreading pays far sooner
    assert not placer(hw=fast_links()).decide(Work(1, 0), UNPLACED, 0, None).spread  # one token: nothing to split


def test_a_burst_is_balanced_by_whole_requests_not_rings():
    """32 requests of 500 tokens in one forward: each would spread alone, but with the forward's work to share the
    least-loaded rank takes each one whole, and no ring is needed."""
    p = placer()
    w = p.cost(500, 0).compute_s
    assert spreads(p, 500, decode=2)  # alone, with a short answer, halving its prefill pays
    load = ForwardLoad(np.zeros(2), floor_s=32 * w / 2)
    for i in range(32):
        r = int(np.argmin(load.compute_s))
        d = p.decide(Work(500, 0, 0, 2), UNPLACED, r, load)
        assert not d.spread and d.rank == r
        load.compute_s[r] += w
    assert load.compute_s[0] == load.compute_s[1]
    # a 16K prompt among them still spreads: alone it would be most of the forward
    load = ForwardLoad(np.zeros(2), floor_s=(p.cost(16384, 0).compute_s + 32 * w) / 2)
    assert p.decide(Work(16384, 0, 0, 32), UNPLACED, 0, load).spread


def test_growth_spreads_a_long_appendix_but_not_a_short_question():
    p = placer()
    home = 1
    # turn 2 of a short local chat appends a long document: its new tokens spread (the chat's K/V stay put)
    assert spreads(p, 16000, p_cached=300, home=home)
    # a short question on a long document held by one rank: the question's keys stay with the document
    assert not spreads(p, 20, p_cached=6000, home=home)
    # a chunked prompt: the decision for the first chunk counts the chunks still to come
    assert spreads(p, 256, later=63 * 256) and not spreads(p, 256, decode=48)


def test_forced_modes_and_one_rank():
    assert Placer("shard", 2).decide(Work(3, 0), UNPLACED, 0, None).spread
    d = Placer("local", 2).decide(Work(100000, 0), UNPLACED, 1, None)
    assert not d.spread and d.rank == 1 and d.method == "forced"
    assert not Placer("auto", 1).decide(Work(100000, 0), UNPLACED, 0, None).spread
    with pytest.raises(ValueError, match="placement must be one of"):
        Placer("sometimes", 2)
    with pytest.raises(ValueError, match="cost model"):
        Placer("auto", 2)
    with pytest.raises(ValueError, match="compute_share"):
        CostModel(SMOL, GLOO, 2, compute_share=0.0)


def test_decision_metrics_carry_the_prediction():
    d = placer().decide(Work(8000, 0, 0, 48), UNPLACED, 0, None)
    m = d.as_metrics()
    assert m["placement"] == "spread" and m["method"] == "auto" and m["spread_s"] < m["local_s"]
    assert SPREAD < 0 and UNPLACED < 0 and SPREAD != UNPLACED


def test_crossover_is_the_shortest_prompt_that_spreads():
    p = placer()
    for decode in (8, 48, 256):
        t = p.crossover(decode)
        assert spreads(p, t, decode=decode) and not spreads(p, t - 1, decode=decode)
        assert abs(t - threshold(p, decode)) <= max(1, t // 100)
    assert p.crossover(8) < p.crossover(48) < p.crossover(256)  # a longer answer pays the ring more often
    assert placer(hw=fast_links()).crossover(48) < p.crossover(48) // 10
    assert Placer("shard", 2).crossover(48) is None and Placer("auto", 1).crossover(48) is None
    assert p.crossover(48, limit=16) is None  # nothing that short spreads
