"""FP8 KV cache (cpinfer/engine/kv/fp8.py) on the engine, in both formats (static scales per layer and KV head;
a scale per token and head): CP 2 and 3 (pass-KV, pass-Q, auto) and TP 2 equal CP 1 with FP8 KV — same
quantization whatever the sharding — under chunked (partial) prefill, prefix reuse and sharing, sliding windows, and
KV tiers (entries written at CP 2 restored at CP 3; never read back by a full-precision engine); a checkpoint's
static k_scale / v_scale are used; the error against the unquantized cache is measured and bounded; capacity and
bytes per token; FP8 checkpoints on CP 2 and TP 2 engines against transformers on their dequantized weights. One
pool of ranks per world size serves the module."""
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cpinfer import LLM, SamplingParams
from cpinfer.engine.kv import fp8 as kv_fp8
from cpinfer.engine.kv.capacity import kv_tokens_from_host_ram
from cpinfer.model.config import ModelConfig
from fp8_checkpoint import write_fp8_pair
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import shard_engines

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
# CP N vs CP 1: the same quantization of K / V that differ by fp32 rounding (the attention merges in another
# order). Nearly always the same bytes, so log-probs within fp32 noise (TIGHT, asserted of the median); but an
# element that lands within that noise of an e4m3 rounding boundary rounds the other way at another CP size (1/16 of
# its value), which moves later log-probs of that sequence by up to ~3e-4 (measured): BOUNDARY bounds every one.
TIGHT, BOUNDARY = 1e-5, dict(rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, tp=1, **kw)`: an engine on a pool of cp x tp ranks shared by the module (CP1 in the
    driver process), 2048 KV tokens per rank unless asked otherwise."""
    for get in shard_engines():  # the pools close when the module ends
        yield lambda path, cp, tp=1, **kw: get(path, cp, tp, **{"max_kv_tokens_per_rank": 2048, **kw})


def test_rows_are_quantized_alone():
    """A row's bytes depend on that row only (so on no sharding); decode inverts encode within e4m3's precision;
    zero rows stay zero; the error is bounded by half an e4m3 step of the row's scale."""
    x = torch.randn(50, 3, 16) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7] = 0.0
    p = kv_fp8.encode(x)  # [50, 3, 20] uint8
    assert p.dtype == torch.uint8 and p.shape == (50, 3, 20)
    assert torch.equal(kv_fp8.encode(x[10:13]), p[10:13]) and torch.equal(kv_fp8.encode(x[:, 1:2]), p[:, 1:2])
    y = kv_fp8.decode(p, torch.float32)
    assert torch.equal(y[7], torch.zeros(3, 16))
    amax = x.abs().amax(-1, keepdim=True)
    assert bool(((y - x).abs() <= amax / 16 + 1e-30).all())  # e4m3: 3 mantissa bits, relative step <= 1/8
    torch.testing.assert_close(kv_fp8.decode(kv_fp8.encode(y), torch.float32), y, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_per_token, got "
                                         "'int8'"):
        kv_fp8.check_kv_cache_dtype("int8")


def test_static_scales_per_layer_and_head():
    """The static format: D bytes a row, each KV head scaled by its own fixed scale, rows independent of each
    other; within half an e4m3 step in the normal range, saturating at 448 x scale."""
    scale = torch.tensor([1.0, 0.25, 4.0])
    codec = kv_fp8.RowCodec(scale)
    x = torch.randn(40, 3, 16) * torch.tensor([1.0, 0.25, 4.0])[:, None]
    x[3, 2, 5] = 5000.0  # beyond 448 x 4: saturates
    p = codec.encode(x)
    assert p.dtype == torch.uint8 and p.shape == (40, 3, 16)
    assert torch.equal(codec.encode(x[5:9]), p[5:9])
    y = codec.decode(p, torch.float32)
    assert y[3, 2, 5] == 448 * 4.0
    normal = x.abs() >= 2 ** -6 * scale[:, None]  # e4m3's normal range, per head
    normal[3, 2, 5] = False
    assert bool(((y - x).abs() <= x.abs() / 16 + 1e-30)[normal].all())
    assert bool(((y - x).abs() <= 2 ** -10 * scale[:, None])[~normal & (x.abs() < 1)].all())  # subnormal steps
    assert kv_fp8.row_bytes(16, 2, "fp8") == 16 and kv_fp8.row_bytes(16, 2, "fp8_per_token") == 20
    assert kv_fp8.check_kv_cache_dtype("fp8_e4m3") == "fp8"
    codecs = kv_fp8.layer_codecs("fp8", None, 2, 3, "cpu")
    assert len(codecs) == 2 and torch.equal(codecs[1][1].scale, torch.ones(3))
    assert kv_fp8.layer_codecs("fp8_per_token", None, 2, 3, "cpu")[0][0].scale is None
    assert kv_fp8.layer_codecs("auto", None, 2, 3, "cpu") is None


def test_calibrated_scales_are_powers_of_two_with_headroom(llama_checkpoint):
    """Without checkpoint scales: per layer and KV head a power of two >= 8 x the calibration input's |K| / |V|
    maximum / 448 and < twice that; the same on a second call (every rank computes the same)."""
    from cpinfer.model import ReferenceAttention, load_model

    cfg, model = load_model(llama_checkpoint("gqa", max_position_embeddings=2048))
    k, v = kv_fp8.calibrate_kv_scales(model, cfg, "cpu")
    assert k.shape == v.shape == (2, 2)
    for s in (k, v):
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    n = kv_fp8.CALIBRATION_TOKENS
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ids[0] = cfg.bos_token_id
    ref = ReferenceAttention(torch.zeros(n, dtype=torch.long), torch.arange(n), config=cfg)
    seen = {}

    def attn(layer, q, kk, vv, sinks=None):
        seen[layer] = (kk.abs().amax(dim=(0, 2)), vv.abs().amax(dim=(0, 2)))
        return ref(layer, q, kk, vv, sinks=sinks)

    with torch.no_grad():
        model(ids, torch.arange(n), attn)
    for layer in (0, 1):
        for s, a in zip((k[layer], v[layer]), seen[layer]):
            need = a * kv_fp8.HEADROOM / kv_fp8.FP8_MAX
            assert bool((s >= need).all()) and bool((s < 2 * need).all())
    k2, v2 = kv_fp8.calibrate_kv_scales(model, cfg, "cpu")
    assert torch.equal(k, k2) and torch.equal(v, v2)


def test_e4m3_table_lookup_equals_torchs_conversion():
    """The CPU decode's table lookup gives torch's e4m3 -> fp32 values for all 256 bytes (NaN codes as NaN), on a
    strided view too (a packed row's value bytes)."""
    b = torch.arange(256, dtype=torch.uint8)
    got, want = kv_fp8.e4m3_to_float(b), b.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    rows = torch.randint(0, 256, (7, 3, 20), dtype=torch.uint8)[..., :16]  # strided, like p[..., :W]
    torch.testing.assert_close(kv_fp8.e4m3_to_float(rows), rows.contiguous().view(torch.float8_e4m3fn).float(),
                               rtol=0, atol=0, equal_nan=True)


def _with_kv_scales(src, dst, k: list, v: list):
    """A copy of checkpoint `src` carrying static KV scales `self_attn.k_scale` / `v_scale` (one per layer, or one
    per KV head)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (f,) = sorted(dst.glob("*.safetensors"))
    tensors = load_file(f)
    for i, (ks, vs) in enumerate(zip(k, v)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs, dtype=torch.float32)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_scales(llama_checkpoint, tmp_path):
    """Scales per layer (broadcast over the KV heads) or per KV head (sliced for a TP rank's heads); a checkpoint
    missing one or with a non-positive one is refused, naming the tensor."""
    src = llama_checkpoint("gqa", max_position_embeddings=2048)  # 2 layers, 2 KV heads
    path = _with_kv_scales(src, tmp_path / "a", [0.5, [0.25, 2.0]], [3.0, [1.0, 0.125]])
    k, v = kv_fp8.checkpoint_kv_scales(path, 2, 2)
    torch.testing.assert_close(k, torch.tensor([[0.5, 0.5], [0.25, 2.0]]))
    torch.testing.assert_close(v, torch.tensor([[3.0, 3.0], [1.0, 0.125]]))
    k, v = kv_fp8.checkpoint_kv_scales(path, 2, 1, slice(1, 2))
    torch.testing.assert_close(k, torch.tensor([[0.5], [2.0]]))
    assert kv_fp8.checkpoint_kv_scales(src, 2, 2) is None
    bad = _with_kv_scales(src, tmp_path / "b", [1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale must be positive"):
        kv_fp8.checkpoint_kv_scales(bad, 2, 2)


def _scenario(llm):
    """Turn 1: prompts of 1, 37 and 130 tokens (chunked prefill of 48-token steps), with prompt log-probs; turn 2:
    each conversation continued from the prefix cache, and two requests sharing the first 100 tokens of one."""
    vocab = llm.config.vocab_size
    prompts = prompts_for(vocab, [1, 37, 130], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=True, **GREEDY))
    turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
    turn2 += [prompts[2][:100] + [9, 10], prompts[2][:100] + [4]]
    outs2 = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.num_cached_tokens for o in outs2][:3] == [len(p) + 7 for p in prompts]
    assert all(o.num_cached_tokens >= 64 for o in outs2[3:])  # the shared prefix, in 64-token blocks
    return outs + outs2


def _same(outs, ref):
    deltas = []
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        pairs = [(o.logprobs, r.logprobs)]
        if r.prompt_logprobs is not None:
            pairs.append((o.prompt_logprobs[1:], r.prompt_logprobs[1:]))
        for got, want in pairs:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **BOUNDARY)
            deltas += np.abs(np.subtract(got, want)).tolist()
    assert float(np.median(deltas)) <= TIGHT, f"median |Δ log-prob| {np.median(deltas):.2e} > {TIGHT}"


_REF: dict = {}


def _reference(engines, path, variant, kvd="fp8"):
    if (variant, kvd) not in _REF:
        with engines(path, 1, kv_cache_dtype=kvd, max_num_batched_tokens=48) as llm:
            _REF[(variant, kvd)] = _scenario(llm)
    return _REF[(variant, kvd)]


_CASES = [(2, "auto"), (2, "pass-kv"), (2, "pass-q"), (3, "auto"), (3, "pass-q")]


@pytest.mark.parametrize("variant, kvd, cp, strategy", [(v, "fp8", cp, st) for v in ("gqa", "mistral")
                                                         for cp, st in _CASES]
                         + [("gqa", "fp8_per_token", 2, "pass-kv"), ("gqa", "fp8_per_token", 3, "pass-q"),
                            ("mistral", "fp8_per_token", 3, "auto")])
def test_fp8_kv_cp_n_within_1e3_of_cp_1_on_tiny_models(llama_checkpoint, engines, variant, kvd, cp, strategy):
    """Every strategy at CP 2 and 3, chunked prefill, prefix reuse and sharing; Mistral slides a 24-token window."""
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    ref = _reference(engines, path, variant, kvd)
    with engines(path, cp, kv_cache_dtype=kvd, strategy=strategy, max_num_batched_tokens=48) as llm:
        _same(_scenario(llm), ref)


@pytest.mark.parametrize("kvd", ["fp8", "fp8_per_token"])
def test_fp8_kv_tp2_equals_cp_1(llama_checkpoint, engines, kvd):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    with engines(path, 1, tp=2, kv_cache_dtype=kvd, max_num_batched_tokens=48) as llm:
        _same(_scenario(llm), _reference(engines, path, "gqa", kvd))


_SCALES = {"gqa": ([0.02, [0.05, 0.01]], [[0.004, 0.03], 0.008]), "deepseek_v3": ([0.05, 0.02, 0.1], [1.0] * 3)}


@pytest.mark.parametrize("variant, kvd, scales, cp, tp, form", [
    ("gqa", "fp8", "checkpoint", 2, 1, None), ("gqa", "fp8", "checkpoint", 1, 2, None),
    ("gqa", "fp8", "calibrated", 2, 1, None), ("gqa", "fp8_per_token", None, 2, 1, None),
    ("deepseek_v3", "fp8", "calibrated", 2, 1, None), ("deepseek_v3", "fp8", "calibrated", 1, 2, None),
    ("deepseek_v3", "fp8", "checkpoint", 3, 1, None), ("deepseek_v3", "fp8", "calibrated", 2, 1, "expanded"),
    ("deepseek_v3", "fp8", "checkpoint", 3, 1, "expanded"), ("deepseek_v3", "fp8", "calibrated", 1, 1, "expanded")])
def test_fp8_kv_is_attention_over_dequantized_rows(llama_checkpoint, engines, tmp_path, variant, kvd, scales, cp, tp,
                                                   form):
    """CP 2-3 (or TP 2) with FP8 KV, prefilled in 48-token chunks, equals the model run alone with each K/V row
    quantized and dequantized (encode / decode; static: by the checkpoint's per-layer / per-head k_scale and v_scale,
    per-head ones sliced by TP, or by the scales calibrated here, which every rank calibrates alike) before a dense
    reference attention: the error against full precision is the format's, nothing else. MLA (deepseek_v3): the
    latent row [c ; k_r] in e4m3, c by one scale per layer and k_r by another (a checkpoint's k_scale scales both),
    the values its first channels; in MLA's expanded form too (the dequantized latent up-projected)."""
    from cpinfer.model import ReferenceAttention, load_model

    path = llama_checkpoint(variant, max_position_embeddings=2048)
    if scales == "checkpoint":
        path = _with_kv_scales(path, tmp_path / "scaled", *_SCALES[variant])
    cfg, model = load_model(path)
    layers, heads = cfg.num_hidden_layers, cfg.cached_kv_heads
    found = kv_fp8.checkpoint_kv_scales(path, layers, heads)
    assert (found is None) == (scales != "checkpoint")
    if scales == "calibrated":
        found = kv_fp8.calibrate_kv_scales(model, cfg, "cpu")
    elif found is not None and cfg.values_in_keys:
        found = kv_fp8.mla_scales(found[0][:, 0], found[0][:, 0], cfg.kv_value_width,
                                  cfg.kv_key_width - cfg.kv_value_width)
    codecs = kv_fp8.layer_codecs(kvd, found, layers, heads, "cpu")
    prompt = prompts_for(cfg.vocab_size, [90], seed=11)[0]
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    ref = ReferenceAttention(torch.zeros(len(prompt), dtype=torch.long), pos, config=cfg)

    def fake_quant(layer, q, k, v, sinks=None):
        ck, cv = codecs[layer]
        kq = ck.decode(ck.encode(k), k.dtype)
        vq = kq[..., :v.shape[-1]] if cfg.values_in_keys else cv.decode(cv.encode(v), v.dtype)
        return ref(layer, q, kq, vq, sinks=sinks)

    def unquantized(layer, q, k, v, sinks=None):
        return ref(layer, q, k, v, sinks=sinks)

    with torch.no_grad():
        lp = model.compute_logits(model(ids, pos, fake_quant)).log_softmax(-1)
        full = model.compute_logits(model(ids, pos, unquantized)).log_softmax(-1)
    want = lp[torch.arange(len(prompt) - 1), ids[1:]]
    assert not torch.allclose(want, full[torch.arange(len(prompt) - 1), ids[1:]], atol=1e-4)  # the scales matter
    extra = {} if form is None else {"mla_form": form}
    with engines(path, cp, tp=tp, kv_cache_dtype=kvd, max_num_batched_tokens=48, **extra) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True, temperature=0.0))[0]
    if form is not None:
        assert {s["mla"]["form"] for s in out.metrics["steps"]} == {form}
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, rtol=0, atol=1e-4)


def test_fp8_kv_error_against_the_unquantized_cache(llama_checkpoint, engines):
    """Measured, not exact: turn 1's prompt log-probs (teacher-forced, so comparable position by position) and
    first tokens with a full-precision cache. (A random tiny model's near-flat distributions make later greedy
    tokens diverge once one differs; the embedded model's figures are in docs/quantization.md.)"""
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    with engines(path, 2, max_num_batched_tokens=48) as llm:
        full = _scenario(llm)
    for kvd in ("fp8", "fp8_per_token"):
        fp8 = _reference(engines, path, "gqa", kvd)
        deltas = [np.abs(np.subtract(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) for a, b in zip(fp8[:3], full[:3])]
        worst = max(float(d.max()) for d in deltas if len(d))
        first = np.mean([a.token_ids[0] == b.token_ids[0] for a, b in zip(fp8, full)])
        print(f"\n{kvd} KV vs fp32 KV (tiny gqa, CP2): max |Δ prompt log-prob| {worst:.2e}, first tokens agree "
              f"{first:.2f}")
        assert 0 < worst < 0.5


def _forced(engines, path, cp, kvd, prompts, **kw) -> list[np.ndarray]:
    from cpinfer.bench.kv_fp8 import prompt_logprobs

    longest = max(len(p) for p in prompts)
    with engines(path, cp, kv_cache_dtype=kvd, max_kv_tokens_per_rank=longest // cp + 256, **kw) as llm:
        return prompt_logprobs(llm, prompts)


def _within_own_error(engines, path, prompts: list, cps: list[int], kvds: list[str], **kw) -> dict:
    """Prompt log-probs with the full-precision cache at CP 1 and each FP8 format at CP 1 and each of `cps`; per
    prompt, format and CP size, CP N against CP 1 must stay within the format's own error against full precision
    (mean and 99th percentile of |Δ log-prob|), which must be nonzero. Not the max: under either comparison a single
    token swings where one K/V value sits on an FP8 rounding boundary and a float32 rounding moves it across (CP N's
    merge order, or any kernel's summation order), so the largest of ~1,000 is chance. Returns the summaries."""
    from cpinfer.bench.kv_fp8 import _stats

    full = _forced(engines, path, 1, "auto", prompts, **kw)
    found = {}
    for kvd in kvds:
        one = _forced(engines, path, 1, kvd, prompts, **kw)
        for cp in cps:
            for i, (f, a, b) in enumerate(zip(full, one, _forced(engines, path, cp, kvd, prompts, **kw))):
                own, across = _stats(a, f), _stats(b, a)
                own["p99"], across["p99"] = (float(np.quantile(np.abs(x - y), 0.99)) for x, y in ((a, f), (b, a)))
                found[(i, kvd, cp)] = (own, across)
                print(f"\nprompt {i} ({len(f) + 1} tokens) {kvd}: vs full {own}, CP {cp} vs CP 1 {across}")
                assert own["max"] > 1e-3, own  # the format does round
                assert across["mean"] <= own["mean"] and across["p99"] <= own["p99"], (kvd, cp, own, across)
    return found


@pytest.mark.parametrize("variant, kvds, cps", [("gqa", ["fp8", "fp8_per_token"], [2, 3]),
                                                 ("deepseek_v3", ["fp8"], [2, 3])])
def test_fp8_kv_cp_n_within_its_own_error_on_long_prompts(llama_checkpoint, engines, variant, kvds, cps):
    """Long random prompts (1,200 and 1,900 tokens) on the tiny dense and MLA models: CP 2 and CP 3 with an FP8 cache
    agree with CP 1 within that cache's own error against full precision — what holds in general, since rounding
    to e4m3 turns the fp32 noise of another CP size into whole e4m3 steps that cascade through the layers."""
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    prompts = prompts_for(ModelConfig.from_pretrained(path).vocab_size, [1200, 1900], seed=21)
    _within_own_error(engines, path, prompts, cps, kvds, max_num_batched_tokens=512)


def test_fp8_kv_cp_n_within_its_own_error_on_the_embedded_model(engines):
    """The embedded SmolLM2-135M (30 layers, where e4m3 steps cascade furthest): a 1,200-token seeded random
    prompt and a 929-token document of prose and code (tests/data/fp8_document.txt: the demo's document as this
    project's README gave it on 2026-11-29, kept fixed — the test's input must not move with every edit of the
    README), CP 2 against CP 1 with each FP8 format, within the format's own error against the fp32 cache
    (docs/quantization.md has the measured means and maxima)."""
    from transformers import AutoTokenizer

    from cpinfer.model.resolve import resolve_model

    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(path))
    text = (Path(__file__).parent / "data" / "fp8_document.txt").read_text()
    doc = tok(text, add_special_tokens=False)["input_ids"]
    rnd = np.random.default_rng(0).integers(3, tok.vocab_size, 1200).tolist()
    _within_own_error(engines, path, [rnd, doc], [2], ["fp8", "fp8_per_token"], max_num_batched_tokens=2048)


def _chats(llm, turn2_only=False):
    """Three 140-150-token chats one at a time, then each one's turn 2, newest first (on a small device cache the
    older histories come back from the host pool or the disk)."""
    docs = [[3 + i] + p for i, p in enumerate(prompts_for(llm.config.vocab_size, [150, 140, 150], seed=7))]
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = [llm.generate([d], params)[0] for d in docs] if not turn2_only else _CHATS[:3]
    turn2 = [d + o.token_ids + [5, 6, 7] for d, o in zip(docs, first)]
    return first + [llm.generate([turn2[i]], params)[0] for i in (2, 1, 0)]


_CHATS: list = []


def test_fp8_kv_tiers_restore_across_cp_sizes(llama_checkpoint, engines, tmp_path):
    """At CP 2 on a device cache of about one chat per rank, with a host pool and a disk: histories evicted and
    restored give CP 1's answers; entries written at CP 2 restore at CP 3 after a restart; an engine with a
    full-precision cache on the same directory reuses none of them (the layout names the KV dtype)."""
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    with engines(path, 1, kv_cache_dtype="fp8", max_num_batched_tokens=96) as llm:
        _CHATS[:] = _chats(llm)
    kv_dir = tmp_path / "kv"
    token_bytes = 2 * 2 * 2 * 8  # K and V, 2 layers, 2 KV heads, rows of 8 e4m3 bytes (static scales)
    tiers = dict(kv_cache_dtype="fp8", max_num_batched_tokens=96, kv_disk_dir=kv_dir)
    with engines(path, 2, max_kv_tokens_per_rank=192, kv_host_gib=64 * token_bytes / (1 << 30), **tiers) as llm:
        _same(_chats(llm), _CHATS)
        t = llm.cache_stats()["tiers"]
        assert t["host"]["hit_tokens"] + t["disk"]["hit_tokens"] > 0, t
    with engines(path, 3, **tiers) as llm:  # a restart at CP 3: the histories come from disk
        outs = _chats(llm, turn2_only=True)
        _same(outs, _CHATS)
        assert all(o.num_cached_tokens > 140 for o in outs[3:])
    for kvd in ("auto", "fp8_per_token"):  # fp32 KV or the other FP8 format: nothing matches
        with engines(path, 1, max_num_batched_tokens=96, kv_disk_dir=kv_dir, kv_cache_dtype=kvd) as llm:
            doc = [3] + prompts_for(llm.config.vocab_size, [150, 140, 150], seed=7)[0]  # chat 0, stored at CP 2, 3
            assert llm.generate([doc], SamplingParams(max_tokens=2, **GREEDY))[0].num_cached_tokens == 0


def test_capacity_and_bytes_per_token(llama_checkpoint):
    """cache_stats: bytes per token — fp32 4D, bf16 2D, fp8 D (static scales), fp8_per_token D + 4 — and the tokens
    per rank the same host-RAM share holds: fp8 exactly twice bf16's and four times fp32's."""
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fraction = 512 * 256 / total  # about 512 fp32 tokens (256 bytes each) on one rank
    stats = {}
    for name, dtype, kvd in (("fp32", "float32", "auto"), ("bf16", "bfloat16", "auto"), ("fp8", "float32", "fp8"),
                             ("fp8_per_token", "float32", "fp8_per_token")):
        with LLM(str(path), dtype=dtype, kv_cache_dtype=kvd, kv_memory_fraction=fraction, threads_per_rank=1) as llm:
            stats[name] = llm.cache_stats()
    per_token = {k: v["kv_bytes_per_token"] for k, v in stats.items()}
    assert per_token == {"fp32": 2 * 2 * 2 * 8 * 4, "bf16": 2 * 2 * 2 * 8 * 2, "fp8": 2 * 2 * 2 * 8,
                         "fp8_per_token": 2 * 2 * 2 * (8 + 4)}
    assert stats["fp8"]["kv_cache_dtype"] == "fp8" and stats["fp32"]["kv_cache_dtype"] == "auto"
    for k, v in stats.items():
        want = kv_tokens_from_host_ram(fraction, 1, per_token[k], 64, 2048)
        assert v["kv_capacity_per_rank"] == want
    cap = {k: v["kv_capacity_per_rank"] for k, v in stats.items()}
    assert cap["fp8"] == 2 * cap["bf16"] == 4 * cap["fp32"]
    assert cap["fp8_per_token"] >= 2.5 * cap["fp32"]
    for kvd in ("fp8", "fp8_per_token"):
        with pytest.raises(ValueError, match=f"static_decode=True and kv_cache_dtype='{kvd}'"):
            LLM(str(path), kv_cache_dtype=kvd, static_decode=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(str(path), kv_cache_dtype="fp16")
    mla = llama_checkpoint("deepseek_v3", max_position_embeddings=2048)  # 3 layers, latent 16 + rotary 8
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_per_token' is not supported for deepseek_v3"):
        LLM(str(mla), kv_cache_dtype="fp8_per_token")
    mla_stats = {}
    for kvd in ("auto", "fp8_e4m3"):
        with LLM(str(mla), kv_cache_dtype=kvd, kv_memory_fraction=fraction, threads_per_rank=1) as llm:
            mla_stats[kvd] = llm.cache_stats()
    assert mla_stats["auto"]["kv_bytes_per_token"] == 3 * 24 * 4 and mla_stats["fp8_e4m3"]["kv_bytes_per_token"] == 3 * 24
    assert mla_stats["fp8_e4m3"]["kv_capacity_per_rank"] == 4 * mla_stats["auto"]["kv_capacity_per_rank"]


@pytest.mark.parametrize("variant, fmt, cp, tp", [("gqa", "fbgemm_fp8", 2, 1), ("qwen3_moe", "fp8_block", 1, 2),
                                                   ("deepseek_v3", "fp8_block", 1, 2),
                                                   ("qwen3_moe", "ct_channel_dynamic", 2, 1)])
def test_fp8_checkpoint_on_the_engine_matches_transformers(llama_checkpoint, engines, tmp_path, variant, fmt, cp, tp):
    """FP8 checkpoints through the ranks' loader (TP 2 slices the dequantized tensors and experts) against
    transformers on the dequantized weights, greedy and prompt log-probs within 1e-4."""
    src = llama_checkpoint(variant, max_position_embeddings=2048)
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "deq", fmt)
    with engines(tmp_path / "fp8", cp, tp, max_num_batched_tokens=48) as llm:
        prompts = prompts_for(llm.config.vocab_size, [5, 70], seed=3)
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))
    check_against_hf(tmp_path / "deq", outs, prompts, 6)


def test_plan_models_fp8_kv_memory_and_ring_bytes():
    """`cpinfer plan --kv-cache-dtype fp8`: KV memory and each pass-KV message are half of bf16's; fp8_per_token's
    (D + 4) / 2D of them."""
    from cpinfer.perf import planner
    from cpinfer.perf.simulator import memory_per_gpu

    kinds = ("bf16", "fp8", "fp8_e4m3", "fp8_per_token")
    deps = {k: planner.build_deployment("llama3-405b", "h100-gtt", 4, 8, "fp8-ffn", "bf16", k) for k in kinds}
    mem = {k: memory_per_gpu(d, 128000).kv_gb for k, d in deps.items()}
    msg = {k: d.attn_shape.kv_bytes(1000) for k, d in deps.items()}
    for got in (mem, msg):
        assert got["fp8"] == pytest.approx(0.5 * got["bf16"]) and got["fp8_e4m3"] == got["fp8"]
        assert got["fp8_per_token"] == pytest.approx((128 + 4) / (2 * 128) * got["bf16"])


def test_cli_flag_reaches_the_engine():
    import argparse

    from cpinfer.device import add_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(p.parse_args([]))["kv_cache_dtype"] == "auto"
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8_per_token"]))["kv_cache_dtype"] == "fp8_per_token"
