"""`torch-flash`: PyTorch's own FlashAttention-2 varlen kernel (`aten._flash_attention_forward`) as a provider of the
flash backend (`flash_backend.py`), for CUDA machines without the flash-attn package: the same packing, one varlen
call per ring step, fp32 and MASK tiles through Triton.

The op is CUDA-only (fp16 / bf16, head dim <= 256, GQA native). Two things differ between torch builds and cannot be
known before it runs: the layout of the log-sum-exp it returns ([H, total_q]; [1, H, total_q] or [B, H, max_q]
padded in other versions: all handled, anything else refused) and whether its causal mask is aligned bottom-right
when max_q != max_k (flash-attn >= 2.1 is). So the first use on each device runs a probe — a tiny GQA varlen call
(one sequence with Lq < Lk causal, one with Lq == Lk, one decode row, and a FULL call) against a float32 reference
on that device; if the op raises or disagrees, a warning names what failed and `auto` resolves to Triton.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

DEVICES = ("cuda",)  # where the op runs (the CPU tests add "cpu" with a fake op that checks every call)
PROBE_ATOL = 2e-2  # fp16 probe: a misaligned causal mask or a wrong LSE layout is off by >= 0.1


def aten_op():
    """`torch.ops.aten._flash_attention_forward`, or None when this torch has no such op (tests replace this)."""
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError):
        return None


@dataclasses.dataclass(frozen=True)
class TorchFlashAPI:
    """The op behind `FlashAPI`'s interface: `varlen(...)` → (out [P, H, D] in q's dtype, lse [P, H] fp32, -inf
    where a row sees no key)."""

    op: object  # aten._flash_attention_forward, or a test's stand-in with its schema
    name: str = "torch-flash (aten._flash_attention_forward)"

    def varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
        # q [P, H, D], k/v [K, Hkv, D], cu_q / cu_k [G + 1] int32 on q's device
        res = self.op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(f"{self.name} returned an output of shape {tuple(out.shape)}; expected "
                               f"{tuple(q.shape)}")
        lse = packed_lse(lse, cu_q, q.shape[0], q.shape[1], max_q).float()  # [P, H]
        return out, torch.where(torch.isposinf(lse) | torch.isnan(lse), -torch.inf, lse)


def packed_lse(lse: torch.Tensor, cu_q: torch.Tensor, total_q: int, heads: int, max_q: int) -> torch.Tensor:
    """The op's log-sum-exp in any layout torch has used → [total_q, H] in packed row order (no host sync)."""
    shape, groups = tuple(lse.shape), len(cu_q) - 1
    if shape == (heads, total_q):  # FA2 >= 2.4 varlen, the layout torch vendors today
        return lse.transpose(0, 1)
    if shape == (1, heads, total_q):  # the same with a batch dimension of one
        return lse[0].transpose(0, 1)
    if lse.dim() == 3 and shape[0] == groups and shape[1] == heads and shape[2] >= max_q:  # padded per sequence
        rows = torch.arange(total_q, device=lse.device, dtype=cu_q.dtype)  # [P]
        seq = torch.searchsorted(cu_q[1:].contiguous(), rows, right=True)  # [P] the sequence of each packed row
        return lse[seq, :, (rows - cu_q[seq]).long()]  # [P, H]
    raise RuntimeError(f"aten._flash_attention_forward returned a log-sum-exp of shape {shape}; cpinfer reads "
                       f"[H, total_q] = {[heads, total_q]}, [1, H, total_q] or [sequences, H, >= max_q]")


# ---------------------------------------------------------------- detection: the op, then a probe per device

_PROBED: dict[tuple, str] = {}  # (device type, index) -> '' (the probe passed) or what failed


def unusable(device: torch.device, probe_device: bool = True) -> str:
    """Why torch-flash cannot run on `device` ('' when it can): no CUDA, no op, or the probe failed (warned once).
    `probe_device=False`: '' when the op exists (a process that does not own the device: the ranks probe)."""
    device = torch.device(device)
    if device.type not in DEVICES:
        return "torch-flash needs a CUDA device"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    op = aten_op()
    if op is None:
        return "this torch has no aten._flash_attention_forward"
    if not probe_device:
        return ""

    def run() -> str:
        problem = probe(TorchFlashAPI(op), device)
        if problem:
            warnings.warn(f"torch-flash (aten._flash_attention_forward) failed its probe on {device}: {problem}; "
                          f"the attention backend falls back to triton", RuntimeWarning, stacklevel=3)
        return problem

    stop, problem = probe_once(_PROBED, device, "torch-flash", run)
    return stop or problem


