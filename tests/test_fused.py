"""Fused projections (`model/fused.py`, issue 51): q / k / v and gate / up as one GEMM each keep the model exact
against Hugging Face, leave the parameters and the state dict as they were (views of the fused tensors), and end
when a parameter or module is replaced; the CPU RMSNorm and RoPE forms against float64."""
from __future__ import annotations

import pytest
import torch

from cpinfer.model import ReferenceAttention, load_model
from cpinfer.model.fused import FusedLinears
from cpinfer.model.norms import RMSNorm
from cpinfer.model.rope import apply_rope

pytest.importorskip("transformers")
from checkpoints import load_hf_model  # noqa: E402


def _logprobs(model, ids):
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        hidden = model(ids, pos, ReferenceAttention(torch.zeros_like(pos), pos, config=model.config))
        return model.compute_logits(hidden).log_softmax(-1)


@pytest.mark.parametrize("variant", ["gqa", "llama_bias", "qwen2", "qwen3", "gemma3"])
def test_fused_model_matches_hf_and_unfused(llama_checkpoint, variant):
    path = llama_checkpoint(variant)
    _, model = load_model(path)
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(3))
    before = _logprobs(model, ids)
    names = [n for n, _ in model.named_parameters()]
    n = model.fuse_projections()
    assert n == 2 * model.config.num_hidden_layers  # every layer's attention and MLP
    assert [n for n, _ in model.named_parameters()] == names  # the same parameters, under the same names
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.fused_qkv.valid() and mlp.fused_gate_up.valid()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.fused_qkv.weight.untyped_storage().data_ptr()
    got = _logprobs(model, ids)
    torch.testing.assert_close(got, before, atol=1e-5, rtol=0)
    with torch.no_grad():
        hf = load_hf_model(path)(ids[None]).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(got, hf, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), hf.argmax(-1))


def test_weight_updates_reach_the_fused_gemm_and_replacements_end_it(llama_checkpoint):
    _, model = load_model(llama_checkpoint("gqa"))
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    model.fuse_projections()
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    with torch.no_grad():  # a copy_ into a parameter (load_state_dict's way) writes the fused tensor too
        attn.v_proj.weight.mul_(0.5)
        mlp.up_proj.weight.mul_(2.0)
    fused_out = _logprobs(model, ids)
    attn.fused_qkv = mlp.fused_gate_up = None  # the separate Linears see the same weights
    torch.testing.assert_close(_logprobs(model, ids), fused_out, atol=1e-5, rtol=0)

    model.fuse_projections()
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone() * 0.0)  # new storage
    assert not attn.fused_qkv.valid()
    mlp = model.model.layers[1].mlp
    mlp.up_proj = torch.nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)  # a new module
    assert not mlp.fused_gate_up.valid()
    got = _logprobs(model, ids)  # the layer falls back to its modules: zero keys, a fresh up projection
    attn.fused_qkv = mlp.fused_gate_up = None
    torch.testing.assert_close(got, _logprobs(model, ids), atol=1e-5, rtol=0)
    assert not torch.allclose(got, fused_out, atol=1e-3)
    model.fuse_projections()
    other = model.model.layers[0].self_attn
    assert other.fused_qkv.valid()
    other.q_proj.weight.data = other.q_proj.weight.detach().clone()  # the same Parameter, new storage
    assert not other.fused_qkv.valid()
    gate = model.model.layers[0].mlp
    assert gate.fused_gate_up.valid()
    gate.gate_proj.weight = None  # a parameter taken away: not fused any more, and no error
    assert not gate.fused_gate_up.valid()


def test_only_plain_linears_of_one_input_fuse():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)
    assert FusedLinears.fusable([a, b])
    assert not FusedLinears.fusable([a, torch.nn.Linear(8, 6, bias=False)])  # bias on one only
    assert not FusedLinears.fusable([a, torch.nn.Linear(7, 6)])  # another input size
    assert not FusedLinears.fusable([a, type("Sliced", (torch.nn.Linear,), {})(8, 6)])  # a subclass (TP, quant)
    assert not FusedLinears.fusable([a, torch.nn.Linear(8, 6).double()])


def test_cpu_rms_norm_and_rope_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 6, 32, generator=g) * 3
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    xd = x.double()
    ref = norm.weight.detach().double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x).detach().double(), ref, atol=1e-5, rtol=1e-6)
    cos, sin = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    c, s = cos.double()[:, None], sin.double()[:, None]
    rot = torch.cat((xd[..., :16] * c - xd[..., 16:] * s, xd[..., 16:] * c + xd[..., :16] * s), -1)
    view = torch.cat((x, x), -1)[..., 32:]  # a non-contiguous input (a fused projection's columns)
    for inp in (x, view):
        out = apply_rope(inp, cos, sin)
        assert out.is_contiguous()
        torch.testing.assert_close(out.double(), rot, atol=1e-5, rtol=1e-6)
