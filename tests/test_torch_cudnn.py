"""The `torch-cudnn` backend (PyTorch's cuDNN attention ops) on CPU: fakes with the real ops' schemas
(`fake_torch_cudnn.py`) check every argument (alignment, no GQA in the ragged op, packed tensors) and compute in
float64 with cuDNN's semantics (top-left causal mask), so the mapping of a step's items — causal squares as dense
causal calls, FULL blocks as dense calls grouped by shape or one ragged call, GQA folded into rows — is proven exact
against the float64 reference; the probe turns away a base-2 log-sum-exp or an op that raises (one warning, `auto`
skips it), repeats K/V heads when the op gets GQA wrong, and drops a ragged op with misplaced log-sum-exps (one
warning, dense calls instead); CP2 pass-KV and pass-Q through both ranks; `auto` picks the fastest by timing.
"""
import inspect
import logging
import os
import warnings

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # fp32 and MASK tiles go through the Triton kernel (interpreter)
pytest.importorskip("triton", reason="the cuDNN backend falls back to Triton for fp32 and MASK tiles")

import fake_flash_attn  # noqa: E402
import fake_torch_cudnn as fake  # noqa: E402
from cpinfer.attention import autoselect, backends, cudnn_backend, torch_cudnn  # noqa: E402
from cpinfer.attention.backends import accelerator_default, attend_local, get_step_backend, resolve_name  # noqa: E402
from cpinfer.attention.items import CAUSAL, FULL, AttnItem  # noqa: E402
from cpinfer.attention.local import reference_attention  # noqa: E402
from cpinfer.attention.step import HeadLayout  # noqa: E402
from cpinfer.cp import cp_attention  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402
from test_flash_backend import _run as run_step  # noqa: E402

CPU = torch.device("cpu")
KINDS = ["causal", "partial", "decode", "prefix", "older", "mixed", "window", "chunk", "chunk_window"]


@pytest.fixture
def cu(monkeypatch, request):
    """The fakes installed for one test (param: "dense" — FULL blocks grouped by shape —, "ragged" — every FULL
    block in one ragged call —, or "no-ragged": this torch lacks the ragged op); flash-attn absent."""
    mode = getattr(request, "param", "dense")
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, ragged=mode != "no-ragged")
    if mode == "ragged":
        monkeypatch.setattr(cudnn_backend, "DENSE_GROUPS_MAX", 0)
    yield fake.CALLS


def _check(kind, dtype=torch.float16):
    out, lse, ref_out, ref_lse = run_step(kind, dtype, True, 0, backend="torch-cudnn")
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cu", ["dense", "ragged", "no-ragged"], indirect=True)
def test_every_step_shape_is_exact(cu):
    """Prefill, partial prefill, decode, prefix trees, older FULL blocks (a later pass-KV step), mixed, windows and
    chunks: equal to the float64 reference (fp16 rounding of the output only); causal calls only on squares, the
    ragged op (FULL only) only when FULL blocks are grouped into it, GQA natively only in the dense causal calls."""
    assert get_step_backend("torch-cudnn", CPU).name == "torch-cudnn"
    kinds = KINDS if torch_cudnn.aten_ops()[1] is not None and cudnn_backend.DENSE_GROUPS_MAX else [
        "partial", "decode", "prefix", "older", "mixed", "chunk"]  # (FULL blocks: what the modes change)
    for kind in kinds:
        cu.clear()
        _check(kind)
        assert cu, kind
        for c in cu:
            assert not c["causal"] or (c["rows"] == c["keys"] and c["op"] == "dense"), (kind, c)
            assert c["causal"] or c["heads"] == c["kv_heads"], (kind, c)  # unmasked calls fold GQA into rows
        ragged = [c for c in cu if c["op"] == "ragged"]
        if cudnn_backend.DENSE_GROUPS_MAX == 0 and torch_cudnn.aten_ops()[1] is not None:
            assert len(ragged) <= 1 and (ragged or all(c["causal"] for c in cu)), (kind, cu)
        else:
            assert not ragged, (kind, cu)


