"""The planner's memory per rank against the engine's own accounting, for a tiny model of each kind (dense, mixture
of experts, multi-head latent attention): weight bytes of what the loader really holds (FP8 linears kept FP8 where
FP8 GEMMs run, routed experts and MLA's kv_b_proj dequantized, everything dequantized on CPU), per TP rank; KV
bytes per token and the tokens each CP rank holds after a prefill (`LLM.cache_stats()`); FP8 KV refused for MLA by
both."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cpinfer.engine.kv.store import KVStore, KVWidths
from cpinfer.model import quant
from cpinfer.model.config import ModelConfig
from cpinfer.model.loader import build_model, load_weights
from cpinfer.perf.catalog import HARDWARE
from cpinfer.perf.models import load_model_spec, weight_bytes_per_gpu
from cpinfer.perf.planner import build_deployment
from cpinfer.perf.simulator import memory_per_gpu
from cpinfer.tensor_parallel import load_tp_model
from fp8_checkpoint import write_fp8_pair
from pooled_engine import keyed_engines

KINDS = {"dense": ("gqa", {}), "moe": ("mixtral", {}), "mla": ("deepseek_v3", {"attention_bias": False})}
FP8_GPU = HARDWARE["h100-sxm"]    # a profile with FP8 GEMMs: FP8 linears stay FP8
CPU = HARDWARE["cpu-gloo"]        # none: the engine dequantizes every FP8 weight, as on CPU


@pytest.fixture(autouse=True)
def no_triton_gemm(monkeypatch):
    """The engine here keeps FP8 linears FP8 through `_scaled_mm` only, as the planner's CPU-side comparison
    assumes: Triton's interpreter (TRITON_INTERPRET=1, which another module sets for the whole session) would
    otherwise run the Triton GEMM on the CPU and keep linears of any shape FP8."""
    monkeypatch.setattr(quant, "triton_gemm_runs", lambda device: False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, llama_checkpoint):
    """kind -> (plain fp32 checkpoint, the same with every linear FP8 row-wise, with the MLP's only)."""
    out = {}
    for kind, (variant, over) in KINDS.items():
        plain = llama_checkpoint(variant, **over)
        root = tmp_path_factory.mktemp(f"fp8_{kind}")
        write_fp8_pair(plain, root / "all", root / "deq_all", "ct_channel_dynamic")
        write_fp8_pair(plain, root / "mlp", root / "deq_mlp", "fbgemm_fp8")
        out[kind] = (plain, root / "all", root / "mlp")
    return out


def engine_weight_bytes(path, tp: int = 1, tp_rank: int = 0, fp8_native: bool = False) -> int:
    """Bytes of every parameter one TP rank of the engine holds after loading `path` in fp32."""
    config = ModelConfig.from_pretrained(path)
    if tp == 1:
        model = build_model(config)
        load_weights(model, path, fp8_native=fp8_native)
    else:
        model = load_tp_model(path, config, tp, tp_rank, None, fp8_native=fp8_native)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def planned_weight_bytes(path, weights: str, hardware, tp: int = 1) -> float:
    """The planner's weights per TP rank in fp32. The engine here runs FP8 linears through `_scaled_mm` only (no
    Triton on CPU): a linear whose dims are not multiples of 16 (the tiny MLA's 24-wide latent) is dequantized;
    on a GPU the Triton GEMM would keep it FP8 (`fp8_any_shape`)."""
    dep = build_deployment(load_model_spec(path), hardware, 1, tp, weights, "fp32", "fp32")
    held = dataclasses.replace(dep.held, fp8_any_shape=False)
    assert memory_per_gpu(dep, 1).weights_gb * 1e9 == weight_bytes_per_gpu(dep.model, dep.held, tp)
    return weight_bytes_per_gpu(dep.model, held, tp)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_planned_weights_equal_what_the_loader_holds(checkpoints, kind):
    plain, fp8_all, fp8_mlp = checkpoints[kind]
    for tp in (1, 2):
        assert planned_weight_bytes(plain, "fp32", CPU, tp) == engine_weight_bytes(plain, tp), f"plain TP{tp}"
    # on CPU (no FP8 GEMMs) every FP8 weight is dequantized at load: the plain model's bytes
    assert planned_weight_bytes(fp8_all, "fp8", CPU) == engine_weight_bytes(fp8_all) == engine_weight_bytes(plain)
    # where FP8 GEMMs run, linears stay FP8 with their row scales; routed experts and kv_b_proj do not
    for path, fmt in ((fp8_all, "fp8"), (fp8_mlp, "fp8-ffn")):
        held = engine_weight_bytes(path, fp8_native=True)
        assert planned_weight_bytes(path, fmt, FP8_GPU) == held, f"{fmt}"
    # FP8 attention saves bytes on every kind; the tiny MoE's MLPs are all routed experts, which FP8 cannot shrink
    assert engine_weight_bytes(fp8_all, fp8_native=True) < engine_weight_bytes(plain)
    assert (engine_weight_bytes(fp8_mlp, fp8_native=True) == engine_weight_bytes(plain)) == (kind == "moe")


def test_routed_experts_are_dequantized_in_the_plan_as_in_the_engine(checkpoints):
    """The difference FP8 makes on the MoE model is the dense parts' alone: its experts stay fp32 in both."""
    plain, fp8_all, _ = checkpoints["moe"]
    spec = load_model_spec(plain)
    experts = spec.moe_layers * spec.n_experts * 3 * spec.hidden * spec.expert_ffn_dim * 4
    saved = engine_weight_bytes(plain) - engine_weight_bytes(fp8_all, fp8_native=True)
    assert saved == engine_weight_bytes(plain) - planned_weight_bytes(fp8_all, "fp8", FP8_GPU)
    assert saved < engine_weight_bytes(plain) - experts  # not even the experts' size: they were not shrunk


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, **kw)`: an LLM on one pool of ranks per world size shared by the module."""
    yield from keyed_engines(threads_per_rank=1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_planned_kv_per_rank_equals_the_engine_cache(checkpoints, engines, kind):
    """CP2, one 101-token prompt spread over both ranks: the fuller rank's KV bytes as the planner predicts them."""
    from cpinfer import SamplingParams

    plain = checkpoints[kind][0]
    dep = build_deployment(load_model_spec(plain), CPU, 2, 1, "fp32", "fp32", "fp32")
    prompt = list(range(3, 104))
    with engines(plain, 2, placement="shard") as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        stats = llm.cache_stats()
    per_rank = max(stats["kv_tokens_per_rank"]) * stats["kv_bytes_per_token"]
    assert memory_per_gpu(dep, len(prompt)).kv_gb * 1e9 == per_rank
    assert dep.model.kv_bytes_per_token(1, 4) == stats["kv_bytes_per_token"]


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_per_token"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fp8_kv_bytes_match_the_store_and_mla_per_token_is_refused_by_both(checkpoints, kind, kv_dtype):
    """The planner's FP8 KV bytes per token are the store's (MLA: the latent row, one e4m3 byte a channel); both
    refuse the per-token format for MLA."""
    plain = checkpoints[kind][0]
    config = ModelConfig.from_pretrained(plain)
    widths = KVWidths.of(config)
    spec = load_model_spec(plain)
    if kind == "mla" and kv_dtype == "fp8_per_token":
        with pytest.raises(ValueError, match="MLA"):
            build_deployment(spec, FP8_GPU, 2, 1, "bf16", "bf16", kv_dtype)
        with pytest.raises(ValueError, match="MLA"):
            KVStore(config.num_hidden_layers, 16, config.cached_kv_heads, widths, torch.float32, "cpu", kv_dtype)
        return
    dep = build_deployment(spec, FP8_GPU, 2, 1, "bf16", "bf16", kv_dtype)
    store = KVStore.bytes_per_token(config.num_hidden_layers, config.cached_kv_heads, widths, 2, kv_dtype)
    assert spec.kv_bytes_per_token(1, dep.kv_bytes, dep.kv_scale_bytes) == store
    assert not dep.decode_graphs  # the engine decodes eagerly with an FP8 KV cache
