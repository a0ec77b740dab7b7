"""How many tokens of K/V each rank holds: a share of host RAM on CPU; on CUDA, `gpu_memory_utilization` of the
device minus what the weights and a profiling forward of the batch budget need (the approach of vLLM's profiling).

The arithmetic is a pure function of the memory figures (`kv_tokens_from_memory`), so it is tested on CPU with
injected figures; `MemoryProbe` reads them from the CUDA caching allocator on a rank.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from cpinfer.utils import ceil_div

GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """One rank's device memory, bytes. `free_at_start` is read before the model loads; `peak` is the torch
    allocator's peak over the load and the profiling forward; `non_torch` is what this process added outside the
    allocator meanwhile (cuBLAS / NCCL workspaces, ...)."""

    total: int
    free_at_start: int
    peak: int
    non_torch: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"memory figure {f.name} must be a non-negative integer of bytes, got {v!r}")
        if self.total <= 0 or self.free_at_start > self.total:
            raise ValueError(f"inconsistent memory figures: total {self.total}, free at start {self.free_at_start}")


def kv_tokens_from_memory(fig: MemoryFigures, utilization: float, bytes_per_token: int, block: int,
                          ranks_per_device: int = 1, reserve: int = 0) -> int:
    """KV tokens (a multiple of `block`) for one rank: utilization x total / ranks sharing the device (never more
    than was free before the model loaded, when the rank has the device alone), minus the rank's peak and non-torch
    memory and `reserve` bytes loaded after the measurement (a draft model's weights and scratch rows). ValueError,
    with the figures, when not one block is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = fig.total * utilization / ranks_per_device
    if ranks_per_device == 1:  # memory other processes hold is not ours to take
        budget = min(budget, fig.free_at_start)
    left = budget - fig.peak - fig.non_torch - reserve
    tokens = int(max(left, 0) // bytes_per_token) // block * block
    if tokens < block:
        others = fig.total - fig.free_at_start
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization {utilization} of {fig.total / GiB:.2f} GiB"
            f"{f' / {ranks_per_device} ranks' if ranks_per_device > 1 else ''} gives {budget / GiB:.2f} GiB"
            f"{f' ({others / GiB:.2f} GiB were already in use before the model loaded)' if others else ''}, and the "
            f"weights plus a profiling forward peaked at {fig.peak / GiB:.2f} GiB (+{fig.non_torch / GiB:.2f} GiB "
            f"outside torch{f', +{reserve / GiB:.2f} GiB for the draft model' if reserve else ''}), leaving less "
            f"than one {block}-token block ({block * bytes_per_token / GiB:.3f} GiB); "
            "raise gpu_memory_utilization, lower max_num_batched_tokens, or use more ranks (CP / TP)")
    return tokens


def kv_tokens_from_host_ram(fraction: float, ranks: int, bytes_per_token: int, block: int, max_model_len: int,
                            total_bytes: int | None = None) -> int:
    """CPU: `fraction` of host RAM split over the ranks, capped at 4 x max_model_len, or at what one max_model_len
    request needs on a rank where that is more (a tiny max_model_len), in whole blocks of `block` tokens.
    The share is rounded to a whole byte once and divided in integers after, so float rounding never loses a token
    (and with it a block): a share of exactly k x ranks x bytes_per_token bytes gives k tokens on any machine."""
    total = total_bytes if total_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = round(total * fraction) // ranks // bytes_per_token
    one_request = (ceil_div(ceil_div(max_model_len, ranks) + 2 * ranks, block) + 1) * block  # KVManager's count
    return max(block, min(tokens, max(4 * max_model_len, one_request))) // block * block


def profile_tokens_per_rank(max_num_batched_tokens: int | None, max_model_len: int, cp: int) -> int:
    """New tokens one rank can get in a forward: its two of the 2N chunks of the largest batch."""
    batch = max_num_batched_tokens or max_model_len
    return 2 * ceil_div(batch, 2 * cp)


class MemoryProbe:
    """The CUDA caching allocator's figures on one device (tests replace it to inject numbers)."""

    def __init__(self, device: torch.device, shared: bool = False):
        self.device = torch.device(device)
        self.shared = shared  # other ranks allocate on this device meanwhile: their memory is not ours

    def start(self) -> None:
        """Call before the model loads: the free memory then, and a fresh peak counter."""
        torch.cuda.synchronize(self.device)
        self._free0, self._total = torch.cuda.mem_get_info(self.device)
        self._reserved0 = torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self) -> MemoryFigures:
        """After the profiling forward."""
        torch.cuda.synchronize(self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        grown = self._free0 - free  # everything this process (or a neighbour) took since start()
        torch_grown = torch.cuda.memory_reserved(self.device) - self._reserved0
        return MemoryFigures(total=int(self._total), free_at_start=int(self._free0),
                             peak=int(torch.cuda.max_memory_allocated(self.device)),
                             non_torch=0 if self.shared else int(max(0, grown - torch_grown)))
