"""The Triton kernels compile ahead of time for NVIDIA (sm_90) and AMD (gfx942) GPUs, on this CPU-only machine.

The interpreter tests (test_triton.py) check the numbers; this checks that the same source survives Triton's
real compiler down to a GPU binary (cubin / hsaco) in the step kernel's tuned classes (`triton_tuning`), and reads
the sm_90 binaries: shared memory within Hopper's 227 KB per block, no register spills inside the K/V loops, and
the 16-bit tiles on warpgroup MMA (HGMMA); the merge kernel, at the pairs per program its launchers take, spills
nothing at all (at 64 pairs of 128 channels it spilled 2.6 KB a thread and took 0.58 ms a layer of an H200's
split-KV decode).
It runs in a subprocess without TRITON_INTERPRET and with an empty kernel cache, so every binary is built here.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be compiled")

HOPPER_SHARED = 227 * 1024  # bytes of shared memory one block may use on sm_90
SM90 = ("step-vectors", "step-items", "step-short", "step-d256", "step-vectors-split", "merge", "merge-into",
        "merge-d128", "merge-into-d128", "merge-into-d512")


# the compiles, in two processes that run side by side (about the same compile time each: on two cores the test
# takes half as long); every binary is built once either way
SPECS = (["sm_90:step-vectors,step-d256,step-vectors-split,merge,merge-into"],
         ["sm_90:step-items,step-short,merge-d128,merge-into-d128,merge-into-d512", "gfx942:step-vectors,merge"])


def test_kernels_compile_to_gpu_binaries(tmp_path):
    procs = []
    for i, specs in enumerate(SPECS):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / str(i))
        env["TRITON_DEFAULT_FP_FUSION"] = "1"
        procs.append(subprocess.Popen([sys.executable, "-m", "cpinfer.attention.triton_aot", *specs], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:  # a no-op for those that exited: none outlives a failure here
            proc.kill()
            proc.wait()
    lines = {}
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
        lines.update({tuple(line.split()[:2]): line.split() for line in out.splitlines()})
    assert set(SM90) == {k for t, k in lines if t == "sm_90"}  # the split covers every sm_90 variant
    wanted = [("sm_90", k, "cubin") for k in SM90] + [("gfx942", k, "hsaco") for k in ("step-vectors", "merge")]
    for target, kernel, binary in wanted:
        words = lines[(target, kernel)]
        assert words[2] == "ok" and binary in words[3].split(","), words
    for kernel in SM90:
        res_ = dict(w.split("=") for w in lines[("sm_90", kernel)][4:])
        assert int(res_["shared"]) <= HOPPER_SHARED, (kernel, res_)
        if kernel.startswith("step"):  # MMA kernels: none of their K/V loop's registers spill
            assert int(res_["loop_spills"]) == 0, (kernel, res_)
        else:  # the merges: no spill anywhere (no stack frame)
            assert int(res_["stack"]) == 0, (kernel, res_)
        if kernel in ("step-vectors", "step-items", "step-short", "step-d256"):  # 16-bit tiles of 64+ lanes
            assert int(res_["hgmma"]) > 0, (kernel, res_)
