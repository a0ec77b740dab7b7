"""`EngineConfig`: the engine's arguments (vLLM's names where vLLM has them), validated before any rank starts: the
CP × TP layout (paper §3, §4.1), placement (§3.5.1), the persistent KV cache and its tiers (§3.3), decoding."""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from cpinfer.attention.backends import NAMES as ATTENTION_BACKENDS
from cpinfer.attention.backends import _unusable as backend_problem
from cpinfer.device import check_gpus, ranks_on_this_node, resolve_device, resolve_dtype
from cpinfer.distributed import ParallelConfig
from cpinfer.engine.kv.fp8 import check_kv_cache_dtype
from cpinfer.engine.kv.manager import BLOCK
from cpinfer.engine.kv.placement import PLACEMENTS
from cpinfer.engine.mla_form import check_form
from cpinfer.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from cpinfer.engine.spec_decode.config import SpeculativeConfig

LOAD_FORMATS = ("auto", "dummy")
SPEC_VERIFY = ("decode", "prefill")  # `spec_verify`: drafts verified as decode rows, or as a partial prefill


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Validated engine arguments (everything is checked before a rank starts)."""

    context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    device: str = "auto"  # "auto" (CUDA when available, else CPU), "cpu", "cuda"; resolved here
    dtype: str = "auto"  # "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16", "float16"
    kv_cache_dtype: str = "auto"  # "auto" (the compute dtype), "fp8" (e4m3, static scales) or "fp8_per_token"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS  # None: no bound (every prompt whole)
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_kv_tokens_per_rank: int | None = None
    kv_memory_fraction: float = 0.25  # CPU: share of host RAM for the KV cache of all ranks
    gpu_memory_utilization: float = 0.9  # CUDA: share of each GPU for weights, activations and the KV cache
    share_gpus: bool = False  # CUDA: allow more ranks than GPUs on a node (gloo through host memory; slow)
    strategy: str = "auto"
    mla_form: str = "auto"  # multi-head latent attention: "auto" (per forward, by FLOPs: `mla_form.py`), "absorbed" or
    # "expanded" (every forward in that form: tests and benchmarks); other models ignore it
    placement: str = "auto"  # "auto" (cost model) | "shard" (always 2N-chunk sharding) | "local" (one rank)
    hardware_profile: str | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs; decode runs the dynamic eager path
    static_decode: bool | None = None  # the static-shape decode path: None = exactly when CUDA graphs are on;
    # True also without graphs (eager; on CPU it needs TRITON_INTERPRET=1: the path's attention is Triton's)
    threads_per_rank: int | None = None
    timeout_s: float = 600.0
    in_process: bool = True  # rank 0 runs inside the driver process (CP1 x TP1; CP>1 or TP>1 on CPU when this
    # process hosts no other engine's rank 0): what it does alone needs no message to another process
    kv_host_gib: float = 0.0  # host tier: GiB of host memory per rank for K/V evicted from the device (0: none)
    kv_disk_dir: str | None = None  # disk tier: a directory for evicted / finished K/V, kept across restarts
    kv_disk_gib: float | None = None  # its bound (None: half the disk's free space at start)
    tokenizer: str | None = None  # a tokenizer folder or Hub id other than the model's own
    revision: str | None = None  # the Hub revision (branch, tag or commit) of a model given by Hub id
    download_dir: str | None = None  # the Hugging Face cache folder to download to / read from (default: the Hub's)
    seed: int = 0  # seeds the per-request seeds of requests that give none (reproducible runs)
    generation_config: str = "auto"  # "auto": generation_config.json's sampling defaults; "vllm": none; or a folder
    max_logprobs: int = 20  # the largest top_logprobs a request may ask for (vLLM's name and default); -1: the vocabulary
    load_format: str = "auto"  # "auto": the checkpoint's weights; "dummy": random weights of its config's shape made
    # on each rank's device in the compute dtype (benchmarks of shapes without a checkpoint; TP1; no weight files)
    state_snapshot_interval: int = 0  # hybrid models: keep a recurrent-state snapshot every this many tokens of a
    # sequence (at the first forward end past each multiple), so a later request sharing a long document can continue
    # from inside it; 0: snapshots at the end of each request only
    speculative_config: SpeculativeConfig | None = None  # speculative decoding: vLLM's keys as a dict (or its JSON
    # text), parsed into a SpeculativeConfig here (engine/spec_decode/config.py); None: off
    spec_verify: str = "decode"  # how drafts are verified: "decode" (k+1 decode rows in the decode step: pass-Q, the
    # static / CUDA-graph path) or "prefill" (a partial prefill, the ring chosen as for a mixed forward; benchmarks)

    def __post_init__(self):
        for name in ("context_parallel_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        device = resolve_device(self.device)  # ValueError naming CUDA when it was asked for and is missing
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device))
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_cache_dtype != "auto" and self.static_decode:
            raise ValueError(f"static_decode=True and kv_cache_dtype={self.kv_cache_dtype!r} cannot be combined: the "
                             "static decode path reads a full-precision KV cache (use static_decode=None or False)")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if device == "cuda":  # more ranks than GPUs on this node fails now, naming both numbers
            check_gpus(ranks_on_this_node(self.parallel.world_size), self.share_gpus)
        if self.strategy not in ("auto", "pass-kv", "pass-q"):
            raise ValueError(f"strategy must be 'auto', 'pass-kv' or 'pass-q', got {self.strategy!r}")
        m = self.max_logprobs
        if isinstance(m, bool) or not isinstance(m, int) or m < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, got {m!r}")
        check_form(self.mla_form)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.spec_verify not in SPEC_VERIFY:
            raise ValueError(f"spec_verify must be one of {', '.join(repr(v) for v in SPEC_VERIFY)}, "
                             f"got {self.spec_verify!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(repr(f) for f in LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        if self.load_format == "dummy" and self.tensor_parallel_size > 1:
            raise ValueError("load_format='dummy' (random weights) supports tensor_parallel_size 1 only, got "
                             f"{self.tensor_parallel_size}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.static_decode not in (None, True, False):
            raise ValueError(f"static_decode must be None (auto), True or False, got {self.static_decode!r}")
        if self.static_decode:
            problem = backend_problem("triton", torch.device(device))
            if problem:
                raise ValueError(f"static_decode=True runs decode attention in the Triton kernel, which cannot run "
                                 f"on {device}: {problem}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(repr(p) for p in PLACEMENTS)}, "
                             f"got {self.placement!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.max_kv_tokens_per_rank is not None and self.max_kv_tokens_per_rank < BLOCK:
            raise ValueError(f"max_kv_tokens_per_rank must be >= {BLOCK}, got {self.max_kv_tokens_per_rank}")
        if not 0 < self.kv_memory_fraction <= 0.9:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.9], got {self.kv_memory_fraction}")
        SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)  # validates both
        v = self.state_snapshot_interval
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"state_snapshot_interval must be an integer >= 0 (0: snapshots at request ends only), "
                             f"got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("tokenizer", "revision", "download_dir", "generation_config"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        _check_gib("kv_host_gib", self.kv_host_gib, zero_ok=True)
        if self.kv_disk_gib is not None:
            _check_gib("kv_disk_gib", self.kv_disk_gib, zero_ok=False)
        if self.kv_disk_dir is not None:
            if not isinstance(self.kv_disk_dir, (str, os.PathLike)) or not str(self.kv_disk_dir):
                raise ValueError(f"kv_disk_dir must be a directory path, got {self.kv_disk_dir!r}")
            object.__setattr__(self, "kv_disk_dir", str(self.kv_disk_dir))

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.context_parallel_size, self.tensor_parallel_size)


def _check_gib(name: str, value, zero_ok: bool) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (value >= 0 if zero_ok else value > 0)):
        raise ValueError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} number of GiB, got {value!r}")

