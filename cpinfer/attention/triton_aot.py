"""Ahead-of-time compilation of the Triton kernels for GPU targets, on a machine without a GPU.

Triton's full pipeline (TTIR → TTGIR → LLVM IR → PTX → cubin, or → AMDGCN → hsaco) runs on the CPU, so CI can
check that the kernel source the interpreter verified also compiles for NVIDIA (sm_80, sm_90) and AMD (gfx942)
GPUs. Run as `python -m cpinfer.attention.triton_aot [target ...]` in a process without TRITON_INTERPRET.
"""
from __future__ import annotations

import os
import sys

TARGETS = {"sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
_STEP_ARGS = ["Q", "K", "V", "OUT", "LSE", "QSEQ", "QPOS", "KSEQ", "KEND", "KPOS", "ROW0", "ROW1", "OFF", "KLO",
              "KHI", "RLO", "RHI", "DIAG"]
_STRIDES = ["sq0", "sq1", "sk0", "sk1", "sv0", "sv1", "so0", "so1", "sl0", "sl1", "ss0", "ss1", "ss2"]


def _target(name: str):
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def compile_step(target: str, dtype: str = "bf16", use_vectors: bool = True, head_dim: int = 64, group: int = 4,
                 block_m: int = 64, block_n: int = 64, num_warps: int = 8, split: bool = False):
    """Compile the step kernel for `target` as `launch_step` would launch it; returns Triton's compiled kernel."""
    import triton
    from triton.compiler import ASTSource

    from cpinfer.attention.triton_attention import _step_kernel

    _refuse_interpreter()
    sig = dict(zip(_STEP_ARGS, [f"*{dtype}"] * 3 + ["*fp32"] * 2 + ["*i32"] * 13))
    sig.update({"SLOT": "*i32", "SCR": "*fp32"})
    sig.update({name: "i64" for name in _STRIDES})
    sig["qk_scale"] = "fp32"
    sig["WINDOW"] = "i32"  # sliding window (2^30: none)
    consts = dict(D=head_dim, G=group, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION="ieee" if dtype == "fp32" else "tf32",
                  UPCAST=False, USE_VECTORS=use_vectors, SPLIT=split)
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(fn=_step_kernel, signature=sig, constexprs=consts), target=_target(target),
                          options={"num_warps": num_warps})


def compile_merge(target: str, out_dtype: str = "bf16", head_dim: int = 64, block_r: int = 64,
                  accumulate: bool = False):
    """Compile the merge kernel for `target` (accumulate: the split-KV merge into an fp32 running result)."""
    import triton
    from triton.compiler import ASTSource

    from cpinfer.attention.triton_merge import _merge_kernel

    _refuse_interpreter()
    sig = {"P_OUT": "*fp32", "P_LSE": "*fp32", "OUT": f"*{out_dtype}", "LSE": "*fp32", "n_src": "i32",
           "n_pairs": "i32", "heads": "i32"}
    sig.update({name: "i64" for name in ["po0", "po1", "po2", "pl0", "pl1", "pl2", "oo0", "oo1", "ol0", "ol1"]})
    consts = dict(D=head_dim, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(head_dim), ACCUMULATE=accumulate)
    if accumulate:
        sig["OUT"] = "*fp32"
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(fn=_merge_kernel, signature=sig, constexprs=consts), target=_target(target))


def _refuse_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ahead-of-time compilation needs a process without TRITON_INTERPRET=1")


VARIANTS = {"step-vectors": lambda t: compile_step(t), "step-items": lambda t: compile_step(t, use_vectors=False),
            "step-vectors-split": lambda t: compile_step(t, split=True), "merge": lambda t: compile_merge(t),
            "merge-into": lambda t: compile_merge(t, accumulate=True)}


def main(argv: list[str] | None = None) -> int:
    """Compile kernel variants for targets: arguments TARGET or TARGET:VARIANT[,VARIANT] (default: every
    variant for every target); prints one line per binary (target variant ok kinds)."""
    specs = (argv if argv is not None else sys.argv[1:]) or list(TARGETS)
    for spec in specs:
        target, _, only = spec.partition(":")
        names = only.split(",") if only else list(VARIANTS)
        bad = [n for n in names if n not in VARIANTS]
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
        for name in names:
            print(target, name, "ok", ",".join(VARIANTS[name](target).asm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
