"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule and the mixer layer around it, in the staged shape
of every recurrent mixer here (project → conv → inputs → summary / run → output; see `__init__.py`).

The rule, per value head (S [Dk, Dv] fp32, q/k L2-normalised, q scaled by Dk^-1/2, g_t <= 0 a log decay):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

so a run maps S_in affinely: S_out = M S_in + B with M = prod_t exp(g_t)(I - beta_t k_t k_t^T) (latest on the
left) and B the run from a zero state. `run` is the chunked (UT-transform) form transformers'
`torch_chunk_gated_delta_rule` computes, from any state and for any run length (a token-by-token loop for
short runs: decode); `summary` is the same scan on the state augmented by an identity block with zero values,
so M and B come out of one pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpinfer.model.recurrent.affine import Affine
from cpinfer.model.recurrent.delta import DeltaInputs, drop_tiny_
from cpinfer.model.recurrent.short_conv import causal_conv

DEFAULT_CHUNK = 64  # tokens per chunk of the chunked form (transformers' default)
_STEP_BELOW = 8  # runs shorter than this go token by token (decode, verify)


@dataclass(frozen=True)
class GDNConfig:
    """A Gated DeltaNet layer's shape (config.json's linear_* keys). `layout`: how the input projections are
    stored: "qkvz" (Qwen3-Next: in_proj_qkvz and in_proj_ba, interleaved per key head) or "split" (Qwen3.5:
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    layout: str = "split"
    activation: str = "silu"

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"linear attention {name} must be positive, got {getattr(self, name)}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_key_heads})")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        if self.layout not in ("qkvz", "split"):
            raise ValueError(f"unknown Gated DeltaNet layout {self.layout!r}: expected 'qkvz' or 'split'")
        if self.activation != "silu":
            raise ValueError(f"Gated DeltaNet conv activation {self.activation!r} is not supported: cpinfer "
                             "supports 'silu'")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:  # q, k, v before the conv
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)


GDNInputs = DeltaInputs  # one run's inputs: q, k, v, g [T, H] (a decay per head), beta (`delta.py`)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------- the recurrence

def run(inp: GDNInputs, state: Tensor | None, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """(outputs [T, H, Dv] fp32, state_out [H, Dk, Dv] fp32) of the run from `state` (None: zeros)."""
    h, dk, dv = inp.q.shape[1], inp.q.shape[2], inp.v.shape[2]
    s = torch.zeros(h, dk, dv, dtype=torch.float32, device=inp.q.device) if state is None else state.float()
    if len(inp) == 0:
        return inp.v.new_zeros(0, h, dv), s.clone()
    if len(inp) < _STEP_BELOW:
        return _steps(inp, s)
    return _scan(inp.q, inp.k, inp.v, inp.g, inp.beta, s, chunk, True)


def summary(inp: GDNInputs, chunk: int = DEFAULT_CHUNK) -> Affine:
    """The run's map Affine(M [H, Dk, Dk], B [H, Dk, Dv]): state [0 | I] with values [v | 0], one scan."""
    return _augmented(inp, chunk, False)[0]


def summary_with_outputs(inp: GDNInputs, chunk: int = DEFAULT_CHUNK) -> tuple[Affine, Tensor, Tensor]:
    """The run's map and its outputs as a function of the incoming state, from the same scan: (map, o0 [T, H, Dv]
    the outputs from a zero state, om [T, H, Dk] = q_t^T M_{<=t}), so that from any state S the outputs are
    `outputs_from(o0, om, S)` = o0 + om S — one pass for a shard whose starting state is known only later (CP)."""
    return _augmented(inp, chunk, True)


def outputs_from(o0: Tensor, om: Tensor, state: Tensor | None) -> Tensor:
    """o0 [T, H, Dv] + om [T, H, Dk] · state [H, Dk, Dv] (None: a zero state)."""
    return o0 if state is None else o0 + torch.einsum("thk,hkv->thv", om, state.float())


def _augmented(inp: GDNInputs, chunk: int, want_out: bool):
    t, h, dk, dv = inp.q.shape[0], inp.q.shape[1], inp.q.shape[2], inp.v.shape[2]
    dev = inp.q.device
    s0 = torch.cat((torch.zeros(h, dk, dv, dtype=torch.float32, device=dev),
                    torch.eye(dk, dtype=torch.float32, device=dev).expand(h, dk, dk)), dim=-1)  # [H, Dk, Dv + Dk]
    if t == 0:
        o, s = inp.v.new_zeros(0, h, dv + dk), s0
    elif t < _STEP_BELOW:
        v = torch.cat((inp.v, inp.v.new_zeros(t, h, dk)), dim=-1)  # [T, H, Dv + Dk]
        o, s = _steps(GDNInputs(inp.q, inp.k, v, inp.g, inp.beta), s0)
    else:  # the identity block's values are zero: the scan solves for the real values only
        o, s = _scan(inp.q, inp.k, inp.v, inp.g, inp.beta, s0, chunk, want_out)
    amap = Affine(s[..., dv:].contiguous(), s[..., :dv].contiguous())
    if not want_out:
        return amap, None, None
    return amap, o[..., :dv].contiguous(), o[..., dv:].contiguous()