def test_one_long_causal_sequence_is_one_dense_causal_call(cu):
    """A prefill of one sequence (the gpu_check comparison with dense cuDNN SDPA): one dense causal call over the
    whole square, K/V heads not repeated."""
    resolve_name("torch-cudnn", CPU)
    cu.clear()
    _check("causal")
    assert cu == [{"op": "dense", "causal": True, "batch": 1, "heads": 8, "kv_heads": 2, "rows": 70, "keys": 70}]


def test_calls_group_items_by_shape():
    """Squares of one side share a dense causal call, FULL blocks share a call per shape; past DENSE_GROUPS_MAX
    shapes (with the ragged op) they form one ragged call; one-row squares and FULL blocks of one key (which cuDNN
    refuses) form one call computed without the op."""
    items = [AttnItem(0, 4, 0, 4, CAUSAL), AttnItem(4, 8, 10, 14, CAUSAL), AttnItem(8, 9, 20, 21, CAUSAL),
             AttnItem(9, 10, 0, 7, FULL), AttnItem(0, 4, 30, 37, FULL), AttnItem(4, 8, 40, 47, FULL),
             AttnItem(10, 13, 5, 6, FULL)]
    calls = cudnn_backend.cudnn_calls(items, ragged=True)
    assert [(c.ragged, c.causal, c.batch, c.lq, c.lk, c.one_key) for c in calls] == [
        (False, True, 2, 4, 4, False), (False, False, 1, 1, 7, False), (False, False, 2, 4, 7, False),
        (False, False, 2, 0, 1, True)]
    assert calls[0].q_rows.tolist() == list(range(8)) and calls[0].k_rows.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert calls[-1].q_rows.tolist() == [8, 10, 11, 12] and calls[-1].k_rows.tolist() == [20, 5, 5, 5]
    many = [AttnItem(i, i + 1, 0, 3 + i, FULL) for i in range(cudnn_backend.DENSE_GROUPS_MAX + 1)]
    [call] = cudnn_backend.cudnn_calls(many, ragged=True)
    assert call.ragged and call.cu_k.tolist() == np.cumsum([0] + [3 + i for i in range(len(many))]).tolist()
    assert len(cudnn_backend.cudnn_calls(many, ragged=False)) == len(many)
    fresh = [AttnItem(0, 4, 0, 3, FULL, first=True), AttnItem(0, 4, 3, 7, CAUSAL), AttnItem(4, 8, 0, 4, CAUSAL,
                                                                                         first=True)]
    calls = cudnn_backend.cudnn_calls(fresh, ragged=False)  # squares first: rows 0-3 merge, rows 4-7 are stored
    assert [c.q_rows.tolist() for c in calls] == [list(range(8)), list(range(4))]
    assert cudnn_backend.mark_stores(calls, 8) == [False, False]
    assert cudnn_backend.mark_stores(cudnn_backend.cudnn_calls(fresh[2:], ragged=False), 8) == [True]
    with pytest.raises(ValueError, match="top-left square"):
        cudnn_backend.cudnn_calls([AttnItem(0, 4, 0, 6, CAUSAL)], ragged=True)


def test_one_key_rows_are_exact():
    """A step whose rows see one key each (a one-row square, a FULL block of one key beside a causal square): the
    value itself with the scaled score as lse, equal to the reference; the op never gets a key length of 1."""
    q = torch.randn(5, 8, 16).half()
    k, v = torch.randn(5, 2, 16).half(), torch.randn(5, 2, 16).half()
    seq = torch.tensor([0, 1, 1, 2, 2])
    pos = torch.tensor([0, 0, 1, 0, 1])
    out, lse = cudnn_backend.one_key(q[:1], k[:1], v[:1], 0.3)
    ref_out, ref_lse = reference_attention(q[:1], k[:1], v[:1], seq[:1], pos[:1], seq[:1], pos[:1], scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0, 5], v[0, 1])


@pytest.mark.parametrize("cu", ["dense", "ragged"], indirect=True)
def test_steps_with_one_key_blocks_are_exact(cu):
    """Short sequences (every row of a 2-token prompt; a row with one older key) through the backend: exact, and
    no op call with a key length of 1 (the fakes assert it)."""
    resolve_name("torch-cudnn", CPU)
    g = torch.Generator().manual_seed(5)
    q_seq, q_pos = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 0, 1, 2, 3])
    kv_seq, kv_pos = torch.tensor([0, 0, 1, 2, 2, 2, 2]), torch.tensor([0, 1, 0, 0, 1, 2, 3])
    q = torch.randn(6, 8, 16, generator=g).half()
    k, v = torch.randn(7, 2, 16, generator=g).half(), torch.randn(7, 2, 16, generator=g).half()
    out, lse = attend_local(q, k, v, q_seq, q_pos, kv_seq, kv_pos, backend="torch-cudnn", scale=0.3)
    ref_out, ref_lse = reference_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, scale=0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False], ids=["values-in-keys", "separate-values"])
