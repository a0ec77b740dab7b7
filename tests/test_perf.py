"""Performance model components (GEMM, attention curve, collectives, decode, memory), catalogs, profile migration
and `cpinfer plan`; the shared ring cost model is tests/test_cost_model.py, the paper's statements
tests/test_paper_statements.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cpinfer.cli import main as cli_main
from cpinfer.cp import cost_model
from cpinfer.cp.cost_model import AttnShape
from cpinfer.cp.ring_shape import RingShape
from cpinfer.perf import costs
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.implementations import PAPER
from cpinfer.perf.model_catalog import MODELS
from cpinfer.perf.models import WEIGHT_FORMATS, load_model_spec, model_spec_from_hf_config, weight_bytes_per_gpu
from cpinfer.perf.simulator import Deployment, memory_per_gpu, paper_flops, simulate_decode, simulate_prefill
from cpinfer.perf.statements import K128, M1

GTT = HARDWARE["h100-gtt"]
L405 = MODELS["llama3-405b"]
FP8_FFN = WEIGHT_FORMATS["fp8-ffn"]


def dep405(cp: int, hw: HardwareProfile = GTT, tp: int = 8, implementation=PAPER) -> Deployment:
    return Deployment(L405, hw, cp, tp, FP8_FFN, implementation=implementation)


# --- components from their physics ---------------------------------------------------------------------------
def test_attention_rate_curve_hits_the_paper_reference_and_slows_on_short_blocks():
    shape = AttnShape(128, 8, 128, 2)

    def rate(n: int) -> float:  # TF/s of a causal n x n square on one H100
        return 4 * n * n / 2 * 128 * 128 / cost_model.attention_time(GTT, shape, n * (n + 1) / 2, n, n) / 1e12
    assert rate(8192) == pytest.approx(540, rel=0.01)               # App. A: FA3 causal 8K, 540 TF/s
    assert rate(1024) < rate(4096) < rate(8192) < rate(65536)       # shorter blocks run slower
    assert rate(1 << 20) == pytest.approx(GTT.attn_flops_per_s() / 1e12, rel=0.01)


def test_gemm_pays_whole_tiles_runs_fp8_faster_and_reads_weights_in_decode():
    fp8 = costs.gemm_time(GTT, 4096, 8192, 8192, 8192 * 8192, True)
    bf16 = costs.gemm_time(GTT, 4096, 8192, 8192, 2 * 8192 * 8192, False)
    assert bf16 / fp8 == pytest.approx(GTT.peak_tflops_fp8 / GTT.peak_tflops, rel=1e-9)
    assert costs.gemm_time(GTT, 129, 8192, 8192, 0, False) == pytest.approx(
        costs.gemm_time(GTT, 256, 8192, 8192, 0, False), rel=1e-12)  # a partial 128-row tile costs a full one
    weights = 2 * 8192 * 8192
    assert costs.gemm_time(GTT, 1, 8192, 8192, weights, False) == pytest.approx(weights / GTT.mem_bytes_per_s)


def test_collectives_follow_latency_plus_bytes_over_bandwidth():
    link = cost_model.Link(10e9, 20e-6, 50e9)
    assert cost_model.p2p_time(1e6, link) == pytest.approx(20e-6 + 1e-4)
    one_node = costs.allreduce_time(GTT, 1e9, 8)
    assert one_node == pytest.approx(GTT.intra_latency_us * 1e-6 + 1.75e9 / (GTT.intra_gbs * 1e9))
    assert costs.allreduce_time(GTT, 1e9, 16) > one_node                    # the slice crosses the network
    assert costs.allreduce_time(GTT, 1e9, 1) == 0.0


def test_prefill_breakdown_sums_and_full_prefill_hides_sendrecv_at_128k_cp8():
    est = simulate_prefill(dep405(8), K128)
    assert sum(est.breakdown.values()) == pytest.approx(est.seconds, rel=1e-12)
    assert est.breakdown["sendrecv_exposed"] == 0.0 and est.breakdown["all2all"] == 0.0
    assert est.detail["step_sendrecv_us"] < est.detail["step_attention_max_us"]


def test_transfers_hide_only_where_they_overlap_compute():
    """comm_overlap 1 (GPU: NIC DMA beside the SMs) hides a SendRecv under attention; 0 (gloo on CPU) serialises."""
    ring, shape = RingShape(4, 128_000, 0), dep405(4).attn_shape
    hidden = cost_model.ring_cost(GTT, shape, ring, "pass-kv", tp=8)
    serial = cost_model.ring_cost(dataclasses.replace(GTT, comm_overlap=0.0), shape, ring, "pass-kv", tp=8)
    assert hidden.sendrecv_exposed == 0.0
    assert serial.sendrecv_exposed == pytest.approx(3 * hidden.step_sendrecv, rel=1e-12)


def test_legacy_profile_json_migrates(tmp_path):
    """A profile written before ring_step_us / the attention curve existed still loads, and says so."""
    old = GTT.to_dict()
    for name in ("attn_ref_tokens", "attn_overhead_tokens", "inter_coll_gbs", "comm_overlap"):
        del old[name]
        del old["sources"][name]
    old["ring_step_floor_us"] = old.pop("ring_step_us")
    old["sources"]["ring_step_floor_us"] = old["sources"].pop("ring_step_us")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    hw = load_hardware_profile(str(path))
    assert hw.ring_step_us == GTT.ring_step_us and "migrated from ring_step_floor_us" in hw.sources["ring_step_us"]
    assert hw.attn_overhead_tokens == 0.0 and "predates" in hw.sources["attn_overhead_tokens"]
    assert hw.inter_coll_gbs == hw.inter_gbs and hw.comm_overlap == 1.0


# --- pass-KV vs pass-Q (paper §4.2.4, CP4, T+P = 128000); the full list is tests/test_paper_statements.py ------
def test_pass_q_pays_all2all_only():
    d = dep405(4)
    kv, q = (simulate_prefill(d, 64000, 64000, strategy=s) for s in ("pass-kv", "pass-q"))
    assert kv.breakdown["all2all"] == 0.0 and q.breakdown["all2all"] > 0
    assert kv.breakdown["gemm"] == q.breakdown["gemm"]
    assert kv.breakdown["attention"] == pytest.approx(q.breakdown["attention"], rel=1e-9)


# --- decode --------------------------------------------------------------------------------------------------
def test_decode_ttit_grows_with_cp_because_of_padding_and_ring_latency():
    ttit = [simulate_decode(dep405(cp), K128).seconds for cp in (1, 2, 4)]
    assert ttit[0] < ttit[1] < ttit[2]
    est = simulate_decode(dep405(4), K128, batch=1)
    assert {k: est.detail[k] for k in ("queries_per_rank", "padded_batch", "padding_queries")} == \
        dict(queries_per_rank=1, padded_batch=4, padding_queries=3)
    assert est.breakdown["all2all"] > 0 and est.breakdown["kernels"] > simulate_decode(dep405(1), K128).breakdown[
        "kernels"]


def test_decode_terms_of_section_4_3():
    """Q SendRecv per step, All2All of partial outputs, merge; the paper's decode sends after each step, cpinfer's
    beside it; padding the batch adds work on other ranks, not time on the ring's critical path."""
    from cpinfer.perf.implementations import CPINFER
    from cpinfer.perf.simulator import decode_attention_layer

    paper, ours = dep405(4), dep405(4, implementation=CPINFER)
    att = decode_attention_layer(paper, K128, 1)
    assert att["sendrecv_exposed"] == pytest.approx(3 * att["step_sendrecv"])  # after each step: all exposed
    shape = paper.attn_shape
    assert att["all2all"] == pytest.approx(cost_model.all2all_time(shape.partial_out_bytes(1), 4, paper.link))
    assert decode_attention_layer(ours, K128, 1)["sendrecv_exposed"] < att["sendrecv_exposed"]
    unpadded = dep405(4, implementation=dataclasses.replace(PAPER, pad_decode_batch=False))
    a, b = simulate_decode(paper, K128, 5), simulate_decode(unpadded, K128, 5)
    assert a.seconds == b.seconds
    assert (a.detail["padded_batch"], b.detail["padded_batch"]) == (8, 5)
    assert a.detail["queries_computed_per_layer"] > b.detail["queries_computed_per_layer"]


