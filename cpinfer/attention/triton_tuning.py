"""Tile, warp and pipelining configurations of the Triton step kernel, one per shape class, chosen for Hopper
(H100 / H200, sm_90: 132 multiprocessors, 227 KB of shared memory and 64K registers each, wgmma issued per
4-warp group over 64 rows) and used on every GPU; the interpreter gets small tiles (it is fastest on them).

A program owns BLOCK_M lanes = query rows x G (the G query heads sharing one KV head, packed into M: one K/V load
serves the whole group). The class is read off the step before its tables are built: dtype, head size, whether
any causal square is in the step, and the longest query run of an item (1 in decode).
"""
from __future__ import annotations

import dataclasses

H100_SMS = 132  # multiprocessors assumed where the device cannot be asked (planning on a host without the GPU)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """One launch configuration: lanes per program (query rows x G), keys per inner step, warps, pipeline depth."""

    block_m: int  # M lanes: query rows x G heads (a power of two >= 16, tl.dot's smallest M)
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int  # K/V tiles in flight (software pipelining of the inner loop)
    why: str = ""

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            x = getattr(self, name)
            if x < 16 or x & (x - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {x}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.num_warps == 8 and self.block_m < 128:
            raise ValueError(f"8 warps need 128-lane tiles (each 4-warp group issues wgmma over 64 rows), got "
                             f"block_m={self.block_m}; use 4 warps")
        if not 1 <= self.num_stages <= 5:
            raise ValueError(f"num_stages must be 1..5, got {self.num_stages}")


# The table. Keys: (operand class, head-size class, step class). Operand "16" = bf16 / fp16 (tensor cores, fp32
# accumulation); "32" = fp32 (ieee dots: the exact fallback, FMA-bound). Head-size class: the padded head size
# BLOCK_D (64, 128, 256). Step class: "causal" (a causal square in the step: its diagonal tiles run masked),
# "full" (no diagonal: pass-KV's earlier blocks, cached prefixes), "short" (a prefill too small to give every
# multiprocessor a 128-lane program), "decode" (items of a few rows: M is one row's GQA group).
TABLE: dict[tuple[str, int, str], StepConfig] = {
    # Long prefill, 16-bit: 128 lanes over 8 warps (two warpgroups of 64 rows: wgmma's M per group). Read off the
    # sm_90 binaries (`triton_aot`, with the 16-byte alignment the launcher specialises real tensors with):
    # registers, spills inside the K/V loop, shared memory, cp.async stages, HGMMA. At D=128 64-key steps are the
    # widest that run the loop without spills (204 registers, 130 KB of shared memory with 3 stages); 128 keys
    # spill and take all 227 KB. At D=64 the registers are less used: 128 keys and 4 stages (232 regs, 149 KB).
    ("16", 64, "causal"): StepConfig(128, 128, 8, 4, "long prefill, D<=64: 128-key steps fit the registers"),
    ("16", 64, "full"): StepConfig(128, 128, 8, 4, "long prefill, D<=64"),
    ("16", 128, "causal"): StepConfig(128, 64, 8, 3, "long prefill, D=128: the widest spill-free key step; "
                                                     "64-key diagonal tiles halve the masked work"),
    ("16", 128, "full"): StepConfig(128, 64, 8, 3, "long prefill, D=128 (128-key steps spill in the loop)"),
    # D in (128, 256]: O alone is 128 regs/thread; 32-key steps keep the loop spill-free (the epilogue spills)
    ("16", 256, "causal"): StepConfig(128, 32, 8, 2, "prefill, D<=256: O fills the registers"),
    ("16", 256, "full"): StepConfig(128, 32, 8, 2, "prefill, D<=256: O fills the registers"),
    # too few 128-lane programs to fill the multiprocessors: half the lanes, twice the programs, one warpgroup
    ("16", 64, "short"): StepConfig(64, 64, 4, 3, "short prefill, D<=64"),
    ("16", 128, "short"): StepConfig(64, 64, 4, 3, "short prefill, D=128"),
    ("16", 256, "short"): StepConfig(64, 32, 4, 2, "short prefill, D<=256"),
    # fp32 (ieee): FMA dots, twice the bytes per tile; small tiles, one warpgroup (the exact path, not a fast one)
    ("32", 64, "causal"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 64, "full"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 64, "short"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 128, "causal"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 128, "full"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 128, "short"): StepConfig(64, 32, 4, 2, "fp32 prefill"),
    ("32", 256, "causal"): StepConfig(32, 32, 4, 1, "fp32 prefill, D<=256"),
    ("32", 256, "full"): StepConfig(32, 32, 4, 1, "fp32 prefill, D<=256"),
    ("32", 256, "short"): StepConfig(32, 32, 4, 1, "fp32 prefill, D<=256"),
}
# decode: M is a row's GQA group (block_m = G rounded up to 16, see `select`); the step only streams K/V, so 4
# warps and a deep pipeline keep loads in flight (spill-free on sm_90 with the vector masks compiled in; at
# D=128, 150 registers and 72 KB: two programs fit a multiprocessor); split-KV (`decode_splits`) supplies the
# parallelism
DECODE = {("16", 64): StepConfig(16, 64, 4, 4, "decode"), ("16", 128): StepConfig(16, 64, 4, 3, "decode"),
          ("16", 256): StepConfig(16, 32, 4, 3, "decode"), ("32", 64): StepConfig(16, 32, 4, 3, "fp32 decode"),
          ("32", 128): StepConfig(16, 32, 4, 2, "fp32 decode"), ("32", 256): StepConfig(16, 16, 4, 2, "fp32 decode")}
INTERPRETER = StepConfig(16, 16, 4, 1, "interpreter: numpy per program, fastest on small tiles")
DECODE_LANES = 64  # items of at most this many lanes (rows x G) are the decode class


# head sizes past 256 (MLA's absorbed 576 = 512 latent + 64 rope): O is BLOCK_D >= 512 fp32 columns per lane,
# beyond any register file; these run correct but spilling, in small tiles (a flash-MLA kernel is their fast path)
WIDE = {"16": StepConfig(64, 16, 4, 1, "head size > 256: exact, spills"),
        "32": StepConfig(32, 16, 4, 1, "fp32, head size > 256: exact, spills")}


def head_class(head_dim: int) -> int:
    """64, 128 or 256 (the padded head size BLOCK_D the table knows), or 0 past 256 (the WIDE configs)."""
    if head_dim < 1:
        raise ValueError(f"the Triton step kernel needs a head size >= 1, got {head_dim}")
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256 if head_dim <= 256 else 0


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def select(dtype_bits: int, head_dim: int, group: int, causal: bool, item_rows: int, rows: int, kv_heads: int,
           sms: int = H100_SMS) -> StepConfig:
    """The configuration of a step: dtype_bits 16 or 32, head size, G = heads / kv_heads, whether a causal square
    is in the step, the longest query run of one item, the step's query rows and KV heads, multiprocessors."""
    ops, hd = ("16" if dtype_bits == 16 else "32"), head_class(head_dim)
    lanes = next_pow2(max(item_rows, 1) * group)
    if hd == 0:
        cfg = WIDE[ops]
        lanes = max(lanes if lanes <= DECODE_LANES else cfg.block_m, next_pow2(group), 16)
        return dataclasses.replace(cfg, block_m=lanes, num_warps=8 if lanes >= 128 else 4)
    if lanes <= DECODE_LANES:  # a few rows per item (decode, short chunks): M holds their GQA groups
        base = DECODE[(ops, hd)]
        return dataclasses.replace(base, block_m=max(16, lanes))
    cfg = TABLE[(ops, hd, "causal" if causal else "full")]
    if cfg.block_m >= 128 and -(-rows * group // cfg.block_m) * kv_heads < sms:
        cfg = TABLE[(ops, hd, "short")]
    if cfg.block_m < next_pow2(group):  # one row's group must fit (G > 64: MQA-like packing)
        cfg = dataclasses.replace(cfg, block_m=next_pow2(group), num_warps=8 if next_pow2(group) >= 128 else 4)
    return cfg


def decode_splits(programs: int, kv_heads: int, keys: int, block_n: int, sms: int = H100_SMS) -> int:
    """Keys per split-KV program (0: no split) for a launch of `programs` row blocks x `kv_heads` over `keys` keys
    in all: enough pieces that about two programs per multiprocessor run (one wave of programs each holding a
    whole pipeline), never fewer than 4 K/V tiles per piece (each piece costs a scratch write and a merge read)."""
    target = 2 * sms
    if programs * kv_heads >= target or keys <= 0:
        return 0
    per = max(4 * block_n, -(-keys * kv_heads // target))
    return -(-per // block_n) * block_n


__all__ = ["StepConfig", "TABLE", "DECODE", "WIDE", "INTERPRETER", "select", "decode_splits", "head_class", "H100_SMS"]