def test_value_head_size_differs(cu, shared):
    """Dv < Dk (MLA-like): the values as the keys' first channels, or a separate narrower v — padded exactly."""
    g = torch.Generator().manual_seed(7)
    seq, pos = torch.zeros(30, dtype=torch.long), torch.arange(30)
    q = torch.randn(30, 4, 24, generator=g).half()
    k = torch.randn(30, 1, 24, generator=g).half()
    v = k[..., :16] if shared else torch.randn(30, 1, 16, generator=g).half()
    out, lse = attend_local(q, k, v, seq, pos, seq, pos, backend="torch-cudnn", scale=0.2)
    ref_out, ref_lse = reference_attention(q, k, v, seq, pos, seq, pos, scale=0.2)
    assert out.shape == (30, 4, 16) and cu
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_fold_heads_round_trip_and_alignment():
    """fold → unfold is the identity (out and lse), row i·G + g of KV head kv is query head kv·G + g; a view whose
    stride is not a multiple of 16 bytes is copied, an aligned one is not."""
    q = torch.randn(3, 8, 16)
    f = torch_cudnn.fold_heads(q, 2)  # [12, 2, 16]
    assert f.shape == (12, 2, 16) and torch.equal(f[1 * 4 + 2, 1], q[1, 1 * 4 + 2])
    lse = torch.randn(12, 2)
    out, back = torch_cudnn.unfold_heads(f, lse, 4)
    assert torch.equal(out, q) and torch.equal(back[1, 1 * 4 + 2], lse[1 * 4 + 2, 1])
    x = torch.randn(10, 3, 16).half()
    assert torch_cudnn.aligned(x[2:]).data_ptr() == x[2:].data_ptr()  # 3 x 16 x 2 bytes a row
    odd = torch.randn(10, 3, 20).half()[:, :, :12]  # row stride 60 elements = 120 bytes: fine; head stride 40 bytes
    assert not torch_cudnn.aligned(odd).data_ptr() == odd.data_ptr() and torch_cudnn.aligned(odd).is_contiguous()


def test_fp32_and_big_heads_run_the_tiled_triton_kernel(cu):
    """The ops have no fp32: such a step runs the Triton kernel; the ops are never called (beyond the probe)."""
    resolve_name("torch-cudnn", CPU)
    cu.clear()
    for kind in ("prefix", "window"):
        out, lse, ref_out, ref_lse = run_step(kind, torch.float32, True, 0, backend="torch-cudnn")
        torch.testing.assert_close(out.double(), ref_out, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert cu == []
    assert not cudnn_backend.CudnnBackend.handles(HeadLayout(8, 2, 256, torch.bfloat16))


def test_few_row_blocks_go_to_torch_flash_when_usable(cu, monkeypatch):
    """With torch-flash usable, blocks of at most SMALL_ROWS query rows (decode rows, short chunks) run its varlen
    call and the larger ones cuDNN; every step shape stays exact."""
    import fake_torch_flash

    fake_torch_flash.install(monkeypatch)
    monkeypatch.setattr(cudnn_backend, "SMALL_ROWS", 16)
    resolve_name("torch-cudnn", CPU), resolve_name("torch-flash", CPU)  # the probes' calls before counting
    for kind in ("causal", "partial", "decode", "prefix", "mixed", "window"):
        cu.clear()
        fake_torch_flash.CALLS.clear()
        _check(kind)
        g = 4  # query heads per KV head in these steps: unmasked calls see rows x G
        assert all(c["rows"] > (16 if c["causal"] else 16 * g) for c in cu), (kind, cu)
        if kind == "decode":  # one row per sequence: all torch-flash
            assert not cu and len(fake_torch_flash.CALLS) == 1
        if kind == "causal":  # one 70-row square: cuDNN
            assert len(cu) == 1 and not fake_torch_flash.CALLS


def test_the_fakes_have_the_real_schemas():
    """Parameter names, order, defaults' presence and the keyword-only part of both fakes are this torch's ops'."""
    real = [op.default._schema.arguments for op in (torch.ops.aten._scaled_dot_product_cudnn_attention,
                                                     torch.ops.aten._cudnn_attention_forward)]
    for schema, fn in zip(real, fake.make_ops()):
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params] == [a.name for a in schema]
        assert [p.kind == p.KEYWORD_ONLY for p in params] == [a.kwarg_only for a in schema]
        assert [p.default is not p.empty for p in params] == [a.has_default_value() for a in schema]