def api() -> TorchFlashAPI:
    op = aten_op()
    if op is None:
        raise RuntimeError("this torch has no aten._flash_attention_forward")
    return TorchFlashAPI(op)


def forget_probes() -> None:
    """Probe again at the next use (tests; a new op)."""
    _PROBED.clear()


def probe_once(cache: dict, device: torch.device, name: str, run):
    """`run()`'s result for `device`, computed at the first use there and kept in `cache` → ('', result); or (why it
    cannot be probed now, None): the device cannot be selected, or a CUDA graph is being captured. Shared by the
    backends that probe PyTorch's attention ops (torch-flash, torch-cudnn)."""
    try:
        key = _device_key(device)
    except Exception as exc:  # noqa: BLE001 - e.g. CUDA reported but unusable in this process
        return f"cannot select {device}: {type(exc).__name__}: {exc}", None
    if key not in cache:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return f"{name} is probed before its first use, not inside a CUDA graph capture", None
        cache[key] = run()
    return "", cache[key]


def _device_key(device: torch.device) -> tuple:
    index = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return device.type, index


# ---------------------------------------------------------------- the probe

PROBE_CALLS = (  # (what it checks, causal, query lengths, key lengths)
    ("causal varlen with Lq < Lk, Lq == Lk and a one-row sequence (bottom-right alignment)", True, (3, 5, 1),
     (7, 5, 4)),
    ("FULL varlen (no mask) with Lq != Lk", False, (4, 2), (6, 3)),
)


def probe(api_: TorchFlashAPI, device: torch.device, heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> str:
    """'' when the op agrees with a float32 reference on `device` on every `PROBE_CALLS` entry (GQA, fp16), else
    which call failed and how."""
    g = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    for what, causal, lq, lk in PROBE_CALLS:
        q = torch.randn(sum(lq), heads, head_dim, generator=g).to(device, torch.float16)  # [P, H, D]
        k = torch.randn(sum(lk), kv_heads, head_dim, generator=g).to(device, torch.float16)  # [K, Hkv, D]
        v = torch.randn(sum(lk), kv_heads, head_dim, generator=g).to(device, torch.float16)
        cu_q, cu_k = _cu(lq, device), _cu(lk, device)
        try:  # (the comparison too: a kernel's error may surface at the first sync)
            out, lse = api_.varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), scale, causal)
            ref_out, ref_lse = reference(q, k, v, lq, lk, scale, causal)
            err_out = float((out.float() - ref_out).abs().max())
            err_lse = float((lse.float() - ref_lse).abs().max())
        except Exception as exc:  # noqa: BLE001 - an unsupported GPU, build or layout fails in many ways
            return f"the {what} raised {type(exc).__name__}: {exc}"
        if not err_out <= PROBE_ATOL or not err_lse <= PROBE_ATOL:  # (NaN fails too)
            return (f"the {what} disagrees with the float32 reference (max |out error| {err_out:.3g}, max |lse "
                    f"error| {err_lse:.3g}, tolerance {PROBE_ATOL})")
    return ""


def _cu(lengths, device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)  # [G + 1]


def reference(q, k, v, lq, lk, scale: float, causal: bool):
    """float32 (out [P, H, D], lse [P, H]) of packed sequences, causal aligned bottom-right, on q's device."""
    g = q.shape[1] // k.shape[1]
    outs, lses, qa, ka = [], [], 0, 0
    for nq, nk in zip(lq, lk):
        qq = q[qa:qa + nq].float()  # [nq, H, D]
        kk = k[ka:ka + nk].float().repeat_interleave(g, dim=1)  # [nk, H, D]
        vv = v[ka:ka + nk].float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale  # [H, nq, nk]
        if causal:
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s = s.masked_fill(~(j <= i + nk - nq)[None], -torch.inf)
        lse = torch.logsumexp(s, dim=-1)  # [H, nq]
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv))
        lses.append(lse.transpose(0, 1))
        qa, ka = qa + nq, ka + nk
    return torch.cat(outs), torch.cat(lses)
