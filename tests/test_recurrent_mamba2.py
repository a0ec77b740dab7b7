"""Mamba-2 (cpinfer/model/recurrent/mamba2.py) against transformers' nemotron_h: the SSD recurrence from any state,
its CP composition over load-balanced and arbitrary shards, the conv with its halo, and the whole mixer with the
weights of a tiny random Hugging Face checkpoint (prefill, continuation, decode from HF's cache)."""
import pytest
import torch
from safetensors import safe_open

from cpinfer.model.recurrent import mamba2
from recurrent_shards import one_thread  # noqa: F401 (autouse fixture)
from recurrent_shards import check_composed, check_conv_halo, check_staged, cp_runs, runs_at

hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

H, P, G, N = 4, 8, 2, 8
DT_MIN = 1e-3
TIGHT = dict(atol=2e-5, rtol=1e-5)


def raw_inputs(t: int, seed: int = 0, dt_shift: float = 0.0):
    """x [1, T, H, P], raw dt [1, T, H], A [H], B, C [1, T, G, N], D [H], dt_bias [H]. With dt_shift < 0 some
    softplus(dt + bias) fall below DT_MIN (the clamp at work)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, t, H, P, generator=gen)
    dt = torch.randn(1, t, H, generator=gen) + dt_shift
    a = -torch.empty(H).uniform_(1.0, 16.0, generator=gen)
    b, c = (torch.randn(1, t, G, N, generator=gen) for _ in range(2))
    d = torch.randn(H, generator=gen)
    dt_bias = torch.rand(H, generator=gen) - 2.0
    return x, dt, a, b, c, d, dt_bias


def m2_inputs(x, dt, a, b, c, d, dt_bias) -> mamba2.Mamba2Inputs:
    return mamba2.Mamba2Inputs(x[0], mamba2.discretize_dt(dt[0], dt_bias, DT_MIN), a, b[0], c[0], d)


def hf_scan(x, dt, a, b, c, d, dt_bias, s0, chunk):
    return hf.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=chunk, D=d, dt_bias=dt_bias, initial_states=s0.clone(),
                                dt_softplus=True, dt_limit=(DT_MIN, float("inf")), return_final_states=True)


@pytest.mark.parametrize("t,chunk", [(1, 16), (5, 16), (64, 16), (200, 64)])
def test_run_from_a_state_is_transformers(t, chunk):
    raw = raw_inputs(t, seed=t, dt_shift=-4.0)  # the clamp engages on some tokens
    s0 = torch.randn(1, H, P, N, generator=torch.Generator().manual_seed(1))
    y, s = mamba2.run(m2_inputs(*raw), s0[0], chunk)
    y_ref, s_ref = hf_scan(*raw, s0, chunk)
    torch.testing.assert_close(y, y_ref[0], **TIGHT)
    torch.testing.assert_close(s, s_ref[0], **TIGHT)
    m, b = mamba2.summary(m2_inputs(*raw))
    torch.testing.assert_close(m[:, None, None] * s0[0] + b, s_ref[0], **TIGHT)


def test_run_is_the_recurrent_form():
    """Token by token with transformers' decode update (which does not clamp dt: dt kept above the limit)."""
    x, dt, a, b, c, d, dt_bias = raw = raw_inputs(40, seed=4)
    assert (mamba2.discretize_dt(dt, dt_bias) > DT_MIN).all()
    state = torch.randn(1, H, P, N, generator=torch.Generator().manual_seed(1))
    y, s = mamba2.run(m2_inputs(*raw), state[0].clone(), 16)
    for i in range(x.shape[1]):
        y_i = hf.mamba2_selective_state_update(
            state, x[:, i], dt[:, i, :, None].expand(-1, -1, P), a[:, None, None].expand(-1, P, N), b[:, i],
            c[:, i], d[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
        torch.testing.assert_close(y[i], y_i[0], **TIGHT)
    torch.testing.assert_close(s, state[0], **TIGHT)


def test_empty_run_is_the_identity():
    inp = m2_inputs(*raw_inputs(3))[0:0]
    s0 = torch.randn(H, P, N)
    y, s = mamba2.run(inp, s0)
    m, b = mamba2.summary(inp)
    assert y.shape == (0, H, P)
    torch.testing.assert_close(s, s0, atol=0, rtol=0)
    torch.testing.assert_close(m, torch.ones(H), atol=0, rtol=0)
    torch.testing.assert_close(b, torch.zeros(H, P, N), atol=0, rtol=0)


@pytest.mark.parametrize("runs", [cp_runs(331, 1), cp_runs(331, 2), cp_runs(331, 3),
                                  [runs_at([1, 2, 70, 71, 200, 329], 331)]],
                         ids=["cp1", "cp2", "cp3", "cuts"])
def test_shards_compose_to_the_uncut_run(runs):
    raw = raw_inputs(331, seed=7)
    raw = (raw[0], raw[1], raw[2] / 8, *raw[3:])  # slower decays, so that the start state matters to the end
    s0 = torch.randn(H, P, N, generator=torch.Generator().manual_seed(2))
    check_composed(lambda inp, s: mamba2.run(inp, s, 64), mamba2.summary, m2_inputs(*raw), s0, runs)


# ---------------------------------------------------------------- the mixer against transformers'

def tiny_config():
    return hf.NemotronHConfig(
        vocab_size=64, hidden_size=32, layers_block_type=["mamba", "attention"], mamba_num_heads=H,
        mamba_head_dim=P, n_groups=G, ssm_state_size=N, conv_kernel=4, chunk_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, time_step_min=DT_MIN)


@pytest.fixture(scope="module")
def hf_mixer_and_ours(tmp_path_factory):
    """transformers' Mamba-2 mixer of a tiny random nemotron_h checkpoint (A_log, dt_bias, D, conv weight and
    bias, gated norm randomised), and a Mamba2Mixer loaded from the checkpoint's layer-0 tensors by their names."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = hf.NemotronHForCausalLM(cfg).eval()
    mixer_hf = model.model.layers[0].mixer
    with torch.no_grad():
        mixer_hf.A_log.copy_(torch.empty(H).uniform_(1.0, 16.0).log())
        mixer_hf.dt_bias.uniform_(-1.0, 0.5)
        mixer_hf.D.normal_(0.0, 1.0)
        mixer_hf.conv1d.weight.normal_(0.0, 0.5)
        mixer_hf.conv1d.bias.normal_(0.0, 0.5)
        mixer_hf.norm.weight.normal_(1.0, 0.3)
        mixer_hf.in_proj.weight.normal_(0.0, 0.2)
        mixer_hf.out_proj.weight.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(path)
    prefix = "backbone.layers.0.mixer."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        sd = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    ours = mamba2.Mamba2Mixer(mamba2.Mamba2Shape.from_hf(cfg.to_dict()))
    ours.load_state_dict(sd, strict=True)
    return cfg, mixer_hf, ours.eval()


def test_shape_from_config_and_refusals():
    shape = mamba2.Mamba2Shape.from_hf({"hidden_size": 64, "mamba_num_heads": 8, "mamba_head_dim": 4,
                                        "mamba_n_groups": 2, "ssm_state_size": 16, "mamba_d_conv": 3,
                                        "mamba_dt_min": 0.01, "mamba_chunk_size": 32})
    assert (shape.n_groups, shape.conv_kernel, shape.dt_min, shape.chunk_size) == (2, 3, 0.01, 32)
    with pytest.raises(ValueError, match=r"nemotron_h mamba_num_heads \(6\) must be divisible by n_groups \(4\)"):
        mamba2.Mamba2Shape.from_hf({"hidden_size": 64, "mamba_num_heads": 6, "n_groups": 4})
    with pytest.raises(ValueError, match="nemotron_h mamba_hidden_act 'relu'"):
        mamba2.Mamba2Shape.from_hf({"hidden_size": 64, "mamba_hidden_act": "relu"})


def test_conv_with_halo_is_the_uncut_conv(hf_mixer_and_ours):
    _, _, ours = hf_mixer_and_ours
    u = torch.randn(331, ours.shape.conv_channels)
    for runs in (*cp_runs(331, 3), runs_at([1, 2, 3, 100, 330], 331)):
        check_conv_halo(ours.conv, u, runs, ours.shape.conv_kernel)


def test_mixer_is_transformers_prefill_continuation_decode(hf_mixer_and_ours):
    cfg, mixer_hf, ours = hf_mixer_and_ours
    gen = torch.Generator().manual_seed(3)
    x1, x2, x3 = (torch.randn(1, n, cfg.hidden_size, generator=gen) for n in (150, 70, 1))
    cache = hf.DynamicCache(config=cfg)
    k1 = ours.shape.conv_kernel - 1
    with torch.no_grad():
        y_ref = mixer_hf(x1, cache=cache)
        y, s, tail = ours(x1[0])
        torch.testing.assert_close(y, y_ref[0], **TIGHT)
        torch.testing.assert_close(s, cache.get_recurrent_state(0)[0], **TIGHT)
        torch.testing.assert_close(tail, cache.get_conv_state(0)[0, :, -k1:].T, atol=0, rtol=0)
        for x in (x2, x3):  # a chunk of a longer prompt, then one decode token, each from HF's cached state
            s_hf, tail_hf = cache.get_recurrent_state(0)[0].clone(), cache.get_conv_state(0)[0, :, -k1:].T.clone()
            y_ref = mixer_hf(x, cache=cache)
            y, s, tail = ours(x[0], s_hf, tail_hf)
            torch.testing.assert_close(y, y_ref[0], **TIGHT)
            torch.testing.assert_close(s, cache.get_recurrent_state(0)[0], **TIGHT)
            torch.testing.assert_close(tail, cache.get_conv_state(0)[0, :, -k1:].T, atol=0, rtol=0)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_staged_mixer_under_cp_is_the_uncut_mixer(hf_mixer_and_ours, num_ranks):
    cfg, _, ours = hf_mixer_and_ours
    x = torch.randn(331, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        check_staged(ours, lambda inp, s: mamba2.run(inp, s, ours.shape.chunk_size), mamba2.summary, x,
                     cp_runs(331, num_ranks))


def test_no_tokens_change_nothing(hf_mixer_and_ours):
    """A rank may hold no token of a sequence: the mixer maps its state and conv tail to themselves."""
    cfg, _, ours = hf_mixer_and_ours
    with torch.no_grad():
        _, s, tail = ours(torch.randn(5, cfg.hidden_size))
        y0, s0, tail0 = ours(torch.randn(0, cfg.hidden_size), s, tail)
    assert y0.shape == (0, cfg.hidden_size)
    torch.testing.assert_close(s0, s, atol=0, rtol=0)
    torch.testing.assert_close(tail0, tail, atol=0, rtol=0)


def test_layer_map_is_a_decay_per_head():
    """The engine's layer (state cached transposed, [H, N, P]) gives maps whose M is the decay per head (`map_shape`
    (H,)), so CP exchanges H + H N P numbers per shard; the map applied to a state is the run from it."""
    from cpinfer.model.recurrent.layers import Mamba2Layer

    shape = mamba2.Mamba2Shape(hidden_size=16, num_heads=H, head_dim=P, n_groups=G, state_size=N, dt_min=DT_MIN)
    layer = Mamba2Layer(shape, 0)
    assert layer.map_shape == (H,)
    inp = m2_inputs(*raw_inputs(37, seed=9))
    s0 = torch.randn(H, N, P, generator=torch.Generator().manual_seed(2))
    amap = layer.summary(inp)
    assert amap.M.shape == (H,) and amap.B.shape == (H, N, P) and amap.to_tensor().numel() == H + H * N * P
    _, s = layer.run(inp, s0)
    torch.testing.assert_close(amap.apply(s0), s, **TIGHT)
