"""Kimi Delta Attention (Kimi Linear's `kimi_linear` linear-attention layers): the gated delta rule with a decay per
key channel, as an affine map of its state, and the mixer layer around it in the staged shape of `__init__.py`.

The rule, per head (S [Dk, Dv] fp32; q, k L2-normalised, q scaled by Dk^-1/2; g_t [Dk] <= 0 a log decay per key
channel; beta_t in (0, 1)):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

so a run maps S_in affinely: S_out = M S_in + B with M = prod_t (I - beta_t k_t k_t^T) Diag(exp g_t) [Dk, Dk]
(latest on the left) and B [Dk, Dv] the run from a zero state. Chunked (the WY form of transformers'
`chunk_kimi_delta_attention` / FLA's chunk_kda), a chunk of C tokens with G_i = sum_{j<=i} g_j [C, Dk] solves
the in-chunk updates at once: with L_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd) (i > j) and A = (I + L)^-1,

    W = A (beta k exp(G)) [C, Dk],   U = A (beta v) [C, Dv],   K~ = k exp(G_C - G) [C, Dk]
    V' = U - W S_0,   o = (q exp(G)) S_0 + tril(q exp(G_i - G_j) k^T) V',   S_C = Diag(exp G_C) S_0 + K~^T V'

so the chunk's map is M_c = Diag(exp G_C) - K~^T W, B_c = K~^T U; `summary` gets M and B from one scan of the
state [I | 0] with values [0 | v] (the rule acts on each column of S alone). Every exp is of a non-positive
number (no overflow), and in-chunk decays exp(G_i - G_j) are summed over the span, not differences of cumulative
sums (which lose digits once G reaches thousands; transformers' chunked form does subtract). Chunks are not padded:
the last may be short, a decode step is a chunk of one. Exact up to fp32 reordering against the token-by-token form
at any cut of the run, so under CP each run's summary (from zero), composed in sequence order, gives the next
run's start state (see `__init__.py`).

The layer (Hugging Face's KimiLinearDeltaAttention; checkpoint names q_proj, k_proj, v_proj, q_conv1d, k_conv1d,
v_conv1d, f_a_proj, f_b_proj, A_log [1, 1, H, 1], dt_bias [H Dk], b_proj, g_a_proj, g_b_proj, o_norm, o_proj):
    project: x -> u = [q_proj x; k_proj x; v_proj x] [T, 3 H Dk] (pre-conv), side = (g, beta, gate) with
             g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj x), gate = g_b(g_a(x))
    conv:    the causal depthwise conv (no bias) + activation over [tail; u], tail [kernel - 1, 3 H Dk]
    inputs:  q, k L2-normalised (q then scaled), v, g, beta: `KDAInputs`, fp32
    output:  o_proj(RMSNorm_Dk(o) * o_norm.weight * sigmoid(gate))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from cpinfer.model.recurrent.affine import Affine
from cpinfer.model.recurrent.delta import DeltaInputs, drop_tiny_
from cpinfer.model.recurrent.short_conv import causal_conv, check_activation
from cpinfer.utils import check_positive

DEFAULT_CHUNK = 64  # tokens per chunk on an accelerator (transformers' and FLA's default)
CPU_CHUNK = 16  # on CPU: the in-chunk work is C^2 Dk elementwise, and 16 runs ~5x faster than 64 at Dk 128


def chunk_for(device: torch.device) -> int:
    """The chunk length `run` / `summary` use by default on `device` (any length gives the same result up to fp32
    rounding)."""
    return CPU_CHUNK if device.type == "cpu" else DEFAULT_CHUNK


@dataclass(frozen=True)
class KDAShape:
    """A KDA layer's shape, from config.json (`KDAShape.from_hf`)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    activation: str = "silu"
    eps: float = 1e-5  # o_norm's (config rms_norm_eps)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel"):
            check_positive(getattr(self, name), f"kimi_linear {name}")
        check_activation(self.activation, "kimi_linear hidden_act")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "KDAShape":
        """From a kimi_linear config.json dict: its `linear_attn_config` (num_heads, head_dim,
        short_conv_kernel_size) or transformers' flat keys (linear_num_heads, linear_head_dim, ...)."""
        lin = cfg.get("linear_attn_config") or {}
        return cls(hidden_size=cfg["hidden_size"],
                   num_heads=lin.get("num_heads", cfg.get("linear_num_heads", 32)),
                   head_dim=lin.get("head_dim", cfg.get("linear_head_dim", 128)),
                   conv_kernel=lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)),
                   activation=cfg.get("hidden_act", "silu"), eps=cfg.get("rms_norm_eps", 1e-5))

    @property
    def key_dim(self) -> int:  # H Dk (= value dim: KDA's heads have Dv = Dk)
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:  # q, k, v before the conv
        return 3 * self.key_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.head_dim)


