"""Block-scaled FP8 weights that stay FP8 (cpinfer/model/fp8_gemm.py, `quant.BlockFp8Linear`), run in Triton's
interpreter: the GEMM equals x @ dequant(W)^T in fp32 for decode and prefill shapes, partial scale blocks and both
weight reads (float8e4nv converts, uint8 bits decoded); every e4m3 code decodes exactly; whole tiny models loaded
with `fp8_native=True` run every block-FP8 linear through it and match the dequantized model; at TP 2 the cuts keep
FP8 (block and row-wise) with their scales sliced alike, exactly the dequantized slices, and two TP ranks match the
dequantized model; row-wise scales run through it where `_scaled_mm` cannot; the kernel compiles for sm_90 (wgmma)
and sm_80 (bit decoding) ahead of time; `cpinfer bench fp8-gemm` runs."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before fp8_gemm is imported: its kernel is built for the interpreter
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from cpinfer.model import ModelConfig, ReferenceAttention, build_model, load_model, load_weights  # noqa: E402
from cpinfer.model.fp8_gemm import (GemmConfig, _e4m3_bits_to_f32, block_fp8_linear, block_k_for,  # noqa: E402
                                    interpreting, pick_config)
from cpinfer.model import quant  # noqa: E402
from cpinfer.model.quant import (ROW_BLOCK, BlockFp8Linear, Fp8Linear, NativePlan, native_candidates,  # noqa: E402
                                 parse_quantization, scaled_mm_runs)
from cpinfer.tensor_parallel import load_tp_model  # noqa: E402
from fp8_checkpoint import write_fp8_pair  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="TRITON_INTERPRET was set to 0 before this module")
FP8 = torch.float8_e4m3fn
NAN_CODES = (0x7F, 0xFF)


def _dequantize(w: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    n, k = w.shape
    bo, bi = min(block[0], n), min(block[1], k)  # ROW_BLOCK's 2^30 columns: one block covers all k
    return w.float() * s.repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]


def _random_fp8(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[n, k] e4m3 over every finite code (subnormals, both zeros, ±448), no NaN."""
    bits = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    bits[(bits & 0x7F) == 0x7F] = 0x3F
    return bits.view(FP8)


def test_gemm_equals_the_dequantized_product():
    """M = 1 (decode), 7, 33; N, K = 128, 200 (a partial scale block), 320 (2.5 blocks); 128x128 blocks and
    narrow 32x64 / 64x32 ones; both weight reads; K split in 3 (decode); bias; fp32 exact up to summation order,
    bf16 up to its output rounding."""
    g = torch.Generator().manual_seed(0)
    cases = [(m, n, k, (128, 128)) for m in (1, 7, 33) for n, k in ((128, 128), (200, 200), (320, 320))]
    cases += [(5, 96, 200, (32, 64)), (17, 200, 96, (64, 32))]
    split = GemmConfig(16, 32, 32, 4, 2, split_k=3)  # K split in 3 ranges of whole 32-wide tiles (K=200: 4 + 3 ...)
    for i, (m, n, k, block) in enumerate(cases):
        w = _random_fp8(n, k, g)
        s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 1e-3  # [N/bo, K/bi]
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g) if i % 2 else None
        want = x.double() @ _dequantize(w, s, block).double().t() + (0 if bias is None else bias.double())
        for bits, config in ((False, None), (True, None), (bool(i % 2), split if m <= 16 else None)):
            y = block_fp8_linear(x, w, s, block, bias, decode_bits=bits, config=config)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    xb = torch.randn(2, 3, 200, generator=g).to(torch.bfloat16)  # [..., K] leading dims, 16-bit activations
    w, s = _random_fp8(320, 200, g), torch.rand(3, 2, generator=g) * 0.01
    want = (xb.float() @ _dequantize(w, s, (128, 128)).t()).to(torch.bfloat16)
    for config in (None, GemmConfig(16, 32, 64, 4, 2, split_k=2)):
        y = block_fp8_linear(xb, w, s, (128, 128), config=config)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 320)
        torch.testing.assert_close(y, want)


