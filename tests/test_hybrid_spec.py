"""Speculative decoding on the hybrid families (Gated DeltaNet, KDA, Mamba-2 layers beside attention): a verify run
keeps each recurrent layer's state and conv tail after each of its tokens on every rank, and a rejected draft rolls
the live state back to the last accepted token at the next forward. Greedy tokens and log-probs with speculation
(drafts right up to a chosen token, so that every rollback length happens; prompt lookup; a dense draft model)
equal those without, and transformers', at CP 1 and 2, verify rows on the decode path and as a partial prefill;
every case asserts that drafts were both accepted and rejected. One pool of
ranks per CP size serves the module."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpinfer import LLM, SamplingParams
from cpinfer.engine.spec_decode.proposer import Proposer
from cpinfer.launch import WorkerPool
from hf_oracle import check_against_hf
from pooled_engine import PooledLLM

pytest.importorskip("transformers")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
STEPS = 24


@pytest.fixture(scope="module")
def engines():
    pools: dict[int, WorkerPool] = {}

    def get(path, cp, **kw):
        kw = dict(dict(context_parallel_size=cp, max_kv_tokens_per_rank=4096, max_num_seqs=4), **kw)
        if cp == 1:
            return LLM(str(path), threads_per_rank=1, **kw)
        if cp not in pools:
            pools[cp] = WorkerPool(cp, threads_per_rank=1, timeout_s=120)
        return PooledLLM(str(path), pools[cp], **kw)

    yield get
    for pool in pools.values():
        pool.close()


def _prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    """Prompts that repeat a passage (prompt lookup finds matches) and one that does not."""
    rng = np.random.default_rng(seed)
    a = rng.integers(3, vocab, size=29).tolist()
    b = rng.integers(3, vocab, size=17).tolist()
    return [a * 3 + a[:5], b + a + b + a[:7], rng.integers(3, vocab, size=40).tolist()]


def _params() -> SamplingParams:
    # a seed fixes each request's k (docs/engine.md, "Adaptive k"): the same verify steps on every run
    return SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=True, top_logprobs=2, ignore_eos=True, seed=0)


def _run(llm, prompts):
    with llm:
        outs = llm.generate(prompts, _params(), use_tqdm=False)
        eng = llm.engine
        eng.kv.check_invariants()
        assert eng.kv.states.in_use == eng.kv.state_snapshots  # every live slot went back
        return outs, eng.stats()


def _same(ref, got) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert list(ta) == list(tb)


def _partly_rejected(stats) -> None:
    spec = stats.spec
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec


class OracleProposer(Proposer):
    """Drafts from the known greedy continuation (`ref`: prompt tuple -> tokens), its first j tokens right and the
    rest wrong, j cycling 0 .. k over the proposals: every rollback length happens, and full acceptance too."""

    def __init__(self, config, engine, ref: dict, vocab: int):
        super().__init__(config, engine)
        self.ref, self.vocab, self.count = ref, vocab, 0

    def propose(self, reqs, ks):
        out = []
        for req, k in zip(reqs, ks):
            cont = self.ref[tuple(req.prompt)][len(req.out):len(req.out) + k]
            draft = np.asarray(cont, dtype=np.int64)
            j = self.count % (k + 1)
            self.count += 1
            draft[j:] = (draft[j:] + 1) % self.vocab
            out.append(draft)
        return out


def _with_oracle(llm, ref: dict):
    eng = llm.engine
    eng.proposer = OracleProposer(eng.args.speculative_config, eng, ref, eng.config.vocab_size)
    eng.scheduler.on_release = eng.proposer.release
    return llm


_PLAIN: dict = {}


def _plain(engines, path, key, prompts):
    """The CP1 run without speculation, checked against transformers once."""
    if key not in _PLAIN:
        _PLAIN[key] = _run(engines(path, 1), prompts)[0]
        check_against_hf(path, _PLAIN[key], prompts, STEPS, check_prompt_lp=False)
    return _PLAIN[key]


@pytest.mark.parametrize("cp, verify", [(1, "decode"), (2, "decode"), (2, "prefill")])
@pytest.mark.parametrize("variant", ["qwen3_5", "kimi_linear", "nemotron_h"])
def test_rejected_drafts_roll_the_state_back(llama_checkpoint, engines, variant, cp, verify):
    """Drafts of up to 4 (the adaptive k) with 0 .. k of them right, in turn: the states after each number of dropped
    tokens are picked."""
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    prompts = _prompts(3)
    ref = _plain(engines, path, variant, prompts)
    llm = _with_oracle(engines(path, cp, speculative_config=NGRAM, spec_verify=verify,
                               placement="shard" if cp > 1 else "auto"),
                       {tuple(p): o.token_ids for p, o in zip(prompts, ref)})
    outs, stats = _run(llm, prompts)
    _same(ref, outs)
    _partly_rejected(stats)
    assert all(stats.spec["accepted_per_pos"][:2]), stats.spec  # runs of 1 and 2 drafts were accepted too
    check_against_hf(path, outs, prompts, STEPS, check_prompt_lp=False)


@pytest.mark.parametrize("cp", [1, 2])
def test_prompt_lookup_on_a_hybrid(llama_checkpoint, engines, cp):
    """Prompt lookup itself, on a 16-token vocabulary (where its drafts are sometimes right)."""
    path = llama_checkpoint("nemotron_h", max_position_embeddings=2048, vocab_size=16)
    prompts = _prompts(3, vocab=16)
    ref = _plain(engines, path, "nemotron_h/16", prompts)
    outs, stats = _run(engines(path, cp, speculative_config=NGRAM, placement="shard" if cp > 1 else "auto"),
                       prompts)
    _same(ref, outs)
    _partly_rejected(stats)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_dense_draft_model_drafts_for_a_hybrid(llama_checkpoint, engines, cp):
    """A one-layer dense model with the target's (16-token) vocabulary drafts; its K/V mirror the attention layers'
    slots."""
    path = llama_checkpoint("qwen3_5", max_position_embeddings=2048, vocab_size=16)
    draft = llama_checkpoint("mqa", seed=7, num_hidden_layers=1, max_position_embeddings=2048, vocab_size=16)
    prompts = _prompts(3, vocab=16)
    ref = _plain(engines, path, "qwen3_5/16", prompts)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    outs, stats = _run(engines(path, cp, speculative_config=spec, placement="shard" if cp > 1 else "auto"), prompts)
    _same(ref, outs)
    _partly_rejected(stats)


def test_a_hybrid_draft_model_is_refused(llama_checkpoint):
    path = llama_checkpoint("gqa", max_position_embeddings=2048)
    draft = llama_checkpoint("qwen3_5", max_position_embeddings=2048)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="hybrid .*draft model"):
        LLM(str(path), max_kv_tokens_per_rank=2048, speculative_config=spec)
