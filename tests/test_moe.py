"""The mixture-of-experts block (cpinfer/model/moe.py) against a plain loop over tokens and their experts: every
router option (softmax top-k normalised or not, sigmoid top-1 scaling the input, router bias), experts with biases
and gpt-oss's clamped SwiGLU, both storage layouts, the shared expert with and without its gate; grouped by
expert through `torch._grouped_mm`, the per-expert fallback and the per-row gather (CUDA-graph capture); and the TP
split of each expert."""
import dataclasses

import pytest
import torch

from cpinfer.model.config import ModelConfig
from cpinfer.model.config_parts import MoEConfig
from cpinfer.model.decoder import MLP
from cpinfer.model.families import config_kwargs
from cpinfer.model.moe import GROUPED_MM_MODES, SparseMoE, _grouped_mm_runs, grouped_mm, grouped_mm_mode
from cpinfer.tensor_parallel import _expert_slice

HIDDEN = 32
CASES = {
    "qwen3_moe": MoEConfig(num_experts=6, top_k=2, intermediate_size=16, norm_topk_prob=True),
    "qwen_unnormalised": MoEConfig(num_experts=6, top_k=3, intermediate_size=16),
    "qwen2_moe_shared_gate": MoEConfig(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=24,
                                       shared_expert_gate=True),
    "mixtral_gelu": MoEConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True, hidden_act="gelu"),
    "gpt_oss": MoEConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True, router_bias=True,
                         router_name="router", expert_bias=True, hidden_act="swiglu_clamped", swiglu_limit=0.5,
                         gate_up_interleaved=True, transposed=True),
    "llama4": MoEConfig(num_experts=4, top_k=1, intermediate_size=16, scoring="sigmoid", router_name="router",
                        weight_input=True, transposed=True, shared_intermediate_size=16),
}


def random_block(cfg: MoEConfig, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    block = SparseMoE(HIDDEN, cfg, lambda size: MLP(HIDDEN, size))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def routed_loop(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The routed experts token by token, expert by expert, with plain matmuls."""
    ex = block.experts
    gate_up = ex.gate_up_proj if ex.transposed else ex.gate_up_proj.transpose(1, 2)  # [E, H, 2I]
    down = ex.down_proj if ex.transposed else ex.down_proj.transpose(1, 2)  # [E, I, H]
    weights, experts = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist()):
            xin = x[t] * w if ex.weight_input else x[t]
            h = xin @ gate_up[e] + (0 if ex.gate_up_proj_bias is None else ex.gate_up_proj_bias[e])
            gate, up = (h[0::2], h[1::2]) if ex.interleaved else h.chunk(2)
            y = ex.glu(gate, up) @ down[e] + (0 if ex.down_proj_bias is None else ex.down_proj_bias[e])
            out[t] += y if ex.weight_input else y * w
    return out


def per_token_loop(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The whole block: routed experts plus the (gated) shared expert."""
    out = routed_loop(block, x)
    if block.shared_expert is not None:
        shared = block.shared_expert(x)
        if block.shared_expert_gate is not None:
            shared = torch.sigmoid(block.shared_expert_gate(x)) * shared
        out = out + shared
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_block_matches_per_token_loop(case):
    block = random_block(CASES[case])
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(block(x), per_token_loop(block, x), atol=1e-5, rtol=1e-5)
        routed = routed_loop(block, x)
        weights, experts = block.route(x)
        for mode in GROUPED_MM_MODES:  # torch._grouped_mm, one matmul per expert, per-row gathered experts
            out = block.experts(x, weights, experts, mode=mode)
            torch.testing.assert_close(out, routed, atol=1e-5, rtol=1e-5)
        one = x[:1]  # a lone decode token: most experts idle
        torch.testing.assert_close(block(one), per_token_loop(block, one), atol=1e-5, rtol=1e-5)
        assert block(x[:0]).shape == (0, HIDDEN)


def test_router_options():
    """softmax top-k (renormalised or not) and sigmoid top-1 weights, and the router bias, by hand."""
    x = torch.randn(5, HIDDEN)
    block = random_block(CASES["qwen_unnormalised"])
    w, e = block.route(x)
    probs = (x @ block.route.weight.T).softmax(-1)
    torch.testing.assert_close(w, probs.gather(1, e))
    assert (w.sum(-1) < 1).all() and (e == probs.topk(3).indices).all()
    block = random_block(CASES["gpt_oss"])
    w, e = block.route(x)
    logits = x @ block.route.weight.T + block.route.bias
    top = logits.topk(2)
    torch.testing.assert_close(w, top.values.softmax(-1))  # gpt-oss: softmax over the top-k logits
    block = random_block(CASES["llama4"])
    w, e = block.route(x)
    logits = x @ block.route.weight.T
    torch.testing.assert_close(w[:, 0], logits.max(-1).values.sigmoid())


def test_grouped_mm_fallback_on_unaligned_shapes():
    """Rows whose byte size is not a multiple of 16 cannot use torch._grouped_mm: one matmul per group instead."""
    x, w = torch.randn(7, 5), torch.randn(3, 5, 3)
    counts, groups = torch.tensor([2, 0, 5]), torch.tensor([0, 0, 2, 2, 2, 2, 2])
    ref = torch.cat([x[:2] @ w[0], x[2:] @ w[2]])
    assert grouped_mm_mode(x, w) == "per_expert"
    torch.testing.assert_close(grouped_mm(x, w, counts, groups), ref)
    runs = _grouped_mm_runs(torch.device("cpu"), torch.float32)  # torch 2.9+: torch._grouped_mm on CPU too
    assert grouped_mm_mode(torch.randn(7, 8), torch.randn(3, 8, 4)) == ("grouped" if runs else "per_expert")
    with pytest.raises(ValueError, match="unknown grouped_mm mode"):
        grouped_mm(x, w, counts, groups, mode="dense")


@pytest.mark.parametrize("case", ["qwen2_moe_shared_gate", "gpt_oss", "llama4"])
def test_tp_slices_of_experts_sum_to_the_block(case):
    """Each TP rank keeps a slice of every expert's intermediate dimension (gate and up halves or interleaved
    columns, down rows or columns); the ranks' partial outputs (down bias on rank 0 only) sum to the block."""
    cfg, tp = CASES[case], 2
    full = random_block(cfg)
    x = torch.randn(11, HIDDEN)
    local = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size // tp,
                                shared_intermediate_size=cfg.shared_intermediate_size // tp)
    total = torch.zeros(11, HIDDEN)
    f, fs = cfg.intermediate_size // tp, cfg.shared_intermediate_size // tp
    for rank in range(tp):
        part = random_block(local, seed=1)
        sd = {}
        for name, p in full.state_dict().items():
            owner, _, leaf = name.rpartition(".")
            if owner == "experts":
                sd[name] = _expert_slice(full.experts, leaf, p, slice(rank * f, (rank + 1) * f),
                                         cfg.intermediate_size)
            elif owner.startswith("shared_expert.") and owner != "shared_expert.down_proj":
                sd[name] = p[rank * fs:(rank + 1) * fs]
            elif owner == "shared_expert.down_proj":
                sd[name] = p[:, rank * fs:(rank + 1) * fs]
            else:
                sd[name] = p
        part.load_state_dict(sd)
        part.experts.down_bias_here = rank == 0
        with torch.no_grad():
            total += part(x)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x), atol=1e-5, rtol=1e-5)


