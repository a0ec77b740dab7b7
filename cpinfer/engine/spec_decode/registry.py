"""The speculative-decoding methods: method name → the proposer class built with (config, engine)."""
from __future__ import annotations

from cpinfer.engine.spec_decode.config import SpeculativeConfig
from cpinfer.engine.spec_decode.draft import DraftProposer
from cpinfer.engine.spec_decode.ngram import NgramProposer
from cpinfer.engine.spec_decode.proposer import Proposer

PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "draft_model": DraftProposer}


def check_method(config: SpeculativeConfig) -> type[Proposer]:
    """The proposer class of config.method, or ValueError naming the available methods (before any rank starts)."""
    cls = PROPOSERS.get(config.method)
    if cls is None:
        raise ValueError(f"speculative_config: method {config.method!r} is not available in this build "
                         f"(available: {', '.join(sorted(PROPOSERS))})")
    return cls


def make_proposer(config: SpeculativeConfig, engine=None) -> Proposer:
    """The proposer of config.method, built with the engine it serves."""
    return check_method(config)(config, engine)
