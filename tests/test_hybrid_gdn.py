"""The gated delta rule (`model/recurrent/gdn.py`) against transformers' reference functions, and the affine-map
contract (`affine.py`): a run from any state equals the reference; shard summaries composed in sequence order
give the final state of the whole run, and each shard run from its predecessors' composed state gives the whole
run's outputs — for arbitrary cuts (short shards, one token, several chunks)."""
import pytest
import torch
import torch.nn.functional as F

from cpinfer.model.recurrent import delta, gdn
from cpinfer.model.recurrent.affine import Affine, compose
from recurrent_shards import denormals

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(t, h=4, dk=8, dv=6, seed=0):
    """Random raw q, k, v [1, T, H, D] and decays, betas [1, T, H] as the GDN layer feeds the reference."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, t, h, dk, generator=gen), torch.randn(1, t, h, dk, generator=gen)
    v = torch.randn(1, t, h, dv, generator=gen)
    g = -torch.rand(1, t, h, generator=gen) * 0.3  # log decays in (-0.3, 0]
    beta = torch.rand(1, t, h, generator=gen)
    return q, k, v, g, beta


def _ours(q, k, v, g, beta):
    """The same inputs in gdn's form (L2-normed q, k; q scaled), unbatched."""
    qn = gdn.l2norm(q[0].float()) * q.shape[-1] ** -0.5
    return gdn.GDNInputs(qn, gdn.l2norm(k[0].float()), v[0].float(), g[0].float(), beta[0].float())


@pytest.mark.parametrize("t", [1, 5, 64, 200])
def test_run_matches_transformers_chunked_and_recurrent_from_a_state(t):
    q, k, v, g, beta = _inputs(t)
    s0 = torch.randn(1, 4, 8, 6, generator=torch.Generator().manual_seed(9))
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, initial_state=s0,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec_o, rec_s = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref_o, rec_o, atol=1e-5, rtol=1e-5)  # the two references agree
    for chunk in (16, 64):
        o, s = gdn.run(_ours(q, k, v, g, beta), s0[0], chunk=chunk)
        torch.testing.assert_close(o, ref_o[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_s[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [[0, 300], [0, 1, 300], [0, 7, 8, 100, 163, 300], [0, 150, 299, 300],
                                  [0, 64, 128, 192, 256, 300]])
def test_summaries_compose_over_arbitrary_shards(cuts):
    q, k, v, g, beta = _inputs(300, seed=3)
    s0 = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(4))
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, initial_state=s0[None],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    inp = _ours(q, k, v, g, beta)
    shards = [inp[a:b] for a, b in zip(cuts, cuts[1:])]
    maps = [gdn.summary(s, chunk=32) for s in shards]
    # every shard's summary is the affine map of its run: B from zero, M S0 + B from any S0
    for shard, m in zip(shards, maps):
        _, direct = gdn.run(shard, s0, chunk=32)
        torch.testing.assert_close(m.apply(s0), direct, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compose(maps).apply(s0), ref_s[0], atol=1e-4, rtol=1e-4)
    outs, start = [], s0
    for i, shard in enumerate(shards):  # each shard from its predecessors' composed maps (what a CP rank does)
        start_i = s0 if i == 0 else compose(maps[:i]).apply(s0)
        o, _ = gdn.run(shard, start_i, chunk=32)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), ref_o[0], atol=1e-4, rtol=1e-4)


def test_affine_algebra_and_flattening():
    gen = torch.Generator().manual_seed(1)
    a = Affine(torch.randn(3, 4, 4, generator=gen), torch.randn(3, 4, 5, generator=gen))
    b = Affine(torch.randn(3, 4, 4, generator=gen), torch.randn(3, 4, 5, generator=gen))
    s = torch.randn(3, 4, 5, generator=gen)
    torch.testing.assert_close(a.then(b).apply(s), b.apply(a.apply(s)))
    ident = Affine.identity_like(s)
    torch.testing.assert_close(ident.then(a).apply(s), a.apply(s))
    back = Affine.from_tensor(a.to_tensor(), (3, 4, 4), (3, 4, 5))
    assert torch.equal(back.M, a.M) and torch.equal(back.B, a.B)
    # a per-head decay (Mamba-2's shape)
    d1 = Affine(torch.rand(3, generator=gen), torch.randn(3, 2, 6, generator=gen))
    d2 = Affine(torch.rand(3, generator=gen), torch.randn(3, 2, 6, generator=gen))
    s2 = torch.randn(3, 2, 6, generator=gen)
    torch.testing.assert_close(d1.then(d2).apply(s2), d2.apply(d1.apply(s2)))
    with pytest.raises(ValueError, match="per-head decay"):
        d1.then(a)


@pytest.mark.parametrize("t", [3, 100])
def test_outputs_as_a_function_of_the_starting_state(t):
    """summary_with_outputs: one scan gives the map and o0 + om S, the run's outputs from any state S."""
    q, k, v, g, beta = _inputs(t, seed=5)
    inp = _ours(q, k, v, g, beta)
    s0 = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(6))
    amap, o0, om = gdn.summary_with_outputs(inp, chunk=32)
    o, s = gdn.run(inp, s0, chunk=32)
    torch.testing.assert_close(gdn.outputs_from(o0, om, s0), o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(amap.apply(s0), s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gdn.outputs_from(o0, om, None), gdn.run(inp, None, chunk=32)[0], atol=1e-5, rtol=1e-5)


def test_a_long_decaying_summary_never_holdsdenormals(monkeypatch):
    """The augmented scan's identity block decays as exp(sum g); entries that would fall below 2^-64 are set to 0
    (float32's denormals are ~100x slower to multiply), and the map still reproduces the plain run from a state."""
    q, k, v, g, beta = _inputs(300, seed=7)
    inp = _ours(q, k, v, g * 2.0, beta)  # log decays in (-0.6, 0]: M reaches the denormals within the run
    with monkeypatch.context() as m:
        m.setattr(delta, "TINY", 0.0)  # no flush: the same inputs do leave denormals in M
        assert denormals(gdn.summary_with_outputs(inp, chunk=32)[0].M) > 0
    amap, o0, om = gdn.summary_with_outputs(inp, chunk=32)
    assert denormals(amap.M) == 0 and denormals(amap.B) == 0
    s0 = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(8))
    o, s = gdn.run(inp, s0, chunk=32)
    torch.testing.assert_close(gdn.outputs_from(o0, om, s0), o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(amap.apply(s0), s, atol=1e-5, rtol=1e-5)
