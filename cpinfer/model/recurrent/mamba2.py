"""Mamba-2 (Nemotron-H's `nemotron_h` mamba layers): the SSD recurrence with grouped B / C and a D skip, as an affine
map of its state, and the mixer layer around it in the staged shape of `__init__.py`.

The recurrence, per head h (S [P, N] fp32: head dim x state size; heads share B_t, C_t [N] within a group of
H / G heads; dt_t > 0; A_h = -exp(A_log_h) < 0):

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,      y_t = S_t C_t + D_h x_t

so a run maps S_in affinely with a scalar per head: S_out = M S_in + B, M [H] = exp(A_h sum_t dt_t) and
B [H, P, N] = sum_t exp(A_h sum_{s>t} dt_s) dt_t x_t B_t^T (the run from zero). `run` is the chunked SSD form of
transformers' `mamba2_chunk_scan` (within a chunk: y = (C B^T o L) (dt x) with L_ts = exp(sum_{t>=r>s} dt_r A),
plus the chunk's start state decayed; between chunks one scaled add), from any state, chunks unpadded (the last
may be short; a decode step is a chunk of one). Decays over a span are summed over the span (masked cumulative
sums), never differences of long sums, which lose digits when A dt is large. `summary` is the closed form above in
one contraction.

dt: softplus(dt_raw + dt_bias) clamped to [dt_min, dt_max]. transformers' NemotronHMamba2Mixer clamps to
(time_step_min, inf) in its chunked (prefill) path and not at all in its one-token decode path; cpinfer clamps
always (a token's dt must not depend on how the tokens are batched, or CP and chunked prefill would not be exact),
which equals both wherever softplus(dt_raw + dt_bias) >= time_step_min.

The layer (Hugging Face's NemotronHMamba2Mixer; checkpoint names in_proj, conv1d, dt_bias [H], A_log [H], D [H],
norm, out_proj under `backbone.layers.<i>.mixer.`):
    project: in_proj(x) = [z (H P) | xBC (H P + 2 G N) | dt_raw (H)]: u = xBC (pre-conv), side = (z, dt)
    conv:    the causal depthwise conv (+ bias) + activation over [tail; u], tail [kernel - 1, H P + 2 G N]
    inputs:  x [T, H, P], B, C [T, G, N], dt [T, H], A [H], D [H]: `Mamba2Inputs`, fp32
    output:  out_proj(norm.weight * GroupRMSNorm_G(y * silu(z)))  (norm after the gate, G groups over H P)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.recurrent.affine import Affine
from cpinfer.model.recurrent.short_conv import causal_conv, check_activation
from cpinfer.utils import check_divisible, check_positive

DEFAULT_CHUNK = 128  # nemotron_h's chunk_size default


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's shape, from config.json (`Mamba2Shape.from_hf`)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False  # in_proj / out_proj
    activation: str = "silu"
    eps: float = 1e-5  # the gated norm's (config layer_norm_epsilon)
    chunk_size: int = DEFAULT_CHUNK
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "chunk_size"):
            check_positive(getattr(self, name), f"nemotron_h mamba {name}")
        check_divisible(self.num_heads, self.n_groups, "nemotron_h mamba_num_heads", "n_groups")
        check_activation(self.activation, "nemotron_h mamba_hidden_act")
        if not 0.0 <= self.dt_min <= self.dt_max:
            raise ValueError(f"nemotron_h time step limits must satisfy 0 <= min <= max, got "
                             f"({self.dt_min}, {self.dt_max})")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "Mamba2Shape":
        """From a nemotron_h config.json dict (transformers' names, or the checkpoints' `mamba_*` aliases). The
        dt limit is transformers' (time_step_min, inf)."""
        def get(name, alias, default):
            return cfg.get(alias, cfg.get(name, default))
        return cls(hidden_size=cfg["hidden_size"], num_heads=cfg.get("mamba_num_heads", 128),
                   head_dim=cfg.get("mamba_head_dim", 64), n_groups=get("n_groups", "mamba_n_groups", 8),
                   state_size=cfg.get("ssm_state_size", 128), conv_kernel=get("conv_kernel", "mamba_d_conv", 4),
                   use_conv_bias=get("use_conv_bias", "mamba_conv_bias", True), use_bias=cfg.get("use_bias", False),
                   activation=cfg.get("mamba_hidden_act", "silu"), eps=cfg.get("layer_norm_epsilon", 1e-5),
                   chunk_size=get("chunk_size", "mamba_chunk_size", DEFAULT_CHUNK),
                   dt_min=get("time_step_min", "mamba_dt_min", 0.001))

    @property
    def inner(self) -> int:  # H P
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:  # x, B, C before the conv
        return self.inner + 2 * self.n_groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class Mamba2Inputs:
    """One run's recurrence inputs, fp32: x [T, H, P], dt [T, H] (discretised: > 0), A [H] (< 0), B, C [T, G, N],
    D [H] (the skip; None for none)."""

    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, s: slice) -> "Mamba2Inputs":
        return Mamba2Inputs(self.x[s], self.dt[s], self.A, self.B[s], self.C[s], self.D)


