"""Hybrid (linear-attention) models on prefill / decode groups against transformers: the request's recurrent state
after its prompt travels with the prompt's K/V rows to every rank of the decode group (each keeps a replica), and
the state after the answer travels back with the answer's rows, so the chat's next turn on the prefill group
continues from the whole history. One worker pool per world size serves the module."""
import pytest

from cpinfer import SamplingParams
from cpinfer.launch import WorkerPool
from hf_oracle import check_against_hf, prompts_for
from pooled_engine import pd_llm
from wait_utils import settle

pytest.importorskip("transformers")

GREEDY = dict(temperature=0.0, logprobs=True, ignore_eos=True)
OUT = 8


@pytest.fixture(scope="module")
def pools():
    made: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        if world not in made:
            made[world] = WorkerPool(world, threads_per_rank=1, timeout_s=120)
        return made[world]

    try:
        yield get
    finally:
        for p in made.values():
            p.close()


@pytest.mark.parametrize("variant, layout", [("qwen3_5", (2, 1)), ("qwen3_5", (1, 2)), ("nemotron_h", (2, 2))],
                         ids=lambda x: x if isinstance(x, str) else "%d-%d" % x)
def test_state_travels_with_the_rows_both_ways(llama_checkpoint, pools, variant, layout):
    """Turn 1 (a ~300-token prompt prefilled in chunks on the prefill group, decoded on the decode group) and turn 2
    (its whole history cached on the prefill group: the answer's rows and state moved back) equal transformers."""
    n, m = layout
    path = llama_checkpoint(variant, max_position_embeddings=2048)
    llm = pd_llm(pools(n + m), path, context_parallel_size=n, pd_decode_cp=m, placement="shard",
                 max_num_batched_tokens=128, max_kv_tokens_per_rank=4096, max_num_seqs=4)
    try:
        prompts = prompts_for(llm.config.vocab_size, [300, 41], seed=n + 2 * m)
        first = llm.generate(prompts, SamplingParams(max_tokens=OUT, prompt_logprobs=True, **GREEDY),
                             use_tqdm=False)
        check_against_hf(path, first, prompts, OUT)
        assert settle(llm.engine) == []  # the answers' rows and states are back in the prefill tree
        s = llm.engine.pd_stats()
        assert s["transfers"] >= 2 and s["move_backs"] == 2, s
        turn2 = [p + o.token_ids + [5, 6, 7] for p, o in zip(prompts, first)]
        second = llm.generate(turn2, SamplingParams(max_tokens=OUT, **GREEDY), use_tqdm=False)
        assert [o.num_cached_tokens for o in second] == [len(p) + OUT - 1 for p in prompts]
        check_against_hf(path, second, turn2, OUT, check_prompt_lp=False)
        assert settle(llm.engine) == []
        for g in llm.engine.groups:
            g.kv.check_invariants()
    finally:
        llm.shutdown()
