"""K/V whose value head size differs from the key head size (MLA, DeepSeek-V2 §2.1): one packed row per token for
the ring, and the exact padding for kernels that need one head size.

Values are either their own tensor v [L, Hkv, Dv] or the first Dv channels of the keys (`v = k[..., :Dv]`, a view:
MLA's latent c is both the key's first part and the value). Then a token's row is its key alone: the cache, the ring
messages and the tiers carry Dk values per KV head, not Dk + Dv.
"""
from __future__ import annotations

import torch
from torch import Tensor


def values_in_keys(k: Tensor, v: Tensor) -> bool | None:
    """Whether v is the view k[..., :Dv] with Dv < Dk (same storage, offset and strides); None when k holds no
    element (nothing tells; a plan agrees on it over the ranks that know)."""
    if k.numel() == 0:
        return None
    return (v.shape[:-1] == k.shape[:-1] and v.shape[-1] < k.shape[-1] and v.stride() == k.stride()
            and v.data_ptr() == k.data_ptr() and v.device == k.device and v.dtype == k.dtype)


def row_width(dk: int, dv: int, shared: bool) -> int:
    """Channels per KV head of one packed token row: Dk when the values sit in the keys, else Dk + Dv."""
    return dk if shared else dk + dv


def pack_rows(k: Tensor, v: Tensor, shared: bool, out: Tensor | None = None, idx: Tensor | None = None) -> Tensor:
    """The rows `idx` (all when None) of k [L, Hkv, Dk] and v [L, Hkv, Dv] as one tensor [R, Hkv, W] (W =
    `row_width`): keys then values, or the keys alone when the values are in them (`shared`). With `out`
    [>= R, Hkv, W] the rows are written into its first R rows (the rest stay as they are) and `out` is returned."""
    dk = k.shape[-1]
    if idx is not None:
        k = k.index_select(0, idx)
        v = None if shared else v.index_select(0, idx)
    if out is None:
        return k.clone() if shared else torch.cat((k, v), dim=-1)
    out[:k.shape[0], :, :dk] = k
    if not shared:
        out[:k.shape[0], :, dk:] = v
    return out


def unpack_rows(block: Tensor, dk: int, dv: int) -> tuple[Tensor, Tensor]:
    """Views (k [R, Hkv, Dk], v [R, Hkv, Dv]) of a packed block [R, Hkv, W] (`pack_rows`)."""
    if block.shape[-1] == dk:  # values in the keys
        return block, block[..., :dv]
    return block[..., :dk], block[..., dk:dk + dv]


def same_head_size(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) with one head size D = max(Dk, Dv), exactly: values in the keys → the keys themselves as values
    (the output's first Dv channels are P·v); Dv < Dk → v padded with zero channels; Dv > Dk → q and k padded with
    zero channels (q·k unchanged). The caller keeps the output's first Dv channels."""
    dk, dv = k.shape[-1], v.shape[-1]
    if dk == dv:
        return q, k, v
    if values_in_keys(k, v):  # (Dv < Dk)
        return q, k, k
    if dv < dk:
        return q, k, torch.nn.functional.pad(v, (0, dk - dv))
    pad = (0, dv - dk)
    return torch.nn.functional.pad(q, pad), torch.nn.functional.pad(k, pad), v


def attend_same_head_size(attend, q, k, v, acc_out: Tensor, acc_lse: Tensor) -> None:
    """Run `attend(q, k, v, acc_out, acc_lse)` of a kernel that needs one head size for q, k and v, merging into
    acc_out [Lq, H, Dv] fp32 in place: the inputs padded by `same_head_size` and a wider accumulator whose first Dv
    channels are copied in and back (every channel merges independently, so the extra ones change nothing)."""
    q2, k2, v2 = same_head_size(q, k, v)
    if k.shape[-1] == v.shape[-1]:
        attend(q, k, v, acc_out, acc_lse)
        return
    if v2.shape[-1] == acc_out.shape[-1]:  # Dv > Dk: q and k padded, the accumulator as it is
        attend(q2, k2, v2, acc_out, acc_lse)
        return
    wide = acc_out.new_zeros(acc_out.shape[:-1] + (v2.shape[-1],))  # [Lq, H, Dk]
    wide[..., :acc_out.shape[-1]] = acc_out
    attend(q2, k2, v2, wide, acc_lse)
    acc_out.copy_(wide[..., :acc_out.shape[-1]])


__all__ = ["values_in_keys", "row_width", "pack_rows", "unpack_rows", "same_head_size", "attend_same_head_size"]
