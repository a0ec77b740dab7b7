"""The hybrid families on the engine against transformers at CP 1, 2 and 3: a 310-token prompt prefilled in
chunks of 128 (several of the recurrence's 64-token chunks per shard), prompt log-probs within 1e-4, greedy decode
(tokens round-robin over the ranks: each recurrent layer's shard summaries and conv halos exchanged, every rank
advancing its replica of every state), then turn 2 of each conversation continuing from the state snapshot left at
the end of turn 1 (no token of turn 1 recomputed). Features that do not carry recurrent states yet are refused
before any rank starts. One pool of ranks per CP size serves the module."""
import pytest

from cpinfer import LLM, SamplingParams
from cpinfer.launch import WorkerPool
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import PooledLLM

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h"]


@pytest.fixture(scope="module")
def engines():
    pools: dict[int, WorkerPool] = {}

    def get(path, cp, **kw):
        # (KDA's states are large next to these tiny models' attention rows: the state cache takes 8 x 2 + 64 of them
        # out of the KV budget)
        kw = dict(dict(context_parallel_size=cp, max_kv_tokens_per_rank=8192, max_num_seqs=8), **kw)
        if cp == 1:
            return LLM(str(path), threads_per_rank=1, **kw)
        if cp not in pools:
            pools[cp] = WorkerPool(cp, threads_per_rank=1, timeout_s=120)
        return PooledLLM(str(path), pools[cp], **kw)

    yield get
    for pool in pools.values():
        pool.close()


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("variant", HYBRIDS)
def test_hybrid_matches_hf_chunked_decode_and_second_turn(llama_checkpoint, engines, variant, cp):
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    with engines(path, cp, max_num_batched_tokens=128) as llm:
        prompts = prompts_for(llm.config.vocab_size, [1, 37, 310], seed=cp)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=True, **GREEDY))
        check_against_hf(path, outs, prompts, 8)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=6, **GREEDY))
        # turn 1 less its last token (never fed back) came from the snapshot: none of it recomputed
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 7 for p in prompts]
        check_against_hf(path, outs2, turn2, 6, check_prompt_lp=False)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_shared_document_without_a_snapshot_is_recomputed(llama_checkpoint, engines, cp):
    """The K/V of a document another request read are in the tree, but no state describes the document alone (the
    only snapshot is at the end of that request): the next request matches nothing, and stays exact."""
    path = llama_checkpoint("qwen3_5", max_position_embeddings=2048)
    doc = prompts_for(256, [120], seed=7)[0]
    with engines(path, cp, max_num_batched_tokens=64) as llm:
        first = llm.generate([doc + [5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
        second = llm.generate([doc + [8, 9]], SamplingParams(max_tokens=4, **GREEDY))
        assert second[0].num_cached_tokens == 0
        check_against_hf(path, first + second, [doc + [5, 6, 7], doc + [8, 9]], 4, check_prompt_lp=False)
        # the same prompt again: its only snapshot lies past the prompt (after 3 decoded tokens): nothing usable
        again = llm.generate([doc + [8, 9]], SamplingParams(max_tokens=4, **GREEDY))
        assert again[0].num_cached_tokens == 0 and again[0].token_ids == second[0].token_ids
        # its continuation reaches that snapshot: prompt + 3 decoded tokens come from the cache
        follow = doc + [8, 9] + second[0].token_ids + [4]
        out = llm.generate([follow], SamplingParams(max_tokens=3, **GREEDY))
        assert out[0].num_cached_tokens == len(doc) + 2 + 3
        check_against_hf(path, out, [follow], 3, check_prompt_lp=False)


@pytest.mark.parametrize("kw, feature", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
])
def test_unsupported_features_are_refused_before_ranks_start(llama_checkpoint, kw, feature):
    path = llama_checkpoint("qwen3_5")
    with pytest.raises(ValueError, match=f"hybrid .*{feature}"):
        LLM(str(path), max_kv_tokens_per_rank=2048, **kw)


@pytest.mark.parametrize("cp", [1, 3])
def test_snapshot_interval_lets_a_shared_document_hit(llama_checkpoint, engines, cp):
    """With a snapshot every 32 tokens, prefill chunks of 40 leave snapshots at 40, 80 and 120: a second request on
    the same 120-token document continues from the one at its end, a third (sharing 100 tokens) from 80."""
    path = llama_checkpoint("qwen3_next", max_position_embeddings=2048)
    doc = prompts_for(256, [120], seed=11)[0]
    with engines(path, cp, max_num_batched_tokens=40, state_snapshot_interval=32) as llm:
        prompts = [doc + [5, 6, 7], doc + [8, 9], doc[:100] + [10, 11, 12]]
        outs = [llm.generate([p], SamplingParams(max_tokens=4, **GREEDY))[0] for p in prompts]
        assert [o.num_cached_tokens for o in outs] == [0, 120, 80]
        check_against_hf(path, outs, prompts, 4, check_prompt_lp=False)
        stats = llm.cache_stats()["state_cache"]
        assert stats["snapshots"] >= 4 and stats["in_use"] == stats["snapshots"]  # nothing running: no live slot
        assert stats["bytes_per_rank"] == stats["slots"] * stats["bytes_per_slot"] > 0


@pytest.mark.parametrize("cp, cap", [(1, 792), (2, 600)])
def test_preemption_recomputes_and_stays_exact(llama_checkpoint, engines, cp, cap):
    """Two requests that overflow the cache together (the state cache's 408 tokens' worth of bytes come out of
    max_kv_tokens_per_rank; a token's K/V counts the 2 attention layers only): preempted requests free their live
    state and recompute from the start."""
    path = llama_checkpoint("qwen3_5", max_position_embeddings=2048)
    with engines(path, cp, max_kv_tokens_per_rank=cap, max_num_seqs=2, max_num_batched_tokens=64) as llm:
        eng = llm.engine
        stats = llm.cache_stats()
        assert stats["kv_capacity_per_rank"] == (384 if cp == 1 else 192)
        assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # attention layers x (K, V) x KV heads x head_dim
        assert stats["state_cache"]["bytes_per_rank"] == 408 * stats["kv_bytes_per_token"]
        prompts = prompts_for(256, [150, 150], seed=1)
        before = eng.stats().preemptions
        outs = llm.generate(prompts, SamplingParams(max_tokens=90, **GREEDY))
        assert eng.stats().preemptions > before
        check_against_hf(path, outs, prompts, 90, check_prompt_lp=False)
        eng.kv.check_invariants()
        assert eng.kv.states.in_use == eng.kv.state_snapshots  # every live slot went back
