"""CPU kernels of our own, compiled on first use: a batched decode attention reading the paged KV store in place
(`cpu_decode.cpp`, the op `torch.ops.cpinfer.decode_attention`).

aten has no attention over many short sequences whose keys sit in runs of a shared store: the decode path would
call its flash kernel once per sequence and slot run (hundreds of calls a step, each with too few (row, head)
problems to keep the threads busy). No library on PyPI provides one for this torch on the CPU, so the kernel is
compiled here, once per machine, with the C++ compiler that builds torch extensions (`$CXX`, else `c++`), against the
installed torch's headers, for this CPU (`-march=native`), and cached under `$CPINFER_KERNEL_CACHE` (default
`~/.cache/cpinfer/kernels`), keyed by the source, torch's version, the compiler and the CPU's flags. A file lock
lets one process build while the others (the CP ranks of one machine) wait for it.

Without a compiler, or with `CPINFER_CPU_KERNELS=0`, `decode_attention_op()` returns None and the engine keeps
aten's kernel (same results within float32 rounding; slower at batched decode). Building takes ~10-30 s the first
time and is logged.
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
from pathlib import Path

import torch

log = logging.getLogger("cpinfer")
_SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# -fopenmp: at::parallel_for's inline OpenMP region (the process's one OpenMP runtime, torch's libgomp);
# -fno-math-errno lets the compiler vectorise expf
_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-std=c++20", "-shared",
          "-fPIC")
_lock = threading.Lock()
_state: dict = {}  # "op": the loaded op or None, once tried


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
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(_SOURCE), "-o", str(target),
               f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(target, out)


def _library() -> Path:
    """The compiled library for this source, torch, compiler and CPU: built (under a file lock) when missing."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), torch.__version__, version, _cpu_flags(), *_FLAGS]).encode())
    cache = Path(os.environ.get("CPINFER_KERNEL_CACHE") or Path.home() / ".cache" / "cpinfer" / "kernels")
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"cpu_decode-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if not lib.exists():
            log.info("compiling cpinfer's CPU decode-attention kernel (once per machine) into %s", cache)
            _build(cxx, lib)
    return lib


def decode_attention_op():
    """torch.ops.cpinfer.decode_attention, built and loaded on first call; None when it cannot be (no compiler,
    a failed build, CPINFER_CPU_KERNELS=0): the caller then keeps aten's kernel. The reason is logged once."""
    with _lock:
        if "op" not in _state:
            _state["op"] = None
            if os.environ.get("CPINFER_CPU_KERNELS", "1") != "0":
                try:
                    torch.ops.load_library(str(_library()))
                    _state["op"] = torch.ops.cpinfer.decode_attention
                except Exception as e:  # noqa: BLE001 - any failure leaves aten's kernel in place
                    log.warning("CPU decode-attention kernel unavailable, using aten's (%s)", e)
        return _state["op"]


__all__ = ["decode_attention_op"]
