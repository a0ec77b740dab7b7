"""The engine with other attention backends and dtypes on CPU: Triton (interpreter) at CP2, and bf16 vs HF bf16.

TRITON_INTERPRET=1 is set before anything imports triton; the engine's spawned ranks inherit it.
"""
import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the Triton engine path cannot be checked")

from cpinfer import SamplingParams  # noqa: E402
from checkpoints import load_hf_model  # noqa: E402
from hf_oracle import check_against_hf, prompts_for  # noqa: E402
from pooled_engine import keyed_engines  # noqa: E402

BF16_TOL = 0.08  # logprob; HF bf16 itself differs from HF fp32 by ~0.03 on these models


@pytest.fixture(scope="module")
def engines():
    """`engines(path, cp, **kw)`: an LLM on one pool of ranks per world size shared by the module."""
    yield from keyed_engines(threads_per_rank=1, timeout_s=300)


def _shared_prefix_prompts(vocab):
    """Two prompts extending one prefix (a branch in the radix tree) and an unrelated one."""
    base, a, b, c = prompts_for(vocab, [24, 5, 9, 13], seed=3)
    return [base + a, base + b, c]


def test_engine_cp2_triton_matches_hf(llama_checkpoint, engines):
    """CP2 with the Triton backend (interpreter), fp32: the tokens and log-probs HF gives (the CPU backend is held
    to the same oracle in test_engine.py): a conversation's second turn, a branch off its shared prefix and an
    unrelated prompt in one batch, all on the cached, sharded KV."""
    path = llama_checkpoint("gqa", max_position_embeddings=1024)
    prompts = _shared_prefix_prompts(256)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    with engines(path, 2, attention_backend="triton", max_kv_tokens_per_rank=1024, placement="shard") as llm:
        first = llm.generate(prompts[:1], params)  # prompt log-probs too (they bypass the prefix cache)
        turn2 = [prompts[0] + first[0].token_ids + [7, 8, 9]] + prompts[1:]  # a second turn, a branch, another
        second = llm.generate(turn2, dataclasses.replace(params, prompt_logprobs=False))
    check_against_hf(path, first, prompts[:1], 4)
    check_against_hf(path, second, turn2, 4, check_prompt_lp=False)
    assert second[0].num_cached_tokens >= len(turn2[0]) - 4  # partial prefill on the sharded KV
    assert second[1].num_cached_tokens >= 24  # the branch read the shared prefix from the cache


def test_engine_bf16_matches_hf_bf16(llama_checkpoint, engines):
    """dtype="bfloat16" on CPU at CP2: every generated and prompt log-prob within a bf16 tolerance of HF in bf16,
    each generated token within that tolerance of HF's best, and measurably not fp32."""
    path = llama_checkpoint("gqa", max_position_embeddings=1024)
    prompts = _shared_prefix_prompts(256)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    with engines(path, 2, dtype="bfloat16", max_kv_tokens_per_rank=1024, placement="shard") as llm:
        outs = llm.generate(prompts, params)
    hf16 = load_hf_model(path).to(torch.bfloat16)
    hf32 = load_hf_model(path)
    drift = 0.0
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            lp16 = hf16(seq).logits[0].float().log_softmax(-1)
            lp32 = hf32(seq).logits[0].float().log_softmax(-1)
        n, gen = len(prompt), torch.tensor(out.token_ids)
        rows = torch.arange(n - 1, n - 1 + len(gen))
        mine = torch.tensor(out.logprobs)
        torch.testing.assert_close(mine, lp16[rows, gen], atol=BF16_TOL, rtol=0)
        assert (lp16[rows].max(-1).values - lp16[rows, gen]).max() <= BF16_TOL  # greedy up to bf16 ties
        prompt_lp = torch.tensor(out.prompt_logprobs[1:])
        torch.testing.assert_close(prompt_lp, lp16[torch.arange(n - 1), torch.tensor(prompt[1:])], atol=BF16_TOL,
                                   rtol=0)
        drift = max(drift, float((mine - lp32[rows, gen]).abs().max()))
    assert drift > 1e-3  # an fp32 engine would agree with HF fp32 to ~1e-5
