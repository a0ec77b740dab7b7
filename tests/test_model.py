"""Model layer: every family and RoPE scaling exact against HF transformers (both config layouts), config parsing
and its errors, loader (incl. errors and shards), torch-only random checkpoints."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpinfer.model import (
    CausalLM, ModelConfig, ReferenceAttention, build_model, load_model, load_weights, rope_inv_freq,
    write_random_checkpoint,
)
from cpinfer.model.random_checkpoint import random_config_dict

transformers = pytest.importorskip("transformers")
from checkpoints import load_hf_model, tiny_config  # noqa: E402

VARIANTS = ["gqa", "mqa", "mha", "tied", "llama3", "llama_bias"]
FAMILIES = ["mistral", "qwen2", "qwen2_full", "qwen3", "qwen3_swa", "gemma3"]
ROPES = ["linear", "dynamic", "yarn", "yarn_mscale", "longrope", "llama3"]


@functools.lru_cache(maxsize=None)
def _hf(path):
    return load_hf_model(path)


@functools.lru_cache(maxsize=None)
def _ours(path):
    return load_model(path)[1]


@torch.no_grad()
def hf_logprobs(path, ids, positions=None):
    """[L, vocab] log-probs of HF on one sequence alone."""
    pos = None if positions is None else positions[None]
    return _hf(path)(ids[None], position_ids=pos).logits[0].float().log_softmax(-1)


@torch.no_grad()
def our_logprobs(model, ids, positions, seq_ids):
    hidden = model(ids, positions, ReferenceAttention(seq_ids, positions, config=model.config))  # [L, hidden]
    return model.compute_logits(hidden).log_softmax(-1)


def pack(seqs, perm_seed=None):
    """Concatenate sequences -> ids, positions, seq_ids [L]; optionally shuffle the token order."""
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    sid = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    perm = torch.arange(len(ids))
    if perm_seed is not None:
        perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(perm_seed))
    return ids[perm], pos[perm], sid[perm]


def rand_ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- exactness vs transformers

@pytest.mark.parametrize("variant", VARIANTS + FAMILIES)
def test_single_sequence_matches_hf(llama_checkpoint, variant):
    path = llama_checkpoint(variant)
    model = _ours(path)
    ids = rand_ids(96, model.config.vocab_size, 0)
    pos = torch.arange(96)
    got = our_logprobs(model, ids, pos, torch.zeros_like(pos))
    torch.testing.assert_close(got, hf_logprobs(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["gqa", "mqa", "tied", "llama3", "qwen2", "gemma3"])
def test_packed_shuffled_batch_matches_hf_per_sequence(llama_checkpoint, variant):
    path = llama_checkpoint(variant)
    model = _ours(path)
    seqs = [rand_ids(n, model.config.vocab_size, n) for n in (7, 33, 18)]
    ids, pos, sid = pack(seqs, perm_seed=1)
    got = our_logprobs(model, ids, pos, sid)
    for i, s in enumerate(seqs):
        rows = got[sid == i][pos[sid == i].argsort()]  # back to sequence order
        torch.testing.assert_close(rows, hf_logprobs(path, s), atol=1e-4, rtol=0)


# Positions past the original context (64 for llama3 / yarn / longrope; 4x the trained 512 for linear).
# `dynamic` is evaluated at factor x max_position_embeddings = 128, where transformers evaluates it for a
# sequence whose last position is 127.
FAR = {"linear": (2040, 2064), "dynamic": (104, 128), "yarn": (400, 424), "yarn_mscale": (400, 424),
       "longrope": (200, 224), "llama3": (400, 424)}


@pytest.mark.parametrize("layout", ["hf5", "hf4"])
@pytest.mark.parametrize("variant", ROPES)
def test_rope_scaling_at_far_positions_matches_hf(llama_checkpoint, variant, layout):
    path = llama_checkpoint(variant, layout=layout)
    model = _ours(path)
    a, b = FAR[variant]
    ids, pos = rand_ids(b - a, model.config.vocab_size, 5), torch.arange(a, b)
    got = our_logprobs(model, ids, pos, torch.zeros_like(pos))
    torch.testing.assert_close(got, hf_logprobs(path, ids, pos), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ROPES + ["gemma3"])
def test_inv_freq_and_attention_factor_match_hf(llama_checkpoint, variant):
    path = llama_checkpoint(variant)
    cfg, hf = ModelConfig.from_pretrained(path), _hf(path)
    rotary = hf.model.rotary_emb
    if variant == "gemma3":  # one RoPE per layer type
        for layer_type, rope in cfg.rope.items():
            inv, scale = rope_inv_freq(cfg.head_dim, rope, cfg.max_position_embeddings)
            torch.testing.assert_close(inv, getattr(rotary, f"{layer_type}_inv_freq").float(), atol=0, rtol=1e-6)
            assert scale == getattr(rotary, f"{layer_type}_attention_scaling")
        return
    if variant in ("dynamic", "longrope"):  # evaluated at a fixed length: run HF once at that length
        a, b = FAR[variant]
        hf_logprobs(path, rand_ids(b - a, cfg.vocab_size, 1), torch.arange(a, b))
    inv, scale = rope_inv_freq(cfg.head_dim, cfg.layer_rope(0), cfg.max_position_embeddings)
    torch.testing.assert_close(inv, rotary.inv_freq.float(), atol=0, rtol=1e-6)
    torch.testing.assert_close(torch.tensor(scale), torch.tensor(float(rotary.attention_scaling)))
    if variant in ("yarn", "yarn_mscale", "longrope"):
        assert scale != 1.0  # the attention factor is in play


def test_bf16_load_runs_close_to_fp32(llama_checkpoint):
    path = llama_checkpoint("gqa")
    _, model = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, pos = rand_ids(16, model.config.vocab_size, 2), torch.arange(16)
    got = our_logprobs(model, ids, pos, torch.zeros_like(pos))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, hf_logprobs(path, ids), atol=0.15, rtol=0)


@pytest.mark.parametrize("variant", ["gqa", "qwen3", "gemma3"])
def test_heads_follow_weight_shapes_for_tp_slicing(llama_checkpoint, variant):
    """Two half-head 'TP ranks' (q/k/v rows and biases, o columns sliced from outside) sum to the full block."""
    model = _ours(llama_checkpoint(variant))
    block, d = model.model.layers[0].self_attn, model.config.head_dim
    x, pos = torch.randn(10, model.config.hidden_size), torch.arange(10)
    cos, sin = model.rotary.cos_sin(pos)
    attn = ReferenceAttention(torch.zeros_like(pos), pos, config=model.config)
    full = block(x, cos, sin, attn)
    hq, hkv = block.num_heads, block.num_kv_heads
    parts = []
    for r in range(2):
        part = CausalLM(model.config).model.layers[0].self_attn
        part.load_state_dict(block.state_dict())
        qs, kvs = slice(r * hq // 2 * d, (r + 1) * hq // 2 * d), slice(r * hkv // 2 * d, (r + 1) * hkv // 2 * d)
        for name, rows in (("q_proj", qs), ("k_proj", kvs), ("v_proj", kvs)):
            src = getattr(block, name)
            lin = torch.nn.Linear(src.in_features, rows.stop - rows.start, bias=src.bias is not None)
            lin.weight.data.copy_(src.weight[rows])
            if src.bias is not None:
                lin.bias.data.copy_(src.bias[rows])
            setattr(part, name, lin)
        w = block.o_proj.weight[:, qs]
        part.o_proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        part.o_proj.weight.data.copy_(w)
        assert (part.num_heads, part.num_kv_heads) == (hq // 2, hkv // 2)
        with torch.no_grad():
            parts.append(part(x, cos, sin, attn))
    o_bias = 0 if block.o_proj.bias is None else block.o_proj.bias
    torch.testing.assert_close(parts[0] + parts[1] + o_bias, full.detach(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- config

def test_config_reads_hf5_layout(llama_checkpoint):
    raw = json.loads((llama_checkpoint("llama3") / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.num_queries_per_kv, cfg.head_dim, cfg.layer_rope(0).factor) == (4, 16, 8.0)


@pytest.mark.parametrize("variant", ROPES + FAMILIES)
def test_hf4_and_hf5_layouts_give_the_same_config(llama_checkpoint, variant):
    new = json.loads((llama_checkpoint(variant) / "config.json").read_text())
    old = json.loads((llama_checkpoint(variant, layout="hf4") / "config.json").read_text())
    assert "rope_parameters" in new and "rope_parameters" not in old
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(old)


def test_config_reads_legacy_layout_and_eos_list():
    d = random_config_dict(rope_theta=5e5, eos_token_id=[2, 7], rope_scaling={
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    del d["head_dim"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_rope(0).theta == 5e5 and cfg.layer_rope(0).factor == 32.0
    assert cfg.eos_token_ids == (2, 7) and cfg.head_dim == d["hidden_size"] // d["num_attention_heads"]
    assert ModelConfig.from_dict(random_config_dict(rope_scaling=None)).layer_rope(0).rope_type == "default"


def test_family_options_and_windows():
    cfg = lambda variant, **kw: ModelConfig.from_dict(tiny_config(variant, **kw))  # noqa: E731
    g = cfg("gemma3")
    assert (g.windows, g.attention_scale, g.norm_style, g.hidden_act) == ((16, None, 16), 24 ** -0.5, "gemma",
                                                                          "gelu_pytorch_tanh")
    assert g.layer_rope(1).rope_type == "linear" and g.layer_rope(0).theta == 1e4 and g.layer_rope(1).theta == 1e6
    assert g.qk_norm and g.sandwich_norm and g.embed_scale and g.tie_word_embeddings
    assert cfg("qwen2").windows == (None, 20) and cfg("qwen2").qkv_bias and not cfg("qwen2").o_bias
    assert cfg("qwen2", use_sliding_window=False).windows == (None, None)  # Qwen2.5's configs: windows off
    assert cfg("qwen3").head_dim == 16 and cfg("qwen3").qk_norm and cfg("qwen3").o_bias
    assert cfg("mistral").windows == (24, 24) and cfg("mistral", sliding_window=None).windows == (None, None)
    assert cfg("gqa").attention_scale == 8 ** -0.5
    legacy = {**tiny_config("gemma3"), "layer_types": None, "rope_parameters": None}
    del legacy["layer_types"], legacy["rope_parameters"]
    assert ModelConfig.from_dict({**legacy, "num_hidden_layers": 12}).windows == (16,) * 5 + (None,) + (16,) * 5 + (
        None,)  # 4.x Gemma 3: every 6th layer global, rope_theta 1e6 / rope_local_base_freq 1e4 by default


@pytest.mark.parametrize("override, message", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2': cpinfer supports 'llama'"),
    ({"model_type": "gemma3"}, "multimodal Gemma 3 folder"),
    ({"num_attention_heads": 8, "num_key_value_heads": 3}, "num_attention_heads (8) must be divisible"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "unsupported rope type 'su'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing key 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear rope scaling needs a factor > 0"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "missing key 'long_factor'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 0}, "sliding_window must be a positive"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked_attention"] * 2},
     "chunked_attention layers but attention_chunk_size is not set"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["linear_attention"] * 2},
     "linear_attention layers but model_type 'qwen2' defines no recurrent mixer"),
])
def test_config_rejects_unsupported(override, message):
    d = {**random_config_dict(), **override}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ModelConfig.from_dict(d)


def test_config_missing_key():
    d = random_config_dict()
    del d["vocab_size"]
    with pytest.raises(ValueError, match="missing required key"):
        ModelConfig.from_dict(d)


# ---------------------------------------------------------------- loader

def test_sharded_checkpoint_loads_like_single(llama_checkpoint):
    single, sharded = llama_checkpoint("gqa"), llama_checkpoint("gqa", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _ours(single).state_dict(), _ours(sharded).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_embeddings_share_storage(llama_checkpoint):
    model = _ours(llama_checkpoint("tied"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    """Rewrite path/model.safetensors with `edit(state_dict)` applied in place."""
    sd = load_file(str(path / "model.safetensors"))
    edit(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_loader_missing_dir_config_and_files(tmp_path, random_checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    path = _copy(random_checkpoint(), tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_model(path)


def test_loader_index_names_missing_shard(tmp_path, llama_checkpoint):
    path = _copy(llama_checkpoint("gqa", max_shard_size="40KB"), tmp_path)
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"names shard '{shard.name}', which does not exist"):
        load_model(path)


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensor\(s\): \['model.layers.1.mlp.up_proj"),
    (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(3)),
     r"tensor 'model.norm.weight' has shape \(3,\) in the checkpoint, expected \(128,\)"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.ones(128)),
     r"unexpected tensor\(s\): \['model.layers.0.self_attn.q_proj.bias'\]"),
])
def test_loader_tensor_errors(tmp_path, random_checkpoint, edit, message):
    path = _copy(random_checkpoint(), tmp_path)
    _edit_tensors(path, edit)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_loader_ignores_rotary_inv_freq_and_tied_lm_head(tmp_path, random_checkpoint):
    path = _copy(random_checkpoint(tie_word_embeddings=True), tmp_path)

    def add_extras(sd):
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    _edit_tensors(path, add_extras)
    _, model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loader_slicer_hook_loads_tp_slices(random_checkpoint):
    """A TP-like rank: resize the meta linears, then load only the matching rows through the slicer."""
    path = random_checkpoint()
    full = load_file(str(path / "model.safetensors"))
    model = build_model(ModelConfig.from_pretrained(path))
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            lin = getattr(layer.self_attn, name)
            with torch.device("meta"):
                setattr(layer.self_attn, name, torch.nn.Linear(lin.in_features, lin.out_features // 2, bias=False))
    seen = []

    def first_half_rows(name, sl):
        seen.append(name)
        rows = sl.get_shape()[0]
        return sl[: rows // 2] if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) else sl[:]
    load_weights(model, path, slicer=first_half_rows)
    assert len(seen) == len(full)
    q = model.model.layers[1].self_attn.q_proj.weight
    torch.testing.assert_close(q, full["model.layers.1.self_attn.q_proj.weight"][:64], atol=0, rtol=0)
    assert model.model.layers[1].self_attn.num_heads == 4


# ---------------------------------------------------------------- torch-only random checkpoints

@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "num_key_value_heads": 1, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32}}, {"model_type": "qwen3", "head_dim": 32, "architectures": None},
    {"model_type": "gemma3_text", "architectures": None, "hidden_activation": "gelu_pytorch_tanh",
     "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "query_pre_attn_scalar": 32}])
def test_random_checkpoint_matches_hf(random_checkpoint, overrides):
    path = random_checkpoint(seed=1, **overrides)
    model = _ours(path)
    ids, pos = rand_ids(48, model.config.vocab_size, 4), torch.arange(48)
    got = our_logprobs(model, ids, pos, torch.zeros_like(pos))
    torch.testing.assert_close(got, hf_logprobs(path, ids), atol=1e-4, rtol=0)


def test_random_checkpoint_is_deterministic(tmp_path):
    a = load_file(str(write_random_checkpoint(tmp_path / "a", seed=3, hidden_size=32) / "model.safetensors"))
    b = load_file(str(write_random_checkpoint(tmp_path / "b", seed=3, hidden_size=32) / "model.safetensors"))
    c = load_file(str(write_random_checkpoint(tmp_path / "c", seed=4, hidden_size=32) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert 0.015 < a["lm_head.weight"].std() < 0.025


def _local_config(**kw):
    from cpinfer.model import RopeConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=5, attention_chunk_size=8, attention_sinks=True,
                layer_types=("chunked_attention", "full_attention", "sliding_attention"),
                rope={"full_attention": RopeConfig(theta=5e5), "sliding_attention": RopeConfig(theta=1e4)})
    return ModelConfig(**{**base, **kw})


def test_chunked_layers_and_sinks_in_the_config():
    c = _local_config()
    assert c.chunks == (8, None, None) and c.windows == (None, None, 5) and c.local_attention
    assert c.layer_rope(0) == c.layer_rope(1) != c.layer_rope(2)  # chunked layers rotate like the global ones
    assert not _local_config(layer_types=("full_attention",) * 3, sliding_window=None).local_attention
    sinks = [layer.self_attn.sinks for layer in CausalLM(c).model.layers]
    assert all(s.shape == (4,) for s in sinks)
    assert CausalLM(_local_config(attention_sinks=False)).model.layers[0].self_attn.sinks is None
    with pytest.raises(ValueError, match="chunked_attention layers but attention_chunk_size is not set"):
        _local_config(attention_chunk_size=None)
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive"):
        _local_config(attention_chunk_size=0)


def test_reference_attention_takes_chunks_windows_and_sinks():
    """The model's single-device reference (fp32) against the float64 softmax with the sink column, per layer kind,
    over two packed sequences."""
    from cpinfer.attention.local import reference_attention

    c = _local_config()
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([0] * 20 + [1] * 13)
    pos = torch.cat([torch.arange(20), torch.arange(3, 16)])
    q, k, v = torch.randn(33, 4, 8, generator=g), torch.randn(33, 2, 8, generator=g), torch.randn(33, 2, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    attn = ReferenceAttention(seq, pos, config=c)
    for layer in range(3):
        for s in (None, sinks):
            out = attn(layer, q, k, v) if s is None else attn(layer, q, k, v, sinks=s)
            ref, _ = reference_attention(q, k, v, seq, pos, seq, pos, scale=c.attention_scale,
                                         window=c.layer_window(layer), chunk=c.layer_chunk(layer), sinks=s)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
