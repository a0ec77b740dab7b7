"""Kimi Delta Attention (cpinfer/model/recurrent/kda.py) against transformers' kimi_linear: the recurrence from any
state, its CP composition over load-balanced and arbitrary shards, the conv with its halo, and the whole layer with
the weights of a tiny random Hugging Face checkpoint (prefill, continuation, decode from HF's cache)."""
import pytest
import torch
from safetensors import safe_open

from cpinfer.model.recurrent import delta, kda
from recurrent_shards import one_thread  # noqa: F401 (autouse fixture)
from recurrent_shards import Y_TOL, check_composed, denormals, check_conv_halo, check_staged, cp_runs, runs_at

hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

H, D = 3, 16
TIGHT = dict(atol=2e-5, rtol=1e-5)


def raw_inputs(t: int, seed: int = 0, strong: bool = False):
    """Unnormalised q, k, v [1, T, H, D], g [1, T, H, D] (per-channel log decays, some near 0; `strong`: up to
    ~ -50 a token, so that a chunk's cumulative decay reaches thousands), beta [1, T, H]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, t, H, D, generator=gen) for _ in range(3))
    rate = torch.rand(H, 1, generator=gen) * (16 if strong else 4) + 0.05
    g = -rate * torch.nn.functional.softplus(torch.randn(1, t, H, D, generator=gen) + (1 if strong else -2))
    beta = torch.sigmoid(torch.randn(1, t, H, generator=gen))
    return q, k, v, g, beta


def kda_inputs(q, k, v, g, beta) -> kda.KDAInputs:
    return kda.KDAInputs(kda.l2norm(q[0]) * D ** -0.5, kda.l2norm(k[0]), v[0], g[0], beta[0])


def hf_reference(form, raw, s0):
    fn = hf.chunk_kimi_delta_attention if form == "chunk" else hf.recurrent_kimi_delta_attention
    o, s = fn(*raw[:3], g=raw[3], beta=raw[4], initial_state=s0.clone(), output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


@pytest.mark.parametrize("t,chunk", [(1, None), (5, None), (64, 64), (200, None), (200, 64)])
def test_run_from_a_state_is_transformers(t, chunk):
    raw = raw_inputs(t, seed=t)
    s0 = torch.randn(1, H, D, D, generator=torch.Generator().manual_seed(1))
    o, s = kda.run(kda_inputs(*raw), s0[0], chunk)
    for form in ("chunk", "recurrent"):
        o_ref, s_ref = hf_reference(form, raw, s0)
        torch.testing.assert_close(o, o_ref, **TIGHT)
        torch.testing.assert_close(s, s_ref, **TIGHT)
    m, b = kda.summary(kda_inputs(*raw), chunk)
    torch.testing.assert_close(m @ s0[0] + b, s_ref, **TIGHT)


def test_strong_decays_keep_their_digits():
    """Decays of tens a token: the chunked form sums in-chunk decays (no differences of cumulative sums in the
    thousands), so it stays as close to the token-by-token form as with mild decays."""
    raw = raw_inputs(150, seed=11, strong=True)
    assert raw[3].min() < -40
    s0 = torch.randn(1, H, D, D, generator=torch.Generator().manual_seed(1))
    o, s = kda.run(kda_inputs(*raw), s0[0])
    o_ref, s_ref = hf_reference("recurrent", raw, s0)
    torch.testing.assert_close(o, o_ref, **TIGHT)
    torch.testing.assert_close(s, s_ref, **TIGHT)


def test_empty_run_is_the_identity():
    inp = kda_inputs(*raw_inputs(3))[0:0]
    s0 = torch.randn(H, D, D)
    o, s = kda.run(inp, s0)
    m, b = kda.summary(inp)
    assert o.shape == (0, H, D)
    torch.testing.assert_close(s, s0, atol=0, rtol=0)
    torch.testing.assert_close(m, torch.eye(D).expand(H, D, D), atol=0, rtol=0)
    torch.testing.assert_close(b, torch.zeros(H, D, D), atol=0, rtol=0)


@pytest.mark.parametrize("runs", [cp_runs(331, 1), cp_runs(331, 2), cp_runs(331, 3),
                                  [runs_at([1, 2, 70, 71, 200, 329], 331)]],
                         ids=["cp1", "cp2", "cp3", "cuts"])
def test_shards_compose_to_the_uncut_run(runs):
    inp = kda_inputs(*raw_inputs(331, seed=7))
    s0 = torch.randn(H, D, D, generator=torch.Generator().manual_seed(2))
    check_composed(kda.run, kda.summary, inp, s0, runs)


# ---------------------------------------------------------------- the layer against transformers'

def tiny_config():
    return hf.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, linear_head_dim=D, linear_num_heads=H, linear_conv_kernel_dim=4, num_local_experts=4,
        num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def hf_layer_and_mixer(tmp_path_factory):
    """transformers' KDA layer of a tiny random kimi_linear checkpoint (decays, dt bias, conv, gate norm
    randomised), and a KDAMixer loaded from the checkpoint's layer-0 tensors under their on-disk names."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = hf.KimiLinearForCausalLM(cfg).eval()
    layer = model.model.layers[0].self_attn
    with torch.no_grad():
        layer.forget_gate.A_log.copy_(torch.empty(1, 1, H, 1).uniform_(1.0, 16.0).log())
        layer.forget_gate.dt_bias.normal_(0.0, 1.0)
        layer.conv1d.weight.normal_(0.0, 0.5)
        layer.o_norm.weight.normal_(1.0, 0.3)
        for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.b_proj, layer.g_a_proj, layer.g_b_proj,
                    layer.forget_gate.f_a_proj, layer.forget_gate.f_b_proj, layer.o_proj):
            lin.weight.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("kimi_linear")
    model.save_pretrained(path)
    prefix = "model.layers.0.self_attn."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        sd = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    mixer = kda.KDAMixer(kda.KDAShape.from_hf(cfg.to_dict()))
    mixer.load_state_dict(sd, strict=True)
    return cfg, layer, mixer.eval()


