"""`torch-cudnn`'s ops: PyTorch's cuDNN attention with log-sum-exp behind one interface (`CudnnAPI`), found and
probed once per device; `cudnn_backend.py` maps a ring step's items onto them. What the ops do (read from PyTorch's
`attention.cu`, `cudnn/MHA.cpp` and `sdp_utils.cpp`, checked by the probe):

- dense `aten._scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
  return_debug_mask, *, scale)`: q [B, H, Lq, D], k/v [B, Hkv, Lk, D] (any strides with a unit last one; the
  cuDNN graph is built from the given strides and cached per shape/stride), log-sum-exp [B, H, Lq] fp32. Its causal
  mask is cuDNN's `set_causal_mask`: TOP-LEFT (row i sees keys j <= i), so it is exact only for squares — which is
  what cpinfer's CAUSAL items are (`local._pair_items`: a top-left square after the FULL blocks of the same rows).
  Every other block is FULL (is_causal=False). K/V heads are passed as they are (GQA in the graph); if the probe
  finds that wrong on a device, causal squares repeat the K/V heads instead.
- ragged `aten._cudnn_attention_forward(q, k, v, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, ...)`: packed
  q [total_q, H, D] (offsets are computed as cum_seq x H x D: packed contiguous tensors only), log-sum-exp
  [total_q, H, 1] (other layouts read too). PyTorch's own varlen front end refuses it for GQA and for causal with
  different q / k lengths, and older builds wrote each sequence's log-sum-exp at the wrong offset — so cpinfer
  uses it only for FULL blocks (no mask) with GQA folded into rows, and only when its own probe passed.
- GQA folding (FULL blocks, no mask): the G query heads of a KV head become G query rows against that head
  (q [L, H, D] → [L·G, Hkv, D]), exact because rows of an unmasked block are independent; a one-row decode
  block becomes G rows, its log-sum-exp [G, Hkv] → [1, H].
- The log-sum-exp is the natural log (cuDNN's softmax stats; a base-2 one is refused by the probe). No row of any
  call cpinfer makes sees no key (FULL blocks have keys; a top-left square's row i sees key 0), so no empty-row
  convention is relied on; +inf / NaN would still read as -inf.
- Alignment: cuDNN wants 16-byte aligned bases and strides (multiples of 8 bf16 elements) with a unit last stride;
  a view that is not is copied first (`aligned`). PyTorch's SDPA dispatch refuses cuDNN for a key length of 1
  (`check_cudnn_tensor_shapes`): blocks of one key (a one-row square, a FULL block of one key) are computed
  without the op — the value itself, the scaled score as log-sum-exp (`cudnn_backend.one_key`).

The first use on each device runs a probe (fp16, GQA) against a float32 reference: dense causal squares (batch of
two), dense FULL blocks with Lq != Lk, a one-row decode block (failing: once more with K/V heads repeated), causal
squares on strided views as a fused QKV projection gives them (failing: dense inputs are packed first), then the
ragged op over three sequences of unequal lengths. The dense calls failing → one warning naming what failed,
`auto` skips torch-cudnn; the ragged call failing → one warning, FULL blocks of many shapes run as dense calls
grouped by shape instead.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from cpinfer.attention.torch_flash import _cu, _device_key, probe_once, reference

log = logging.getLogger(__name__)

DEVICES = ("cuda",)  # where the ops run (the CPU tests add "cpu" with fake ops that check every call)
PROBE_ATOL = 2e-2  # fp16 probe: a misaligned causal mask, a base-2 LSE or a wrong layout is off by >= 0.1
ALIGN = 16  # bytes


def aten_ops():
    """(dense op, ragged op) of this torch, each None when absent (tests replace this)."""
    def get(name):
        try:
            return getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            return None

    return get("_scaled_dot_product_cudnn_attention"), get("_cudnn_attention_forward")


# ---------------------------------------------------------------- the ops behind one interface

def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its base or a stride is not a multiple of 16 bytes or its last stride is not 1."""
    size = t.element_size()
    ok = t.stride(-1) == 1 and all(s * size % ALIGN == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    if ok and t.device.type != "meta":
        ok = t.data_ptr() % ALIGN == 0
    return t if ok else t.contiguous()


def fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., L, H, D] → [..., L·G, Hkv, D]: query head kv·G + g becomes row i·G + g of KV head kv (a copy)."""
    *lead, n, h, d = q.shape
    g = h // kv_heads
    x = q.reshape(*lead, n, kv_heads, g, d).transpose(-3, -2)  # [..., L, G, Hkv, D]
    return x.reshape(*lead, n * g, kv_heads, d).contiguous()  # (a view when L == 1: packed here, always)


def unfold_heads(out: torch.Tensor, lse: torch.Tensor, g: int):
    """Inverse of `fold_heads`: out [..., L·G, Hkv, Dv], lse [..., L·G, Hkv] → [..., L, H, Dv], [..., L, H]."""
    *lead, ng, hkv, dv = out.shape
    n = ng // g
    out = out.reshape(*lead, n, g, hkv, dv).transpose(-3, -2).reshape(*lead, n, g * hkv, dv)
    lse = lse.reshape(*lead, n, g, hkv).transpose(-2, -1).reshape(*lead, n, g * hkv)
    return out, lse


def dense_lse(lse: torch.Tensor, b: int, heads: int, lq: int) -> torch.Tensor:
    """The dense op's log-sum-exp ([B, H, Lq] or [B, H, Lq, 1]) → [B, Lq, H] fp32."""
    if tuple(lse.shape) == (b, heads, lq, 1):
        lse = lse[..., 0]
    if tuple(lse.shape) != (b, heads, lq):
        raise RuntimeError(f"aten._scaled_dot_product_cudnn_attention returned a log-sum-exp of shape "
                           f"{tuple(lse.shape)}; cpinfer reads [B, H, Lq] = {[b, heads, lq]} (or with a trailing 1)")
    return lse.transpose(1, 2).float()