@triton.jit
def _decode_kernel(B, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, _e4m3_bits_to_f32(tl.load(B + i)))


def test_every_e4m3_code_decodes_exactly():
    """The bit decoder (Ampere's path) on all 256 codes: zeros, subnormals (m 2^-9), normals, ±448 and NaN
    (0x7F, 0xFF) equal torch's float8_e4m3fn conversion; through the GEMM (x = identity) both weight reads give
    every finite code exactly times its scale. (The interpreter reads float8e4nv NaN codes as ±480, the GPU as
    NaN: the identity check leaves NaN out; a NaN weight is garbage in any case.)"""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    _decode_kernel[(1,)](codes, out, N=256)
    torch.testing.assert_close(out, codes.view(FP8).float(), rtol=0, atol=0, equal_nan=True)
    finite = codes.clone()
    finite[list(NAN_CODES)] = 0
    w = finite.reshape(16, 16).view(FP8)  # [N, K]
    s = torch.tensor([[0.125]])  # a power of two: the scaled values stay exact
    for bits in (False, True):
        y = block_fp8_linear(torch.eye(16), w, s, (16, 16), decode_bits=bits)
        torch.testing.assert_close(y, w.float().t() * 0.125, rtol=0, atol=0)


def test_tile_configs():
    """K tiles divide the scale block (one scale per column per tile); decode gets a 16-row tile and enough N
    tiles for the SMs; an unusable block K size is refused by name."""
    assert [block_k_for(q) for q in (128, 64, 32, 16, 96, 48, 200, 24)] == [128, 64, 32, 16, 32, 16, None, None]
    dec = pick_config(1, 8192, 8192, 128, torch.bfloat16, sms=132)
    assert (dec.block_m, dec.block_n, dec.block_k, dec.split_k) == (16, 32, 128, 1)  # 256 N tiles: no split
    tp8 = pick_config(1, 1024, 8192, 128, torch.bfloat16, sms=132)  # a TP 8 slice: 32 N tiles
    assert (tp8.block_n, tp8.split_k) == (32, 5)  # 160 programs, each over 13 K tiles
    assert pick_config(1, 1024, 512, 128, torch.bfloat16).split_k == 1  # K too short to split
    pre = pick_config(8192, 4096, 4096, 128, torch.bfloat16, sms=132)
    assert (pre.block_m, pre.block_n, pre.num_warps, pre.split_k) == (128, 128, 8, 1)
    assert pick_config(33, 4096, 4096, 96, torch.float32).block_k == 32
    with pytest.raises(ValueError, match="block K size divisible by 16, got 24"):
        pick_config(1, 64, 64, 24, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two >= 16"):
        GemmConfig(8, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        GemmConfig(16, 64, 64, 4, 2, split_k=0)
    with pytest.raises(ValueError, match="must divide the scale block's K size 32"):
        block_fp8_linear(torch.randn(1, 64), _random_fp8(32, 64, torch.Generator()), torch.ones(1, 2), (32, 32),
                         config=GemmConfig(16, 32, 64, 4, 2))
    with pytest.raises(ValueError, match=r"a \[1, 2\] scale"):
        block_fp8_linear(torch.randn(1, 64), _random_fp8(32, 64, torch.Generator()), torch.ones(2, 2), (32, 32))


@torch.no_grad()
def _logprobs(model, cfg, ids):
    pos = torch.arange(len(ids))
    attn = ReferenceAttention(torch.zeros(len(ids), dtype=torch.long), pos, config=cfg)
    return model.compute_logits(model(ids, pos, attn)).log_softmax(-1)


# (tiny variant, format): dense every linear block-wise (fp8 and compressed-tensors), a MoE with a shared expert
# (its linears stay FP8, the routed experts are dequantized), q/k/v biases (added in the kernel). (Quantized MLA checkpoints are refused at config
# time, families.py; `native_candidates` leaves kv_b_proj out for when they are not.)
MODELS = [("gqa", "fp8_block"), ("gqa", "ct_block"), ("qwen2_moe", "fp8_block"), ("qwen2", "fp8_block")]


@pytest.mark.parametrize("variant, fmt", MODELS)
def test_block_fp8_model_runs_through_the_triton_gemm(llama_checkpoint, tmp_path, variant, fmt):
    """fp8_native: every block-FP8 linear becomes a `BlockFp8Linear` holding e4m3 weights and the checkpoint's
    block scales; the logits equal the dequantized model's up to fp32 summation order (each product is the same
    sum of exact e4m3 x activation terms, scaled per 32-wide K block instead of per weight): max |Δ log-prob|
    under 1e-4 — the bound test_quant.py holds transformers to."""
    write_fp8_pair(llama_checkpoint(variant), tmp_path / "fp8", tmp_path / "deq", fmt)
    cfg = ModelConfig.from_pretrained(tmp_path / "fp8")
    native = build_model(cfg)
    load_weights(native, tmp_path / "fp8", fp8_native=True)
    fp8 = {n: m for n, m in native.named_modules() if isinstance(m, BlockFp8Linear)}
    layer = native.model.layers[0]
    assert layer.self_attn.o_proj in fp8.values()
    assert all(m.weight.dtype == FP8 and m.block == (32, 32) for m in fp8.values())
    assert not [n for n, p in native.named_parameters() if p.dtype == FP8 and "weight_scale" not in n
                and n.rpartition(".")[0] not in fp8]
    if variant == "qwen2_moe":
        assert isinstance(native.model.layers[0].mlp.shared_expert.down_proj, BlockFp8Linear)
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(3))
    _, plain = load_model(tmp_path / "deq")
    lp, want = _logprobs(native, cfg, ids), _logprobs(plain, cfg, ids)
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-4)
    print(f"\n{variant} {fmt}: {len(fp8)} BlockFp8Linear, max |Δ log-prob| {float((lp - want).abs().max()):.1e}")


