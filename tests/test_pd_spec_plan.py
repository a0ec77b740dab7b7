"""The planner's prefill/decode-groups and speculative-decoding predictions (cpinfer/perf/pd.py, speculative.py):
the decode model against the paper's 128K TTITs, the layout overlap against the engine's sharding, the KV transfer's
bytes and time from their formulas, the speculation formula, and `cpinfer plan --pd-decode-cp / --spec-tokens`."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from cpinfer.cli import main as cli_main
from cpinfer.cp.sharding import shard_prefill
from cpinfer.perf import pd, speculative
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.planner import Workload, build_deployment, make_plan
from cpinfer.perf.simulator import simulate_decode
from cpinfer.perf.statements import K128, dep

GTT = HARDWARE["h100-gtt"]
L405 = ("llama3-405b", "h100-gtt")

# §4.3, batch 1, 128K context, the paper's ring: TP8 46 ms, CP2 + TP8 60 ms, CP4 + TP8 71 ms. The running text
# states 71 ms (fitted); 46 and 60 ms are from the paper's TTIT table and are predicted here, unfitted. Today's
# errors: -9%, -13%, -3% (docs/planning.md, "Decode TTIT against the paper"); 15% holds each with a little room.
PAPER_TTIT_128K = {1: 0.046, 2: 0.060, 4: 0.071}
TTIT_TOL = 0.15


def plan405(cp: int, tokens: int, kv: str = "bf16", tp: int = 8):
    return make_plan(build_deployment(*L405, cp, tp, "fp8-ffn", "bf16", kv), Workload(tokens))


# --- the decode model against §4.3 ------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", sorted(PAPER_TTIT_128K))
def test_decode_ttit_matches_the_paper_at_128k(cp):
    assert simulate_decode(dep(GTT, cp), K128).seconds == pytest.approx(PAPER_TTIT_128K[cp], rel=TTIT_TOL)


def test_decode_ttit_grows_with_cp_as_in_the_paper():
    ttit = [simulate_decode(dep(GTT, cp), K128).seconds for cp in (1, 2, 4)]
    assert ttit[0] < ttit[1] < ttit[2]
    # the growth is the ring (SendRecv, All2All, ring kernels), not the GEMMs, which CP does not change
    parts = [simulate_decode(dep(GTT, cp), K128).breakdown for cp in (1, 4)]
    assert parts[0]["gemm"] == pytest.approx(parts[1]["gemm"])
    assert parts[1]["all2all"] > 0 == parts[0]["all2all"]


# --- where each token goes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,m", [(2, 1), (3, 2), (2, 2), (1, 2), (16, 1), (16, 2), (4, 3), (5, 7)])
def test_layout_overlap_equals_the_engine_sharding(n, m):
    tokens = 2 * n * 2 * m * 3  # a length both layouts split without padding
    src, _ = shard_prefill([tokens], n).inverse()
    dst, _ = shard_prefill([tokens], m).inverse()
    share = pd.layout_overlap(n, m)
    for s in range(n):
        for d in range(m):
            assert share[s][d] == Fraction(int(((src == s) & (dst == d)).sum()), tokens), (s, d)


def test_layout_overlap_same_size_is_the_identity():
    share = pd.layout_overlap(3, 3)
    assert all(share[s][d] == (Fraction(1, 3) if s == d else 0) for s in range(3) for d in range(3))


# --- the KV transfer --------------------------------------------------------------------------------------------
def test_transfer_bytes_per_token_follow_the_cache_format():
    bf16 = pd.plan_pd(plan405(16, K128), 1).transfer
    assert bf16.bytes_per_token == 126 * 2 * 1 * 128 * 2          # layers x (K, V) x KV heads per TP8 rank x D x 2 B
    assert bf16.model_bytes_per_token == 8 * bf16.bytes_per_token  # 8 KV heads over 8 TP ranks
    assert bf16.receiver_bytes == K128 * bf16.bytes_per_token      # CP1: one decode device per TP rank gets it all
    assert bf16.total_bytes == 8 * bf16.receiver_bytes
    fp8 = pd.plan_pd(plan405(16, K128, "fp8"), 1).transfer
    assert fp8.bytes_per_token == bf16.bytes_per_token / 2
    per_token = pd.plan_pd(plan405(16, K128, "fp8_per_token"), 1).transfer
    assert per_token.bytes_per_token == 126 * 2 * (128 + 4)       # + one fp32 scale per row
    # MLA: the latent (kv_lora_rank + rope) once per layer, the same on every TP rank
    v3 = make_plan(build_deployment("deepseek-v3", "h200", 2, 8, "fp8", "bf16", "fp8"), Workload(8192))
    mla = pd.plan_pd(v3, 1).transfer
    assert mla.bytes_per_token == 61 * (512 + 64) == mla.model_bytes_per_token
    # sliding-window layers send only their window
    g = make_plan(build_deployment("gemma-3-27b", "h200", 4, 2, "bf16"), Workload(K128))
    gem = pd.plan_pd(g, 1).transfer
    row = 2 * 8 * 128 * 2  # K and V of 8 KV heads per TP2 rank
    assert gem.bytes_per_token == pytest.approx((10 * K128 + 52 * 1024) * row / K128)


def test_transfer_time_is_the_busiest_nic_and_hides_behind_the_prefill():
    plan = plan405(16, K128)
    t = pd.plan_pd(plan, 1).transfer
    # 16 prefill devices into one: 16 flows x 18.4 GB/s exceed the 50 GB/s NIC, whose line rate decides
    assert t.flows_in == 16 and t.link.aggregate == GTT.inter_gbs_peak * 1e9
    assert t.seconds == pytest.approx(t.receiver_bytes / 50e9 + 126 * GTT.inter_latency_us * 1e-6)
    assert t.exposed_s == pytest.approx(t.seconds / 126)  # one layer's share is left after the last layer
    # CP2 decode: each decode device receives half, from 8 prefill devices
    t2 = pd.plan_pd(plan, 2).transfer
    assert t2.flows_in == 8 and t2.receiver_bytes == pytest.approx(t.receiver_bytes / 2)
    # a transfer longer than the prefill: what is left is the transfer minus all but one layer of the prefill
    slow = pd.estimate_transfer(plan.deployment, 1, 1, K128, 1, prefill_s=0.05)
    assert slow.exposed_s == pytest.approx(slow.seconds - 0.05 + 0.05 / 126)
    # a single flow (1 -> 1) is held to the per-flow rate
    one = pd.estimate_transfer(build_deployment(*L405, 1, 8, "fp8-ffn"), 1, 1, K128, 1, prefill_s=10.0)
    assert one.seconds == pytest.approx(one.receiver_bytes / (GTT.inter_gbs * 1e9) + 126 * GTT.inter_latency_us * 1e-6)


def test_pd_decode_and_memory_against_colocated():
    for tokens in (128_000, 256_000, 512_000, 1_000_000):
        plan = plan405(16, tokens)
        for m in (1, 2):
            p = pd.plan_pd(plan, m)
            assert p.ttit.seconds == pytest.approx(simulate_decode(p.decode, tokens).seconds)
            assert p.ttit.seconds < p.colocated_ttit.seconds
            assert p.gpus == (16 + m) * 8
            assert p.second_token_s == pytest.approx(plan.chosen_ttft_s + p.transfer.exposed_s + p.ttit.seconds)
    # one TP8 node holds 256K of bf16 KV beside 405B's weights, not 512K; two nodes hold 1M only in FP8
    assert pd.plan_pd(plan405(16, 256_000), 1).memory.fits
    assert not pd.plan_pd(plan405(16, 512_000), 1).memory.fits
    assert not pd.plan_pd(plan405(16, 1_000_000), 2).memory.fits
    assert pd.plan_pd(plan405(16, 1_000_000, "fp8"), 2).memory.fits
    # two decode groups split a batch of 4
    grouped = pd.plan_pd(make_plan(plan405(16, K128).deployment, Workload(K128, batch=4)), 1, groups=2)
    assert grouped.batch_per_group == 2 and grouped.transfer.receiver_bytes == pytest.approx(
        2 * K128 * grouped.transfer.bytes_per_token)


# --- speculative decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_expected_tokens_is_the_sum_of_acceptance_powers(alpha, k):
    assert speculative.expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))


def test_expected_tokens_matches_a_simulated_acceptance_run():
    import random

    rng, k, alpha, steps = random.Random(0), 4, 0.6, 40_000
    emitted = 0
    for _ in range(steps):
        run = 0
        while run < k and rng.random() < alpha:
            run += 1
        emitted += run + 1  # the accepted run plus the target's own token
    # standard error of the mean < 0.01 at these numbers: 0.03 is > 3 sigma
    assert emitted / steps == pytest.approx(speculative.expected_tokens(alpha, k), abs=0.03)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, True, "0.5", float("nan")])
def test_acceptance_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        speculative.expected_tokens(bad, 4)


def test_verify_step_and_gain_at_the_papers_cp4_decode():
    d = dep(GTT, 4)
    decode = simulate_decode(d, K128)
    assert simulate_decode(d, K128, rows=1).seconds == decode.seconds
    for k in (1, 4, 8):
        spec = speculative.plan_spec(d, K128, k, 0.7)
        verify = simulate_decode(d, K128, rows=k + 1)
        assert spec.verify.seconds == verify.seconds and spec.decode.seconds == decode.seconds
        # same ring latency and one KV read: far less than k + 1 decode steps, more than one
        assert decode.seconds < verify.seconds < 1.1 * decode.seconds
        assert verify.breakdown["kernels"] == decode.breakdown["kernels"]
        assert spec.gain == pytest.approx(speculative.expected_tokens(0.7, k) * decode.seconds / verify.seconds)
        be = spec.breakeven
        assert speculative.expected_tokens(be, k) == pytest.approx(spec.cost_ratio, rel=1e-9)
    assert speculative.plan_spec(d, K128, 4, 0.0).gain < 1  # nothing accepted: the verify step is pure cost


def test_verify_as_an_eager_partial_prefill():
    """spec_verify='prefill' (the engine's earlier path): k + 1 new tokens over the cached context through the
    prefill ring (pass-Q), eager; the plan names which line is the engine's default path."""
    from cpinfer.perf.simulator import decode_kernels_time, simulate_prefill

    d = dep(GTT, 4)
    spec = speculative.plan_spec(d, K128, 4, 0.7)
    prefill = simulate_prefill(d, 5, K128 - 1, 1, "pass-q")
    assert spec.verify_partial.seconds == pytest.approx(prefill.seconds + decode_kernels_time(d, eager=True))
    assert spec.verify_partial.breakdown["ring_steps"] == pytest.approx(126 * 4 * GTT.ring_step_us * 1e-6)
    assert spec.gain_partial == pytest.approx(spec.expected_tokens * spec.decode.seconds / spec.verify_partial.seconds)
    assert spec.gain_partial < 1 < spec.gain  # the eager ring's per-step cost eats the gain at CP4
    assert speculative.plan_spec(d, K128, 2, 0.7).breakeven_partial is None
    one = speculative.plan_spec(dep(GTT, 1), K128, 4, 0.7)  # no ring: only the launches differ
    assert one.verify_partial.breakdown["ring_steps"] == 0 and 1 < one.gain_partial < one.gain
    text = speculative.format_spec(spec, d, K128)
    assert "the engine's path, spec_verify='decode'): " in text and "eager; spec_verify='prefill'): " in text


def test_breakeven_is_none_when_no_acceptance_pays():
    assert speculative.breakeven_acceptance(2, 3.5) is None
    assert speculative.breakeven_acceptance(2, 0.9) == 0.0
    assert speculative.breakeven_acceptance(1, 1.5) == pytest.approx(0.5)


# --- the command --------------------------------------------------------------------------------------------------
BASE = ["plan", "--model", "llama3-405b", "--hardware", "h100-gtt", "--weights", "fp8-ffn", "--tp", "8"]


def test_cli_pd_prints_transfer_with_bandwidth_and_ttit(capsys):
    assert cli_main(BASE + ["--cp", "16", "--prompt-tokens", "128k", "--pd-decode-cp", "1"]) == 0
    out = capsys.readouterr().out
    assert "50.0 GB/s per device" in out and "18.4 GB/s per flow" in out
    assert "exposed after the prefill's last layer" in out and "colocated on CP16 x TP8" in out
    assert "--pd-decode-cp 1" in out and "--nnodes 17" in out  # the launch line covers both groups
    assert cli_main(BASE + ["--cp", "16", "--prompt-tokens", "128k", "--pd-decode-cp", "2", "--pd-decode-groups",
                            "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    expect = pd.plan_pd(plan405(16, 128_000), 2, 2)
    assert got["pd"]["ttit_s"] == pytest.approx(expect.ttit.seconds)
    assert got["pd"]["transfer"]["seconds"] == pytest.approx(expect.transfer.seconds)
    assert got["pd"]["transfer"]["link"]["line_rate_gbs"] == 50.0 and got["pd"]["gpus"] == 160
    assert got["ttit_s"] == pytest.approx(expect.colocated_ttit.seconds)


def test_cli_spec_prints_the_gain(capsys):
    argv = BASE + ["--cp", "4", "--prompt-tokens", "128k", "--implementation", "paper", "--spec-tokens", "4",
                   "--spec-acceptance", "0.7"]
    assert cli_main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)["spec"]
    expect = speculative.plan_spec(dep(GTT, 4), K128, 4, 0.7)
    assert got["gain"] == pytest.approx(expect.gain) and got["cp"] == 4
    assert got["expected_tokens"] == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401)
    assert got["gain_partial"] == pytest.approx(expect.gain_partial)
    assert got["verify_partial_s"] == pytest.approx(expect.verify_partial.seconds)
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert f"gain {expect.gain:.2f}x decode tokens/s" in out and f"gain {expect.gain_partial:.2f}x, break-even" in out
    # with P/D the speculation is planned on the decode group
    assert cli_main(BASE + ["--cp", "16", "--prompt-tokens", "128k", "--pd-decode-cp", "1", "--spec-tokens", "2",
                            "--spec-acceptance", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["cp"] == 1


@pytest.mark.parametrize("extra,msg", [
    (["--spec-tokens", "4", "--spec-acceptance", "1"], "--spec-acceptance must be a number in [0, 1)"),
    (["--spec-tokens", "4", "--spec-acceptance", "-0.2"], "--spec-acceptance must be a number in [0, 1)"),
    (["--spec-tokens", "4"], "--spec-tokens K and --spec-acceptance A go together"),
    (["--spec-tokens", "0", "--spec-acceptance", "0.5"], "--spec-tokens must be a positive integer"),
    (["--pd-decode-groups", "2"], "--pd-decode-groups needs --pd-decode-cp"),
    (["--pd-decode-cp", "0"], "--pd-decode-cp must be a positive integer"),
])
def test_cli_bad_pd_and_spec_input_is_one_clear_line(capsys, extra, msg):
    assert cli_main(BASE + ["--cp", "4", "--prompt-tokens", "128k", *extra]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_cli_sweep_refuses_pd(capsys):
    assert cli_main(BASE + ["--prompt-tokens", "128k", "--sweep", "--ttft-target", "10", "--pd-decode-cp", "1"]) == 2
    assert "--sweep sizes one colocated CP group" in capsys.readouterr().err