def test_decode_is_weight_read_bound_at_batch_1():
    dep = dep405(1)
    est = simulate_decode(dep, 1024)
    weights = weight_bytes_per_gpu(L405, dep.held, 8, vocab_parallel=True)
    assert est.breakdown["gemm"] >= weights * 0.95 / GTT.mem_bytes_per_s


# --- memory --------------------------------------------------------------------------------------------------
def test_memory_per_gpu():
    mem = memory_per_gpu(dep405(16), M1)
    assert mem.weights_gb == pytest.approx(405.85 * (0.19 * 2 + 0.81 * 1) / 8, rel=0.03)
    kv_gb = M1 / 16 * 126 * 2 * 1 * 128 * 2 / 1e9  # tokens per rank x layers x K,V x 1 KV head x D_H x bf16
    assert mem.kv_gb == pytest.approx(kv_gb, rel=1e-6)
    assert mem.fits
    bf16 = memory_per_gpu(Deployment(L405, GTT, 1, 8, WEIGHT_FORMATS["bf16"]), 1024)
    assert bf16.weights_gb > 96 * 0.9 and not bf16.fits


# --- catalogs ------------------------------------------------------------------------------------------------
def test_llama3_catalog_shapes():
    assert load_model_spec("Llama3-405B").params == pytest.approx(405e9, rel=0.01)
    assert load_model_spec("llama3-70b").params == pytest.approx(70.6e9, rel=0.01)
    assert load_model_spec("llama3-8b").params == pytest.approx(8.03e9, rel=0.01)


# (total, non-embedding) parameters as their publishers state them (model cards; Gemma 3 technical report
# Table 1 for the text part; the meta-device count 23,572,403,200 for Mistral Small 3.x text)
PUBLISHED = {"llama-3.1-8b": (8_030_261_248, None), "llama-3.1-70b": (70_553_706_496, None),
             "qwen2.5-7b": (7.61e9, 6.53e9), "qwen2.5-14b-1m": (14.7e9, 13.1e9), "qwen3-8b": (8.2e9, 6.95e9),
             "qwen3-32b": (32.8e9, 31.2e9), "mistral-small": (23_572_403_200, None),
             "gemma-3-12b": (None, 10_759e6), "gemma-3-27b": (None, 25_600e6)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_family_catalog_matches_published_parameter_counts(name):
    spec, (total, non_embedding) = load_model_spec(name), PUBLISHED[name]
    assert spec.source.startswith("published config.json of huggingface.co/")
    if total:
        assert spec.params == pytest.approx(total, rel=0.01)
    if non_embedding:
        assert spec.n_layers * (spec.attn_params + spec.ffn_params) == pytest.approx(non_embedding, rel=0.01)


def test_gemma3_layers_alternate_five_local_to_one_global():
    for name, layers, local in (("gemma-3-12b", 48, 40), ("gemma-3-27b", 62, 52)):
        spec = load_model_spec(name)
        assert (spec.n_layers, spec.window_layers, spec.full_layers, spec.window) == (layers, local,
                                                                                       layers - local, 1024)
    assert load_model_spec("qwen3-32b").head_dim * 64 == 8192 != load_model_spec("qwen3-32b").hidden


def test_model_from_hf_config(tmp_path):
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               intermediate_size=128, vocab_size=100, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json"):
        spec = load_model_spec(str(where))
        assert (spec.head_dim, spec.n_kv_heads, spec.tie_embeddings) == (16, 2, True)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_spec(str(tmp_path))


BASE_CFG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=12,
                intermediate_size=128, vocab_size=100)


