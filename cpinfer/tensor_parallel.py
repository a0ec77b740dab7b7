"""Tensor parallelism applied to a decoder of any supported family from outside it (paper §4.1: TP inside a node).

Column-parallel q/k/v, gate and up projections keep this rank's output rows (and bias entries); row-parallel o
and down projections keep their input columns, all-reduce their output over the TP group, then add their bias
once. Norms (incl. Qwen3 / Gemma 3 per-head q/k norms) are replicated; attention sinks (one logit per query
head, gpt-oss) are split with the query heads. Query heads are split evenly; KV heads are
split when tp divides them and replicated when tp is a multiple of them (as the paper does for TP16 on 8 KV heads).
Each rank reads only its slices from the safetensors files.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpinfer.model import ModelConfig, build_model, load_weights
from cpinfer.timing import Stopwatch


class RowParallelLinear(nn.Module):
    """A linear holding this rank's input columns; the output is summed over the TP group."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear, self.group = linear, group
        self._comm: list = []  # all-reduce spans (seconds on CPU, CUDA-event spans on CUDA), read by `comm_s`
        self._comm_s = 0.0

    @property
    def weight(self):
        return self.linear.weight

    @property
    def comm_s(self) -> float:
        """Seconds spent in the all-reduce so far (for benchmarks; on CUDA, the stream's time in it)."""
        self._comm_s += sum(float(x) for x in self._comm)
        self._comm = []
        return self._comm_s

    @comm_s.setter
    def comm_s(self, value: float) -> None:
        self._comm, self._comm_s = [], value

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, in/tp] → [L, out]
        y = F.linear(x, self.linear.weight)
        clock = Stopwatch(y.device)
        t0 = clock.mark()
        dist.all_reduce(y, group=self.group)
        self._comm.append(clock.span(t0, clock.mark()))
        if len(self._comm) > 4096:  # nobody reads them (a server): keep the record bounded
            _ = self.comm_s
        return y if self.linear.bias is None else y + self.linear.bias  # the bias once, not once per rank


def head_ranges(config: ModelConfig, tp: int, tp_rank: int) -> tuple[range, range]:
    """(query heads, KV heads) this TP rank holds."""
    hq = config.num_attention_heads // tp
    q = range(tp_rank * hq, (tp_rank + 1) * hq)
    nkv = config.num_key_value_heads
    if nkv % tp == 0:
        hkv = nkv // tp
        return q, range(tp_rank * hkv, (tp_rank + 1) * hkv)
    kv = tp_rank * nkv // tp  # replicated: consecutive TP ranks share one KV head
    return q, range(kv, kv + 1)


def _row_slices(config: ModelConfig, tp: int, tp_rank: int) -> dict[str, slice]:
    d = config.head_dim
    q, kv = head_ranges(config, tp, tp_rank)
    f = config.intermediate_size // tp
    return {"q_proj": slice(q.start * d, q.stop * d), "k_proj": slice(kv.start * d, kv.stop * d),
            "v_proj": slice(kv.start * d, kv.stop * d), "gate_proj": slice(tp_rank * f, (tp_rank + 1) * f),
            "up_proj": slice(tp_rank * f, (tp_rank + 1) * f)}


def _col_slices(config: ModelConfig, tp: int, tp_rank: int) -> dict[str, slice]:
    d = config.head_dim
    q, _ = head_ranges(config, tp, tp_rank)
    f = config.intermediate_size // tp
    return {"o_proj": slice(q.start * d, q.stop * d), "down_proj": slice(tp_rank * f, (tp_rank + 1) * f)}


def load_tp_model(path, config: ModelConfig, tp: int, tp_rank: int, tp_group, dtype=torch.float32, device="cpu"):
    """Build on meta, shrink the sharded linears, load only this rank's slices, wrap the row-parallel ones."""
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide intermediate_size ({config.intermediate_size})")
    rows, cols = _row_slices(config, tp, tp_rank), _col_slices(config, tp, tp_rank)
    heads, _ = head_ranges(config, tp, tp_rank)
    model = build_model(config, dtype)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                out_f, in_f = lin.out_features, lin.in_features
                if name in rows:
                    out_f = rows[name].stop - rows[name].start
                if name in cols:
                    in_f = cols[name].stop - cols[name].start
                with torch.device("meta"):
                    setattr(parent, name, nn.Linear(in_f, out_f, bias=lin.bias is not None, dtype=dtype))
        if layer.self_attn.sinks is not None:  # [H] -> this rank's query heads
            with torch.device("meta"):
                layer.self_attn.sinks = nn.Parameter(torch.zeros(len(heads), dtype=dtype))

    def slicer(name: str, sl):
        if name.endswith(".self_attn.sinks"):
            return sl[heads.start:heads.stop]
        key = name.rsplit(".", 2)[-2] if ".layers." in name else ""
        if key in rows:  # weight rows and bias entries of a column-parallel linear
            return sl[rows[key]]
        if key in cols and name.endswith(".weight"):  # a row-parallel bias stays whole (added after all-reduce)
            return sl[:, cols[key]]
        return sl[:]

    load_weights(model, path, dtype=dtype, device=device, slicer=slicer)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, tp_group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, tp_group)
    return model


def allreduce_seconds(model) -> float:
    """Total time the model's row-parallel layers spent in all-reduce so far."""
    return sum(m.comm_s for m in model.modules() if isinstance(m, RowParallelLinear))