def test_row_wise_without_scaled_mm_runs_through_the_triton_gemm(llama_checkpoint, tmp_path, monkeypatch):
    """Where `_scaled_mm` cannot serve (Ampere; here: its probe patched to fail), row-wise FP8 linears stay FP8 as
    `BlockFp8Linear`s with one block per row ([out, 1] scales): activations are not quantized, so the logits
    equal the dequantized model's within 1e-4 log-prob, as for block scales. (Per-tensor scales take the same
    path: test_tp2_slices_keep_fp8_with_their_scales[fp8_tensor-*].)"""
    monkeypatch.setattr(quant, "scaled_mm_runs", lambda device: False)
    write_fp8_pair(llama_checkpoint("gqa"), tmp_path / "fp8", tmp_path / "deq", "ct_channel_dynamic")
    cfg = ModelConfig.from_pretrained(tmp_path / "fp8")
    native = build_model(cfg)
    load_weights(native, tmp_path / "fp8", fp8_native=True)
    fp8 = [m for m in native.modules() if isinstance(m, BlockFp8Linear)]
    assert len(fp8) == 14 and all(m.block == ROW_BLOCK for m in fp8)
    lin = native.model.layers[0].mlp.down_proj
    assert lin in fp8 and lin.weight_scale_inv.shape == (lin.weight.shape[0], 1)
    ids = torch.randint(3, 256, (16,), generator=torch.Generator().manual_seed(5))
    _, plain = load_model(tmp_path / "deq")
    torch.testing.assert_close(_logprobs(native, cfg, ids), _logprobs(plain, cfg, ids), rtol=0, atol=1e-4)