def test_the_real_dense_op_on_meta_tensors():
    """This torch's dense op takes our call (BSHD-strided views, GQA, scale by keyword) and its log-sum-exp layout
    ([B, H, Lq] or [B, H, Lq, 1]) is one we read: the adapter returns [B, Lq, H, D] and [B, Lq, H] fp32."""
    api = torch_cudnn.CudnnAPI(torch.ops.aten._scaled_dot_product_cudnn_attention)
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 5, 2, 64, device="meta", dtype=torch.bfloat16)
    for causal in (True, False):
        out, lse = api.dense(q, k, k, 0.125, causal)
        assert out.shape == (2, 5, 8, 64) and lse.shape == (2, 5, 8) and lse.dtype == torch.float32


def test_probe_passes_correct_ops_and_auto_takes_cudnn_before_torch_flash(cu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch_cudnn.unusable(CPU) == ""
        assert accelerator_default(CPU) == "torch-cudnn"
    api = torch_cudnn.api(CPU)
    assert api.ragged_op is not None and not api.expand_gqa
    assert {c["op"] for c in cu} == {"dense", "ragged"} and any(c["causal"] for c in cu)
    n = len(cu)
    assert torch_cudnn.unusable(CPU) == "" and len(cu) == n  # once per device


@pytest.mark.parametrize("kwargs,why", [
    ({"lse_base2": True}, "dense causal squares .*disagrees with the float32 reference"),
    ({"fail": True}, "dense causal squares .*raised RuntimeError: cuDNN Frontend error"),
])
def test_probe_failure_warns_once_and_auto_skips_it(monkeypatch, kwargs, why):
    """A base-2 log-sum-exp or an op that raises: one warning naming what failed, `auto` is then the next backend
    (triton here) and asking for torch-cudnn by name is refused with the same reason."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, **kwargs)
    with pytest.warns(RuntimeWarning, match="torch-cudnn .*failed its probe on cpu: the " + why):
        assert accelerator_default(CPU) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert accelerator_default(CPU) == "triton"
        with pytest.raises(ValueError, match="'torch-cudnn' cannot run on cpu: the " + why):
            resolve_name("torch-cudnn", CPU)


def test_wrong_native_gqa_repeats_kv_heads(monkeypatch, caplog):
    """An op that pairs query heads with the wrong KV heads: no warning, causal squares repeat the K/V heads and
    every step is still exact."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, gqa_wrong=True)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="cpinfer.attention.torch_cudnn"):
        warnings.simplefilter("error")
        assert torch_cudnn.unusable(CPU) == ""
    assert torch_cudnn.api(CPU).expand_gqa and "repeat K/V heads" in caplog.text
    for kind in ("causal", "partial", "decode"):
        fake.CALLS.clear()
        _check(kind)
        assert all(c["heads"] == c["kv_heads"] for c in fake.CALLS)


def test_strided_views_packed_when_the_op_misreads_them(monkeypatch, caplog):
    """An op that misreads queries strided like a fused QKV projection's: no warning, dense inputs are packed first
    (logged), and the steps are exact — also with queries that are such a view."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, packed_only=True)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="cpinfer.attention.torch_cudnn"):
        warnings.simplefilter("error")
        assert torch_cudnn.unusable(CPU) == ""
    assert torch_cudnn.api(CPU).packed and "packed first" in caplog.text
    for kind in ("causal", "partial", "decode"):
        _check(kind)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(20, 12, 16, generator=g).half()  # a fused projection: 8 query heads, then K and V heads
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    seq, pos = torch.zeros(20, dtype=torch.long), torch.arange(20)
    out, lse = attend_local(q, k, v, seq, pos, seq, pos, backend="torch-cudnn", scale=0.25)
    ref_out, ref_lse = reference_attention(q, k, v, seq, pos, seq, pos, scale=0.25)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=3e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_ragged_probe_failure_warns_once_and_runs_dense(monkeypatch):
    """A ragged op that misplaces the log-sum-exps of later sequences (older PyTorch): one warning, the backend
    stays usable and FULL blocks of many shapes run as dense calls, exact."""
    fake_flash_attn.uninstall()
    fake.install(monkeypatch, ragged_offset_bug=True)
    monkeypatch.setattr(cudnn_backend, "DENSE_GROUPS_MAX", 0)
    with pytest.warns(RuntimeWarning, match="ragged op .*failed its probe on cpu: the ragged FULL call .*disagrees"):
        assert torch_cudnn.unusable(CPU) == ""
    assert torch_cudnn.api(CPU).ragged_op is None
    for kind in ("decode", "prefix", "older"):
        fake.CALLS.clear()
        _check(kind)
        assert {c["op"] for c in fake.CALLS} == {"dense"}


def test_unusable_without_cuda_or_op(monkeypatch):
    monkeypatch.setattr(torch_cudnn, "_PROBED", {})
    assert torch_cudnn.unusable(CPU) == "torch-cudnn needs a CUDA device"
    if not torch.cuda.is_available():
        assert torch_cudnn.unusable(torch.device("cuda")) == "CUDA is not available"
    monkeypatch.setattr(torch_cudnn, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch_cudnn, "aten_ops", lambda: (None, None))
    assert "no aten._scaled_dot_product_cudnn_attention" in torch_cudnn.unusable(CPU)


def test_engine_matches_math(cu, llama_checkpoint):
    """The engine at CP1 (fp16, the fakes): prefills, a partial prefill reading a cached prefix through the store
    (keys gathered by index) and batched decodes give the tokens and log-probs of the `math` backend."""
    from cpinfer import LLM, SamplingParams

    rng = np.random.default_rng(0)
    doc = rng.integers(3, 256, 40).tolist()
    prompts = [doc + rng.integers(3, 256, n).tolist() for n in (5, 17)] + [rng.integers(3, 256, 9).tolist()]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, ignore_eos=True)
    path = llama_checkpoint("gqa", max_position_embeddings=512)
    resolve_name("torch-cudnn", CPU)  # the probe's calls before counting
    runs = {}
    for name in ("torch-cudnn", "math"):
        with LLM(str(path), dtype="float16", attention_backend=name, max_kv_tokens_per_rank=1024,
                 threads_per_rank=1) as llm:
            before = len(cu)
            runs[name] = (llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params), len(cu) - before)
    assert runs["torch-cudnn"][1] > 0 and runs["math"][1] == 0
    assert runs["torch-cudnn"][0][1].num_cached_tokens >= 40
    for mine, ref in zip(runs["torch-cudnn"][0], runs["math"][0]):
        assert mine.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=2e-2)


# ---------------------------------------------------------------- auto: the fastest by a short timing

def test_auto_times_usable_backends_once_per_shape_class(cu, caplog, monkeypatch):
    """With a head layout `auto` times every usable backend once per (device, shape class), takes the fastest, logs
    one line with the timings; another length bucket or head layout is timed again; a backend whose timing fails
    is never chosen; a name given explicitly is not timed."""
    seen = []
    fast = {"torch-cudnn": 3e-3, "triton": 1e-3}

    def timer(name, device, shape):
        seen.append((name, shape.tokens))
        if name == "triton" and shape.head_dim == 32:
            raise RuntimeError("out of resources")
        return fast[name]

    monkeypatch.setattr(backends, "time_backend", timer)
    layout = HeadLayout(8, 2, 16, torch.float16)
    with caplog.at_level(logging.INFO, logger="cpinfer.attention.autoselect"):
        assert accelerator_default(CPU, layout=layout) == "triton"
        assert accelerator_default(CPU, layout=layout, tokens=5000) == "triton"  # the same bucket (8192)
        assert seen == [("torch-cudnn", 8192), ("triton", 8192)]
        assert accelerator_default(CPU, layout=layout, tokens=100_000) == "triton"  # bucket 32768
        assert len(seen) == 4
        assert accelerator_default(CPU, layout=HeadLayout(8, 2, 32, torch.float16)) == "torch-cudnn"
        assert resolve_name("torch-cudnn", CPU, layout=layout) == "torch-cudnn" and len(seen) == 6
        assert accelerator_default(CPU, probe=False, layout=layout) == "torch-cudnn" and len(seen) == 6
    lines = [r.getMessage() for r in caplog.records
             if r.name == "cpinfer.attention.autoselect" and r.levelno == logging.INFO]
    assert lines[0] == ("attention backend auto on cpu for D=16 H=8/2 float16, causal prefill of 8192 tokens: "
                        "triton (torch-cudnn 3 ms, triton 1 ms)")
    assert "triton failed" in lines[-1] and len(lines) == 3
    choice = autoselect.chosen(CPU, layout)
    assert choice.name == "triton" and choice.timings_ms == {"torch-cudnn": 3.0, "triton": 1.0}


def test_auto_without_layout_takes_the_fixed_order(cu):
    """No head layout (or probe=False): no timing, the first usable backend of ORDER; ties go by that order."""
    assert autoselect.ORDER.index("torch-cudnn") < autoselect.ORDER.index("torch-flash")
    assert accelerator_default(CPU) == "torch-cudnn"
    shape = autoselect.ShapeClass.of(HeadLayout(4, 4, 8, torch.bfloat16), 3)
    assert shape.tokens == autoselect.MIN_BUCKET and shape.dtype == "bfloat16"
    tie = autoselect.choose(CPU, shape, ["torch-cudnn", "triton"], lambda *a: 2e-3)
    assert tie.name == "torch-cudnn"
    with pytest.raises(ValueError, match="heads divisible"):
        autoselect.ShapeClass(8, 6, 4, "float16", 1024)


def test_real_timer_runs_on_cpu():
    """`time_backend` itself (the math backend on CPU, tiny shape): a positive median."""
    shape = autoselect.ShapeClass(16, 4, 2, "float32", 64)
    assert backends.time_backend("math", CPU, shape, repeat=3) > 0


# ---------------------------------------------------------------- CP2 ring steps through both ranks

@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, timeout_s=120) as p:
        yield p


def _rank_fake_cudnn(ctx, q, k, v, q_seq, q_pos, kv_seq, kv_pos, kv_end, strategy):
    fake.install_plain()
    out = cp_attention(q, k, v, q_seq, q_pos, kv_seq, kv_pos, group=ctx.group, strategy=strategy, kv_seq_end=kv_end,
                       backend="torch-cudnn")
    return out, [c for c in fake.CALLS if c["op"]], len(fake.CALLS)


@pytest.mark.parametrize("strategy", ["pass-kv", "pass-q"])
def test_cp2_ring_steps_are_exact(pool, strategy):
    """CP2 with a prefix tree split over both ranks, pass-KV and pass-Q ring steps: the result equals the float64
    reference; every causal call is a square."""
    kv_seq = np.repeat([0, 1, 2], [24, 11, 9])
    kv_pos = np.concatenate([np.arange(24), np.arange(24, 35), np.arange(24, 33)])
    kv_end = np.repeat([3, 2, 3], [24, 11, 9])
    q_rows = np.arange(24, 44)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(44, 2, 16, generator=g).half() for _ in range(2))
    q = torch.randn(44, 8, 16, generator=g).half()[q_rows]
    t = (lambda x: torch.as_tensor(np.asarray(x)))  # noqa: E731
    q_seq, q_pos = t(kv_seq[q_rows]), t(kv_pos[q_rows])
    ranks_q = [np.arange(0, 20, 2), np.arange(1, 20, 2)]
    ranks_kv = [np.arange(0, 44, 2), np.arange(1, 44, 2)]
    args = [(q[a], k[b], v[b], q_seq[a], q_pos[a], t(kv_seq[b]), t(kv_pos[b]), t(kv_end[b]), strategy)
            for a, b in zip(ranks_q, ranks_kv)]
    res = pool.run_each(_rank_fake_cudnn, args)
    out = torch.zeros(20, 8, 16, dtype=torch.float64)
    for a, (o, calls, n) in zip(ranks_q, res):
        out[a] = o.double()
        assert n > 0 and all(not c["causal"] or c["rows"] == c["keys"] for c in calls)
    ref, _ = reference_attention(q, k, v, q_seq, q_pos, t(kv_seq), t(kv_pos), kv_seq_end=t(kv_end))
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-3)


# ---------------------------------------------------------------- gpu_check part (b)'s pieces that need no GPU

@pytest.mark.parametrize("cu", ["dense", "no-ragged"], indirect=True)
def test_gpu_check_torch_cudnn_rows(cu, monkeypatch):
    """Part (b)'s torch-cudnn check itself, through the fakes (torch-flash's too): a probe row, then the small
    varlen steps with dense FULL calls, ragged ones when the op passed its probe, and few-row blocks to torch-flash
    — each row exact enough to pass its own assertions; the module's settings restored."""
    import fake_torch_flash
    from cpinfer.bench import gpu_check

    fake_torch_flash.install(monkeypatch)
    res = gpu_check.torch_cudnn_check(device="cpu", long_tokens=None)
    names = [r[0].split(" vs ")[0] for r in res["rows"]]
    ragged = torch_cudnn.aten_ops()[1] is not None
    assert names == ["torch-cudnn probe", "torch-cudnn (dense FULL calls)"] + (
        ["torch-cudnn (ragged FULL calls)"] if ragged else []) + ["torch-cudnn (few-row blocks to torch-flash)"]
    assert res["ragged"] == ragged and "passed" in res["rows"][0][1] and fake_torch_flash.CALLS
    assert (cudnn_backend.DENSE_GROUPS_MAX, cudnn_backend.SMALL_ROWS) == (4, 128)