@pytest.mark.parametrize("extra,windowed,window", [
    (dict(model_type="gemma3_text", sliding_window=16), 10, 16),                        # default pattern 6
    (dict(model_type="gemma3_text", sliding_window=16, sliding_window_pattern=4), 9, 16),
    (dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 6), 6, 16),
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=8), 4, 32),
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=False), 0, 0),
    (dict(model_type="qwen3", sliding_window=None, use_sliding_window=False), 0, 0),
    (dict(model_type="mistral", sliding_window=4096), 12, 4096),
    (dict(model_type="mistral", sliding_window=None), 0, 0),
])
def test_sliding_window_layers_follow_transformers_layout(extra, windowed, window):
    spec = model_spec_from_hf_config(BASE_CFG | extra, "m", "test")
    assert (spec.window_layers, spec.window) == (windowed, window)


def test_multimodal_configs_read_their_text_config():
    cfg = {"model_type": "gemma3", "text_config": BASE_CFG | dict(model_type="gemma3_text", sliding_window=8,
                                                                   head_dim=32, max_position_embeddings=4096)}
    spec = model_spec_from_hf_config(cfg, "g", "test")
    assert (spec.head_dim, spec.window_layers, spec.tie_embeddings, spec.max_context) == (32, 10, True, 4096)


@pytest.mark.parametrize("extra,msg", [
    (dict(layer_types=["full_attention"] * 3), "3 entries for 12 layers"),
    (dict(layer_types=["chunked_attention"] * 12), "chunked_attention"),
    (dict(layer_types=["sliding_attention"] * 12), "no sliding_window length"),
    (dict(num_hidden_layers="many"), "malformed"),
])
def test_bad_layer_layouts_are_named(extra, msg):
    with pytest.raises(ValueError, match=msg):
        model_spec_from_hf_config(BASE_CFG | extra, "m", "test")


def test_sliding_windows_cut_the_attention_of_gemma3():
    """Gemma 3 27B at 128K, CP4 x TP2 on H200: 52 of its 62 layers see 1024 keys, so attention is a small part."""
    gemma = load_model_spec("gemma-3-27b")
    dense = dataclasses.replace(gemma, window=0, window_layers=0)
    plans = {m.name if m.window else "dense": simulate_prefill(Deployment(m, HARDWARE["h200"], 4, 2,
                                                                          WEIGHT_FORMATS["bf16"]), 131072)
             for m in (gemma, dense)}
    attention = {k: p.breakdown["attention"] for k, p in plans.items()}
    assert attention["gemma-3-27b"] < 0.3 * attention["dense"]
    assert attention["gemma-3-27b"] > 10 / 62 * attention["dense"]  # the 10 global layers stay whole
    assert plans["gemma-3-27b"].breakdown["gemm"] == plans["dense"].breakdown["gemm"]
    # App. A's FLOP count takes the windowed layers' visible pairs: the achieved rate stays below the peak
    assert plans["gemma-3-27b"].detail["tflops_per_gpu"] < plans["dense"].detail["tflops_per_gpu"] < 989
    wide = dataclasses.replace(gemma, window=10**6)
    assert paper_flops(wide, 131072, 5000) == pytest.approx(paper_flops(dense, 131072, 5000), rel=1e-4)
    tt = {k: simulate_decode(Deployment(m, HARDWARE["h200"], 4, 2, WEIGHT_FORMATS["bf16"]), 131072)
          for k, m in (("gemma", gemma), ("dense", dense))}
    assert tt["gemma"].breakdown["attention"] < tt["dense"].breakdown["attention"]


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="llama3-405b"):
        load_model_spec("gpt-9")
    with pytest.raises(ValueError, match="h100-gtt"):
        load_hardware_profile("tpu-v9")


def test_every_profile_states_its_sources_and_round_trips_json(tmp_path):
    for name, hw in HARDWARE.items():
        assert hw.sources and all(hw.sources.values()), name
        again = HardwareProfile.from_json(hw.to_json())
        assert again == hw and again.sources == hw.sources
    path = tmp_path / "mine.json"
    GTT.to_json(path)
    assert load_hardware_profile(str(path)) == GTT
    assert HARDWARE["h200"].kind == "spec" and HARDWARE["cpu-gloo"].kind == "estimate"


def test_profiles_validate_themselves():
    with pytest.raises(ValueError, match="gemm_efficiency"):
        dataclasses.replace(GTT, gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="mem_tbps"):
        dataclasses.replace(GTT, mem_tbps=-1.0)
    with pytest.raises(ValueError, match="inter_gbs"):
        dataclasses.replace(GTT, inter_gbs=80.0)
    data = GTT.to_dict()
    with pytest.raises(ValueError, match="unknown keys"):
        HardwareProfile.from_dict(data | {"typo": 1})
    del data["mem_gb"]
    with pytest.raises(ValueError, match="missing keys"):
        HardwareProfile.from_dict(data)
    with pytest.raises(ValueError, match="no source"):
        dataclasses.replace(GTT, sources={})


