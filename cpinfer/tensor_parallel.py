"""Tensor parallelism applied to a decoder of any supported family from outside it (paper §4.1: TP inside a node).

Column-parallel q/k/v, gate and up projections keep this rank's output rows (and bias entries); row-parallel o
and down projections keep their input columns, all-reduce their output over the TP group, then add their bias
once. Norms (incl. Qwen3 / Gemma 3 per-head q/k norms) are replicated; attention sinks (one logit per query
head, gpt-oss) are split with the query heads. A sparse MLP block slices each expert's intermediate dimension (and
its shared expert's) the same way, keeps its router and shared-expert gate whole, and all-reduces its output once.
Query heads are split evenly; KV heads are
split when tp divides them and replicated when tp is a multiple of them (as the paper does for TP16 on 8 KV heads).
Each rank reads only its slices from the safetensors files.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from cpinfer.model import ModelConfig, build_model, load_weights
from cpinfer.model.moe import PER_EXPERT_NAME, Experts, SparseMoE
from cpinfer.model.quant import product_without_bias
from cpinfer.timing import Stopwatch


class AllReduceSum(nn.Module):
    """A module whose output is a partial sum over the TP group; `_reduce` sums it and times the all-reduce."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self._comm: list = []  # all-reduce spans (seconds on CPU, CUDA-event spans on CUDA), read by `comm_s`
        self._comm_s = 0.0

    @property
    def comm_s(self) -> float:
        """Seconds spent in the all-reduce so far (for benchmarks; on CUDA, the stream's time in it)."""
        self._comm_s += sum(float(x) for x in self._comm)
        self._comm = []
        return self._comm_s

    @comm_s.setter
    def comm_s(self, value: float) -> None:
        self._comm, self._comm_s = [], value

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        clock = Stopwatch(y.device)
        t0 = clock.mark()
        dist.all_reduce(y, group=self.group)
        self._comm.append(clock.span(t0, clock.mark()))
        if len(self._comm) > 4096:  # nobody reads them (a server): keep the record bounded
            _ = self.comm_s
        return y


class RowParallelLinear(AllReduceSum):
    """A linear holding this rank's input columns; the output is summed over the TP group."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__(group)
        self.linear = linear

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, in/tp] → [L, out]
        y = self._reduce(product_without_bias(self.linear, x))  # FP8 linears too
        return y if self.linear.bias is None else y + self.linear.bias  # the bias once, not once per rank


class RowParallelBlock(AllReduceSum):
    """A sparse MLP block whose experts (and shared expert) hold this rank's intermediate slice: one all-reduce
    of its output sums the routed and shared partial outputs (expert down biases are added by TP rank 0 only)."""

    def __init__(self, block: nn.Module, group):
        super().__init__(group)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L, hidden] → [L, hidden]
        return self._reduce(self.block(x))


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


def _dense_slices(prefix: str, size: int, tp: int, tp_rank: int, rows: dict, cols: dict) -> None:
    """A gated MLP at `prefix` with intermediate `size`: gate / up rows and down columns of this rank."""
    f = size // tp
    part = slice(tp_rank * f, (tp_rank + 1) * f)
    rows[f"{prefix}.gate_proj"] = rows[f"{prefix}.up_proj"] = part
    cols[f"{prefix}.down_proj"] = part


def _mla_slices(attn: str, mla, heads: range, rows: dict, cols: dict) -> None:
    """MLA under TP: this rank's query heads of q_proj / q_b_proj and kv_b_proj (per head: the no-RoPE key part
    and the value of the latent) and their o_proj columns; the latent path (q_a_proj, kv_a_proj_with_mqa and
    their norms) stays whole, so every rank holds the same latent cache."""
    q_name = "q_proj" if mla.q_lora_rank is None else "q_b_proj"
    rows[f"{attn}.{q_name}"] = slice(heads.start * mla.qk_head_dim, heads.stop * mla.qk_head_dim)
    per = mla.qk_nope_head_dim + mla.v_head_dim
    rows[f"{attn}.kv_b_proj"] = slice(heads.start * per, heads.stop * per)
    cols[f"{attn}.o_proj"] = slice(heads.start * mla.v_head_dim, heads.stop * mla.v_head_dim)


def _plan(model, config: ModelConfig, tp: int, tp_rank: int) -> tuple[dict, dict, dict]:
    """(rows, cols, experts): module path -> the output rows / input columns this rank keeps of a linear, and
    experts-module path -> its slice of each expert's intermediate dimension."""
    d = config.head_dim
    q, kv = head_ranges(config, tp, tp_rank)
    rows: dict[str, slice] = {}
    cols: dict[str, slice] = {}
    experts: dict[str, slice] = {}
    for i, layer in enumerate(model.model.layers):
        attn, ffn = f"model.layers.{i}.self_attn", f"model.layers.{i}.{layer.mlp_name}"
        if config.mla is not None:
            _mla_slices(attn, config.mla, q, rows, cols)
        else:
            rows[f"{attn}.q_proj"] = slice(q.start * d, q.stop * d)
            rows[f"{attn}.k_proj"] = rows[f"{attn}.v_proj"] = slice(kv.start * d, kv.stop * d)
            cols[f"{attn}.o_proj"] = slice(q.start * d, q.stop * d)
        if not isinstance(layer.ffn, SparseMoE):
            _dense_slices(ffn, config.intermediate_size, tp, tp_rank, rows, cols)
            continue
        f = config.moe.intermediate_size // tp
        experts[f"{ffn}.experts"] = slice(tp_rank * f, (tp_rank + 1) * f)
        if layer.ffn.shared_expert is not None:
            _dense_slices(f"{ffn}.{layer.ffn.shared_name}", config.moe.shared_intermediate_size, tp, tp_rank, rows,
                          cols)
    return rows, cols, experts