def test_moe_layers_from_config():
    """decoder_sparse_step / mlp_only_layers (Qwen-MoE) and interleave_moe_layer_step (Llama 4) pick the layers."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    qwen = ModelConfig(**config_kwargs(dict(base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3])))
    assert qwen.moe_layers == (1, 5) and qwen.moe.top_k == 2
    mixtral = ModelConfig(**config_kwargs(dict(base, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)))
    assert mixtral.moe_layers == tuple(range(6)) and mixtral.mlp_module == "block_sparse_moe"
    assert mixtral.moe.expert_proj_names == ("w1", "w3", "w2") and mixtral.moe.norm_topk_prob


@pytest.mark.parametrize("bad, message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4' is not supported"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"n_group": 8, "topk_group": 4}, "n_group"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_experts_per_tok": 9}, "exceeds the number of experts"),
])
def test_unsupported_moe_options_are_named(bad, message):
    d = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 16, **bad}
    with pytest.raises(ValueError, match=message):
        ModelConfig(**config_kwargs(d))


def test_unsupported_architecture_lists_every_family():
    from cpinfer.model.families import FAMILIES

    with pytest.raises(ValueError, match="unsupported model_type 'rwkv'") as err:
        ModelConfig.from_dict({"model_type": "rwkv"})
    assert all(repr(name) in str(err.value) for name in FAMILIES)  # (a test-only family may be registered too)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3", "qwen3_moe", "qwen2_moe", "mixtral",
            "gpt_oss", "llama4_text", "deepseek_v3", "kimi_k2", "deepseek_v2"} <= set(FAMILIES)
    with pytest.raises(ValueError, match="model_type 'llama4_text'"):
        ModelConfig.from_dict({"model_type": "llama4", "text_config": {}})


def _write(directory, config_dir, tensors):
    import shutil

    from safetensors.torch import save_file

    directory.mkdir()
    shutil.copy(config_dir / "config.json", directory / "config.json")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_per_expert_and_fused_checkpoints_load_the_same_model(llama_checkpoint, tmp_path):
    """The Hub's per-expert tensors (what transformers 5 save_pretrained writes for Qwen-MoE) and the fused
    experts.gate_up_proj / down_proj give the same model; a missing expert tensor is named."""
    from safetensors.torch import load_file

    from cpinfer.model import ReferenceAttention, load_model

    path = llama_checkpoint("qwen3_moe")
    sd = load_file(str(path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in sd and "model.layers.1.mlp.gate_proj.weight" in sd
    fused = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat((sd[f"{p}.{e}.gate_proj.weight"],
                                                             sd[f"{p}.{e}.up_proj.weight"])) for e in range(4)])
        fused[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    ids, pos = torch.randint(3, 256, (40,)), torch.arange(40)
    logits = []
    for folder in (path, _write(tmp_path / "fused", path, fused)):
        cfg, model = load_model(folder)
        attn = ReferenceAttention(torch.zeros(40, dtype=torch.long), pos, config=cfg)
        with torch.no_grad():
            logits.append(model.compute_logits(model(ids, pos, attn)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    missing = {k: v for k, v in sd.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"}
    with pytest.raises(ValueError, match="7 of the 8 per-expert tensors of model.layers.2.mlp.experts.gate_up_proj"):
        load_model(_write(tmp_path / "missing", path, missing))