def test_deployment_rejects_bad_tp():
    with pytest.raises(ValueError, match="tp"):
        Deployment(L405, GTT, 2, 3, FP8_FFN)
    with pytest.raises(ValueError, match="cp"):
        Deployment(L405, GTT, 0, 8, FP8_FFN)


# --- the CLI -------------------------------------------------------------------------------------------------
BASE = ["plan", "--model", "llama3-405b", "--hardware", "h100-gtt", "--weights", "fp8-ffn", "--tp", "8"]


def _json(capsys, argv) -> tuple[int, dict]:
    rc = cli_main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_plan_json(capsys):
    rc, out = _json(capsys, BASE + ["--cp", "8", "--prompt-tokens", str(K128)])
    assert rc == 0
    assert out["pass_kv"]["ttft_s"] == pytest.approx(5.85, rel=0.10)
    assert out["pass_q"]["ttft_s"] > out["pass_kv"]["ttft_s"]
    assert out["choice"] == "pass-kv" and out["ttit_s"] > 0 and out["memory_gb_per_gpu"] > 60
    rc, out = _json(capsys, BASE + ["--cp", "4", "--prompt-tokens", "1600", "--cached-tokens", "126400"])
    assert out["choice"] == "pass-q" and out["fastest_simulated"] == "pass-q"


def test_cli_plan_text(capsys):
    assert cli_main(BASE + ["--cp", "2", "--prompt-tokens", "1000", "--cached-tokens", "9000"]) == 0
    text = capsys.readouterr().out
    for label in ("exposed SendRecv", "All2All", "TP all-reduce", "choice", "TTIT", "memory"):
        assert label in text
    assert "explain" not in text


def test_cli_plan_explain_lists_components_with_parameters(capsys):
    assert cli_main(BASE + ["--cp", "4", "--prompt-tokens", "6400", "--cached-tokens", "121600", "--explain"]) == 0
    text = capsys.readouterr().out
    for label in ("GEMM", "attention kernels", "exposed SendRecv", "All2All", "TP all-reduce", "per-step ring"):
        assert f"  {label}" in text
    assert f"gemm_efficiency = {GTT.gemm_efficiency:g}  [fitted" in text
    assert "attn_tflops = 540  [paper" in text
    rc, out = _json(capsys, BASE + ["--cp", "4", "--prompt-tokens", "6400", "--explain"])
    assert out["parameters"]["inter_gbs"]["value"] == GTT.inter_gbs


def test_cli_plans_the_families_and_says_when_the_context_is_too_long(capsys):
    rc, out = _json(capsys, ["plan", "--model", "gemma-3-27b", "--hardware", "h200", "--cp", "4", "--tp", "2",
                             "--prompt-tokens", "131072"])
    assert rc == 0 and (out["window"], out["window_layers"]) == (1024, 52) and out["warnings"] == []
    rc, out = _json(capsys, ["plan", "--model", "qwen3-8b", "--hardware", "h200", "--cp", "2", "--prompt-tokens",
                             "131072"])
    assert any("max_position_embeddings (40960)" in w for w in out["warnings"])
    assert cli_main(["plan", "--model", "qwen3-8b", "--hardware", "h200", "--cp", "2", "--prompt-tokens",
                     "131072"]) == 0
    assert "warning   131072 tokens exceed qwen3-8b" in capsys.readouterr().out


def test_cli_implementation_switches_whose_ring_is_predicted(capsys):
    argv = BASE + ["--cp", "4", "--prompt-tokens", "3200", "--cached-tokens", "124800"]
    _, ours = _json(capsys, argv)
    _, paper = _json(capsys, argv + ["--implementation", "paper"])
    assert (ours["implementation"], paper["implementation"]) == ("cpinfer", "paper")
    # cpinfer sends fp32 partial outputs: twice the output bytes of the paper's bf16 ones
    assert ours["pass_q"]["breakdown_s"]["all2all"] > paper["pass_q"]["breakdown_s"]["all2all"]
    assert ours["ttit_detail"]["padding_queries"] == 0 and paper["ttit_detail"]["padding_queries"] == 3


def test_cli_sweep_finds_the_smallest_cp(capsys):
    rc, out = _json(capsys, BASE + ["--prompt-tokens", str(K128), "--sweep", "--ttft-target", "10"])
    assert rc == 0
    cp = out["smallest_cp"]
    assert out["ttft_s"] <= 10 and out["cp"] == cp
    assert [r["cp"] for r in out["sweep"]] == list(range(1, cp + 1))
    assert all(r["ttft_s"] > 10 for r in out["sweep"][:-1])


def test_cli_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--help"])
    text = capsys.readouterr().out
    for opt in ("--model", "--hardware", "--cp", "--tp", "--prompt-tokens", "--cached-tokens", "--batch",
                "--weights", "--kv-dtype", "--method", "--json", "--sweep", "--ttft-target", "--max-cp", "--explain",
                "--implementation", "gemma-3-27b", "qwen2.5-14b-1m", "calibrate", "docs/planning.md"):
        assert opt in text