@dataclass(frozen=True)
class Mamba2Side:
    """The per-token inputs besides the conv's: z [T, H P] (the gate), dt [T, H] (discretised, fp32)."""

    z: Tensor
    dt: Tensor

    def __getitem__(self, s: slice) -> "Mamba2Side":
        return Mamba2Side(self.z[s], self.dt[s])


def discretize_dt(dt_raw: Tensor, dt_bias: Tensor, dt_min: float = 0.0, dt_max: float = math.inf) -> Tensor:
    """[T, H] -> clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), fp32."""
    return torch.clamp(F.softplus(dt_raw.float() + dt_bias.float()), min=dt_min, max=dt_max)


# ---------------------------------------------------------------- the recurrence

def run(inp: Mamba2Inputs, state: Tensor | None, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """(outputs y [T, H, P] fp32 (D skip included), state_out [H, P, N] fp32) of the run from `state` (None:
    zeros)."""
    t, h, p = inp.x.shape
    x, dt, a_h = inp.x.float(), inp.dt.float(), inp.A.float()
    b, c = _per_head(inp.B, h), _per_head(inp.C, h)  # [T, H, N]
    s = x.new_zeros(h, p, b.shape[-1]) if state is None else state.float().clone()
    a = dt * a_h  # [T, H] log decays
    xdt = x * dt[..., None]  # [T, H, P]
    y = x.new_empty(t, h, p)
    for i in range(0, t, chunk):
        r = slice(i, min(i + chunk, t))
        ac = a[r].T  # [H, C]
        acum = ac.cumsum(-1)
        decay = _segsum(ac).exp()  # [H, C, C]: exp(sum_{s<r<=l} a_r), 0 above the diagonal
        within = torch.einsum("lhn,shn->hls", c[r], b[r]) * decay
        y[r] = (torch.einsum("hls,shp->lhp", within, xdt[r])
                + torch.einsum("lhn,hpn->lhp", c[r], s) * acum.exp().T[..., None])
        to_end = decay[:, -1]  # [H, C]: exp(sum_{s<r<=last} a_r), summed rather than a difference of sums
        s = s * acum[:, -1].exp()[:, None, None] + torch.einsum("lhn,hl,lhp->hpn", b[r], to_end, xdt[r])
    if inp.D is not None:
        y = y + inp.D.float()[:, None] * x
    return y, s


def summary(inp: Mamba2Inputs) -> Affine:
    """The run's map Affine(M [H], B [H, P, N]), fp32, in closed form."""
    h = inp.x.shape[1]
    a = inp.dt.float() * inp.A.float()  # [T, H]
    after = a.flip(0).cumsum(0).flip(0)  # [T, H]: sum_{s >= t} a_s
    total = after[0] if len(inp) else a.new_zeros(h)
    after = torch.cat([after[1:], a.new_zeros(min(len(inp), 1), h)])  # sum_{s > t} a_s
    xdt = inp.x.float() * (inp.dt.float() * after.exp())[..., None]  # [T, H, P]
    return Affine(total.exp(), torch.einsum("thp,thn->hpn", xdt, _per_head(inp.B, h)))


def _per_head(bc: Tensor, h: int) -> Tensor:
    """[T, G, N] -> [T, H, N]: group g serves heads g H/G ... (g + 1) H/G - 1."""
    return bc.float().repeat_interleave(h // bc.shape[1], dim=1)


def _segsum(a: Tensor) -> Tensor:
    """a [H, C] -> [H, C, C]: sum_{s < r <= l} a_r for l >= s, -inf above the diagonal (masked cumulative sums,
    as transformers' segment_sum: no differences of long sums)."""
    c = a.shape[-1]
    x = a[..., None].expand(*a.shape, c)  # x[..., r, s] = a_r
    x = x.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1), 0.0)
    return x.cumsum(-2).masked_fill(~torch.ones(c, c, dtype=torch.bool, device=a.device).tril(), float("-inf"))


