"""Which hardware a run uses: `auto` device and dtype, CUDA checks and GPUs per node, all before any rank starts.

device "auto" is CUDA when `torch.cuda.is_available()`, else CPU; dtype "auto" is bfloat16 on CUDA and float32 on
CPU (bf16 matmuls are hundreds of times slower than fp32 on CPUs). The CLI commands share `add_arguments`.
"""
from __future__ import annotations

import argparse
import functools
import os

import torch

from cpinfer.attention.backends import NAMES as ATTENTION_BACKENDS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HOST_MMAP_THRESHOLD = 32 << 20  # the most glibc takes (64-bit): blocks up to 32 MiB come from its heaps
HOST_TRIM_THRESHOLD = (1 << 31) - 1  # free memory a heap keeps before it gives any back (mallopt takes an int)


@functools.cache
def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed activation memory for the next forward instead of handing it back to the system
    and faulting it in again (idempotent; one call per process; False where it does not apply).

    By default glibc adapts its thresholds as blocks are freed: in some processes a CPU prefill's activations (blocks
    of 1-32 MiB) then come from fresh mmaps or trimmed heaps at every forward. Seen on the 2-core EPYC (2026-11-30) in
    two processes of seven: ~191,000 minor page faults and 0.30-0.47 s of system time per 3,100-token prefill of the
    embedded model, 5.46-6.01 s a prefill where the others took 5.05-5.50 s; with the fixed thresholds no process
    did (0 faults after the first prefill). Fixed thresholds (as `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`
    would set): blocks up to 32 MiB from the heaps, freed memory kept (the process holds its peak activations). Only
    for glibc; `CPINFER_HOST_MALLOC=default` leaves malloc as it is (e.g. with tcmalloc or jemalloc preloaded)."""
    import ctypes
    import platform

    if os.environ.get("CPINFER_HOST_MALLOC", "keep") == "default" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc after all: malloc as it is
        return False


def cuda_problem() -> str | None:
    """Why CUDA cannot be used in this process (one sentence), or None when it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) was built without CUDA"
    return ("torch.cuda.is_available() is False: no GPU is visible (check the driver with nvidia-smi and "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")


def resolve_device(name: str | None) -> str:
    """"auto" / None → "cuda" when available, else "cpu"; "cuda" without CUDA is a ValueError naming why."""
    name = name or "auto"
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu":
        return name
    problem = cuda_problem()
    if name == "auto":
        return "cpu" if problem else "cuda"
    if problem:
        raise ValueError(f"device 'cuda' was asked for but CUDA cannot be used: {problem}; "
                         "use device 'cpu' (or 'auto', which picks CUDA only when it is available)")
    return name


def resolve_dtype(name: str | None, device: str) -> str:
    """"auto" / None → "bfloat16" on CUDA, "float32" on CPU; other names are checked."""
    name = name or "auto"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return name


def ranks_on_this_node(world_size: int) -> int:
    """Ranks that share this node's GPUs: torchrun's LOCAL_WORLD_SIZE, else every rank (local launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def check_gpus(ranks: int, share_gpus: bool = False) -> int:
    """The visible GPU count, after checking that `ranks` ranks of this node get one each (or may share).

    NCCL refuses two ranks on one GPU, so without `share_gpus` more ranks than GPUs is a ValueError naming both.
    """
    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise ValueError(f"device 'cuda' but no GPU is visible ({cuda_problem() or 'device_count() is 0'})")
    if ranks > gpus and not share_gpus:
        raise ValueError(f"{ranks} ranks on this node need one GPU each, but {gpus} GPU(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use at most "
                         f"{gpus} rank(s) per node, or share_gpus=True (--share-gpus) to place several ranks on one "
                         "GPU with their tensors passed over gloo through host memory (slow: for checks, not speed)")
    return gpus


def comm_backend(device: str, ranks: int, share_gpus: bool = False) -> str:
    """torch.distributed backend for the tensors: gloo on CPU, NCCL on GPUs, gloo when ranks share a GPU."""
    if device == "cpu":
        return "gloo"
    return "gloo" if ranks > check_gpus(ranks, share_gpus) else "nccl"


def gpu_of_rank(local_rank: int) -> torch.device:
    """The GPU of a node-local rank: one each, round-robin when ranks share GPUs."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


# ---------------------------------------------------------------- the command line

def gpu_memory_utilization(text: str) -> float:
    """argparse type: a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser, *, dtype_default: str = "auto", dtype_help: str = "",
                  memory: bool = True) -> None:
    """--device, --dtype, --kv-cache-dtype, --attention-backend, --share-gpus, --enforce-eager and (with `memory`)
    --gpu-memory-utilization."""
    from cpinfer.engine.kv.fp8 import KV_CACHE_DTYPES  # (cpinfer.engine imports this module)

    g = parser.add_argument_group("hardware")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the ranks run: auto = CUDA when a GPU is visible, else CPU (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default=dtype_default,
                   help=dtype_help or "weights, activations and KV cache: auto = bfloat16 on CUDA, float32 on CPU "
                   "(default: %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache: auto = the --dtype; fp8 (= fp8_e4m3) = e4m3 with a static scale per layer and KV "
                        "head (the checkpoint's k_scale / v_scale, else calibrated at load): half the bytes of bf16 per token, in "
                        "the cache, the ring messages and the tiers; fp8_per_token = e4m3 with a scale per token and "
                        "KV head (4 bytes more per row, never saturates) (default: %(default)s)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention kernel: auto = cpu-flash on CPU; on CUDA the fastest on the model's heads, "
                        "timed once per GPU, of flash-attn (when installed), torch-cudnn (PyTorch's cuDNN attention) "
                        "and torch-flash (PyTorch's FlashAttention-2 varlen op) when their probes pass, and triton; "
                        "or $CPINFER_ATTENTION_BACKEND (default: %(default)s)")
    if memory:
        g.add_argument("--gpu-memory-utilization", type=gpu_memory_utilization, default=0.9, metavar="F",
                       help="CUDA: share of each GPU's memory the weights, activations and KV cache may use; the "
                            "KV cache gets what the weights and a profiling forward leave (default: %(default)s)")
    g.add_argument("--share-gpus", action="store_true",
                   help="CUDA: allow more ranks than GPUs on a node (tensors then go over gloo through host "
                        "memory; for checks on one GPU, not for speed)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: never capture CUDA graphs; decode runs eagerly (otherwise it is captured once per "
                        "batch-size bucket and replayed)")


def check_arguments(args) -> None:
    """Fail now (ValueError, exit 2) on a device / dtype the machine cannot run, before any rank or model load."""
    device = resolve_device(args.device)
    resolve_dtype(args.dtype, device)


def engine_kwargs(args) -> dict:
    """`LLM` / `AsyncLLM` keyword arguments of `add_arguments`' options."""
    kwargs = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend,
              "share_gpus": args.share_gpus, "enforce_eager": getattr(args, "enforce_eager", False),
              "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}
    if hasattr(args, "gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kwargs