@pytest.mark.parametrize("argv,msg", [
    (["--model", "nope", "--hardware", "h100-gtt", "--cp", "2", "--prompt-tokens", "8"], "llama3-8b"),
    (["--model", "llama3-8b", "--hardware", "nope", "--cp", "2", "--prompt-tokens", "8"], "cpu-gloo"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--cp", "0", "--prompt-tokens", "8"], "cp"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--cp", "2", "--prompt-tokens", "-5"], "prompt"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--prompt-tokens", "8"], "--cp"),
    (["--model", "llama3-8b", "--hardware", "h100-gtt", "--prompt-tokens", "8", "--sweep"], "ttft-target"),
])
def test_cli_bad_input_is_one_clear_line(capsys, argv, msg):
    assert cli_main(["plan"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


# --- mixtures of experts and chunked attention -------------------------------------------------------------------
# name -> (published total, published active); gpt-oss's published active count leaves out the input embedding
MOE_PUBLISHED = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9), "gpt-oss-20b": (21e9, 3.6e9),
                 "gpt-oss-120b": (117e9, 5.1e9), "llama-4-scout": (109e9, 17e9), "mixtral-8x7b": (46.7e9, 12.9e9)}


@pytest.mark.parametrize("name", sorted(MOE_PUBLISHED))
def test_moe_catalog_matches_published_total_and_active_parameters(name):
    spec, (total, active) = load_model_spec(name), MOE_PUBLISHED[name]
    assert spec.source.startswith("published config.json of huggingface.co/") and spec.moe_layers
    embedding = spec.vocab * spec.hidden if name.startswith("gpt-oss") else 0
    assert spec.params == pytest.approx(total, rel=0.02)
    assert spec.active_params - embedding == pytest.approx(active, rel=0.03)


def test_moe_memory_from_total_flops_from_active():
    """Weights in memory are every expert's (TP-sliced); the GEMM FLOPs are those of the k active experts; a decode
    step reads only the experts its tokens touch."""
    moe, dense = load_model_spec("qwen3-30b-a3b"), load_model_spec("qwen3-32b")
    dep = Deployment(moe, HARDWARE["h200"], 2, 2, WEIGHT_FORMATS["bf16"])
    whole = moe.embed_params + moe.moe_layers * moe.n_experts * moe.hidden + moe.norm_params  # on every TP rank
    assert memory_per_gpu(dep, 1000).weights_gb == pytest.approx(((moe.params - whole) / 2 + whole) * 2 / 1e9,
                                                                 rel=1e-9)
    attention_only = dataclasses.replace(moe, n_experts=0, experts_per_tok=0, expert_ffn_dim=0, moe_layers=0,
                                         ffn_dim=1)
    gemm_flops = paper_flops(moe, 4096) - paper_flops(attention_only, 4096)
    assert gemm_flops == pytest.approx(2 * (moe.active_params - attention_only.active_params) * 4096, rel=1e-9)
    ttit = {m.name: simulate_decode(Deployment(m, HARDWARE["h200"], 1, 1, WEIGHT_FORMATS["bf16"]), 8192)
            for m in (moe, dense)}
    assert ttit["qwen3-30b-a3b"].breakdown["gemm"] < 0.2 * ttit["qwen3-32b"].breakdown["gemm"]
    prefill = simulate_prefill(dep, 32768)
    assert prefill.detail["tflops_per_gpu"] < 989


def test_chunked_layers_of_llama4_scout():
    """36 of Scout's 48 layers see only their own 8192-token chunk: FLOPs count the pairs exactly, the ring attention
    is priced by the chunk's geometry (below a window of the same size), both far below full causal at 1M tokens;
    a decode step reads only its chunk's keys."""
    from cpinfer.perf.simulator import _chunk_pairs

    scout = load_model_spec("llama-4-scout")
    assert (scout.local, scout.window, scout.window_layers, scout.full_layers) == ("chunked", 8192, 36, 12)
    brute = sum((x - 1) % 16 + 1 for x in range(5, 100))
    assert _chunk_pairs(5, 99, 16) == brute
    full = dataclasses.replace(scout, window=0, window_layers=0, local="sliding")
    as_window = dataclasses.replace(scout, local="sliding")
    assert paper_flops(scout, 1 << 20) < paper_flops(as_window, 1 << 20) < paper_flops(full, 1 << 20)
    dep = {m: Deployment(spec, HARDWARE["h200"], 8, 8, WEIGHT_FORMATS["bf16"]) for m, spec in
           (("chunked", scout), ("window", as_window), ("full", full))}
    attention = {k: simulate_prefill(d, 1 << 20).breakdown["attention"] for k, d in dep.items()}
    assert attention["chunked"] < attention["window"] < 0.3 * attention["full"]
    decode = {k: simulate_decode(d, 1 << 20).breakdown["attention"] for k, d in dep.items()}
    assert decode["chunked"] <= decode["window"] < decode["full"]  # both at one kernel slot per step here


@pytest.mark.parametrize("extra, expect", [
    (dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          decoder_sparse_step=2, mlp_only_layers=[3]), (8, 2, 32, 0, 5, 0, "sliding")),
    (dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          shared_expert_intermediate_size=64), (8, 2, 32, 64, 12, 0, "sliding")),
    (dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=4096),
     (8, 2, 128, 0, 12, 12, "sliding")),
    (dict(model_type="gpt_oss", num_local_experts=32, experts_per_token=4, sliding_window=128,
          layer_types=["sliding_attention", "full_attention"] * 6), (32, 4, 128, 0, 12, 6, "sliding")),
    (dict(model_type="llama4_text", num_local_experts=16, num_experts_per_tok=1, intermediate_size_mlp=256,
          interleave_moe_layer_step=2, attention_chunk_size=8192), (16, 1, 128, 128, 6, 9, "chunked")),
])
def test_moe_and_chunked_configs_are_read(extra, expect):
    spec = model_spec_from_hf_config(BASE_CFG | extra, "m", "test")
    got = (spec.n_experts, spec.experts_per_tok, spec.expert_ffn_dim, spec.shared_ffn_dim, spec.moe_layers,
           spec.window_layers, spec.local)
    assert got == expect
    assert spec.active_params < spec.params


