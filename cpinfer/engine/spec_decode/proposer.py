"""The proposer interface: who drafts the next tokens of decoding requests (driver side), and the registry of methods.

Each engine step, before scheduling, the engine asks its proposer for drafts of up to k tokens for every decoding
request that speculates; the scheduler then places [last token, drafts...] as one verify sequence. A proposer that
runs forwards of its own (a draft model) reaches the ranks through the engine it is built with. The methods are
listed in registry.py.
"""
from __future__ import annotations

import abc
import numpy as np

from cpinfer.engine.request import Request
from cpinfer.engine.spec_decode.config import SpeculativeConfig


class Proposer(abc.ABC):
    """Drafts tokens. `engine` is the LLMEngine that owns this proposer (its pool, KV manager, config)."""

    def __init__(self, config: SpeculativeConfig, engine=None):
        self.config = config
        self.engine = engine

    @abc.abstractmethod
    def propose(self, reqs: list[Request], ks: list[int]) -> list[np.ndarray]:
        """Per request, a draft of at most ks[i] tokens (int64) continuing `req.known`; an empty one means no
        speculation for that request this step (it decodes one token plainly). A proposer that samples its drafts
        gives their distributions too: `req.draft_q` = [len(draft), V] probabilities (shipped with the batch), or
        [k, V] rows left in the verifying rank's `ModelRunner.draft_probs[req.request_id]`; none: deterministic."""

    def verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """After the verify forward: of the `num_drafted` tokens proposed for req, the first `num_accepted` were
        kept (req.out already holds the emitted tokens). A draft model rolls its own cache back here."""

    def release(self, req: Request) -> None:
        """req leaves the running set (finished, aborted, failed or preempted): drop what is kept for it."""

    def close(self) -> None:
        """The engine shuts down."""
