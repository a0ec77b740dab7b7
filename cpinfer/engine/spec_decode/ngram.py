"""Prompt lookup (method "ngram"): draft the tokens that followed the most recent earlier occurrence of the request's
last n tokens, n from prompt_lookup_max down to prompt_lookup_min. No model: answers that quote their prompt (extract,
repeat, edit a passage) get long drafts for free."""
from __future__ import annotations

import numpy as np

from cpinfer.engine.request import Request
from cpinfer.engine.spec_decode.proposer import Proposer


def ngram_draft(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """tokens [L] int64 → at most k tokens following the latest earlier match of the longest suffix of length n in
    [n_min, n_max] that occurs before (empty when none does). Vectorised: candidates are the earlier positions
    holding the last token; each is extended backwards one comparison (over all candidates) at a time."""
    length = len(tokens)
    if k < 1 or length < n_min + 1:
        return np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])  # [C] candidate match ends, before the last token
    if len(ends) == 0:
        return np.zeros(0, dtype=np.int64)
    n_max = min(n_max, length - 1)
    matched = np.ones(len(ends), dtype=np.int64)  # [C] suffix length matched at each candidate so far
    alive = np.ones(len(ends), dtype=bool)
    for o in range(1, n_max):
        prev = ends - o
        ok = alive & (prev >= 0)
        ok[ok] = tokens[prev[ok]] == tokens[length - 1 - o]
        alive = ok
        matched += alive
        if not alive.any():
            break
    for n in range(n_max, n_min - 1, -1):
        hits = np.flatnonzero(matched >= n)
        if len(hits):
            j = int(ends[hits[-1]])  # the most recent
            return np.asarray(tokens[j + 1:j + 1 + k], dtype=np.int64)
    return np.zeros(0, dtype=np.int64)


class NgramProposer(Proposer):
    def propose(self, reqs: list[Request], ks: list[int]) -> list[np.ndarray]:
        c = self.config
        return [ngram_draft(req.known_array(), k, c.prompt_lookup_min, c.prompt_lookup_max) for req, k in
                zip(reqs, ks)]

