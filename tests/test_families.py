"""Every model family end to end on the engine against Hugging Face transformers at CP 1, 2, 3 and TP 2: prompt
log-probs within 1e-4 (fp32), greedy tokens identical, a second turn reusing the first from the prefix cache;
sliding windows (16-24 tokens) much shorter than the prompts, under chunked prefill, prefix sharing and pass-Q
decode. One pool of ranks per world size serves every checkpoint (spawning ranks is what costs)."""
import numpy as np
import pytest

from cpinfer import LLM, SamplingParams
from cpinfer.launch import WorkerPool
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import PooledLLM

pytest.importorskip("transformers")

# family -> tiny variant (tests/checkpoints.py): windows on Mistral (every layer), Qwen2 (layer 1), Gemma 3
# (local layers 0 and 2); Qwen3 with q/k norm, biases, head_dim 16 != 64 / 8 and YaRN. SmolLM3: layer 1 NoPE
# and sliding; the mixtures of experts: 4 experts of 32, top 2 — Qwen3-MoE with a dense layer between two sparse
# ones (mlp_only_layers), Qwen2-MoE with its gated shared expert and a window on layer 0, Mixtral windowed;
# gpt-oss with sinks, window 16 on layer 0, YaRN and a SwiGLU clamp the activations reach; Llama 4 with chunks of
# 16 on layers 0 and 2, NoPE layers 1 and 3 (temperature tuned, floor_scale 8) whose MLPs are sparse. DeepSeek-V3
# / V2: multi-head latent attention (the cache and the ring carry the 16 + 8 latent), with / without low-rank
# queries, YaRN's softmax mscale (V3), group-limited routing over 8 experts in 4 groups with a correction bias (V3)
# or softmax group_limited_greedy (V2), shared experts, layer 0 dense; TP 2 splits the heads, the latent replicated.
# MiniMax-M2: q/k norms over all heads, RoPE on 8 of 16 channels, sigmoid routing with the block's correction bias
# (TP refused: its norm spans every head). Gemma 4: window 16 on layers 0, 2, 4; global heads twice as wide with
# keys as values (the cache padded to them); layers 4-5 reuse the K/V of 2-3; per-layer inputs; experts beside the
# dense MLPs (TP refused).
FAMILY_VARIANTS = {"llama": "gqa", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
                   "smollm3": "smollm3", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral",
                   "gpt_oss": "gpt_oss", "llama4_text": "llama4", "deepseek_v3": "deepseek_v3",
                   "deepseek_v2": "deepseek_v2", "minimax_m2": "minimax_m2",
                   "gemma4_text": "gemma4"}
WINDOWED = ["mistral", "qwen2", "gemma3", "gemma4_text"]
TP2 = ["qwen2", "qwen3", "gemma3", "mistral", "smollm3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss",
       "llama4_text", "deepseek_v3", "deepseek_v2"]
GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
DELTAS: dict[tuple[str, int | str], float] = {}  # (family, cp or "tp2") -> max |Δ log-prob| vs transformers


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, tp=1, **kw)`: an engine for a checkpoint, on a pool of cp x tp ranks shared by the
    module (CP1 x TP1 runs in the driver process)."""
    pools: dict[int, WorkerPool] = {}

    def get(path, cp, tp=1, **kw):
        kw.setdefault("placement", "shard")  # the ring under windows; tests/test_placement_engine.py: local ones
        kw = dict(context_parallel_size=cp, tensor_parallel_size=tp, max_kv_tokens_per_rank=2048, **kw)
        if cp * tp == 1:
            return LLM(str(path), threads_per_rank=1, **kw)
        if cp * tp not in pools:
            pools[cp * tp] = WorkerPool(cp * tp, threads_per_rank=1, timeout_s=120)
        return PooledLLM(str(path), pools[cp * tp], **kw)

    yield get
    for pool in pools.values():
        pool.close()
    if DELTAS:
        cols = [1, 2, 3, "tp2"]
        rows = [f"| {f} | " + " | ".join(f"{DELTAS[(f, c)]:.1e}" if (f, c) in DELTAS else "-" for c in cols) + " |"
                for f in FAMILY_VARIANTS if any((f, c) in DELTAS for c in cols)]
        print("\nmax |Δ log-prob| vs transformers\n| family | CP1 | CP2 | CP3 | TP2 |\n|---|---|---|---|---|\n"
              + "\n".join(rows))


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("family", list(FAMILY_VARIANTS))
def test_family_matches_hf_with_chunked_prefill_and_prefix_reuse(llama_checkpoint, engines, family, cp):
    path = llama_checkpoint(FAMILY_VARIANTS[family], max_position_embeddings=2048)
    with engines(path, cp, max_num_batched_tokens=48) as llm:  # 130-token prompts prefill in 3 chunks
        prompts = prompts_for(llm.config.vocab_size, [1, 37, 130], seed=cp)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, prompt_logprobs=True, **GREEDY))
        worst = check_against_hf(path, outs, prompts, 10)
        assert all(o.num_cached_tokens == 0 for o in outs)
        if cp > 1:
            assert outs[2].metrics["steps"][0]["strategy"] == "pass-kv"  # prefill
            assert outs[2].metrics["steps"][-1]["strategy"] == "pass-q"  # decode
        turn2 = [p + o.token_ids + [11, 12, 13] for p, o in zip(prompts, outs)]
        outs2 = llm.generate(turn2, SamplingParams(max_tokens=8, **GREEDY))  # (prompt log-probs bypass the cache)
        assert [o.num_cached_tokens for o in outs2] == [len(p) + 9 for p in prompts]  # turn 1 minus its last token
        worst = max(worst, check_against_hf(path, outs2, turn2, 8, check_prompt_lp=False))
    DELTAS[(family, cp)] = worst


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("family", WINDOWED + ["deepseek_v3"])
def test_windowed_prefix_sharing_and_forced_strategies(llama_checkpoint, engines, family, cp):
    """Requests sharing a 100-token document (window 16-24; MLA's latent cache for deepseek_v3) arrive one after
    another and read it from the cache; every strategy (pass-KV and pass-Q for prefill, chunks and decode) stays
    exact."""
    path = llama_checkpoint(FAMILY_VARIANTS[family], max_position_embeddings=2048)
    rng = np.random.default_rng(cp)
    doc = rng.integers(3, 256, 100).tolist()
    questions = [doc + rng.integers(3, 256, n).tolist() for n in (9, 30, 1)]
    for strategy in ("pass-kv", "pass-q"):
        with engines(path, cp, strategy=strategy, max_num_batched_tokens=40) as llm:
            first = llm.generate([questions[0]], SamplingParams(max_tokens=6, prompt_logprobs=True, **GREEDY))
            check_against_hf(path, first, questions[:1], 6)
            rest = llm.generate(questions[1:], SamplingParams(max_tokens=6, **GREEDY))
            assert [o.num_cached_tokens for o in rest] == [100, 100]  # the shared document, not the question
            assert all(st["strategy"] == strategy for o in rest for st in o.metrics["steps"])
            check_against_hf(path, rest, questions[1:], 6, check_prompt_lp=False)


@pytest.mark.parametrize("family", TP2)
def test_family_tp2_matches_hf(llama_checkpoint, engines, family):
    """TP 2 (4 query heads and 1 KV head per rank): biases split by rows, o_proj bias added once, q/k norms and
    Gemma's norms replicated; each expert's intermediate dimension split, the router and shared-expert gate
    replicated, one all-reduce per sparse block."""
    path = llama_checkpoint(FAMILY_VARIANTS[family], max_position_embeddings=2048)
    with engines(path, 1, tp=2, max_num_batched_tokens=48) as llm:
        prompts = prompts_for(llm.config.vocab_size, [23, 70], seed=5)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=True, **GREEDY))
        DELTAS[(family, "tp2")] = check_against_hf(path, outs, prompts, 8)


def test_slot_positions_find_the_window_tail_of_slot_runs():
    """The engine's mirror of slot positions: the cached slots a sliding layer still needs, found by binary
    search over a sequence's runs (positions increase within and across its runs)."""
    from cpinfer.engine.attention import SlotPositions
    from cpinfer.engine.batch import ForwardBatch, SeqInput

    sp = SlotPositions(world=2, capacity=256)
    ranks = np.array([0] * 40 + [1] * 30 + [0] * 20)
    slots = np.concatenate([np.arange(100, 140), np.arange(0, 30), np.arange(10, 30)])  # rank 0: two runs
    sp.record(ForwardBatch((SeqInput(np.zeros(90, np.int64), 5, ranks, slots, (), None),), "pass-kv", "prefill"))
    runs0 = np.array([[100, 140], [10, 30]])  # positions 5..44, then 75..94
    assert sp.recent(0, runs0, 0).tolist() == list(range(100, 140)) + list(range(10, 30))
    assert sp.recent(0, runs0, 40).tolist() == list(range(135, 140)) + list(range(10, 30))
    assert sp.recent(0, runs0, 80).tolist() == list(range(15, 30))
    assert sp.recent(0, runs0, 95).tolist() == []
    assert sp.recent(1, np.array([[0, 30]]), 60).tolist() == list(range(15, 30))  # positions 45..74
