"""Hugging Face transformers as the exactness oracle for engine outputs (greedy, no early stop)."""
import functools

import numpy as np
import torch

from cpinfer.model.testing import load_hf_model


@functools.lru_cache(maxsize=8)
def _model(path: str):
    return load_hf_model(path)


def hf_reference(path, prompt, steps):
    """(prompt logprobs [len-1], greedy continuation, its logprobs) from transformers, greedy without stopping.
    One forward over the prompt, then one token at a time on transformers' own KV cache."""
    hf = _model(str(path))
    with torch.no_grad():
        res = hf(torch.tensor([prompt]), use_cache=True)
        lp = res.logits[0].float().log_softmax(-1)
        prompt_lp = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        last, past, tokens, out_lp = lp[-1], res.past_key_values, [], []
        for _ in range(steps):
            t = int(last.argmax())
            tokens.append(t)
            out_lp.append(float(last[t]))
            res = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            last, past = res.logits[0, -1].float().log_softmax(-1), res.past_key_values
    return prompt_lp, tokens, out_lp


def prompts_for(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def check_against_hf(path, outputs, prompts, steps, check_prompt_lp=True) -> float:
    """Assert greedy tokens equal and log-probs within 1e-4 of transformers; returns the largest |Δ log-prob|."""
    worst = 0.0
    for o, p in zip(outputs, prompts):
        ref_plp, ref_tokens, ref_lp = hf_reference(path, p, steps)
        assert o.token_ids == ref_tokens
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(ref_lp), atol=1e-4, rtol=0)
        if ref_lp:
            worst = max(worst, float((torch.tensor(o.logprobs) - torch.tensor(ref_lp)).abs().max()))
        if check_prompt_lp:
            assert o.prompt_logprobs[0] is None
            torch.testing.assert_close(torch.tensor(o.prompt_logprobs[1:]), ref_plp, atol=1e-4, rtol=0)
            if len(ref_plp):
                worst = max(worst, float((torch.tensor(o.prompt_logprobs[1:]) - ref_plp).abs().max()))
    return worst