# ---------------------------------------------------------------- the layer

class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer with Hugging Face's checkpoint names (`backbone.layers.<i>.mixer.*` of nemotron_h). The
    stages (`project`, `conv`, `inputs`, then `run` / `summary`, `output`) are what the engine runs under CP;
    `forward` chains them for one sequence on one device."""

    def __init__(self, shape: Mamba2Shape):
        super().__init__()
        self.shape = s = shape
        ch = s.conv_channels
        self.in_proj = nn.Linear(s.hidden_size, s.inner + ch + s.num_heads, bias=s.use_bias)
        self.conv1d = nn.Conv1d(ch, ch, s.conv_kernel, groups=ch, bias=s.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(s.inner))
        self.out_proj = nn.Linear(s.inner, s.hidden_size, bias=s.use_bias)

    def project(self, x: Tensor) -> tuple[Tensor, Mamba2Side]:
        """x [T, hidden] -> (u [T, H P + 2 G N] pre-conv x, B, C; the side inputs)."""
        s = self.shape
        z, u, dt_raw = self.in_proj(x).split([s.inner, s.conv_channels, s.num_heads], dim=-1)
        return u, Mamba2Side(z, discretize_dt(dt_raw, self.dt_bias, s.dt_min, s.dt_max))

    def conv(self, u: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
        """u [T, H P + 2 G N], tail [kernel - 1, same] (None: zeros) -> (act(conv + bias), new tail)."""
        return causal_conv(u, tail, self.conv1d.weight[:, 0], self.conv1d.bias, self.shape.activation)

    def inputs(self, u: Tensor, side: Mamba2Side) -> Mamba2Inputs:
        """Conv'd u and the side inputs -> the recurrence's inputs (fp32)."""
        s, t = self.shape, u.shape[0]
        x, b, c = u.float().split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        return Mamba2Inputs(x.reshape(t, s.num_heads, s.head_dim), side.dt, -torch.exp(self.A_log.float()),
                            b.reshape(t, s.n_groups, s.state_size), c.reshape(t, s.n_groups, s.state_size),
                            self.D.float())

    def output(self, y: Tensor, side: Mamba2Side) -> Tensor:
        """y [T, H, P] (fp32, D skip included) -> [T, hidden]: gate, grouped RMSNorm, its weight, out_proj."""
        t, g, inner = y.shape[0], self.shape.n_groups, self.shape.inner
        y = y.float().reshape(t, g, inner // g) * F.silu(side.z.float()).view(t, g, inner // g)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.shape.eps)).reshape(t, inner)
        return self.out_proj((self.norm.weight * y).to(self.out_proj.weight.dtype))  # transformers' prefill order

    def forward(self, x: Tensor, state: Tensor | None = None, tail: Tensor | None = None,
                ) -> tuple[Tensor, Tensor, Tensor]:
        """One sequence's run on one device: x [T, hidden], state [H, P, N] and conv tail (None: a sequence start)
        -> (y [T, hidden], state_out, tail_out)."""
        u, side = self.project(x)
        u, tail = self.conv(u, tail)
        y, state = run(self.inputs(u, side), state, self.shape.chunk_size)
        return self.output(y, side), state, tail


__all__ = ["Affine", "DEFAULT_CHUNK", "Mamba2Inputs", "Mamba2Mixer", "Mamba2Shape", "Mamba2Side", "discretize_dt",
           "run", "summary"]
