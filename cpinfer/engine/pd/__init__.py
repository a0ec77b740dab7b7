"""Prefill and decode on separate groups of ranks (paper §4.3); `make_engine` picks `PDEngine` when `pd_decode_cp` is
given. Rooms: `roles.py` (the world's roles and their sizes), `group.py` (one role's engine), `handoffs.py` (requests
moving between groups; `transfers.py` its transfers' orders, `windows.py` sliding-window rows, `draft_rows.py` a draft
model's rows, `paths.py` tree walks), `driver.py` (`PDEngine`: requests, the step loop, stats); the ranks' side is
`ranks.py`."""
from __future__ import annotations

from cpinfer.engine.llm_engine import LLMEngine
from cpinfer.engine.pd.driver import PDEngine
from cpinfer.engine.pd.group import GroupEngine
from cpinfer.engine.pd.roles import PDConfig, check_pd_args, role_capacities

__all__ = ["GroupEngine", "PDConfig", "PDEngine", "check_pd_args", "make_engine", "role_capacities"]


def make_engine(model=None, **kwargs):
    """`LLMEngine(model, **kwargs)`, or `PDEngine` when kwargs name `pd_decode_cp`."""
    if kwargs.get("pd_decode_cp") is None:
        kwargs.pop("pd_decode_cp", None)
        groups = kwargs.pop("pd_decode_groups", None)
        if groups not in (None, 1):
            raise ValueError(f"pd_decode_groups ({groups}) needs pd_decode_cp (the decode groups' CP size)")
        return LLMEngine(model, **kwargs)
    if kwargs.get("pd_decode_groups") is None:
        kwargs.pop("pd_decode_groups", None)
    return PDEngine(model, **kwargs)
