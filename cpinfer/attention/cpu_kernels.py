"""CPU kernels of our own, compiled on first use into one library: a batched decode attention reading the paged KV
store in place (`cpu_decode.cpp`, the op `torch.ops.cpinfer.decode_attention`) and a flash attention for prefill
blocks (`cpu_prefill.cpp`, `torch.ops.cpinfer.flash_attention`); RoPE in one pass (`cpu_rope.cpp`,
`torch.ops.cpinfer.rope`: the six element-wise ops it replaces, rounded alike) and RMSNorm in one pass a row
(`cpu_rmsnorm.cpp`, `torch.ops.cpinfer.rms_norm`: 3-5x torch's on the engine's rows, its sum in another order);
the gated MLP's SiLU(gate) * up in one pass (`cpu_activation.cpp`, `torch.ops.cpinfer.silu_mul`); a decode step's
few rows times a weight, streamed once (`cpu_linear.cpp`, `torch.ops.cpinfer.small_linear`);
`cpu_vec.h` is the kernels' vector type and its reductions.

aten has no attention over many short sequences whose keys sit in runs of a shared store: the decode path would
call its flash kernel once per sequence and slot run (hundreds of calls a step, each with too few (row, head)
problems to keep the threads busy). Its CPU flash kernel for prefill runs each query head alone (a GQA model's keys
read once per query head) and its softmax at a fraction of the GEMMs' rate (`cpinfer bench cpu-attention`: 113-189
GFLOP/s on the engine's blocks on two cores here, against 201-239 for ours). No library on PyPI provides either for this torch on the CPU, so the kernels are
compiled here, once per machine, with the C++ compiler that builds torch extensions (`$CXX`, else `c++`), against the
installed torch's headers, for this CPU (`-march=native`), and cached under `$CPINFER_KERNEL_CACHE` (default
`~/.cache/cpinfer/kernels`), keyed by the sources, torch's version, the compiler and the CPU's flags. A file lock
lets one process build while the others (the CP ranks of one machine) wait for it.

Without a compiler, or with `CPINFER_CPU_KERNELS=0`, the `*_op()` functions return None and the engine keeps aten's
kernels and ops (the same results within float32 rounding; slower). Building takes ~1-2 minutes of CPU the first
time (the sources compiled in parallel, one a core, then linked) and is logged.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("cpinfer")
_HERE = Path(__file__).parent
_SOURCES = (_HERE / "cpu_decode.cpp", _HERE / "cpu_prefill.cpp", _HERE / "cpu_rope.cpp",
            _HERE / "cpu_rmsnorm.cpp", _HERE / "cpu_activation.cpp", _HERE / "cpu_linear.cpp")  # one library
_HEADERS = (_HERE / "cpu_vec.h",)
# -fopenmp: at::parallel_for's inline OpenMP region (the process's one OpenMP runtime, torch's libgomp);
# -fno-math-errno lets the compiler vectorise expf
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-std=c++20", "-shared",
          "-fPIC")
_lock = threading.Lock()
_state: dict = {}  # "ok": whether the library loaded, once tried


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx)


def _build(cxx: str, out: Path) -> None:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdir = cpp_extension.library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    def run(cmd: list[str]) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")

    compile_flags = [f for f in _FLAGS if f != "-shared"]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in _SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:  # one a core
            list(pool.map(run, [[cxx, *compile_flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c", str(src),
                                 "-o", str(obj)] for src, obj in zip(_SOURCES, objects)]))
        target = Path(tmp) / out.name
        run([cxx, *_FLAGS, *map(str, objects), "-o", str(target), f"-L{libdir}", "-lc10", "-ltorch_cpu",
             f"-Wl,-rpath,{libdir}"])
        os.replace(target, out)


def _library() -> Path:
    """The compiled library for this source, torch, compiler and CPU: built (under a file lock) when missing."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    texts = [p.read_text() for p in _SOURCES + _HEADERS]
    key = hashlib.sha256("\0".join([*texts, torch.__version__, version, _cpu_flags(), *_FLAGS]).encode())
    cache = Path(os.environ.get("CPINFER_KERNEL_CACHE") or Path.home() / ".cache" / "cpinfer" / "kernels")
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if not lib.exists():
            log.info("compiling cpinfer's CPU kernels (once per machine) into %s", cache)
            _build(cxx, lib)
    return lib


def _loaded() -> bool:
    """Build (once per machine) and load the library; False when it cannot be (no compiler, a failed build,
    CPINFER_CPU_KERNELS=0): the callers then keep aten's kernels. The reason is logged once."""
    ok = _state.get("ok")  # (every layer asks: no lock once known)
    if ok is not None:
        return ok
    with _lock:
        if "ok" not in _state:  # set once, when the outcome is known
            ok = False
            if os.environ.get("CPINFER_CPU_KERNELS", "1") != "0":
                try:
                    torch.ops.load_library(str(_library()))
                    ok = True
                except Exception as e:  # noqa: BLE001 - any failure leaves aten's kernels in place
                    log.warning("cpinfer's CPU kernels unavailable, using aten's kernels and ops (%s)", e)
            _state["ok"] = ok
        return _state["ok"]


def decode_attention_op():
    """torch.ops.cpinfer.decode_attention (`cpu_decode.cpp`), or None (see `_loaded`)."""
    return torch.ops.cpinfer.decode_attention if _loaded() else None


def flash_attention_op():
    """torch.ops.cpinfer.flash_attention (`cpu_prefill.cpp`), or None (see `_loaded`)."""
    return torch.ops.cpinfer.flash_attention if _loaded() else None


def rope_op():
    """torch.ops.cpinfer.rope (`cpu_rope.cpp`: float32 RoPE in one pass, aten's bits), or None."""
    return torch.ops.cpinfer.rope if _loaded() else None


def rms_norm_op():
    """torch.ops.cpinfer.rms_norm (`cpu_rmsnorm.cpp`: float32 RMSNorm in one pass a row), or None."""
    return torch.ops.cpinfer.rms_norm if _loaded() else None


def small_linear_op():
    """torch.ops.cpinfer.small_linear (`cpu_linear.cpp`: float32 x [1..16, K] @ weight^T streamed once), or None."""
    return torch.ops.cpinfer.small_linear if _loaded() else None


def small_linear_tiled_ops():
    """(torch.ops.cpinfer.small_linear_tiles, torch.ops.cpinfer.small_linear_tiled) (`cpu_linear.cpp`: a weight's
    interleaved copy, one stream a tile of four rows, and `small_linear`'s product read from it, the same bits), or
    None."""
    return (torch.ops.cpinfer.small_linear_tiles, torch.ops.cpinfer.small_linear_tiled) if _loaded() else None


def small_linear_rows() -> int:
    """The rows of x up to which `small_linear_op` is the faster product on this build (16 with AVX-512, 1 without:
    its tiles need 32 vector registers); 0 without the library."""
    rows = _state.get("small_rows")
    if rows is None:
        rows = _state["small_rows"] = int(torch.ops.cpinfer.small_linear_rows()) if _loaded() else 0
    return rows


def silu_mul_op():
    """torch.ops.cpinfer.silu_mul (`cpu_activation.cpp`: float32 SiLU(gate) * up in one pass), or None."""
    return torch.ops.cpinfer.silu_mul if _loaded() else None


__all__ = ["decode_attention_op", "flash_attention_op", "rms_norm_op", "rope_op", "silu_mul_op", "small_linear_op",
           "small_linear_rows", "small_linear_tiled_ops"]
