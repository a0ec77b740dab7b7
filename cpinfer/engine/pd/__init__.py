"""Prefill and decode on separate groups of ranks: `make_engine` picks the P/D engine when `pd_decode_cp` is given."""
from __future__ import annotations

from cpinfer.engine.llm_engine import LLMEngine


def make_engine(model=None, **kwargs):
    """`LLMEngine(model, **kwargs)`, or the P/D engine (driver.py) when kwargs name `pd_decode_cp`."""
    if kwargs.get("pd_decode_cp") is None:
        kwargs.pop("pd_decode_cp", None)
        groups = kwargs.pop("pd_decode_groups", None)
        if groups not in (None, 1):
            raise ValueError(f"pd_decode_groups ({groups}) needs pd_decode_cp (the decode groups' CP size)")
        return LLMEngine(model, **kwargs)
    from cpinfer.engine.pd.driver import PDEngine

    if kwargs.get("pd_decode_groups") is None:
        kwargs.pop("pd_decode_groups", None)
    return PDEngine(model, **kwargs)
