"""A rank's device KV cache: the K/V tensors of every layer, indexed by the slots the driver's KV manager assigns
(paper §3.3: each CP rank stores its shard of every sequence's K/V), and what one cached token holds per KV head.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cpinfer.engine.kv import fp8 as kv_fp8


@dataclasses.dataclass(frozen=True)
class KVWidths:
    """What one cached token holds per layer and KV head: a key of `key` channels and a value of `value` channels,
    the value stored apart or (`values_in_keys`, MLA's latent) the key's first `value` channels; `index` (DSA, with
    MLA's latent only): the indexer key of that many channels stored after the key in the same row (`indexer.py`),
    so every copy of a token's row (prefix cache, tiers, transfers) carries it; `index_fp8`: in an FP8 cache the
    indexer key is e4m3 with its own scale (the checkpoint's indexer is FP8), else it keeps the compute dtype."""

    key: int
    value: int
    values_in_keys: bool = False
    index: int = 0
    index_fp8: bool = False

    def __post_init__(self) -> None:
        if self.key <= 0 or self.value <= 0:
            raise ValueError(f"KV widths must be positive, got key {self.key}, value {self.value}")
        if self.values_in_keys and self.value > self.key:
            raise ValueError(f"values in the keys need value width <= key width, got {self.value} > {self.key}")
        if self.index and not self.values_in_keys:
            raise ValueError("an indexer key is stored beside MLA's latent only (values in the keys)")

    @classmethod
    def of(cls, config) -> "KVWidths":
        from cpinfer.model.indexer import index_key_fp8

        dsa = getattr(config, "dsa", None)
        return cls(config.kv_key_width, config.kv_value_width, config.values_in_keys,
                   0 if dsa is None else dsa.index_head_dim, dsa is not None and index_key_fp8(config))

    def index_bytes(self, elem_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes of a token's indexer key per layer: `index` elements of the compute dtype; in an FP8 cache, its
        e4m3 bytes and a 4-byte scale (`index_fp8`, `kv/fp8.py`'s per-token format) or its compute-dtype bytes
        after padding the latent's e4m3 bytes to the element size (so they view as that dtype)."""
        if not self.index or not kv_fp8.is_fp8(kv_cache_dtype):
            return self.index * elem_bytes
        if self.index_fp8:
            return self.index + kv_fp8.SCALE_BYTES
        return -self.key % elem_bytes + self.index * elem_bytes

    @property
    def stored(self) -> int:
        """Channels stored per KV head and token: the key's (and a DSA model's indexer key after it), plus the
        value's unless it sits in the key."""
        return self.key + self.index if self.values_in_keys else self.key + self.value


class KVStore:
    """This rank's K/V tensors: k [layers, capacity + 1, Hkv, Dk] and v [layers, capacity + 1, Hkv, Dv] (with
    `values_in_keys` a view of k's first Dv channels: nothing stored twice), indexed by the slots the driver
    assigns; row `sink` (= capacity) is never assigned: the padding rows of a static-shape decode write there. With an
    FP8 KV cache each row is uint8: D e4m3 bytes with a static scale per layer and KV head (MLA: per layer for the
    latent and for the rotary key), or [D + 4] with its own scale in the per-token format (`kv/fp8.py`); `codecs[layer]` = (K, V) `RowCodec`s encode and decode them.
    `used`: rows ever written (1 + the largest slot), what the FP8 attention step dequantizes. A DSA model's rows are
    [latent ; indexer key] (`widths.index`): `index` is the view k[:, :, 0, key:] [layers, capacity + 1, index],
    attention reads k[..., :key]. In an FP8 cache the row is bytes: [latent e4m3 ; indexer key] with the indexer key
    per `widths.index_fp8` (`KVWidths.index_bytes`): `index` is then the packed uint8 [.., index + 4] or the
    compute-dtype view of its bytes; `write_index` / `read_index` encode and decode either."""

    def __init__(self, num_layers: int, capacity: int, n_kv_heads: int, widths: KVWidths, dtype, device,
                 kv_cache_dtype: str = "auto", kv_scales: tuple | None = None):
        self.widths = widths
        fp8 = kv_fp8.is_fp8(kv_cache_dtype)
        if kv_fp8.per_token(kv_cache_dtype) and widths.values_in_keys:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for multi-head latent attention "
                             "(MLA): the values are the stored key's first channels, which a per-row scale packed "
                             "after the row would split; use kv_cache_dtype='fp8' (static scales)")
        self.codecs = kv_fp8.layer_codecs(kv_cache_dtype, kv_scales, num_layers, n_kv_heads, device)
        extra = kv_fp8.SCALE_BYTES if kv_fp8.per_token(kv_cache_dtype) else 0
        store_dtype = torch.uint8 if fp8 else dtype
        if widths.index and n_kv_heads != 1:
            raise ValueError("a DSA model's indexer keys sit beside MLA's latent (one KV head)")
        self.dtype = dtype
        self.index_fp8 = fp8 and widths.index_fp8
        index = widths.index_bytes(dtype.itemsize, kv_cache_dtype) if fp8 else widths.index
        self.k = torch.zeros((num_layers, capacity + 1, n_kv_heads, widths.key + index + extra),
                             dtype=store_dtype, device=device)
        self.index = None  # [layers, capacity + 1, index] (uint8 [.., index + 4] when index_fp8)
        if widths.index and fp8 and not widths.index_fp8:  # compute-dtype bytes after the padded latent
            self.index = self.k[:, :, 0, widths.key - widths.key % -dtype.itemsize:].view(dtype)
        elif widths.index:
            self.index = self.k[:, :, 0, widths.key:]
        if widths.values_in_keys:
            self.v = self.k[..., :widths.value]
        else:
            self.v = torch.zeros((num_layers, capacity + 1, n_kv_heads, widths.value + extra), dtype=store_dtype,
                                 device=device)
        self.sink = capacity
        self.used = 0

    def write_index(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """A layer's new indexer keys x [L, index] into `slots` (encoded when kept in FP8; L may be 0)."""
        if not len(x):
            return
        self.index[layer].index_copy_(0, slots, kv_fp8.encode(x) if self.index_fp8 else x.to(self.index.dtype))

    def read_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored indexer keys (rows of `index`) -> [.., index] in the compute dtype."""
        return kv_fp8.decode(rows, self.dtype) if self.index_fp8 else rows

    def note_written(self, slots: np.ndarray) -> None:
        if len(slots):
            self.used = max(self.used, int(slots.max()) + 1)

    @staticmethod
    def bytes_per_token(num_layers: int, n_kv_heads: int, widths: KVWidths, elem_bytes: int,
                        kv_cache_dtype: str = "auto") -> int:
        if widths.values_in_keys:  # (a DSA model's indexer key after the latent)
            return num_layers * n_kv_heads * (kv_fp8.row_bytes(widths.key, elem_bytes, kv_cache_dtype)
                                              + widths.index_bytes(elem_bytes, kv_cache_dtype))
        return num_layers * n_kv_heads * sum(kv_fp8.row_bytes(w, elem_bytes, kv_cache_dtype)
                                             for w in (widths.key, widths.value))
