"""The planner on linear-attention hybrids (issue 47 must 6): the Qwen3.5-397B-A17B / Qwen3-Next / Kimi Linear
catalog shapes, K/V for the attention layers only plus a state per request, TTFT with the recurrent layers' O(S)
cost and the fixed-size summary exchange, TTIT, `cpinfer plan`; and the planner's bytes against the engine's own
accounting for tiny checkpoints of the families (weights, K/V per token, state per request, map per shard)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cpinfer.cli import main as cli_main
from cpinfer.engine import hybrid as engine_hybrid
from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import build_model
from cpinfer.perf import hybrid
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.model_catalog import MODELS
from cpinfer.perf.models import WEIGHT_FORMATS, load_model_spec, weight_bytes_per_gpu, held_weights
from cpinfer.perf.planner import Workload, build_deployment, make_plan
from cpinfer.perf.simulator import memory_per_gpu, simulate_decode, simulate_prefill

Q35 = MODELS["qwen3.5-397b-a17b"]
H200 = HARDWARE["h200"]
M1 = 1_000_000


def dep(cp: int, tp: int = 8, model=Q35, weights: str = "fp8"):
    return build_deployment(model, H200, cp, tp, weights)


def test_qwen35_catalog_shape_and_published_sizes():
    """60 layers, 45 Gated DeltaNet (64 value / 16 key heads of 128) and 15 gated attention (32 / 2 heads of 256);
    397B total, 17B active (the card's rounding)."""
    m = Q35
    assert (m.n_layers, m.linear_layers, m.attn_layers, m.full_layers) == (60, 45, 15, 15)
    assert (m.linear_v_heads, m.linear_k_heads, m.linear_k_dim, m.linear_v_dim) == (64, 16, 128, 128)
    assert (m.n_heads, m.n_kv_heads, m.head_dim, m.n_experts, m.experts_per_tok) == (32, 2, 256, 512, 10)
    assert m.params / 1e9 == pytest.approx(397, rel=0.01)
    assert m.active_params / 1e9 == pytest.approx(17, rel=0.03)
    assert "Qwen3.5-397B-A17B" in m.source and "transformers" in m.source
    # K/V: 15 layers x (K, V) x 2 KV heads x 256; state: 45 x (64 x 128 x 128 fp32 + 3 conv rows of 2*2048 + 8192)
    assert m.kv_bytes_per_token(1, 2) == 15 * 2 * 2 * 256 * 2
    assert m.linear_state_bytes(1, 2) == 45 * (64 * 128 * 128 * 4 + 3 * 12288 * 2)
    for name, total in (("qwen3-next-80b-a3b", 80), ("kimi-linear-48b-a3b", 48)):
        assert MODELS[name].params / 1e9 == pytest.approx(total, rel=0.03), name
    kimi = MODELS["kimi-linear-48b-a3b"]
    assert (kimi.linear_layers, kimi.attn_layers, kimi.linear_kind, kimi.mla) == (20, 7, "kda", True)


def test_memory_at_1m_tokens_counts_attention_layers_and_a_state_per_request():
    """KV of the 15 attention layers only, CP-sharded; the recurrent state per request on every CP rank (heads
    TP-sharded); a quarter of the K/V a dense model of the same attention shape would hold."""
    for cp, batch in ((8, 1), (16, 1), (16, 4)):
        d = dep(cp)
        mem = memory_per_gpu(d, M1, batch)
        assert mem.kv_gb * 1e9 == pytest.approx(batch * M1 / cp * 15 * 2 * 1 * 256 * 2, rel=1e-3)
        assert mem.state_gb * 1e9 == batch * Q35.linear_state_bytes(8, 2)
        assert mem.total_gb == pytest.approx(mem.weights_gb + mem.kv_gb + mem.state_gb)
        dense = memory_per_gpu(dataclasses.replace(d, model=dataclasses.replace(Q35, linear_layers=0)), M1, batch)
        assert dense.kv_gb == pytest.approx(4 * mem.kv_gb) and dense.state_gb == 0
    assert memory_per_gpu(dep(16), M1).state_gb == memory_per_gpu(dep(16), 1000).state_gb  # fixed size


def test_recurrent_prefill_is_linear_in_s_and_the_exchange_is_not():
    """The recurrence grows as S (attention as S^2); the summary exchange is the same at any S, none at CP1, and
    grows with the CP size; under CP the rule runs on Dv + Dk values (the map in the same pass)."""
    short, long = (simulate_prefill(dep(8), s) for s in (256_000, 512_000))
    assert long.breakdown["recurrence"] / short.breakdown["recurrence"] == pytest.approx(2, rel=0.01)
    assert long.breakdown["attention"] / short.breakdown["attention"] == pytest.approx(4, rel=0.05)
    assert long.breakdown["summary_exchange"] == short.breakdown["summary_exchange"] > 0
    assert simulate_prefill(dep(1), 64_000).breakdown["summary_exchange"] == 0
    assert simulate_prefill(dep(16), M1).breakdown["summary_exchange"] > short.breakdown["summary_exchange"]
    assert hybrid.token_flops(Q35, 1) == 64 * (5 * 128 + 3 * 128) + 6 * 128 * 128
    mapped = 64 * (5 * 128 + 3 * 256) + 6 * 128 * 256 + 2 * 128 * 128
    assert hybrid.token_flops(Q35, 3) == mapped
    assert hybrid.token_flops(Q35, 2) == (hybrid.token_flops(Q35, 1) + mapped) / 2  # one chunk of two plainly
    kimi = MODELS["kimi-linear-48b-a3b"]  # KDA: the augmented pass for the map, then the plain rule from the state
    assert hybrid.token_flops(kimi, 4) == hybrid.rule_flops(128, 256) + hybrid.rule_flops(128, 128)
    # the exchange: 2N - 1 shards' maps of 8 value heads (64 / TP8) x 128 x (128 + 128) fp32 (the first two as B
    # alone), + the conv halo
    d = dep(8)
    maps = 13 * 8 * 128 * 256 * 4 + 2 * 8 * 128 * 128 * 4
    assert simulate_prefill(d, 256_000).detail["exchange_mb_per_layer"] * 1e6 == maps + 15 * 3 * 12288 // 8 * 2
    for s in (simulate_prefill(d, 256_000, strategy=x) for x in ("pass-kv", "pass-q")):
        assert sum(s.breakdown.values()) == pytest.approx(s.seconds)


def test_hybrid_ttit_pays_the_state_and_the_row_exchange():
    """Decode: every rank advances the batch's states (bytes grow with the batch, not the context) and exchanges
    the decode rows once per recurrent layer under CP; attention only on the 15 attention layers."""
    one, four = simulate_decode(dep(4), M1, 1), simulate_decode(dep(4), M1, 4)
    assert four.breakdown["recurrence"] > one.breakdown["recurrence"] > 0
    assert simulate_decode(dep(4), 100_000).breakdown["recurrence"] == one.breakdown["recurrence"]
    assert simulate_decode(dep(1), M1).breakdown["summary_exchange"] == 0 < one.breakdown["summary_exchange"]
    dense = simulate_decode(dataclasses.replace(dep(4), model=dataclasses.replace(Q35, linear_layers=0)), M1)
    assert one.breakdown["attention"] == pytest.approx(dense.breakdown["attention"] / 4)


def test_cli_plans_qwen35_at_1m_tokens(capsys):
    assert cli_main(["plan", "--model", "qwen3.5-397b", "--hardware", "h200", "--cp", "16", "--tp", "8",
                     "--weights", "fp8", "--prompt-tokens", "1m"]) == 0
    out = capsys.readouterr().out
    for text in ("45 Gated DeltaNet", "K/V on the other 15 only", "recurrent layers (conv + rule)",
                 "recurrent summary exchange", "GB recurrent state", "tp 1 only"):
        assert text in out, text
    assert cli_main(["plan", "--model", "qwen3.5-397b-a17b", "--hardware", "h200", "--cp", "16", "--tp", "8",
                     "--weights", "fp8", "--prompt-tokens", "1m", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["linear_layers"], res["attention_layers"]) == (45, 15)
    assert res["state_gb_per_gpu"] == pytest.approx(Q35.linear_state_bytes(8, 2) / 1e9)
    assert res["pass_kv"]["breakdown_s"]["summary_exchange"] > 0 and res["fits"]
    assert res["ttit_breakdown_s"]["recurrence"] > 0
    assert cli_main(["plan", "--model", "qwen3.5-397b", "--hardware", "h200", "--cp", "16", "--tp", "8",
                     "--weights", "fp8", "--prompt-tokens", "1m", "--pd-decode-cp", "2"]) == 0
    out = capsys.readouterr().out  # K/V of the 15 attention layers moves, and each request's state beside it
    assert "16-bit K/V, 15 layers" in out and "recurrent state" in out and "45 layers) travels" in out


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear"])
def test_planner_bytes_equal_the_engine_for_tiny_hybrids(llama_checkpoint, variant):
    """From the checkpoint's config.json: the recurrent layers found, the K/V bytes per token the engine's store
    keeps (attention layers only), the state slot's bytes, the exchanged map's size, and the weights the engine
    builds (fp32; less what the planner leaves out everywhere: q/k norms, Qwen's shared-expert gate)."""
    path = llama_checkpoint(variant)
    config = ModelConfig.from_pretrained(path)
    spec = load_model_spec(path)
    assert spec.linear_layers == len(config.recurrent_layers) > 0
    assert spec.attn_layers == config.num_kv_layers
    assert spec.kv_bytes_per_token(1, 4) == KVStore.bytes_per_token(config.num_kv_layers, config.cached_kv_heads,
                                                                    KVWidths.of(config), 4, "auto")
    assert spec.linear_state_bytes(1, 4) == engine_hybrid.state_bytes_per_slot(config, 4)
    h, dk, dv = config.recurrent.state_shape
    assert hybrid.map_bytes(spec, 1) == h * dk * (dk + dv) * 4  # the runner's [|M| + |B|] fp32 per shard
    model = build_model(config)
    mixers = sum(p.numel() for i in config.recurrent_layers for p in model.model.layers[i].linear_attn.parameters())
    assert spec.linear_layers * spec.linear_params == mixers  # every recurrent mixer's weight, GDN and KDA
    left_out = sum(p.numel() for n, p in model.named_parameters()
                   if n.endswith(("q_norm.weight", "k_norm.weight", "shared_expert_gate.weight"))
                   or (variant == "kimi_linear" and ("bias" in n or "layernorm" in n.split(".")[-2])))
    engine = sum(p.numel() for p in model.parameters()) - left_out
    held = held_weights(WEIGHT_FORMATS["fp32"], spec, 4, False, False)
    if variant != "kimi_linear":  # (Kimi Linear: MLA's latent norms and biases are counted another way)
        assert weight_bytes_per_gpu(spec, held, 1) == engine * 4
    plan = make_plan(build_deployment(spec, HARDWARE["cpu-gloo"], 2, 1, "fp32", "fp32", "fp32"), Workload(300))
    assert plan.memory.state_gb * 1e9 == spec.linear_state_bytes(1, 4)
    assert plan.ttft["pass-kv"].breakdown["summary_exchange"] > 0
