"""Ahead-of-time compilation of the Triton kernels for GPU targets, on a machine without a GPU.

Triton's full pipeline (TTIR → TTGIR → LLVM IR → PTX → cubin, or → AMDGCN → hsaco) runs on the CPU, so CI can
check that the kernel source the interpreter verified also compiles for NVIDIA (sm_80, sm_90) and AMD (gfx942)
GPUs, each step-kernel variant with the tiles, warps and pipeline depth of one class of `triton_tuning`. For
NVIDIA targets it also reads the binary's resources with the cuobjdump Triton ships (registers, spill stack, local
memory, shared memory) and counts Hopper's warpgroup MMA (HGMMA) in its SASS: what the chip would run, read without
the chip. Run as `python -m cpinfer.attention.triton_aot [target ...]` in a process without TRITON_INTERPRET.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

TARGETS = {"sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
_STEP_ARGS = ["Q", "K", "V", "OUT", "LSE", "QSEQ", "QPOS", "KSEQ", "KEND", "KPOS", "ROW0", "ROW1", "OFF", "KLO",
              "KHI", "RLO", "RHI", "DIAG"]
_STRIDES = ["sq0", "sq1", "sk0", "sk1", "sv0", "sv1", "so0", "so1", "sl0", "sl1", "ss0", "ss1", "ss2"]


def _target(name: str):
    from triton.backends.compiler import GPUTarget

    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return GPUTarget(*TARGETS[name])


def compile_step(target: str, dtype: str = "bf16", use_vectors: bool = True, head_dim: int = 128, group: int = 4,
                 block_m: int = 128, block_n: int = 64, num_warps: int = 8, split: bool = False,
                 num_stages: int = 3):
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
    sig["n_kvh"] = "i32"
    consts = dict(D=head_dim, G=group, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION="ieee" if dtype == "fp32" else "tf32",
                  UPCAST=False, USE_VECTORS=use_vectors, SPLIT=split)
    sig.update({name: "constexpr" for name in consts})
    # as Triton's launcher specialises them at run time for 16-byte aligned tensors and strides that are multiples
    # of 16 (every model's K/V rows): without it the loads are 2 bytes wide and the loop is not pipelined
    aligned = ["Q", "K", "V", "OUT", "LSE", "SCR"] + _STRIDES
    attrs = {(list(sig).index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=_step_kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=_target(target), options={"num_warps": num_warps, "num_stages": num_stages})


def compile_class(target: str, key, use_vectors: bool = True, split: bool = False, group: int = 4):
    """Compile the step kernel with the configuration `triton_tuning` gives class `key` (a TABLE key, or
    ("decode", operands, head class)); head size = the class's largest."""
    from cpinfer.attention import triton_tuning

    if key[0] == "decode":
        cfg = triton_tuning.DECODE[key[1:]]
        ops, hd = key[1:]
    else:
        cfg = triton_tuning.TABLE[key]
        ops, hd = key[:2]
    return compile_step(target, "bf16" if ops == "16" else "fp32", use_vectors, hd, group, cfg.block_m, cfg.block_n,
                        cfg.num_warps, split, cfg.num_stages)


def resources(compiled) -> dict:
    """An NVIDIA binary's registers, stack and local bytes (spills), shared memory (static + Triton's dynamic),
    count of HGMMA (warpgroup MMA) instructions and of spill loads / stores among them, read with the cuobjdump
    Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    got = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", usage)}
    got["shared"] = int(compiled.metadata.shared)
    ops = re.findall(r"\b(HGMMA|HMMA|LDL|STL)\b", sass)  # in program order
    mma = [i for i, op in enumerate(ops) if op in ("HGMMA", "HMMA")]
    got["hgmma"] = ops.count("HGMMA")
    # spill traffic between the first and the last tensor-core MMA: inside the K/V loops (the epilogue's merge of
    # two [M, D] fp32 tiles may spill once per program; the loops must not); -1: no MMA to locate the loops by
    got["loop_spills"] = sum(op in ("LDL", "STL") for op in ops[mma[0]:mma[-1]]) if mma else -1
    return got


def compile_merge(target: str, out_dtype: str = "bf16", head_dim: int = 64, block_r: int | None = None,
                  accumulate: bool = False):
    """Compile the merge kernel for `target` (accumulate: the split-KV merge into an fp32 running result), with the
    pairs per program the launchers take for `head_dim` unless `block_r` is given."""
    import triton
    from triton.compiler import ASTSource

    from cpinfer.attention.triton_merge import _merge_kernel, block_rows

    _refuse_interpreter()
    block_r = block_r or block_rows(head_dim)
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


VARIANTS = {  # the step kernel in each class of `triton_tuning` (bf16 unless fp32; G = 4), and the merges
    "step-vectors": lambda t: compile_class(t, ("16", 128, "causal")),
    "step-items": lambda t: compile_class(t, ("16", 128, "causal"), use_vectors=False),
    "step-full": lambda t: compile_class(t, ("16", 128, "full")),
    "step-short": lambda t: compile_class(t, ("16", 128, "short")),
    "step-d64": lambda t: compile_class(t, ("16", 64, "causal")),
    "step-d256": lambda t: compile_class(t, ("16", 256, "causal")),
    "step-fp32": lambda t: compile_class(t, ("32", 128, "causal")),
    "step-vectors-split": lambda t: compile_class(t, ("decode", "16", 128), split=True),
    "step-decode-items": lambda t: compile_class(t, ("decode", "16", 128), use_vectors=False, split=True),
    "merge": lambda t: compile_merge(t),
    "merge-into": lambda t: compile_merge(t, accumulate=True),
    "merge-d128": lambda t: compile_merge(t, head_dim=128),
    "merge-into-d128": lambda t: compile_merge(t, head_dim=128, accumulate=True),
    "merge-into-d512": lambda t: compile_merge(t, head_dim=512, accumulate=True)}


def main(argv: list[str] | None = None) -> int:
    """Compile kernel variants for targets: arguments TARGET or TARGET:VARIANT[,VARIANT] (default: every
    variant for every target); prints one line per binary (target variant ok kinds [key=value resources])."""
    specs = (argv if argv is not None else sys.argv[1:]) or list(TARGETS)
    for spec in specs:
        target, _, only = spec.partition(":")
        names = only.split(",") if only else list(VARIANTS)
        bad = [n for n in names if n not in VARIANTS]
        if bad:
            raise ValueError(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
        for name in names:
            compiled = VARIANTS[name](target)
            extra = []
            if TARGETS[target][0] == "cuda":
                extra = [f"{k}={v}" for k, v in resources(compiled).items()]
            print(target, name, "ok", ",".join(compiled.asm), *extra, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