def test_cli_plans_a_mixture_of_experts(capsys):
    rc, out = _json(capsys, ["plan", "--model", "gpt-oss-120b", "--hardware", "h200", "--cp", "2", "--tp", "2",
                             "--prompt-tokens", "65536"])
    assert rc == 0 and out["active_params"] < 0.06 * out["params"]
    assert (out["window"], out["window_layers"], out["local_attention"]) == (128, 18, "sliding")
    assert cli_main(["plan", "--model", "llama-4-scout", "--hardware", "h200", "--cp", "4", "--tp", "8",
                     "--prompt-tokens", "131072"]) == 0
    assert "17.2B active: 1 of 16 experts on 48 layers" in capsys.readouterr().out


# --- multi-head latent attention ---------------------------------------------------------------------------------
MLA_PUBLISHED = {"deepseek-v3": (671e9, 37e9), "kimi-k2": (1.04e12, 32e9)}


@pytest.mark.parametrize("name", sorted(MLA_PUBLISHED))
def test_mla_catalog_matches_published_parameters_and_caches_the_latent(name):
    """DeepSeek-V3 / Kimi K2: total and active parameters as published; the KV cache holds 512 + 64 values per token
    and layer once — the same on every TP rank (the latent is replicated) — against H x (192 + 128) per head."""
    spec, (total, active) = load_model_spec(name), MLA_PUBLISHED[name]
    assert spec.mla and spec.n_kv_heads == 1 and spec.head_dim == 576 and spec.kv_parts == 1
    assert spec.params == pytest.approx(total, rel=0.02)
    assert spec.active_params == pytest.approx(active, rel=0.03)
    for tp in (1, 8):
        assert spec.kv_bytes_per_token(tp, 2) == 61 * 576 * 2
    assert spec.kv_bytes_per_head_layout(2) == 61 * spec.n_heads * 320 * 2
    shape = Deployment(spec, HARDWARE["h200"], 2, 8, WEIGHT_FORMATS["fp8"]).attn_shape
    assert shape.kv_bytes(1) == 576 * 2  # a ring message carries the latent rows alone


def test_mla_config_is_read_and_planned(capsys):
    cfg = BASE_CFG | dict(model_type="deepseek_v3", kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                          v_head_dim=32, q_lora_rank=96, n_routed_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
    spec = model_spec_from_hf_config(cfg, "m", "test")
    assert (spec.n_kv_heads, spec.head_dim, spec.kv_lora_rank, spec.q_lora_rank) == (1, 80, 64, 96)
    assert (spec.n_experts, spec.experts_per_tok, spec.shared_ffn_dim, spec.moe_layers) == (8, 2, 32, 11)
    rc, out = _json(capsys, ["plan", "--model", "deepseek-v3", "--hardware", "h200", "--cp", "2", "--tp", "8",
                             "--prompt-tokens", "131072", "--weights", "fp8"])
    assert rc == 0 and out["active_params"] < 0.06 * out["params"]


def test_mla_prefill_is_costed_in_the_cheaper_form_and_decode_absorbed():
    """DeepSeek-V3 on CP4 x TP8 H200s: a 128K prefill costs the expanded form's FLOPs (per-head keys and values,
    (128 + 64 + 128) / 2 per pair and head, plus kv_b_proj per latent row and ring step) — less than the absorbed
    form's 576 — while a 64-token partial prefill over 128K cached tokens stays absorbed; the ring still carries
    the latent, and decode is priced on the absorbed form's bytes as before."""
    spec = load_model_spec("deepseek-v3")
    dep = Deployment(spec, HARDWARE["h200"], 4, 8, WEIGHT_FORMATS["bf16"])
    ex = dep.expanded_shape
    assert (ex.pair_dim, ex.head_dim, ex.kv_bytes(1)) == (160, 576, 576 * 2)
    assert ex.expand_flops == 2 * 512 * 256 * 16
    full = simulate_prefill(dep, 131072)
    ring = RingShape(4, 131072, 0)
    absorbed = cost_model.ring_cost(dep.hardware, dep.attn_shape, ring, "pass-kv", tp=8)
    expanded = cost_model.ring_cost(dep.hardware, ex, ring, "pass-kv", tp=8)
    assert full.detail["mla_form"] == "expanded" and expanded.total < absorbed.total / 2
    assert full.breakdown["attention"] == pytest.approx(expanded.attention * spec.full_layers)
    assert expanded.message_bytes == absorbed.message_bytes  # the latent on the wire either way
    assert simulate_prefill(dep, 64, 131072).detail["mla_form"] == "absorbed"
    assert "mla_form" not in simulate_prefill(Deployment(load_model_spec("llama3-8b"), HARDWARE["h200"], 2, 1,
                                                         WEIGHT_FORMATS["bf16"]), 4096).detail


# --- a plan that ends in a command -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, tokens", [("131072", 131072), ("128k", 128_000), ("128K", 131_072),
                                          ("1m", 1_000_000), ("1M", 1_048_576), ("25.6k", 25_600),
                                          ("1_000_000", 1_000_000)])
def test_token_counts_read_as_vllm_writes_them(text, tokens):
    from cpinfer.perf.planner import parse_token_count
    assert parse_token_count(text) == tokens