KDAInputs = DeltaInputs  # one run's inputs: q, k, v, g [T, H, Dk] (a decay per key channel), beta (`delta.py`)


@dataclass(frozen=True)
class KDASide:
    """The per-token inputs besides the conv's: g [T, H, Dk] (log decay, fp32), beta [T, H] (fp32), gate
    [T, H, Dk] (the output gate, before its sigmoid)."""

    g: Tensor
    beta: Tensor
    gate: Tensor

    def __getitem__(self, s: slice) -> "KDASide":
        return KDASide(self.g[s], self.beta[s], self.gate[s])


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA / transformers form)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------- the recurrence

def run(inp: KDAInputs, state: Tensor | None, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """(outputs [T, H, Dv] fp32, state_out [H, Dk, Dv] fp32) of the run from `state` (None: zeros); `chunk` None:
    `chunk_for` the inputs' device."""
    h, dk, dv = *inp.k.shape[1:], inp.v.shape[-1]
    s = inp.v.new_zeros(h, dk, dv, dtype=torch.float32) if state is None else state.float()
    return _scan(inp, s, chunk or chunk_for(inp.k.device), want_out=True)


def summary(inp: KDAInputs, chunk: int | None = None) -> Affine:
    """The run's map Affine(M [H, Dk, Dk], B [H, Dk, Dv]), fp32: the same scan on the state [I | 0] with values
    [0 | v] (the rule acts on each column of S alone, so the identity block comes out as M and the rest as B)."""
    t, h, dk, dv = *inp.k.shape, inp.v.shape[-1]
    eye = torch.eye(dk, dtype=torch.float32, device=inp.k.device).expand(h, dk, dk)
    s0 = torch.cat([eye, eye.new_zeros(h, dk, dv)], dim=-1)  # [H, Dk, Dk + Dv]
    v = torch.cat([inp.v.new_zeros(t, h, dk, dtype=torch.float32), inp.v.float()], dim=-1)
    _, s = _scan(KDAInputs(inp.q, inp.k, v, inp.g, inp.beta), s0, chunk or chunk_for(inp.k.device), want_out=False,
                 flush=True)
    return Affine(s[..., :dk].contiguous(), s[..., dk:].contiguous())


def _scan(inp: KDAInputs, s: Tensor, chunk: int, want_out: bool, flush: bool = False) -> tuple[Tensor | None, Tensor]:
    """The chunked form from s [H, Dk, Dv] -> (o [T, H, Dv] or None, s_out), one chunk at a time. `flush` (the
    summary's augmented state): `delta.drop_tiny_` after each chunk, so that the decaying identity block never
    reaches float32's denormals."""
    t, dv = len(inp), inp.v.shape[-1]
    q, k, v, g = (x.float().transpose(0, 1) for x in (inp.q, inp.k, inp.v, inp.g))  # [H, T, D]
    beta = inp.beta.float().T  # [H, T]
    o = v.new_empty(v.shape[0], t, dv) if want_out else None
    s = s.clone()
    for a in range(0, t, chunk):
        c = slice(a, min(a + chunk, t))
        gc, decay, w, u, k_end = _chunk_terms(k[:, c], v[:, c], g[:, c], beta[:, c])
        v_new = u - w @ s  # [H, C, Dv]
        if want_out:
            qc = q[:, c]
            qk = (qc[:, :, None] * k[:, None, c] * decay).sum(-1)  # [H, C, C]: zero above the diagonal
            o[:, c] = (qc * gc.exp()) @ s + qk @ v_new
        s = s * gc[:, -1, :, None].exp() + k_end.transpose(1, 2) @ v_new
        if flush:
            drop_tiny_(s)
    return (o.transpose(0, 1) if want_out else None), s


def _chunk_terms(k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """One chunk, heads batched: k [H, C, Dk], v [H, C, Dv], g [H, C, Dk], beta [H, C] -> G (cumulative log decay)
    [H, C, Dk], decay [H, C, C, Dk] (exp(G_i - G_j) for j <= i, else 0), W [H, C, Dk], U [H, C, Dv] and
    K~ [H, C, Dk] (see the module docstring). G_i - G_j is summed as sum_{j<r<=i} g_r (masked cumulative sums),
    not subtracted: with strong decays G reaches thousands and the difference would lose digits."""
    h, c, dk = k.shape
    gc = g.cumsum(1)
    ones = torch.ones(c, c, dtype=torch.bool, device=k.device)
    seg = g[:, :, None].expand(h, c, c, dk).masked_fill(~ones.tril(-1)[..., None], 0.0).cumsum(1)  # [H, i, j, Dk]
    decay = seg.masked_fill(~ones.tril()[..., None], float("-inf")).exp()  # exp(sum_{j<r<=i} g_r), 0 for j > i
    kb = k * beta[..., None]
    lower = (kb[:, :, None] * k[:, None] * decay).sum(-1).tril(-1)  # [H, C, C]: L, strictly lower
    eye = torch.eye(c, dtype=k.dtype, device=k.device)
    a = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    w = a @ (kb * gc.exp())
    u = a @ (v * beta[..., None])
    k_end = k * decay[:, -1]  # k_i exp(G_C - G_i)
    return gc, decay, w, u, k_end


# ---------------------------------------------------------------- the layer

class KDAMixer(nn.Module):
    """One KDA layer with Hugging Face's checkpoint names (`model.layers.<i>.self_attn.*` of kimi_linear). The
    stages (`project`, `conv`, `inputs`, then `run` / `summary`, `output`) are what the engine runs under CP;
    `forward` chains them for one sequence on one device."""

    def __init__(self, shape: KDAShape):
        super().__init__()
        self.shape = s = shape
        hidden, d, kd = s.hidden_size, s.head_dim, s.key_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, kd, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(kd, kd, s.conv_kernel, groups=kd, bias=False) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, d, bias=False)
        self.f_b_proj = nn.Linear(d, kd, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, s.num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(kd))
        self.b_proj = nn.Linear(hidden, s.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, d, bias=False)
        self.g_b_proj = nn.Linear(d, kd, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(kd, hidden, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, KDASide]:
        """x [T, hidden] -> (u [T, 3 H Dk] pre-conv q, k, v; the side inputs)."""
        t, h, d = x.shape[0], self.shape.num_heads, self.shape.head_dim
        u = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()  # [T, H Dk]
        f = f.view(t, h, d)
        softplus = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))  # transformers' form, to the bit
        g = -torch.exp(self.A_log.float().view(h, 1)) * softplus  # [T, H, Dk]
        beta = torch.sigmoid(self.b_proj(x)).float()  # [T, H]
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        return u, KDASide(g, beta, gate)

    def conv_weight(self) -> Tensor:
        """[3 H Dk, kernel]: the q, k, v depthwise kernels stacked (the conv's channel order)."""
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])

    def conv(self, u: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
        """u [T, 3 H Dk], tail [kernel - 1, 3 H Dk] (None: zeros) -> (act(conv) [T, 3 H Dk], new tail)."""
        return causal_conv(u, tail, self.conv_weight(), None, self.shape.activation)

    def inputs(self, u: Tensor, side: KDASide) -> KDAInputs:
        """Conv'd u [T, 3 H Dk] and the side inputs -> the recurrence's inputs (fp32)."""
        t, h, d = u.shape[0], self.shape.num_heads, self.shape.head_dim
        q, k, v = (x.float().reshape(t, h, d) for x in u.split(self.shape.key_dim, dim=-1))
        return KDAInputs(l2norm(q) * d ** -0.5, l2norm(k), v, side.g, side.beta)

    def output(self, o: Tensor, side: KDASide) -> Tensor:
        """o [T, H, Dv] (fp32) -> [T, hidden]: per-head RMSNorm, its weight, the sigmoid gate, o_proj."""
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.shape.eps)
        o = self.o_norm.weight.float() * o * torch.sigmoid(side.gate.float())
        return self.o_proj(o.to(self.o_proj.weight.dtype).reshape(o.shape[0], self.shape.key_dim))

    def forward(self, x: Tensor, state: Tensor | None = None, tail: Tensor | None = None,
                ) -> tuple[Tensor, Tensor, Tensor]:
        """One sequence's run on one device: x [T, hidden], state [H, Dk, Dv] and conv tail (None: a sequence
        start) -> (y [T, hidden], state_out, tail_out)."""
        u, side = self.project(x)
        u, tail = self.conv(u, tail)
        o, state = run(self.inputs(u, side), state)
        return self.output(o, side), state, tail


__all__ = ["Affine", "CPU_CHUNK", "DEFAULT_CHUNK", "KDAInputs", "KDAMixer", "KDAShape", "KDASide", "chunk_for", "l2norm",
           "run", "summary"]
