"""The FP8 KV cache on the hybrid families: the attention layers' K/V in e4m3 (static scales calibrated on the
attention layers alone, or a scale per token), the recurrent states and conv tails in fp32, tested as
tests/test_kv_fp8.py tests the dense families and with its tolerances: the engine at CP 2-3 equals the model run
alone with each attention layer's K/V rows quantized and dequantized (atol 1e-4), and CP 2 / 3 with FP8 KV equal
CP 1 with FP8 KV (chunked prefill, decode, turn 2 from the state snapshot): the same tokens, log-probs within fp32
noise in the median and within the format's own error. One pool of ranks per world size serves the module."""
import numpy as np
import pytest
import torch

from cpinfer import SamplingParams
from cpinfer.engine.kv import fp8 as kv_fp8
from hf_oracle import prompts_for
from pooled_engine import shard_engines

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
TIGHT = 1e-5  # tests/test_kv_fp8.py's median bound


@pytest.fixture(scope="module")
def engines():
    for get in shard_engines():  # the pools close when the module ends
        yield lambda path, cp, **kw: get(path, cp, **{"max_kv_tokens_per_rank": 32768, "max_num_seqs": 4, **kw})


@pytest.mark.parametrize("variant, kvd, cp", [("qwen3_5", "fp8", 2), ("qwen3_next", "fp8_per_token", 2),
                                              ("kimi_linear", "fp8", 2), ("nemotron_h", "fp8", 3)])
def test_fp8_kv_is_attention_over_dequantized_rows(llama_checkpoint, engines, variant, kvd, cp):
    """The engine's prompt log-probs equal the model run alone (the recurrent layers from a zero state, fp32) with
    each attention layer's K/V rows encoded and decoded by the scales calibrated here (which every rank calibrates
    alike) before a dense reference attention."""
    from cpinfer.model import ReferenceAttention, load_model
    from cpinfer.model.recurrent.reference import ReferenceRecurrence

    path = llama_checkpoint(variant, max_position_embeddings=2048)
    cfg, model = load_model(path)
    kv_of = {layer: i for i, layer in enumerate(cfg.attention_layers)}
    heads = cfg.cached_kv_heads
    assert kv_fp8.checkpoint_kv_scales(path, cfg.num_hidden_layers, heads, layers=cfg.attention_layers) is None
    found = kv_fp8.calibrate_kv_scales(model, cfg, "cpu") if kvd == "fp8" else None
    assert found is None or found[0].shape[0] == cfg.num_kv_layers < cfg.num_hidden_layers
    codecs = kv_fp8.layer_codecs(kvd, found, cfg.num_kv_layers, heads, "cpu")
    prompt = prompts_for(cfg.vocab_size, [90], seed=11)[0]
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    ref = ReferenceAttention(torch.zeros(len(prompt), dtype=torch.long), pos, config=cfg)

    def fake_quant(layer, q, k, v, sinks=None):
        ck, cv = codecs[kv_of[layer]]
        kq = ck.decode(ck.encode(k), k.dtype)
        vq = kq[..., :v.shape[-1]] if cfg.values_in_keys else cv.decode(cv.encode(v), v.dtype)
        return ref(layer, q, kq, vq, sinks=sinks)

    def unquantized(layer, q, k, v, sinks=None):
        return ref(layer, q, k, v, sinks=sinks)

    def logprobs(attn):
        rec = ReferenceRecurrence()
        rec.set_batch([0] * len(prompt))
        with torch.no_grad():
            lp = model.compute_logits(model(ids, pos, attn, rec)).log_softmax(-1)
        return lp[torch.arange(len(prompt) - 1), ids[1:]]

    want = logprobs(fake_quant)
    assert not torch.allclose(want, logprobs(unquantized), atol=1e-4)  # the quantization matters
    with engines(path, cp, kv_cache_dtype=kvd, max_num_batched_tokens=48) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=True, temperature=0.0))[0]
        assert llm.cache_stats()["state_cache"]["bytes_per_slot"] > 0
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), want, rtol=0, atol=1e-4)


def _scenario(llm):
    """Turn 1: prompts of 1, 37 and 130 tokens (chunked prefill of 48-token steps) with prompt log-probs, 8 decoded
    tokens; turn 2 of each continued from the state snapshot at the end of turn 1."""
    prompts = prompts_for(llm.config.vocab_size, [1, 37, 130], seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=True, **GREEDY))
    turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
    outs2 = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
    assert [o.num_cached_tokens for o in outs2] == [len(p) + 7 for p in prompts]
    return outs + outs2


def _same(outs, ref, own_max: float):
    """Tokens equal, log-probs within fp32 noise in the median, and every one within the FP8 cache's own largest
    error against full precision (tests/test_kv_fp8.py's two criteria: at a hybrid's recurrent layers an e4m3
    element rounded the other way at another CP size moves later log-probs a little further than BOUNDARY)."""
    deltas = []
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r.token_ids
        pairs = [(o.logprobs, r.logprobs)]
        if r.prompt_logprobs is not None:
            pairs.append((o.prompt_logprobs[1:], r.prompt_logprobs[1:]))
        for got, want in pairs:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=max(own_max, 1e-3))
            deltas += np.abs(np.subtract(got, want)).tolist()
    assert float(np.median(deltas)) <= TIGHT, f"median |Δ log-prob| {np.median(deltas):.2e} > {TIGHT}"
    return max(deltas)


@pytest.mark.parametrize("variant, kvd, cps", [("qwen3_5", "fp8", [2, 3]), ("kimi_linear", "fp8", [2]),
                                               ("nemotron_h", "fp8_per_token", [2])])
def test_fp8_kv_cp_n_equals_cp_1(llama_checkpoint, engines, variant, kvd, cps):
    """CP N with FP8 KV against CP 1 with FP8 KV; the format's own error is the turn-1 prompt log-probs' largest
    difference between CP 1 with FP8 KV and with the full-precision cache (nonzero: the format does round)."""
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    with engines(path, 1, max_num_batched_tokens=48) as llm:
        full = _scenario(llm)
    with engines(path, 1, kv_cache_dtype=kvd, max_num_batched_tokens=48) as llm:
        ref = _scenario(llm)
    own = max(float(np.abs(np.subtract(a.prompt_logprobs[1:], b.prompt_logprobs[1:])).max(initial=0.0))
              for a, b in zip(ref[:3], full[:3]))
    assert own > 1e-3, own
    for cp in cps:
        with engines(path, cp, kv_cache_dtype=kvd, max_num_batched_tokens=48) as llm:
            worst = _same(_scenario(llm), ref, own)
        print(f"\n{variant} {kvd} CP{cp} vs CP1: max |Δ log-prob| {worst:.2e}; FP8 vs full precision {own:.2e}")