@pytest.mark.parametrize("bad", ["", "1.5", "12x", "-3k", "0.0001k"])
def test_bad_token_counts_are_refused(bad):
    from cpinfer.perf.planner import parse_token_count
    with pytest.raises(ValueError, match="token count"):
        parse_token_count(bad)


def test_cli_takes_suffixed_token_counts(capsys):
    rc, out = _json(capsys, BASE + ["--cp", "16", "--prompt-tokens", "1m", "--cached-tokens", "1k"])
    assert rc == 0 and (out["prompt_tokens"], out["cached_tokens"]) == (1_000_000, 1000)


@pytest.mark.parametrize("name, mem_gb, bf16, fp8, tbps", [("h100-sxm", 80, 989, 1979, 3.35),
                                                           ("h200", 141, 989, 1979, 4.8),
                                                           ("b200", 180, 2250, 4500, 8.0)])
def test_datasheet_profiles(name, mem_gb, bf16, fp8, tbps):
    hw = HARDWARE[name]
    assert (hw.mem_gb, hw.peak_tflops, hw.peak_tflops_fp8, hw.mem_tbps) == (mem_gb, bf16, fp8, tbps)
    assert hw.kind == "spec" and "NVIDIA" in hw.sources["mem_gb"] and "NVIDIA" in hw.sources["peak_tflops"]
    assert "NVLink" in hw.sources["devices_per_node"]


def test_gpu_memory_gib_replaces_the_profile_memory(capsys):
    argv = BASE + ["--cp", "8", "--prompt-tokens", "128k", "--hardware", "h100-sxm"]
    _, plain = _json(capsys, argv)
    _, small = _json(capsys, argv + ["--gpu-memory-gib", "64"])
    assert plain["capacity_gb_per_gpu"] == 80
    assert small["capacity_gb_per_gpu"] == pytest.approx(64 * 2**30 / 1e9)
    assert small["memory_gb_per_gpu"] == plain["memory_gb_per_gpu"] and not small["fits"] and plain["fits"]
    assert small["decision"]["decided_by"] == "memory" and small["decision"]["memory_margin_gb"] < 0


def test_sweep_says_memory_decided_and_by_how_much(capsys):
    """On 80 GB devices the weights of 405B at TP8 leave little room: CP1-CP2 would meet a loose target but their
    KV does not fit, so memory decides; with a tight target the TTFT decides."""
    argv = BASE + ["--hardware", "h100-sxm", "--prompt-tokens", "1m", "--sweep"]
    _, loose = _json(capsys, argv + ["--ttft-target", "2000"])
    rows = loose["sweep"]
    assert rows[-2]["ttft_s"] <= 2000 and not rows[-2]["fits"] and rows[-1]["fits"]
    d = loose["decision"]
    assert d["decided_by"] == "memory" and f"CP{rows[-2]['cp']} meets the TTFT target" in d["text"]
    assert d["memory_margin_gb"] == pytest.approx(d["usable_gb_per_gpu"] - rows[-1]["memory_gb_per_gpu"])
    _, tight = _json(capsys, argv + ["--ttft-target", "50"])
    assert tight["decision"]["decided_by"] == "ttft" and tight["sweep"][-2]["fits"]
    assert tight["decision"]["ttft_margin_s"] == pytest.approx(50 - tight["ttft_s"])


def test_one_node_plan_prints_the_serve_command(capsys):
    _, out = _json(capsys, ["plan", "--model", "llama3-70b", "--hardware", "h200", "--cp", "2", "--tp", "4",
                            "--prompt-tokens", "128K", "--kv-cache-dtype", "fp8"])
    launch = out["launch"]
    assert (launch["nodes"], launch["procs_per_node"]) == (1, 8)
    assert launch["command"] == ("cpinfer serve --model meta-llama/Llama-3.1-70B --cp 2 --tp 4 --max-model-len "
                                 "131072 --dtype bfloat16 --kv-cache-dtype fp8 --hardware-profile h200 --port 8000")
    assert any("CUDA graphs" in n for n in launch["notes"]) and out["ttit_detail"]["cuda_graphs"] is False


def test_multinode_plan_prints_the_torchrun_line_every_node_runs(capsys):
    """The paper's 1M setup: 16 nodes of 8, one torchrun line each; the engine's own flags parse it."""
    import shlex

    from cpinfer.cli import build_parser
    argv = BASE + ["--cp", "16", "--prompt-tokens", "1m"]
    _, out = _json(capsys, argv)
    launch = out["launch"]
    assert (launch["nodes"], launch["procs_per_node"]) == (16, 8) and len(launch["per_node"]) == 16
    words = shlex.split(launch["command"])
    assert words[:4] == ["torchrun", "--nnodes", "16", "--nproc-per-node"] and words[4] == "8"
    serve = words[words.index("-m") + 2:]
    args = build_parser().parse_args(serve)
    assert (args.cp, args.tp, args.model, args.host) == (16, 8, "meta-llama/Llama-3.1-405B-Instruct-FP8", "0.0.0.0")
    assert args.max_model_len == 1_000_000
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "on each of the 16 nodes" in text and launch["command"] in text and "decided   memory" in text


def test_node_layout_keeps_tp_groups_whole():
    from cpinfer.perf.launch import node_layout
    assert node_layout(8, 8, 8) == (1, 8)
    assert node_layout(128, 8, 8) == (16, 8)
    assert node_layout(16, 16, 8) == (2, 8)      # TP16 over two nodes
    assert node_layout(10, 2, 8) == (2, 5) or node_layout(10, 2, 8) == (5, 2)
    nodes, per = node_layout(10, 2, 8)
    assert per % 2 == 0 and nodes * per == 10


