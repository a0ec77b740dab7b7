"""The Triton kernels compile ahead of time for NVIDIA (sm_90) and AMD (gfx942) GPUs, on this CPU-only machine.

The interpreter tests (test_triton.py) check the numbers; this checks that the same source survives Triton's
real compiler down to a GPU binary (cubin / hsaco). It runs in a subprocess without TRITON_INTERPRET and with
an empty kernel cache, so every binary is built here.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be compiled")


def test_kernels_compile_to_gpu_binaries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-m", "cpinfer.attention.triton_aot", "sm_90", "gfx942:step-vectors,merge"],
                         env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = {tuple(line.split()[:2]): line.split() for line in res.stdout.splitlines()}
    wanted = [("sm_90", k, "cubin") for k in ("step-vectors", "step-items", "step-vectors-split", "merge", "merge-into")]
    wanted += [("gfx942", k, "hsaco") for k in ("step-vectors", "merge")]
    for target, kernel, binary in wanted:
        words = lines[(target, kernel)]
        assert words[2] == "ok" and binary in words[3].split(","), words
