"""The index and metadata tensors of one forward, moved to the device in one transfer before the first layer.

Planning puts numpy arrays here under keys (`put`); `upload()` packs every pending array into one byte buffer
(8-byte aligned), pinned, and copies it with one non-blocking transfer on an accelerator (on CPU the arrays are
wrapped without a copy); afterwards `tables[key]` is a view of the right dtype and shape on the device. Inside the
layer loop only those views are read: no host→device copy, no host synchronisation (a FlashInfer-style plan/run
split). `meta` holds the host-side facts (counts, flags) that go with a key.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # bytes: every array starts at a multiple of its element size
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
           np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}


class ForwardTables:
    """Device tables of one forward (or of one plan run alone), filled on the host, uploaded once."""

    def __init__(self, device):
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        self.meta: dict = {}  # key -> host-side information that goes with the key's arrays
        self.uploads = 0  # transfers made so far (the engine's forwards make exactly one)
        self._pending: dict = {}  # key -> numpy array waiting for the next upload
        self._views: dict = {}  # key -> device tensor (a view of the packed buffer)

    def put(self, key, array) -> None:
        """Register `array` (int64, int32, bool, uint8 or float32; any shape) for the next upload."""
        if key in self:
            raise KeyError(f"device table {key!r} was put twice")
        a = np.ascontiguousarray(array)
        if a.dtype not in _DTYPES:
            raise TypeError(f"device table {key!r} has dtype {a.dtype}; allowed: {', '.join(map(str, _DTYPES))}")
        self._pending[key] = a

    def __contains__(self, key) -> bool:
        return key in self._views or key in self._pending

    def __getitem__(self, key) -> torch.Tensor:
        if key in self._pending:  # asked for before the upload: one more transfer (never inside the engine)
            self.upload()
        return self._views[key]

    @property
    def pending(self) -> int:
        return len(self._pending)

    def upload(self) -> None:
        """Move every pending array to the device in one transfer (nothing to do if none is pending)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        if self.device.type == "cpu":  # the host is the device: views of the arrays themselves
            self._views.update({key: torch.from_numpy(a) for key, a in pending.items()})
            self.uploads += 1
            return
        offsets, total = {}, 0
        for key, a in pending.items():
            offsets[key] = total
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)  # [bytes]
        flat = host.numpy()
        for key, a in pending.items():
            flat[offsets[key]:offsets[key] + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = host.to(self.device, non_blocking=True)  # the one copy; the pinned block is kept until it is done
        for key, a in pending.items():
            raw = dev[offsets[key]:offsets[key] + a.nbytes]
            self._views[key] = raw.view(_DTYPES[a.dtype]).view(a.shape)
        self.uploads += 1
