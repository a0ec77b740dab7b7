"""Mixture of experts as one block of the shared decoder: a router picks k experts per token, the routed tokens are
grouped by expert (one GEMM per expert over its tokens, `torch._grouped_mm` where it runs), then weighted and
summed, plus an optional shared expert. Qwen2/3-MoE, Mixtral, gpt-oss and Llama 4 are options of it (`MoEConfig`).

No distributed code: under TP each expert's intermediate dimension is sliced from outside (`tensor_parallel.py`)
and the block's output is then a partial sum; the router and the shared expert's gate stay whole.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.config_parts import MoEConfig

# A per-expert checkpoint tensor (transformers 4.x layout, the Hub's Qwen-MoE and Mixtral files):
# "<prefix>.experts.<e>.<proj>.weight", stacked here into the block's [E, ...] parameters.
PER_EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


class Router(nn.Module):
    """Expert choice per token: scores = softmax or sigmoid of x W^T (+ b), the top k of them, renormalised to
    sum 1 when `norm_topk_prob`. Covers Qwen/Mixtral (softmax), gpt-oss (softmax of the top-k logits equals the
    renormalised top-k softmax) and Llama 4 (sigmoid of the top-k logits, not renormalised).

    DeepSeek's options are separate steps: a selection-only bias added to the scores before `topk`
    (e_score_correction_bias, V3), group-limited selection (`_eligible`: n_group / topk_group), a final scale
    (routed_scaling_factor). The weights are always the unbiased scores of the chosen experts.
    """

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.score_correction_bias \
            and not cfg.correction_bias_on_block else None
        self.top_k, self.scoring, self.normalize = cfg.top_k, cfg.scoring, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.group_score = cfg.n_group, cfg.topk_group, cfg.group_score
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: Tensor, correction: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [L, hidden] -> (weights [L, k] fp32, experts [L, k] int64). `correction` [E]: the selection-only bias
        when the block holds it (MiniMax-M2), else the router's own."""
        logits = F.linear(x, self.weight, self.bias).float()  # [L, E]
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias if correction is None else correction
        if bias is None and self.n_group == 1:
            weights, experts = torch.topk(scores, self.top_k, dim=-1)  # [L, k] each
        else:
            choice = scores if bias is None else scores + bias.float()
            experts = torch.topk(self._eligible(choice), self.top_k, dim=-1).indices  # [L, k]
            weights = scores.gather(1, experts)  # [L, k]: the bias only chooses
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scaling if self.scaling != 1.0 else weights), experts

    def _eligible(self, choice: Tensor) -> Tensor:
        """choice [L, E] with the experts outside each token's topk_group best groups set to -inf."""
        if self.n_group == 1:
            return choice
        groups = choice.view(choice.shape[0], self.n_group, choice.shape[1] // self.n_group)  # [L, G, E/G]
        if self.group_score == "top2_sum":
            group_scores = groups.topk(2, dim=-1).values.sum(-1)  # [L, G]
        else:
            group_scores = groups.amax(-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1).indices  # [L, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [L, G]
        return groups.masked_fill(~keep[..., None], -torch.inf).view_as(choice)


def swiglu_clamped(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's activation: gate clamped above at `limit`, up to [-limit, limit]; (up + 1) * gate * σ(α gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def relu2(x: Tensor) -> Tensor:
    """Nemotron-H's activation: relu(x)^2."""
    return torch.square(F.relu(x))


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu2": relu2}
_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> torch._grouped_mm runs there


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` exists and runs for this device type and dtype (probed once, tiny)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a, b = torch.ones(4, 16, device=device, dtype=dtype), torch.ones(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(a, b, offs=torch.tensor([1, 4], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


GROUPED_MM_MODES = ("grouped", "per_expert", "gather")


def grouped_mm_mode(x: Tensor, w: Tensor) -> str:
    """How `grouped_mm` runs here: one `torch._grouped_mm` where it runs and the strides suit it (16-byte aligned
    rows); else, while a CUDA graph is being captured (no host reads allowed), one batched matmul over each row's
    own expert matrix; else one matmul per expert."""
    es = x.element_size()
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # no probe then: eager forwards ran it
    if x.shape[1] * es % 16 == 0 and w.shape[2] * es % 16 == 0 and (
            _GROUPED_MM_OK.get((x.device.type, x.dtype), False) if capturing else _grouped_mm_runs(x.device, x.dtype)):
        return "grouped"
    return "gather" if capturing else "per_expert"


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, groups: Tensor, mode: str | None = None) -> Tensor:
    """x [N, K] (rows sorted by group), w [G, K, M] (any strides), counts [G] rows per group, groups [N] each
    row's group (ascending) -> [N, M]. `mode` (default `grouped_mm_mode`): "grouped" (torch._grouped_mm over
    per-group offsets), "per_expert" (a host read of `counts`, one matmul per non-empty group) or "gather" (each
    row times its group's matrix, [N, K, M] gathered: small N only, no host read)."""
    mode = mode or grouped_mm_mode(x, w)
    if mode == "grouped":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [G] end row of each group
        return torch._grouped_mm(x.contiguous(), w, offs=offs)
    if mode == "gather":
        return torch.bmm(x[:, None, :], w[groups]).squeeze(1)  # [N, 1, K] @ [N, K, M]
    if mode != "per_expert":
        raise ValueError(f"unknown grouped_mm mode {mode!r}: expected one of {GROUPED_MM_MODES}")
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for g, n in enumerate(counts.tolist()):
        if n:
            torch.mm(x[start:start + n], w[g], out=out[start:start + n])
        start += n
    return out


class Experts(nn.Module):
    """The routed experts, stacked: gate_up_proj [E, 2I, H] and down_proj [E, H, I] (or [E, H, 2I] / [E, I, H]
    when `transposed`), with gpt-oss's biases [E, 2I] / [E, H]. `down_bias_here` is False on the TP ranks that
    must not add the down bias (it is added once, before the block's all-reduce)."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        e, i = cfg.num_experts, cfg.intermediate_size
        self.transposed, self.interleaved = cfg.transposed, cfg.gate_up_interleaved
        self.gated = cfg.gated
        if not cfg.gated:  # Nemotron-H: up_proj [E, I, H], no gate
            if cfg.transposed or cfg.expert_bias:
                raise ValueError("un-gated experts are stored [E, out, in] without biases")
            self.up_proj = nn.Parameter(torch.empty(e, i, hidden))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty((e, hidden, 2 * i) if cfg.transposed else (e, 2 * i, hidden)))
        self.down_proj = nn.Parameter(torch.empty((e, i, hidden) if cfg.transposed else (e, hidden, i)))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if cfg.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden)) if cfg.expert_bias else None
        self.down_bias_here = True
        self.weight_input = cfg.weight_input
        self.names = dict(zip(cfg.expert_proj_names, ("gate", "up", "down")))
        self.act = _ACTS.get(cfg.hidden_act)
        if cfg.hidden_act == "swiglu_clamped":
            alpha, limit = cfg.swiglu_alpha, cfg.swiglu_limit
            self.glu = lambda g, u: swiglu_clamped(g, u, alpha, limit)
        else:
            act = _ACTS[cfg.hidden_act]
            self.glu = lambda g, u: act(g) * u

    @property
    def num_experts(self) -> int:
        return self.down_proj.shape[0]

    @property
    def intermediate(self) -> int:  # this rank's intermediate size per expert (TP-sliced)
        return self.down_proj.shape[1] if self.transposed else self.down_proj.shape[2]

    def _weights(self) -> tuple[Tensor, Tensor]:
        """(gate_up [E, H, 2I] (un-gated: up [E, H, I]), down [E, I, H]) as views for x @ w."""
        if not self.gated:
            return self.up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        if self.transposed:
            return self.gate_up_proj, self.down_proj
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor, mode: str | None = None) -> Tensor:
        """x [L, H], weights / experts [L, k] -> sum over k of weight * expert(x) [L, H] (Llama 4: expert(weight * x)).

        The L*k (token, expert) pairs are sorted by expert, so each expert runs one GEMM over its tokens (`mode`:
        see `grouped_mm`); with `torch._grouped_mm` nothing here reads device values on the host."""
        n, k = experts.shape
        flat = experts.reshape(-1)  # [L*k]
        order = torch.argsort(flat, stable=True)  # [L*k] pairs grouped by expert
        token = order // k  # [L*k] the token of each sorted pair
        expert = flat[order]  # [L*k] ascending
        w = weights.reshape(-1)[order][:, None]  # [L*k, 1] fp32
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))  # [E] pairs per expert (no host sync, unlike bincount on CUDA)
        xs = x[token]  # [L*k, H]
        if self.weight_input:
            xs = (xs * w).to(x.dtype)
        gate_up_w, down_w = self._weights()
        h = grouped_mm(xs, gate_up_w, counts, expert, mode)  # [L*k, 2I]
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[expert]
        if not self.gated:
            y = grouped_mm(self.act(h), down_w, counts, expert, mode)  # [L*k, H]
            y = (y * w).to(x.dtype)
            return x.new_zeros(n, x.shape[1]).index_add_(0, token, y)
        if self.interleaved:
            gate, up = h[:, 0::2], h[:, 1::2]  # [L*k, I] each
        else:
            gate, up = h.chunk(2, dim=-1)
        y = grouped_mm(self.glu(gate, up), down_w, counts, expert, mode)  # [L*k, H]
        if self.down_proj_bias is not None and self.down_bias_here:
            y = y + self.down_proj_bias[expert]
        if not self.weight_input:
            y = (y * w).to(x.dtype)
        return x.new_zeros(n, x.shape[1]).index_add_(0, token, y)  # [L, H]

    def checkpoint_part(self, expert: int, proj: str) -> tuple[str, tuple]:
        """Where a per-expert checkpoint tensor `experts.<expert>.<proj>.weight` goes: (parameter name, index)."""
        if self.transposed:
            raise ValueError(f"per-expert tensors ({proj}) for an experts layout stored [E, in, out]: this family's "
                             "checkpoints store fused experts.gate_up_proj / experts.down_proj")
        if proj not in self.names:
            raise ValueError(f"unknown expert projection {proj!r}: expected one of {sorted(self.names)}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range for {self.num_experts} experts")
        i, part = self.intermediate, self.names[proj]
        if part == "down":
            return "down_proj", (expert,)
        if not self.gated:
            if part != "up":
                raise ValueError(f"un-gated experts have no {proj!r} projection (only up_proj / down_proj)")
            return "up_proj", (expert,)
        return "gate_up_proj", (expert, slice(0, i) if part == "gate" else slice(i, 2 * i))

    def parts_expected(self, param: str) -> int:
        """How many per-expert tensors fill one stacked parameter."""
        return self.num_experts * (2 if param == "gate_up_proj" else 1)  # (un-gated up_proj: one per expert)


class SparseMoE(nn.Module):
    """Router → top-k experts grouped by expert → weighted sum, plus an optional shared expert (Qwen2-MoE gates it
    with sigmoid(x w); Llama 4 adds it as is). The router sits under the checkpoint's name (`gate` or `router`)."""

    def __init__(self, hidden: int, cfg: MoEConfig, mlp_factory):
        super().__init__()
        self.router_name = cfg.router_name
        setattr(self, cfg.router_name, Router(hidden, cfg))
        if cfg.latent_size:  # Nemotron 3: the routed experts work in a smaller space, projected in and out
            self.fc1_latent_proj = nn.Linear(hidden, cfg.latent_size, bias=cfg.latent_bias)
            self.fc2_latent_proj = nn.Linear(cfg.latent_size, hidden, bias=cfg.latent_bias)
        self.latent = bool(cfg.latent_size)
        self.experts = Experts(cfg.latent_size or hidden, cfg)
        self.shared_name = cfg.shared_name
        # registered under the checkpoint's name, read through the `shared_expert` property (hence not setattr)
        self._modules[cfg.shared_name] = mlp_factory(cfg.shared_intermediate_size) if cfg.shared_intermediate_size \
            else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if cfg.shared_expert_gate else None
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.correction_bias_on_block \
            else None

    @property
    def route(self) -> Router:
        """The router, whatever the checkpoint calls it."""
        return self._modules[self.router_name]

    @property
    def shared_expert(self) -> nn.Module | None:
        """The shared expert, whatever the checkpoint calls it (`shared_expert`, DeepSeek's `shared_experts`)."""
        return self._modules.get(self.shared_name)

    def forward(self, x: Tensor) -> Tensor:  # [L, hidden] -> [L, hidden]
        weights, experts = self.route(x, self.e_score_correction_bias)  # [L, k] each
        if self.latent:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, experts))
        else:
            out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # [L, hidden]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