def test_deepseek_v3_fp8_on_80gb_h100s_does_not_fit_at_tp8():
    """The engine dequantizes routed experts at load: 671B with bf16 experts cannot fit 8 x 80 GB."""
    spec = load_model_spec("deepseek-v3")
    dep = Deployment(spec, HARDWARE["h100-sxm"], 1, 8, WEIGHT_FORMATS["fp8"])
    mem = memory_per_gpu(dep, 4096)
    experts = spec.moe_layers * spec.n_experts * 3 * spec.hidden * spec.expert_ffn_dim * 2 / 8 / 1e9
    assert mem.weights_gb > experts > 150 and not mem.fits
    paper_rules = Deployment(spec, HARDWARE["h100-sxm"], 1, 8, WEIGHT_FORMATS["fp8"], implementation=PAPER)
    assert memory_per_gpu(paper_rules, 4096).weights_gb < mem.weights_gb - experts / 2 + 1


# --- DeepSeek sparse attention ---------------------------------------------------------------------------------
def test_dsa_catalog_caches_the_indexer_key_and_costs_sparse_attention(capsys):
    """DeepSeek-V3.2: DeepSeek-V3's shapes plus a 64 x 128 indexer per layer (whole on every TP rank), top-2048;
    each token caches latent 576 + indexer key 128 per layer (FP8: 576 + 128 + its 4-byte scale). Prefill is
    costed as sparse on every layer (indexer O(S^2) at its width, attention O(S k), the exchange of rows, candidates
    and partials; no ring steps): at 1M tokens on CP4 x TP1 the attention kernels cost a fraction of DeepSeek-V3's
    dense ones (under TP8 the indexer, whole on every TP rank, costs more than the TP-split dense attention), growing
    ~quadratically only through the indexer; the App. A count follows the same FLOPs; `cpinfer plan` says so and
    prints 128K and 1M."""
    from cpinfer.perf.simulator import paper_flops, sparse_attention_layer, topk_pairs

    v32, v3 = load_model_spec("deepseek-v3.2"), load_model_spec("deepseek-v3")
    assert v32.dsa and (v32.index_heads, v32.index_dim, v32.index_topk) == (64, 128, 2048)
    assert v32.params - v3.params == 61 * (1536 * 64 * 128 + 7168 * (128 + 64))
    assert v32.params == pytest.approx(671.9e9, rel=0.01)
    for tp in (1, 8):
        assert v32.kv_bytes_per_token(tp, 2) == 61 * (576 + 128) * 2
    assert v32.kv_bytes_per_token(8, 1) == 61 * (576 + 128 + 4)
    assert topk_pairs(0, 5000, 2048) == sum(min(2048, i + 1) for i in range(5000))
    assert topk_pairs(100, 3000, 2048) == sum(min(2048, 100 + i + 1) for i in range(3000))
    dense, sparse = (Deployment(m, HARDWARE["h200"], 4, 1, WEIGHT_FORMATS["bf16"]) for m in (v3, v32))
    ttft = {n: (simulate_prefill(dense, n), simulate_prefill(sparse, n)) for n in (131072, 1048576)}
    for n, (d, s) in ttft.items():
        assert s.detail["mla_form"] == "sparse" and s.breakdown["ring_steps"] == 0 and s.breakdown["all2all"] > 0
        one = sparse_attention_layer(sparse, RingShape(4, n, 0), 1)
        assert s.breakdown["attention"] == pytest.approx(61 * one["attention"])
        index = 2.0 * 64 * 129 * n * n / 2
        attend = 2.0 * 128 * (576 + 512) * topk_pairs(0, n, 2048)
        assert paper_flops(v32, n) == pytest.approx(2.0 * v32.active_params * n + 61 * (index + attend))
    assert ttft[1048576][1].breakdown["attention"] < ttft[1048576][0].breakdown["attention"] / 3
    assert ttft[1048576][1].breakdown["attention"] > 20 * ttft[131072][1].breakdown["attention"]  # the indexer's S^2
    single = simulate_prefill(Deployment(v32, HARDWARE["h200"], 1, 8, WEIGHT_FORMATS["bf16"]), 131072)
    assert single.breakdown["all2all"] == 0
    for tokens in ("128K", "1M"):
        rc, out = _json(capsys, ["plan", "--model", "deepseek-v3.2", "--hardware", "h200", "--cp", "4", "--tp", "8",
                                 "--prompt-tokens", tokens, "--weights", "fp8"])
        assert rc == 0 and out["ttft_s"] > 0 and out["kv_gb_per_gpu"] > 0
    assert cli_main(["plan", "--model", "deepseek-v3.2", "--hardware", "h200", "--cp", "4", "--tp", "8",
                     "--prompt-tokens", "1M"]) == 0
    text = capsys.readouterr().out
    assert "DeepSeek sparse attention" in text and "latent 576 + indexer key 128" in text


def test_dsa_config_is_read():
    cfg = BASE_CFG | dict(model_type="deepseek_v32", kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                          v_head_dim=32, q_lora_rank=96, index_topk=256, index_n_heads=8, index_head_dim=32)
    spec = model_spec_from_hf_config(cfg, "m", "test")
    assert (spec.index_heads, spec.index_dim, spec.index_topk) == (8, 32, 256) and spec.dsa
    with pytest.raises(ValueError, match="sparse attention needs MLA"):
        dataclasses.replace(load_model_spec("llama3-8b"), index_heads=8, index_dim=32, index_topk=256)
