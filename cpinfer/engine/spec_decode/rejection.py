"""The acceptance rule of speculative decoding (on the rank that holds a verify sequence's k+1 rows of logits).

Row i's distribution p_i is the target's, processed exactly as plain sampling processes it (engine/sampling.py:
bias, grammar mask, min_tokens suppression, penalties over the output *and the drafts before row i*, temperature,
min-p, top-k, top-p). Greedy: draft d_i is kept while it equals row i's argmax; the first row that differs (or row
k, after all k) emits its argmax — token for token what plain greedy decoding emits. Sampling: d_i is kept with
probability min(1, p_i(d_i) / q_i(d_i)); on rejection a token is drawn from the normalised (p_i - q_i)+ and the step
ends; after all k, a bonus token is drawn from p_k. The emitted tokens are then distributed exactly as the target's.
q_i is the proposer's distribution ([k, V]); None means the drafts were deterministic (prompt lookup): q_i is a point
mass at d_i, so d_i is kept with probability p_i(d_i) and a rejection draws from p_i without d_i.

Randomness is reproducible: row i's draws come from a generator seeded from (request seed, output index of row i).
The bonus row uses plain sampling's own stream; acceptance rows a salted one, so that a proposer drawing its drafts
from plain sampling's stream stays independent of the acceptance test.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpinfer.engine.sampling import GREEDY_EPS, SampleSpec, scores_of, target_probs, token_logprobs

_SALT = 0x5DEECE66D  # acceptance rows' stream: (seed, step) mixed with this


def row_specs(spec: SampleSpec, draft: np.ndarray, allowed: np.ndarray | None = None,
              suppress_rows: int = 0) -> list[SampleSpec]:
    """The k+1 rows' sampling specs from the first row's: row i samples output index step+i, its penalties read the
    output followed by draft[:i], its grammar mask is allowed[i] ([k+1, W] when constrained) and it holds back the
    stop tokens while i < suppress_rows (min_tokens not reached yet)."""
    out = []
    for i in range(len(draft) + 1):
        output = spec.output
        if output is not None and i:
            output = np.concatenate([output, np.asarray(draft[:i], dtype=np.int64)])
        out.append(dataclasses.replace(spec, step=spec.step + i, output=output,
                                       suppress=spec.suppress if i < suppress_rows else (),
                                       allowed=spec.allowed if allowed is None else allowed[i]))
    return out


def _generator(spec: SampleSpec, salted: bool) -> torch.Generator:
    base = (spec.seed * 1_000_003 + spec.step) % (2 ** 63)
    return torch.Generator().manual_seed((base * 31 + _SALT) % (2 ** 63) if salted else base)


def verify(logits: torch.Tensor, draft: np.ndarray, specs: list[SampleSpec],
           q: torch.Tensor | None = None) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """logits [k+1, V] of a verify sequence's rows, draft [k], specs (row_specs), q [k, V] the proposer's
    probabilities or None (deterministic drafts) → the emitted tokens, each (token, log p under the raw logits,
    top list): the accepted drafts, then the target's correction or bonus token."""
    k = len(draft)
    emitted = []
    for i, spec in enumerate(specs[:k + 1]):
        raw, scores = scores_of(logits[i], spec)
        rejected = False
        if spec.temperature < GREEDY_EPS:
            token = int(torch.argmax(scores))
        elif i == k:  # bonus: all k accepted, a plain draw from p_k
            token = int(torch.multinomial(target_probs(scores, spec), 1, generator=_generator(spec, False)))
        else:
            p = target_probs(scores, spec)  # [V]
            d = int(draft[i])
            qd = 1.0 if q is None else float(q[i, d])
            gen = _generator(spec, True)
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            if qd <= 0.0 or u < min(1.0, float(p[d]) / qd):
                token = d
            else:
                rejected = True
                resid = p.clone()
                if q is None:
                    resid[d] = 0.0
                else:
                    resid = (p - q[i].to(p.dtype)).clamp_(min=0.0)
                total = float(resid.sum())
                token = int(torch.multinomial(resid / total if total > 0 else p, 1, generator=gen))
        emitted.append((token,) + token_logprobs(raw, token, spec))
        if i == k or rejected or token != int(draft[i]):
            break
    return emitted