def _check_sizes(config: ModelConfig, tp: int) -> None:
    sizes = {"intermediate_size": config.intermediate_size}
    if config.moe is not None:
        sizes["moe intermediate size"] = config.moe.intermediate_size
        if config.moe.shared_intermediate_size:
            sizes["shared_expert_intermediate_size"] = config.moe.shared_intermediate_size
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide {name} ({size})")


def _shrink(model, rows: dict, cols: dict, experts: dict, config: ModelConfig, tp: int, dtype) -> None:
    """Resize the meta model's sliced linears and experts to this rank's shapes."""
    for path in set(rows) | set(cols):
        lin = model.get_submodule(path)
        out_f = rows[path].stop - rows[path].start if path in rows else lin.out_features
        in_f = cols[path].stop - cols[path].start if path in cols else lin.in_features
        owner, _, leaf = path.rpartition(".")
        with torch.device("meta"):
            setattr(model.get_submodule(owner), leaf, nn.Linear(in_f, out_f, bias=lin.bias is not None, dtype=dtype))
    if experts:
        local = dataclasses.replace(config.moe, intermediate_size=config.moe.intermediate_size // tp)
        for path in experts:
            owner, _, leaf = path.rpartition(".")
            with torch.device("meta"):
                setattr(model.get_submodule(owner), leaf, Experts(config.hidden_size, local).to(dtype))


def _expert_slice(experts_mod: Experts, leaf: str, sl, part: slice, full_i: int) -> torch.Tensor:
    """This rank's slice of a fused expert tensor (`gate_up_proj[_bias]`, `down_proj[_bias]`)."""
    if leaf == "down_proj_bias":
        return sl[:]  # added once (TP rank 0), before the block's all-reduce
    if leaf == "down_proj":  # [E, H, I], or [E, I, H] transposed
        return sl[:, part] if experts_mod.transposed else sl[:, :, part]
    axis = 1 if leaf == "gate_up_proj_bias" or not experts_mod.transposed else 2  # the 2I axis
    lead = (slice(None),) * axis
    if experts_mod.interleaved:  # gate / up columns alternate: intermediate j is columns 2j, 2j + 1
        return sl[lead + (slice(2 * part.start, 2 * part.stop),)]
    up = slice(full_i + part.start, full_i + part.stop)
    return torch.cat((sl[lead + (part,)], sl[lead + (up,)]), dim=axis)


def load_tp_model(path, config: ModelConfig, tp: int, tp_rank: int, tp_group, dtype=torch.float32, device="cpu",
                  fp8_native: bool | None = None):
    """Build on meta, shrink the sharded linears and experts, load only this rank's slices (FP8 weights may stay
    FP8 with their scales sliced alike: `load_weights`' `fp8_native`), wrap the row-parallel linears and the sparse
    blocks (their output is all-reduced once)."""
    _check_sizes(config, tp)
    model = build_model(config, dtype)
    rows, cols, experts = _plan(model, config, tp, tp_rank)
    _shrink(model, rows, cols, experts, config, tp, dtype)
    heads, _ = head_ranges(config, tp, tp_rank)
    for layer in model.model.layers:
        if layer.self_attn.sinks is not None:  # [H] -> this rank's query heads
            with torch.device("meta"):
                layer.self_attn.sinks = nn.Parameter(torch.zeros(len(heads), dtype=dtype))

    def slicer(name: str, sl):
        if name.endswith(".self_attn.sinks"):
            return sl[heads.start:heads.stop]
        owner, _, leaf = name.rpartition(".")
        if owner in rows:  # weight rows and bias entries of a column-parallel linear
            return sl[rows[owner]]
        if owner in cols and leaf == "weight":  # a row-parallel bias stays whole (added after all-reduce)
            return sl[:, cols[owner]]
        if owner in experts:
            return _expert_slice(model.get_submodule(owner), leaf, sl, experts[owner], config.moe.intermediate_size)
        m = PER_EXPERT_NAME.match(name)
        if m and m["experts"] in experts:  # one expert's [out, in] linear of a per-expert checkpoint
            part = experts[m["experts"]]
            return sl[:, part] if model.get_submodule(m["experts"]).names.get(m["proj"]) == "down" else sl[part]
        return sl[:]

    load_weights(model, path, dtype=dtype, device=device, slicer=slicer, fp8_native=fp8_native)
    _wrap(model, tp_rank, tp_group)
    return model


def _wrap(model, tp_rank: int, tp_group) -> None:
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, tp_group)
        ffn = layer.ffn
        if isinstance(ffn, SparseMoE):
            shared = ffn.shared_expert
            if shared is not None and shared.down_proj.bias is not None:
                raise ValueError("a shared expert with a down_proj bias is not supported under tensor parallelism")
            ffn.experts.down_bias_here = tp_rank == 0
            setattr(layer, layer.mlp_name, RowParallelBlock(ffn, tp_group))
        else:
            ffn.down_proj = RowParallelLinear(ffn.down_proj, tp_group)


def allreduce_seconds(model) -> float:
    """Total time the model's row-parallel layers spent in all-reduce so far."""
    return sum(m.comm_s for m in model.modules() if isinstance(m, AllReduceSum))
