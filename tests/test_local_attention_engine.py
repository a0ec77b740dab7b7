"""The engine on layers that see part of the context — chunked attention (Llama 4) beside full and sliding layers —
with attention sinks on every layer (gpt-oss), against the single-rank reference (the same weights, the dense fp32
`ReferenceAttention` over whole sequences) at CP 1, 2, 3 and TP 2: chunks of 16 positions much shorter
than the 130-token prompts, under chunked prefill (48-token steps), a second turn from the prefix cache, prefix
sharing with forced strategies, and the static decode path. One pool of ranks per world size."""
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any pool spawns: the static decode path runs Triton's kernel

from cpinfer import LLM, SamplingParams  # noqa: E402
from cpinfer.launch import WorkerPool  # noqa: E402
from cpinfer.model import ReferenceAttention, load_model  # noqa: E402
from local_attention_family import register, unregister, write_checkpoint  # noqa: E402
from pooled_engine import PooledLLM  # noqa: E402

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
LAYERS = ["chunked_attention", "full_attention", "chunked_attention", "sliding_attention"]
MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, layer_types=LAYERS,
             attention_chunk_size=16, sliding_window=12, attention_sinks=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    register()  # in this process for the module's tests only (rank pools: `engines`)
    yield write_checkpoint(tmp_path_factory.mktemp("local_attention"), seed=3, **MODEL)
    unregister()


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, tp=1, **kw)`: an engine on a pool of cp x tp ranks shared by the module, each rank with the
    test family registered (CP1 x TP1 runs in this process)."""
    pools: dict[int, WorkerPool] = {}

    def get(path, cp, tp=1, **kw):
        kw.setdefault("max_num_batched_tokens", 48)  # prompts of 130 tokens prefill in 3 steps
        kw = dict(context_parallel_size=cp, tensor_parallel_size=tp, max_kv_tokens_per_rank=2048, placement="shard",
                  **kw)
        if cp * tp == 1:
            return LLM(str(path), threads_per_rank=1, **kw)
        if cp * tp not in pools:
            pools[cp * tp] = WorkerPool(cp * tp, threads_per_rank=1, timeout_s=120)
            pools[cp * tp].run(register)
        return PooledLLM(str(path), pools[cp * tp], **kw)

    yield get
    for pool in pools.values():
        pool.close()


_MODELS = {}


def reference(path, prompt, steps):
    """(prompt log-probs [len-1], greedy tokens, their log-probs) of the single-rank model: every step one forward
    over the whole sequence with the dense reference attention (chunks, window and sinks per layer)."""
    if str(path) not in _MODELS:
        _MODELS[str(path)] = load_model(path)
    config, model = _MODELS[str(path)]

    def log_probs(tokens):  # [L, vocab]
        ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
        with torch.inference_mode():
            hidden = model(ids, pos, ReferenceAttention(torch.zeros_like(ids), pos, config=config))
            return model.compute_logits(hidden).log_softmax(-1)

    lp = log_probs(prompt)
    prompt_lp = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
    tokens, out_lp, seq = [], [], list(prompt)
    for _ in range(steps):
        t = int(lp[-1].argmax())
        tokens.append(t)
        out_lp.append(float(lp[-1, t]))
        seq.append(t)
        lp = log_probs(seq)
    return prompt_lp, tokens, out_lp


def check(path, outs, prompts, steps, prompt_lp=True) -> None:
    for o, p in zip(outs, prompts):
        ref_plp, ref_tokens, ref_lp = reference(path, p, steps)
        assert o.token_ids == ref_tokens
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(ref_lp), atol=1e-4, rtol=0)
        if prompt_lp:
            torch.testing.assert_close(torch.tensor(o.prompt_logprobs[1:]), ref_plp, atol=1e-4, rtol=0)


def _prompts(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in lengths]


@pytest.mark.parametrize("cp,tp", [(1, 1), (2, 1), (3, 1), (1, 2)])
def test_chunked_layers_with_sinks_match_the_reference(checkpoint, engines, cp, tp):
    """Prompts of 1, 37 and 130 tokens prefilled in 48-token steps, 10 greedy tokens, then a second turn that reads
    the first from the prefix cache; TP 2 splits the sinks with the query heads."""
    with engines(checkpoint, cp, tp) as llm:
        prompts = _prompts(cp * 10 + tp, [1, 37, 130])
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, prompt_logprobs=True, **GREEDY))
        check(checkpoint, outs, prompts, 10)
        if cp > 1:
            assert outs[2].metrics["steps"][0]["strategy"] == "pass-kv"  # prefill
            assert outs[2].metrics["steps"][-1]["strategy"] == "pass-q"  # decode
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 9 for p in prompts]
        check(checkpoint, outs2, turn2, 8, prompt_lp=False)


def test_prefix_sharing_under_forced_strategies(checkpoint, engines):
    """CP3: requests sharing a 100-token document (six chunks of 16) read it from the cache one after another, under
    pass-KV and pass-Q for every forward (prefill chunks and decode)."""
    rng = np.random.default_rng(7)
    doc = rng.integers(3, 256, 100).tolist()
    questions = [doc + rng.integers(3, 256, n).tolist() for n in (9, 30, 1)]
    for strategy in ("pass-kv", "pass-q"):
        with engines(checkpoint, 3, strategy=strategy, max_num_batched_tokens=40) as llm:
            first = llm.generate([questions[0]], SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))
            check(checkpoint, first, questions[:1], 6)
            rest = llm.generate(questions[1:], SamplingParams(max_tokens=6, **GREEDY))
            assert [o.num_cached_tokens for o in rest] == [100, 100]
            assert all(st["strategy"] == strategy for o in rest for st in o.metrics["steps"])
            check(checkpoint, rest, questions[1:], 6, prompt_lp=False)


@pytest.mark.parametrize("cp", [1, 2])
def test_static_decode_path(checkpoint, engines, cp):
    """The static-shape decode path (Triton's kernel in the interpreter): its per-(window, chunk) tables start at the
    query's chunk, and the sinks join after pass-Q decode's merge."""
    with engines(checkpoint, cp, static_decode=True) as llm:
        prompts = _prompts(cp, [20, 45])
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
        check(checkpoint, outs, prompts, 8, prompt_lp=False)
        served = llm.engine._pool.run(_static_forwards)
        assert min(served) >= 7  # every decode step after the prefill went static


def _static_forwards(ctx):
    return ctx.state["runner"].static.forwards