def _steps(inp: GDNInputs, s: Tensor) -> tuple[Tensor, Tensor]:
    """Token by token (the recurrent form): s [H, Dk, Dv] -> (o [T, H, Dv], s_out)."""
    out = []
    for t in range(len(inp)):
        s = s * inp.g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, inp.k[t])  # S^T k
        delta = (inp.v[t] - kv) * inp.beta[t][:, None]  # [H, Dv]
        s = s + inp.k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, inp.q[t]))
    return torch.stack(out), s


_BLOCK_BYTES = 1 << 20  # the chunks handled at once: about this many bytes per [H, chunks, C, D] tensor (cache-sized)


def _scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor, chunk: int,
          want_out: bool) -> tuple[Tensor | None, Tensor]:
    """The chunked form. q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], s [H, Dk, W] with W >= Dv (W > Dv: the
    state's columns past Dv have zero values: the summary's identity block) -> (o [T, H, W] or None, s_out).
    Within a chunk the delta rule's updates are solved at once (a unit lower-triangular system: the UT transform);
    between chunks the state is carried by one matmul per chunk. A few chunks at a time, so that every temporary
    stays in cache (the whole sequence at once is memory-bound on a CPU); the same arithmetic either way. An
    augmented state's entries below 2^-64 are set to 0 after each chunk: its identity block decays as exp(sum g)
    over the run and would otherwise fall into float32's denormals, where every multiply is ~100x slower (what they
    would add to a state is below 1e-17 of it)."""
    t, h, dk, dv, width = q.shape[0], q.shape[1], q.shape[2], v.shape[2], s.shape[-1]
    dev = q.device
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()
    out = torch.empty(t, h, width, dtype=torch.float32, device=dev) if want_out else None
    step = chunk * max(1, _BLOCK_BYTES // (4 * h * chunk * max(dk, width)))
    for a in range(0, t, step):
        e = min(t, a + step)
        pad = (-(e - a)) % chunk  # padded with tokens that change nothing (k = v = 0, beta = 0, g = 0)
        n = (e - a + pad) // chunk
        # [H, N, C, D] fp32
        qc, kc, vc = (F.pad(x[a:e].float().transpose(0, 1), (0, 0, 0, pad)).reshape(h, n, chunk, -1)
                      for x in (q, k, v))
        gc, bc = (F.pad(x[a:e].float().transpose(0, 1), (0, pad)).reshape(h, n, chunk) for x in (g, beta))
        kb = kc * bc[..., None]
        cg = gc.cumsum(-1)  # [H, N, C] log decay from the chunk's start through each token
        decay = (cg[..., :, None] - cg[..., None, :]).masked_fill(~lower, -torch.inf).exp()  # [H, N, C, C] i >= j
        system = (kb @ kc.transpose(-1, -2)) * decay  # strictly lower part used; unit diagonal
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * cg.exp()[..., None], upper=False, unitriangular=True)
        intra = (qc @ kc.transpose(-1, -2)) * decay if want_out else None  # [H, N, C, C]
        q_dec = qc * cg.exp()[..., None]
        k_dec_t = (kc * (cg[..., -1:] - cg).exp()[..., None]).transpose(-1, -2)  # [H, N, Dk, C]
        chunk_decay = cg[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
        ob = torch.empty(h, n, chunk, width, dtype=torch.float32, device=dev) if want_out else None
        for i in range(n):
            v_new = -(w[:, i] @ s)  # [H, C, W]: the values less what the state already predicts
            v_new[..., :dv] += u[:, i]
            if want_out:
                torch.baddbmm(intra[:, i] @ v_new, q_dec[:, i], s, out=ob[:, i])
            s = torch.baddbmm(s * chunk_decay[:, i], k_dec_t[:, i], v_new)
            if width > dv:  # the identity block decays towards float32's denormals
                drop_tiny_(s)
        if want_out:
            out[a:e] = ob.reshape(h, n * chunk, width)[:, :e - a].transpose(0, 1)
    return out, s


# ---------------------------------------------------------------- the mixer layer

class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, times silu(z): weight * x̂ (cast to x's dtype) * silu(z fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (`linear_attn` in the checkpoint), in stages; the recurrent callback of the engine
    (or `recurrent/reference.py`) runs stages 2-4 per sequence with its conv tail and state."""

    recurrence = "gdn"

    def __init__(self, cfg: GDNConfig, hidden: int, eps: float, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        c = cfg.conv_channels
        if cfg.layout == "qkvz":
            self.in_proj_qkvz = nn.Linear(hidden, 2 * cfg.key_dim + 2 * cfg.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * cfg.num_value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, c, bias=False)
            self.in_proj_z = nn.Linear(hidden, cfg.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, cfg.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, cfg.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c, c, cfg.conv_kernel, groups=c, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads))
        self.norm = GatedRMSNorm(cfg.value_head_dim, eps)
        self.out_proj = nn.Linear(cfg.value_dim, hidden, bias=False)

    # what the engine sizes its caches by
    @property
    def kernel(self) -> int:
        return self.cfg.conv_kernel

    @property
    def conv_channels(self) -> int:
        return self.cfg.conv_channels

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.cfg.state_shape

    @property
    def side_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of the side inputs (z, b, a): what the engine ships for a short shard."""
        hv = self.cfg.num_value_heads
        return ((hv, self.cfg.value_head_dim), (hv,), (hv,))

    def project(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """Stage 1: x [T, hidden] -> (u [T, C] = [q | k | v] before the conv, (z [T, Hv, Dv], b, a [T, Hv]))."""
        cfg, n = self.cfg, x.shape[0]
        hk, hv, dk, dv = cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim
        if cfg.layout == "split":
            u = self.in_proj_qkv(x)
            z = self.in_proj_z(x).view(n, hv, dv)
            return u, (z, self.in_proj_b(x), self.in_proj_a(x))
        r = hv // hk  # Qwen3-Next: per key head [q, k, v (r heads), z (r heads)] and [b (r), a (r)]
        qkvz = self.in_proj_qkvz(x).view(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(n, hk, 2 * r), [r, r], dim=-1)
        u = torch.cat((q.reshape(n, cfg.key_dim), k.reshape(n, cfg.key_dim), v.reshape(n, cfg.value_dim)), dim=-1)
        return u, (z.reshape(n, hv, dv), b.reshape(n, hv), a.reshape(n, hv))

    def conv(self, u: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        """Stage 2: the causal depthwise conv over [tail; u] and silu. u [T, C], tail [K-1, C] -> (u' [T, C],
        the new tail: the last K-1 rows of [tail; u])."""
        return causal_conv(u, tail, self.conv1d.weight[:, 0], self.conv1d.bias, "silu")

    def inputs(self, u: Tensor, side: tuple[Tensor, Tensor, Tensor]) -> GDNInputs:
        """Stage 3: the conv'd u' [T, C] and (z, b, a) -> fp32 q, k (L2-normed, heads repeated to Hv, q scaled), v,
        g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
        cfg, n = self.cfg, u.shape[0]
        r = cfg.num_value_heads // cfg.num_key_heads
        q, k, v = torch.split(u, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(n, cfg.num_key_heads, cfg.key_head_dim)
        k = k.reshape(n, cfg.num_key_heads, cfg.key_head_dim)
        if r > 1:
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        q = l2norm(q.float()) * cfg.key_head_dim ** -0.5
        k = l2norm(k.float())
        _, b, a = side
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return GDNInputs(q, k, v.reshape(n, cfg.num_value_heads, cfg.value_head_dim).float(), g.float(), beta)

    @staticmethod
    def run(inp: GDNInputs, state: Tensor | None) -> tuple[Tensor, Tensor]:
        return run(inp, state)

    @staticmethod
    def summary(inp: GDNInputs) -> Affine:
        return summary(inp)

    @staticmethod
    def summary_with_outputs(inp: GDNInputs) -> tuple[Affine, Tensor, Tensor]:
        return summary_with_outputs(inp)

    @staticmethod
    def outputs_from(o0: Tensor, om: Tensor, state: Tensor | None) -> Tensor:
        return outputs_from(o0, om, state)

    def output(self, o: Tensor, side: tuple[Tensor, Tensor, Tensor], x: Tensor) -> Tensor:
        """Stage 5: o [T, Hv, Dv] fp32 -> gated RMSNorm with z, out_proj -> [T, hidden]."""
        z = side[0]
        y = self.norm(o.to(x.dtype), z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(o.shape[0], self.cfg.value_dim))

    def forward(self, x: Tensor, recurrent) -> Tensor:
        """x [L, hidden] (any sequences, packed) -> [L, hidden]; `recurrent(layer_idx, mixer, u, side)` runs the
        conv and the recurrence per sequence and returns o [L, Hv, Dv]."""
        u, side = self.project(x)
        o = recurrent(self.layer_idx, self, u, side)
        return self.output(o, side, x)