def ragged_lse(lse: torch.Tensor, total: int, heads: int) -> torch.Tensor:
    """The ragged op's log-sum-exp ([total, H, 1]; [H, total], [1, H, total] or [total, H]) → [total, H] fp32."""
    shape = tuple(lse.shape)
    if shape == (total, heads, 1):
        return lse[..., 0].float()
    if shape == (heads, total):
        return lse.transpose(0, 1).float()
    if shape == (1, heads, total):
        return lse[0].transpose(0, 1).float()
    if shape == (total, heads):
        return lse.float()
    raise RuntimeError(f"aten._cudnn_attention_forward returned a log-sum-exp of shape {shape}; cpinfer reads "
                       f"[total_q, H, 1] = {[total, heads, 1]}, [H, total_q], [1, H, total_q] or [total_q, H]")


def _finite_or_empty(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse) | torch.isnan(lse), -torch.inf, lse)


@dataclasses.dataclass(frozen=True)
class CudnnAPI:
    """PyTorch's cuDNN attention ops as cpinfer calls them (`dense`, `ragged`); what the probe found decides
    `ragged_op` (None: unused), `expand_gqa` and `packed`."""

    dense_op: object  # aten._scaled_dot_product_cudnn_attention, or a test's stand-in with its schema
    ragged_op: object | None = None  # aten._cudnn_attention_forward when its probe passed
    expand_gqa: bool = False  # causal squares with K/V heads repeated (the op disagreed with fewer KV heads)
    packed: bool = False  # dense inputs copied to packed [B, L, H, D] first (the op disagreed on strided views)
    name: str = "torch-cudnn (aten._scaled_dot_product_cudnn_attention)"

    def dense(self, q, k, v, scale: float, causal: bool):
        """q [B, Lq, H, D], k/v [B, Lk, Hkv, D] → (out [B, Lq, H, Dv] in q's dtype, lse [B, Lq, H] fp32).
        causal: cuDNN's top-left mask, exact for Lq == Lk only."""
        g = q.shape[2] // k.shape[2]
        if g > 1 and not causal:  # unmasked: fold the query heads of a KV head into rows
            out, lse = self._dense(fold_heads(q, k.shape[2]), k, v, scale, False)
            return unfold_heads(out, lse, g)
        if g > 1 and self.expand_gqa:
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # [B, Lk, H, D]
        return self._dense(q, k, v, scale, causal)

    def _dense(self, q, k, v, scale: float, causal: bool):
        b, lq, h, _ = q.shape
        if self.packed:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qh, kh, vh = (aligned(x.transpose(1, 2)) for x in (q, k, v))  # [B, H, L, D] views (BSHD strides)
        res = self.dense_op(qh, kh, vh, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        if tuple(out.shape) != (b, h, lq, v.shape[-1]):
            raise RuntimeError(f"{self.name} returned an output of shape {tuple(out.shape)}; expected "
                               f"{[b, h, lq, v.shape[-1]]}")
        return out.transpose(1, 2), _finite_or_empty(dense_lse(lse, b, h, lq))  # [B, Lq, H, Dv], [B, Lq, H]

    def ragged(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        """FULL blocks (no mask) of packed sequences: q [P, H, D], k/v [K, Hkv, D], cu_q / cu_k [G + 1] int32 in
        unfolded rows → (out [P, H, Dv], lse [P, H] fp32). GQA is folded into rows (the op takes no GQA)."""
        g = q.shape[1] // k.shape[1]
        if g > 1:
            q, cu_q, max_q = fold_heads(q, k.shape[1]), cu_q * g, max_q * g
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # offsets are cum_seq x H x D
        res = self.ragged_op(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, False, False, scale=scale)
        out, lse = res[0], res[1]
        if tuple(out.shape) != (q.shape[0], q.shape[1], v.shape[-1]):
            raise RuntimeError(f"aten._cudnn_attention_forward returned an output of shape {tuple(out.shape)}; "
                               f"expected {[q.shape[0], q.shape[1], v.shape[-1]]}")
        lse = _finite_or_empty(ragged_lse(lse, q.shape[0], q.shape[1]))  # [P·G, Hkv]
        return unfold_heads(out, lse, g) if g > 1 else (out, lse)


# ---------------------------------------------------------------- detection: the ops, then a probe per device

_PROBED: dict[tuple, tuple[str, CudnnAPI | None]] = {}  # device key -> ('' or what failed, the API to use)


def unusable(device: torch.device, probe_device: bool = True) -> str:
    """Why torch-cudnn cannot run on `device` ('' when it can): no CUDA, no op, or the probe failed (warned once).
    `probe_device=False`: '' when the op exists (a process that does not own the device: the ranks probe)."""
    device = torch.device(device)
    if device.type not in DEVICES:
        return "torch-cudnn needs a CUDA device"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    if device.type == "cuda" and not torch.backends.cudnn.is_available():
        return "this torch has no cuDNN"
    if aten_ops()[0] is None:
        return "this torch has no aten._scaled_dot_product_cudnn_attention"
    if not probe_device:
        return ""
    stop, found = probe_once(_PROBED, device, "torch-cudnn", lambda: detect(device))
    return stop or found[0]


def api(device) -> CudnnAPI:
    """The API the probe chose for `device` (probing now if it has not run)."""
    problem = unusable(device)
    if problem:
        raise RuntimeError(f"torch-cudnn cannot run on {device}: {problem}")
    return _PROBED[_device_key(torch.device(device))][1]


def forget_probes() -> None:
    """Probe again at the next use (tests; new ops)."""
    _PROBED.clear()


def detect(device: torch.device) -> tuple[str, CudnnAPI | None]:
    """('' or what failed, the API): the dense op as it is, else with K/V heads repeated for causal squares; then
    the ragged op. Warns once for each failure."""
    dense_op, ragged_op = aten_ops()
    chosen = CudnnAPI(dense_op)
    problem = probe(chosen, device, DENSE_CALLS)
    if problem:
        expanded = dataclasses.replace(chosen, expand_gqa=True)
        if probe(expanded, device, DENSE_CALLS):
            warnings.warn(f"torch-cudnn (aten._scaled_dot_product_cudnn_attention) failed its probe on {device}: "
                          f"{problem}; the attention backend falls back to the next one", RuntimeWarning,
                          stacklevel=3)
            return problem, None
        log.info("torch-cudnn on %s: causal squares repeat K/V heads (with fewer KV heads: %s)", device, problem)
        chosen = expanded
    strided = probe(chosen, device, STRIDED_CALLS)
    if strided:  # e.g. queries read from a fused QKV projection: copied to packed tensors first
        log.info("torch-cudnn on %s: dense inputs are packed first (on strided views: %s)", device, strided)
        chosen = dataclasses.replace(chosen, packed=True)
    if ragged_op is not None:
        with_ragged = dataclasses.replace(chosen, ragged_op=ragged_op)
        ragged_problem = probe(with_ragged, device, RAGGED_CALLS)
        if ragged_problem:
            warnings.warn(f"torch-cudnn's ragged op (aten._cudnn_attention_forward) failed its probe on {device}: "
                          f"{ragged_problem}; FULL blocks run as dense calls grouped by shape", RuntimeWarning,
                          stacklevel=3)
        else:
            chosen = with_ragged
    return "", chosen


DENSE_CALLS = (  # (what it checks, "dense" / "ragged", causal, query lengths, key lengths)
    ("dense causal squares (top-left, batch of 2)", "dense", True, (5, 5), (5, 5)),
    ("dense FULL blocks with Lq != Lk (GQA folded into rows)", "dense", False, (3, 3), (7, 7)),
    ("one-row dense FULL block (decode, GQA folded)", "dense", False, (1,), (6,)),
)
STRIDED_CALLS = (  # the queries a view of a wider tensor (a fused QKV projection's output), keys a gathered block
    ("dense causal squares on strided views", "dense", True, (6,), (6,)),
)
RAGGED_CALLS = (
    ("ragged FULL call over sequences of unequal lengths (GQA folded)", "ragged", False, (3, 1, 4), (7, 5, 2)),
)


def probe(api_: CudnnAPI, device: torch.device, calls, heads: int = 4, kv_heads: int = 2,
          head_dim: int = 64) -> str:
    """'' when `api_` agrees with a float32 reference on `device` on every call (GQA, fp16), else which failed."""
    g = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    for what, op, causal, lq, lk in calls:
        wide = 2 * heads if calls is STRIDED_CALLS else heads  # strided: q [P, H, D] with token stride 2·H·D
        q = torch.randn(sum(lq), wide, head_dim, generator=g).to(device, torch.float16)[:, wide - heads:]
        k = torch.randn(sum(lk), kv_heads, head_dim, generator=g).to(device, torch.float16)  # [K, Hkv, D]
        v = torch.randn(sum(lk), kv_heads, head_dim, generator=g).to(device, torch.float16)
        try:  # (the comparison too: a kernel's error may surface at the first sync)
            if op == "dense":
                b = len(lq)
                out, lse = api_.dense(q.view(b, lq[0], heads, head_dim), k.view(b, lk[0], kv_heads, head_dim),
                                      v.view(b, lk[0], kv_heads, head_dim), scale, causal)
                out, lse = out.reshape(q.shape), lse.reshape(q.shape[:2])
            else:
                out, lse = api_.ragged(q, k, v, _cu(lq, device), _cu(lk, device), max(lq), max(lk), scale)
            ref_out, ref_lse = reference(q, k, v, lq, lk, scale, causal)
            err_out = float((out.float() - ref_out).abs().max())
            err_lse = float((lse.float() - ref_lse).abs().max())
        except Exception as exc:  # noqa: BLE001 - an unsupported GPU, build or layout fails in many ways
            return f"the {what} raised {type(exc).__name__}: {exc}"
        if not err_out <= PROBE_ATOL or not err_lse <= PROBE_ATOL:  # (NaN fails too)
            return (f"the {what} disagrees with the float32 reference (max |out error| {err_out:.3g}, max |lse "
                    f"error| {err_lse:.3g}, tolerance {PROBE_ATOL})")
    return ""


__all__ = ["CudnnAPI", "unusable", "api", "probe", "detect", "forget_probes", "fold_heads", "unfold_heads",
           "aligned", "dense_lse", "ragged_lse"]
