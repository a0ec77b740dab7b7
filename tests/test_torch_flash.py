"""The `torch-flash` backend (PyTorch's own FA2 varlen op) on CPU: a fake op with the real schema
(`fake_torch_flash.py`) checks every argument and computes in float64 with FA2's semantics, so the packing is proven
exact against the float64 reference in every log-sum-exp layout torch has used; the real op is called on meta
tensors (its schema and LSE layout in this torch); the probe passes a correct op and turns away one that misaligns
causal masks, returns an unknown LSE layout or raises — with one warning naming the failure, `auto` then being
Triton; `auto` on an accelerator is flash-attn, else torch-flash, else triton; fp32 runs Triton.
"""
import os
import warnings

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # fp32 and MASK tiles go through the Triton kernel (interpreter)
pytest.importorskip("triton", reason="the flash backends fall back to Triton for fp32 and MASK tiles")

import fake_flash_attn  # noqa: E402
import fake_torch_flash as fake  # noqa: E402
from cpinfer.attention import torch_flash  # noqa: E402
from cpinfer.attention.backends import accelerator_default, get_step_backend, resolve_name  # noqa: E402
from test_flash_backend import _run as run_step, check_one_call_per_layer  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def tf(monkeypatch, request):
    """The fake op installed (param: its LSE layout) for one test; flash-attn absent."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, layout=getattr(request, "param", "hp"))
    yield fake.CALLS


def _run(kind, dtype=torch.float16, vectors=True, seed=0):
    return run_step(kind, dtype, vectors, seed, backend="torch-flash")


@pytest.mark.parametrize("tf", ["hp", "1hp", "padded"], indirect=True)
@pytest.mark.parametrize("kind,calls", [("causal", 1), ("partial", 1), ("decode", 1), ("prefix", 1), ("older", 1),
                                        ("mixed", 2), ("window", 1), ("chunk", 1), ("chunk_window", 1)])
def test_varlen_packing_is_exact(tf, kind, calls):
    """Every step shape through the op: equal to the float64 reference (fp16 rounding of the output only), empty
    rows zero with lse -inf, one call per step (two when causal squares meet FULL blocks of several rows), whatever
    the LSE layout. (The probe's calls come first and are not counted.)"""
    assert get_step_backend("torch-flash", CPU).name == "torch-flash"
    tf.clear()
    out, lse, ref_out, ref_lse = _run(kind)
    assert len(tf) == calls, tf
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_fp32_runs_the_tiled_triton_kernel(tf):
    """The op has no fp32: such a step runs the Triton kernel; the op is never called (beyond the probe)."""
    resolve_name("torch-flash", CPU)
    tf.clear()
    for kind in ("prefix", "window"):
        out, lse, ref_out, ref_lse = _run(kind, dtype=torch.float32)
        torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert tf == []


def test_the_real_op_on_meta_tensors():
    """This torch's op takes our call (argument names and order from its schema) and its LSE layout is one we read:
    the adapter's result has the packed shapes [P, H, D] and [P, H]."""
    op = torch_flash.aten_op()
    assert op is not None
    names = [a.name for a in op.default._schema.arguments]
    assert names[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                          "is_causal", "return_debug_mask"] and "scale" in names
    q = torch.empty(9, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(16, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    out, lse = torch_flash.TorchFlashAPI(op).varlen(q, k, k, cu, cu, 5, 7, 0.125, True)
    assert out.shape == (9, 4, 64) and lse.shape == (9, 4) and lse.dtype == torch.float32


def test_the_fake_has_the_real_schema():
    """The fake's parameters are the real op's, in order, with the same keyword-only part."""
    import inspect

    schema = torch_flash.aten_op().default._schema.arguments
    params = list(inspect.signature(fake.make_op()).parameters.values())
    assert [p.name for p in params] == [a.name for a in schema]
    assert [p.kind == p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in schema]


def test_probe_passes_a_correct_op_and_auto_prefers_it_to_triton(tf):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch_flash.unusable(CPU) == ""
        assert accelerator_default(CPU) == "torch-flash"
    assert {c["causal"] for c in tf} == {True, False} and any(c["rows"] < c["keys"] for c in tf)  # the probe ran
    n = len(tf)
    assert torch_flash.unusable(CPU) == "" and len(tf) == n  # once per device


@pytest.mark.parametrize("kwargs,why", [
    ({"top_left": True}, "causal varlen with Lq < Lk.*disagrees with the float32 reference"),
    ({"layout": "bad"}, "raised RuntimeError: .*log-sum-exp of shape"),
    ({"fail": True}, "raised RuntimeError: FlashAttention only supports Ampere"),
])
def test_probe_failure_warns_once_and_falls_back_to_triton(monkeypatch, kwargs, why):
    """An op that aligns causal masks top-left, returns an LSE layout we do not know, or raises: one warning naming
    what failed, then `auto` is triton and asking for torch-flash by name is refused with the same reason."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, **kwargs)
    with pytest.warns(RuntimeWarning, match="torch-flash .*failed its probe on cpu: the .*" + why):
        assert accelerator_default(CPU) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert accelerator_default(CPU) == "triton"
        with pytest.raises(ValueError, match="'torch-flash' cannot run on cpu: the .*" + why):
            resolve_name("torch-flash", CPU)


def test_auto_order_flash_attn_then_torch_flash_then_triton(monkeypatch):
    """auto on an accelerator: flash-attn when it imports, else torch-flash when its probe passed, else triton
    (no op in this torch); without CUDA, torch-flash is refused naming CUDA."""
    fake.install(monkeypatch)
    try:
        fake_flash_attn.install()
        assert accelerator_default(CPU) == "flash-attn"
    finally:
        fake_flash_attn.uninstall()
    assert accelerator_default(CPU) == "torch-flash"
    monkeypatch.setattr(torch_flash, "aten_op", lambda: None)
    monkeypatch.setattr(torch_flash, "_PROBED", {})
    assert accelerator_default(CPU) == "triton"
    assert "no aten._flash_attention_forward" in torch_flash.unusable(CPU)
    if not torch.cuda.is_available():
        assert torch_flash.unusable(torch.device("cuda")) == "CUDA is not available"
    monkeypatch.setattr(torch_flash, "DEVICES", ("cuda",))
    assert torch_flash.unusable(CPU) == "torch-flash needs a CUDA device"


def test_gpu_check_small_varlen_cases_hold_with_a_correct_op(tf):
    """gpu_check part (a)'s torch-flash cases, run here through the fake op: each passes its own assertions (empty
    rows zero with lse -inf, out and lse within tolerance) with one call per step."""
    from cpinfer.bench import gpu_check

    resolve_name("torch-flash", CPU)
    for name, case in gpu_check.SMALL_VARLEN.items():
        tf.clear()
        err_out, err_lse = gpu_check.small_varlen_check(*case, device="cpu")
        assert 1 <= len(tf) <= 2 and err_out < 2e-2 and err_lse < 1e-3, (name, tf, err_out, err_lse)


def test_engine_one_varlen_call_per_layer(tf, llama_checkpoint):
    """The engine at CP1 (fp16, the fake op): prefills, a partial prefill over a cached prefix and batched decodes
    each make one call per layer, with the tokens and log-probs of the `math` backend."""
    resolve_name("torch-flash", CPU)  # the probe's calls before counting
    check_one_call_per_layer("torch-flash", tf, llama_checkpoint("gqa", max_position_embeddings=512))
