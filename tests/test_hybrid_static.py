"""The static decode path (`static_decode=True`; captured as CUDA graphs on a GPU, run eagerly here with its
attention in Triton's interpreter) on the hybrid families: every decode row's recurrent state and conv tail updated
in place in the state store (`engine/static_recurrent.py`), every rank advancing every replica. Token for token the
dynamic path's output, log-probs within fp32 rounding, at CP 1 and 2 (ring rows; local rows with an idle rank), and
a second turn continues from the state the static path left."""
import os

import numpy as np
import pytest
import torch

from cpinfer import SamplingParams

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the pool spawns: the static path's attention is Triton's
pytest.importorskip("triton", reason="the static decode path's attention is the Triton kernel")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pool():
    from cpinfer.launch import WorkerPool

    with WorkerPool(2, threads_per_rank=1, timeout_s=120) as p:
        yield p


def _static_forwards(ctx):
    return ctx.state["runner"].static.forwards


def _decode(path, cp, pool, static: bool, placement: str):
    """Three requests (two share a 40-token prefix; different lengths and stop points, so the decode batch shrinks
    from 3 to 1 and buckets change), greedy with log-probs; the static forwards each rank served."""
    from cpinfer import LLM
    from pooled_engine import PooledLLM

    kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=8192, max_num_seqs=4, static_decode=static,
              placement=placement)
    llm = LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)
    with llm:
        rng = np.random.default_rng(cp)
        doc = rng.integers(3, 256, 40).tolist()
        prompts = [doc + rng.integers(3, 256, 3).tolist(), doc + rng.integers(3, 256, 21).tolist(),
                   rng.integers(3, 256, 30).tolist()]
        params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True) for n in (9, 5, 7)]
        outs = llm.generate(prompts, params)
        turn2 = [prompts[0] + outs[0].token_ids + [7, 8]]  # continues from the state the static path left
        outs += llm.generate(turn2, SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True))
        assert outs[-1].num_cached_tokens == len(prompts[0]) + 8
        served = llm.engine._pool.run(_static_forwards) if static else [0]
    return outs, served


@pytest.mark.parametrize("cp, placement", [(1, "auto"), (2, "shard"), (2, "local")])
@pytest.mark.parametrize("variant", ["qwen3_next", "kimi_linear", "nemotron_h"])
def test_static_decode_equals_the_dynamic_path(llama_checkpoint, pool, variant, cp, placement):
    """The static path (run eagerly on CPU; captured as CUDA graphs on a GPU) updates every state slot in place:
    token for token the dynamic path's output, log-probs within fp32 rounding (tests/test_decode_graph.py's bound).
    "shard": ring rows on every rank; "local": each request on one rank, a rank with none left replicates only."""
    path = llama_checkpoint(variant, max_position_embeddings=512)
    dynamic, _ = _decode(path, cp, pool, False, placement)
    static, served = _decode(path, cp, pool, True, placement)
    assert min(served) >= 1 and max(served) >= 8  # decode steps went through the static path
    for a, b in zip(dynamic, static, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)


@pytest.mark.parametrize("cp", [1, 2])
def test_static_decode_beside_speculation(llama_checkpoint, pool, cp):
    """One request speculates (drafts right up to a chosen token: its verify forwards run on the dynamic path, which
    keeps its per-token states), the others decode on the static path once it is done; the rolled-back state it
    leaves at its end serves its second turn. The same tokens as without speculation on the dynamic path."""
    from cpinfer import LLM
    from pooled_engine import PooledLLM
    from test_hybrid_spec import OracleProposer

    class OnlyOne(OracleProposer):  # only the second request (of turn 1) speculates
        def propose(self, reqs, ks):
            drafts = super().propose(reqs, ks)
            return [d if tuple(r.prompt) == tuple(prompts[1]) else d[:0] for r, d in zip(reqs, drafts)]

    path = llama_checkpoint("qwen3_5", max_position_embeddings=512)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (30, 21, 12)]
    greedy = dict(temperature=0.0, logprobs=True, ignore_eos=True)
    params = [SamplingParams(max_tokens=n, **greedy) for n in (4, 12, 6)]

    def run(static, spec, ref=None):
        kw = dict(context_parallel_size=cp, max_kv_tokens_per_rank=8192, max_num_seqs=4, static_decode=static,
                  placement="shard" if cp > 1 else "auto")
        if spec:
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
        llm = LLM(str(path), threads_per_rank=1, **kw) if cp == 1 else PooledLLM(str(path), pool, **kw)
        with llm:
            eng = llm.engine
            if spec:
                eng.proposer = OnlyOne(eng.args.speculative_config, eng, ref, eng.config.vocab_size)
            outs = llm.generate(prompts, params)
            turn2 = prompts[1] + outs[1].token_ids + [9, 10]
            outs += llm.generate([turn2], SamplingParams(max_tokens=5, **greedy))
            assert outs[-1].num_cached_tokens == len(prompts[1]) + 11
            stats = eng.stats().spec
            served = eng._pool.run(_static_forwards) if static else [0]
        return outs, stats, served

    plain, _, _ = run(False, False)
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    ref[tuple(prompts[1] + plain[1].token_ids + [9, 10])] = plain[3].token_ids  # (asked, not drafted)
    outs, stats, served = run(True, True, ref)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert max(served) >= 1
    for a, b in zip(plain, outs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