def test_bench_reports_the_cudnn_ratio():
    """`cpinfer bench gpu`'s report: torch-cudnn's rate over dense cuDNN SDPA's per length (where both ran), every
    output's distance from SDPA's, and kernels that could not run named with the reason."""
    from cpinfer.bench import gpu

    row = (lambda t, k, tf, err=None: {"tokens": t, "kernel": k, "seconds": None if tf is None else 1.0,  # noqa: E731
                                       "tflops": tf, "of_matmul": None if tf is None else tf / 800,
                                       "vs_sdpa": None if tf is None else 4e-3, "error": err,
                                       "new_length_s": None if tf is None else 0.0125})
    rows = [row(8192, "torch-cudnn", 450.0), row(8192, "sdpa-cudnn", 500.0), row(8192, "torch-sdpa", 520.0),
            row(16384, "torch-cudnn", 600.0), row(16384, "sdpa-cudnn", None, "RuntimeError: no cuDNN")]
    ratios = gpu.cudnn_ratios(rows)
    assert ratios == {8192: 0.9}
    text = gpu.format_report({"device": "H100", "dtype": "bf16", "heads": 32, "kv_heads": 8, "head_dim": 128,
                              "matmul_tflops": 800.0, "rows": rows, "cudnn_vs_sdpa": ratios})
    assert "| 8192 | torch-cudnn | 1000.00 | 450.0 | 0.56 | 4.0e-03 | 12.50 |" in text
    assert "| 16384 | sdpa-cudnn | RuntimeError: no cuDNN | - | - | - | - |" in text
    assert text.endswith("torch-cudnn / dense cuDNN SDPA (same run; target >= 0.90): 8192: 0.90")


def test_a_refused_step_runs_triton_with_one_warning(cu, monkeypatch):
    """A shape the op refuses at run time (cuDNN has no engine for it): one warning, that step runs the Triton
    kernel, exact (nothing half-merged); later steps use cuDNN again without another warning."""
    backend = get_step_backend("torch-cudnn", CPU)
    monkeypatch.setattr(backend, "_warned", False)
    dense = torch_cudnn.api(CPU).dense_op

    def picky(q, *args, **kwargs):
        if q.shape[2] > 40:
            raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")
        return dense(q, *args, **kwargs)

    monkeypatch.setattr(backend, "api", torch_cudnn.dataclasses.replace(backend.api, dense_op=picky))
    with pytest.warns(RuntimeWarning, match="torch-cudnn refused a step on cpu .*No execution plans"):
        _check("causal")  # a 70-row square
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fake.CALLS.clear()
        _check("partial")  # 30 rows: cuDNN again, no second warning
        assert fake.CALLS
