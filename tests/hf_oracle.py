"""Hugging Face transformers as the exactness oracle for engine outputs (greedy, no early stop)."""
import functools

import numpy as np
import torch

from checkpoints import load_hf_model


@functools.lru_cache(maxsize=8)
def _model(path: str):
    return load_hf_model(path)


TIE = 1e-5  # logits this close to the largest are ties: greedy may take either (float rounding decides)


def hf_logprobs(path, tokens) -> torch.Tensor:
    """[len, vocab] fp32 log-probs of transformers' one uncached forward over `tokens`."""
    with torch.no_grad():
        return _model(str(path))(torch.tensor([tokens]), use_cache=False).logits[0].float().log_softmax(-1)


def prompts_for(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def check_against_hf(path, outputs, prompts, steps, check_prompt_lp=True) -> float:
    """Assert the engine's greedy continuation is transformers' and its log-probs within 1e-4; returns the largest
    |Δ log-prob|. Transformers runs teacher-forced on the engine's tokens (one forward over prompt + output): each
    engine token must be transformers' argmax there — or tie with it within TIE, where rounding may pick either."""
    worst = 0.0
    for o, p in zip(outputs, prompts):
        assert len(o.token_ids) == steps, f"{len(o.token_ids)} tokens generated, {steps} expected"
        lp = hf_logprobs(path, list(p) + list(o.token_ids)[:-1])  # [len(p) + steps - 1, vocab]
        rows = lp[len(p) - 1:]  # the distributions the engine sampled from
        chosen = torch.tensor(o.token_ids, dtype=torch.long)
        ref_lp = rows[torch.arange(steps), chosen]
        best = rows.max(-1).values
        assert bool((ref_lp >= best - TIE).all()), (
            f"greedy token is not transformers' argmax at steps {torch.nonzero(ref_lp < best - TIE).flatten().tolist()}")
        torch.testing.assert_close(torch.tensor(o.logprobs), ref_lp, atol=1e-4, rtol=0)
        if steps:
            worst = max(worst, float((torch.tensor(o.logprobs) - ref_lp).abs().max()))
        if check_prompt_lp:
            ref_plp = lp[torch.arange(len(p) - 1), torch.tensor(p[1:], dtype=torch.long)]
            assert o.prompt_logprobs[0] is None
            torch.testing.assert_close(torch.tensor(o.prompt_logprobs[1:]), ref_plp, atol=1e-4, rtol=0)
            if len(ref_plp):
                worst = max(worst, float((torch.tensor(o.prompt_logprobs[1:]) - ref_plp).abs().max()))
    return worst