def test_shape_from_the_checkpoint_config_layout():
    shape = kda.KDAShape.from_hf({"hidden_size": 64, "rms_norm_eps": 1e-6, "linear_attn_config": {
        "num_heads": 4, "head_dim": 8, "short_conv_kernel_size": 3, "kda_layers": [1], "full_attn_layers": [2]}})
    assert (shape.num_heads, shape.head_dim, shape.conv_kernel, shape.eps) == (4, 8, 3, 1e-6)
    with pytest.raises(ValueError, match="kimi_linear hidden_act 'gelu'"):
        kda.KDAShape.from_hf({"hidden_size": 64, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="kimi_linear num_heads"):
        kda.KDAShape.from_hf({"hidden_size": 64, "linear_attn_config": {"num_heads": 0}})


def test_conv_with_halo_is_the_uncut_conv(hf_layer_and_mixer):
    _, _, mixer = hf_layer_and_mixer
    u = torch.randn(331, mixer.shape.conv_channels)
    for runs in (*cp_runs(331, 3), runs_at([1, 2, 3, 100, 330], 331)):
        check_conv_halo(mixer.conv, u, runs, mixer.shape.conv_kernel)
    with pytest.raises(ValueError, match=r"conv tail has shape \(2, 144\), expected .* \(3, 144\)"):
        mixer.conv(u[:5], u[:2])


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_layer_is_transformers_prefill_continuation_decode(hf_layer_and_mixer, monkeypatch, form):
    """transformers' layer with its token-by-token kernel (`recurrent`: the exact reference, fp32 tight), and with
    its own chunked kernel (`chunk`: within Y_TOL: with this layer's strong decays its in-chunk decay differences
    lose ~1e-5, which the per-head output norm magnifies)."""
    cfg, layer, mixer = hf_layer_and_mixer
    tol = TIGHT if form == "recurrent" else Y_TOL
    if form == "recurrent":
        monkeypatch.setattr(hf, "chunk_kimi_delta_attention", hf.recurrent_kimi_delta_attention)
    gen = torch.Generator().manual_seed(3)
    x1, x2, x3 = (torch.randn(1, n, cfg.hidden_size, generator=gen) for n in (150, 70, 1))
    cache = hf.DynamicCache(config=cfg)
    k1 = mixer.shape.conv_kernel - 1
    with torch.no_grad():
        y_ref = layer(x1, cache=cache)
        y, s, tail = mixer(x1[0])
        torch.testing.assert_close(y, y_ref[0], **tol)
        torch.testing.assert_close(s, cache.get_recurrent_state(0)[0], **TIGHT)
        torch.testing.assert_close(tail, cache.get_conv_state(0)[0, :, -k1:].T, atol=0, rtol=0)
        for x in (x2, x3):  # a chunk of a longer prompt, then one decode token, each from HF's cached state
            s_hf, tail_hf = cache.get_recurrent_state(0)[0].clone(), cache.get_conv_state(0)[0, :, -k1:].T.clone()
            y_ref = layer(x, cache=cache)
            y, s, tail = mixer(x[0], s_hf, tail_hf)
            torch.testing.assert_close(y, y_ref[0], **tol)
            torch.testing.assert_close(s, cache.get_recurrent_state(0)[0], **TIGHT)
            torch.testing.assert_close(tail, cache.get_conv_state(0)[0, :, -k1:].T, atol=0, rtol=0)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_staged_layer_under_cp_is_the_uncut_layer(hf_layer_and_mixer, num_ranks):
    cfg, _, mixer = hf_layer_and_mixer
    x = torch.randn(331, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        check_staged(mixer, kda.run, kda.summary, x, cp_runs(331, num_ranks))


def test_no_tokens_change_nothing(hf_layer_and_mixer):
    """A rank may hold no token of a sequence: the layer maps its state and conv tail to themselves."""
    cfg, _, mixer = hf_layer_and_mixer
    with torch.no_grad():
        _, s, tail = mixer(torch.randn(5, cfg.hidden_size))
        y0, s0, tail0 = mixer(torch.randn(0, cfg.hidden_size), s, tail)
    assert y0.shape == (0, cfg.hidden_size)
    torch.testing.assert_close(s0, s, atol=0, rtol=0)
    torch.testing.assert_close(tail0, tail, atol=0, rtol=0)



def test_a_decaying_summary_never_holds_denormals(monkeypatch):
    """The summary's identity block decays per channel; entries that would fall below 2^-64 are set to 0 (float32's
    denormals are ~100x slower to multiply) and the map still equals the plain run from a state."""
    inp = kda_inputs(*raw_inputs(300, seed=3))
    with monkeypatch.context() as m:
        m.setattr(delta, "TINY", 0.0)  # no flush: the same inputs do leave denormals in M
        assert denormals(kda.summary(inp, chunk=64).M) > 0
    amap = kda.summary(inp, chunk=64)
    assert denormals(amap.M) == 0 and denormals(amap.B) == 0
    s0 = torch.randn(H, D, D, generator=torch.Generator().manual_seed(4))
    _, s = kda.run(inp, s0, chunk=64)
    torch.testing.assert_close(amap.apply(s0), s, atol=1e-5, rtol=1e-5)