def test_native_plan_by_device_and_format(llama_checkpoint):
    """On CPU nothing stays FP8 unless forced; forced, the interpreter runs the block GEMM and `_scaled_mm`
    (where this PyTorch runs it on CPU) the row-wise one; lm_head and MLA's kv_b_proj are never candidates."""
    cfg = ModelConfig.from_pretrained(llama_checkpoint("deepseek_v3"))
    model = build_model(cfg)
    method = parse_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]})
    cpu = torch.device("cpu")
    assert native_candidates(model, method, cpu) is None
    assert native_candidates(model, None, cpu, force=True) is None
    plan = native_candidates(model, method, cpu, force=True)
    assert isinstance(plan, NativePlan) and "triton_block" in plan.kernels
    assert "model.layers.0.self_attn.q_a_proj.weight" in plan.names
    assert not [n for n in plan.names if "kv_b_proj" in n or n.startswith("lm_head")]


COMPILE = """
from cpinfer.model.fp8_gemm import compile_for
for arch, m, bits in ((90, 4096, False), (80, 1, True)):
    k = compile_for(arch, m, 4096, decode_bits=bits)
    ptx = k.asm["ptx"]
    print(arch, "cubin" in k.asm, "wgmma" in ptx, "cvt.rn.bf16x2.e4m3x2" in ptx or "e4m3x2" in ptx)
"""


