"""Exact merge of partial attention results (paper Appendix B).

A partial is `(out, lse)` for the same queries over disjoint sets of keys. Merging is done in fp32 with the
numerically stable sigmoid / log-sigmoid update; an empty partial (lse = -inf) contributes nothing, and rows
that are empty in every partial come out as zeros with lse = -inf. An attention sink (a learned logit per head,
gpt-oss) is one more partial with lse = sink and zero output, merged once after all the others (`merge_sink`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def merge_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """In-place: (acc_out, acc_lse) ← merge((acc_out, acc_lse), (out, lse)).

    acc_out: [L, H, D] fp32, acc_lse: [L, H] fp32 (updated in place); out: [L, H, D] any float dtype, lse: [L, H].
    """
    lse = lse.float()
    # weight of the new partial: sigmoid(lse - acc_lse) = exp(lse) / (exp(acc_lse) + exp(lse))
    diff = lse - acc_lse
    both_empty = torch.isneginf(lse) & torch.isneginf(acc_lse)
    diff = torch.where(both_empty, torch.full_like(diff, -torch.inf), diff)  # nan (-inf - -inf) → weight 0
    w = torch.sigmoid_(diff).unsqueeze(-1)
    acc_out.lerp_(out.float(), w)
    # new lse = acc_lse - logsigmoid(acc_lse - lse) = logaddexp(acc_lse, lse), exact for ±inf too
    torch.logaddexp(acc_lse, lse, out=acc_lse)


def merge_partials(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge any number of partials. outs: each [L, H, D]; lses: each [L, H]. Returns fp32 (out, lse)."""
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need the same non-zero number of outputs and lses, got {len(outs)} and {len(lses)}")
    lse = torch.stack([x.float() for x in lses])  # [S, L, H]
    lse_max = lse.amax(dim=0)  # [L, H]
    safe_max = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse - safe_max)  # [S, L, H]; empty partials (and all-empty rows) weigh 0
    denom = weights.sum(dim=0)  # [L, H]
    out = torch.zeros_like(outs[0], dtype=torch.float32)
    for o, w in zip(outs, weights):
        out.add_(o.float() * w.unsqueeze(-1))
    nonempty = denom > 0
    out = torch.where(nonempty.unsqueeze(-1), out / torch.where(nonempty, denom, 1.0).unsqueeze(-1), 0.0)
    merged_lse = torch.where(nonempty, safe_max + torch.log(torch.where(nonempty, denom, 1.0)), -torch.inf)
    return out, merged_lse


def merge_rows_into(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor, rows: Tensor,
                    unique: bool) -> None:
    """In place: merge packed partials into the accumulator rows they belong to.

    acc_out [L, H, D] fp32, acc_lse [L, H] fp32; out [P, H, D], lse [P, H] and rows [P] int64 (the accumulator row
    of each packed row). With `unique` every row appears at most once (gather, merge, scatter back); otherwise a
    row may receive several partials: a per-row max over all of them, then weighted sums with index_add — a fixed
    handful of kernels however many partials there are.
    """
    if unique:
        a_out, a_lse = acc_out.index_select(0, rows), acc_lse.index_select(0, rows)  # [P, H, D], [P, H]
        merge_into(a_out, a_lse, out, lse)
        acc_out.index_copy_(0, rows, a_out)
        acc_lse.index_copy_(0, rows, a_lse)
        return
    lse = lse.float()
    top = acc_lse.clone().index_reduce_(0, rows, lse, "amax")  # [L, H] max over the row's partials and acc
    safe = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_acc = torch.exp(acc_lse - safe)  # [L, H]; empty partials weigh 0
    w_new = torch.exp(lse - safe.index_select(0, rows))  # [P, H]
    den = w_acc.index_add(0, rows, w_new)
    num = (acc_out * w_acc.unsqueeze(-1)).index_add_(0, rows, out.float() * w_new.unsqueeze(-1))
    has = den > 0
    acc_out.copy_(torch.where(has.unsqueeze(-1), num / torch.where(has, den, 1.0).unsqueeze(-1), 0.0))
    acc_lse.copy_(torch.where(has, safe + torch.log(torch.where(has, den, 1.0)), -torch.inf))


def merge_sink(acc_out: Tensor, acc_lse: Tensor, sinks: Tensor) -> None:
    """In place: merge the sink partial (out 0, lse = sinks[h]) into (acc_out [L, H, D] fp32, acc_lse [L, H] fp32).

    exp(sink) joins each query's softmax denominator exactly once, so call this after every key's partial is in
    (after the ring, after pass-Q's All2All merge), never per step or per rank. A row with no visible key keeps
    out = 0 (0 · anything); a head whose sink is -inf is left as it is. sinks: [H] any float dtype."""
    s = sinks.float().reshape(1, -1).expand_as(acc_lse)  # [L, H]
    diff = torch.where(torch.isneginf(acc_lse), torch.full_like(acc_lse, -torch.inf), acc_lse - s)
    acc_out.mul_(torch.sigmoid(diff).unsqueeze(-1))  # weight of the keys: exp(lse) / (exp(lse) + exp(sink))
    torch.logaddexp(acc_lse, s, out=acc_lse)


def finish(acc_out: Tensor, acc_lse: Tensor, sinks: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The merged result in `dtype`, the sink merged first when there is one (acc_* fp32, updated in place)."""
    if sinks is not None:
        merge_sink(acc_out, acc_lse, sinks)
    return acc_out.to(dtype)