def test_kernel_compiles_for_hopper_and_ampere(tmp_path):
    """Without the interpreter: Hopper's prefill tile (float8e4nv read, converted in hardware) builds a cubin on
    wgmma; Ampere's decode tile (bit decoding, no e4m3 instruction) builds one too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:2] == ["90 True True True", "80 True False False"], res.stdout


def _dequantized(module) -> torch.Tensor:
    if isinstance(module, BlockFp8Linear):
        return _dequantize(module.weight, module.weight_scale_inv, module.block)
    if isinstance(module, Fp8Linear):
        return module.weight.float() * module.weight_scale.reshape(-1, 1)
    return module.weight


def _linears(model) -> dict:
    """name -> the linear module (a row-parallel wrapper's inner one under its own name)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, Fp8Linear, BlockFp8Linear)):
            out[name.removesuffix(".linear")] = m
    return out


@pytest.mark.parametrize("fmt, kind, kv_kinds", [
    ("fp8_block", BlockFp8Linear, (BlockFp8Linear, torch.nn.Linear)),
    ("ct_channel_dynamic", Fp8Linear, (BlockFp8Linear, BlockFp8Linear)),
    ("ct_channel_dynamic", BlockFp8Linear, (BlockFp8Linear, BlockFp8Linear)),
    ("fp8_tensor", BlockFp8Linear, (BlockFp8Linear, BlockFp8Linear))])
def test_tp2_slices_keep_fp8_with_their_scales(llama_checkpoint, tmp_path, monkeypatch, fmt, kind, kv_kinds):
    """TP 2 (tiny llama: q / MLP rows and o / down columns cut at multiples of 32): every sliced linear whose cut
    keeps its scale stays FP8 (`kind`), and its weight x scale equals the same slice of the dequantized checkpoint
    exactly; k / v (8 rows per rank) as the cut allows — block: FP8 on rank 0 (rows 0-7, on a block edge),
    dequantized on rank 1 (rows 8-15 split a 32-row block); row-wise or per-tensor: 8 rows are no shape for
    `_scaled_mm`, so the Triton GEMM takes them as row blocks on both ranks (the only kernel where `_scaled_mm`
    does not run, as on Ampere)."""
    if kind is Fp8Linear and not scaled_mm_runs(torch.device("cpu")):
        pytest.skip("this PyTorch has no CPU torch._scaled_mm")
    if kind is BlockFp8Linear and fmt != "fp8_block":
        monkeypatch.setattr(quant, "scaled_mm_runs", lambda device: False)
    write_fp8_pair(llama_checkpoint("gqa"), tmp_path / "fp8", tmp_path / "deq", fmt)
    cfg = ModelConfig.from_pretrained(tmp_path / "fp8")
    plain_cfg = ModelConfig.from_pretrained(tmp_path / "deq")
    for rank in (0, 1):
        fp8 = _linears(load_tp_model(tmp_path / "fp8", cfg, 2, rank, None, fp8_native=True))
        plain = _linears(load_tp_model(tmp_path / "deq", plain_cfg, 2, rank, None))
        assert fp8.keys() == plain.keys()
        for name, m in fp8.items():
            torch.testing.assert_close(_dequantized(m), plain[name].weight, rtol=0, atol=0, msg=name)
        kept = {n for n, m in fp8.items() if isinstance(m, kind)}
        attn = "model.layers.0.self_attn."
        assert {attn + "q_proj", attn + "o_proj", "model.layers.1.mlp.down_proj"} <= kept
        assert type(fp8[attn + "k_proj"]) is kv_kinds[rank] and type(fp8[attn + "v_proj"]) is kv_kinds[rank]
        assert "lm_head" not in kept


class _ThreadAllReduce:
    """`dist.all_reduce` for TP ranks run as threads of this process: every rank gets the same sum (rank order)."""

    def __init__(self, n: int):
        self.rank = threading.local()
        self.parts: list = [None] * n
        self.barrier = threading.Barrier(n)

    def __call__(self, y, group=None):
        self.parts[self.rank.r] = y.clone()
        self.barrier.wait()
        total = sum(self.parts[1:], self.parts[0])
        self.barrier.wait()
        y.copy_(total)


def test_tp2_block_fp8_model_matches_the_dequantized_model(llama_checkpoint, tmp_path, monkeypatch):
    """Two TP ranks (threads; their all-reduce sums in rank order) run the tiny llama with attention and MLP biases
    and block-FP8 linears kept FP8 where the cuts allow (column-parallel biases added in the kernel, row-parallel
    ones once after the all-reduce): each rank's logits equal the TP 1 dequantized model's within 1e-4."""
    write_fp8_pair(llama_checkpoint("llama_bias"), tmp_path / "fp8", tmp_path / "deq", "fp8_block")
    cfg = ModelConfig.from_pretrained(tmp_path / "fp8")
    ranks = [load_tp_model(tmp_path / "fp8", cfg, 2, r, None, fp8_native=True) for r in (0, 1)]
    assert all(any(isinstance(m, BlockFp8Linear) for m in model.modules()) for model in ranks)
    reduce = _ThreadAllReduce(2)
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    lock = threading.Lock()  # the interpreter patches triton.language while a kernel runs: one kernel at a time
    product = BlockFp8Linear.product

    def locked(self, x, bias=False):
        with lock:
            return product(self, x, bias)

    monkeypatch.setattr(BlockFp8Linear, "product", locked)
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(4))
    out: list = [None, None]

    def run(r):
        reduce.rank.r = r
        out[r] = _logprobs(ranks[r], cfg, ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    _, plain = load_model(tmp_path / "deq")
    want = _logprobs(plain, cfg, ids)
    for lp in out:
        torch.testing.assert_close(lp, want, rtol=0, atol=1e-4)


def test_bench_runs_every_kernel_and_checks_it(capsys):
    """`cpinfer bench fp8-gemm` on CPU (interpreter): every kernel runs, its error vs the fp32 product is in
    bounds, the table has a row per (shape, M, kernel); a wrong result would make it return 1."""
    import argparse

    from cpinfer.bench import fp8_gemm as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--shapes", "128x256,200x128", "--tokens", "1,20", "--dtype", "fp32", "--repeat", "1"])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    kernels = 3 if scaled_mm_runs(torch.device("cpu")) else 2  # 200 rows: no _scaled_mm (not a multiple of 16)
    assert out.count("| 128 x 256 |") == 2 * kernels and out.count("| 200 x 128 |") == 2 * 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "0"])
    assert "expected positive integers" in capsys.readouterr().err
