"""FP8 checkpoints: config.json's `quantization_config` picks one linear method per format — `fbgemm_fp8` (row-wise
scales, Llama-3.1-405B-FP8), `fp8` (128x128 block-wise `weight_scale_inv`, DeepSeek-V3 / Qwen3-FP8, or one scale
per tensor) and `compressed-tensors` FP8 (per-tensor, per-channel or block weight scales; static or dynamic
activations). Every other format is refused at config time, naming it.

A method says which scale tensors belong to an FP8 weight and how to dequantize it; the loader (`loader.py`) asks
`checkpoint_tensors` for ordinary tensors, so the decoder, the MoE stacks and TP slicing never see a scale. On CUDA
an FP8 linear may instead stay FP8 (`process_weights`): row-wise / per-tensor as `Fp8Linear` (`torch._scaled_mm`),
block-wise as `BlockFp8Linear` (the Triton GEMM of `fp8_gemm.py`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterator

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_FP8_FILE_DTYPES = {"F8_E4M3": "e4m3"}  # safetensors dtype names cpinfer dequantizes
# tensors that hold no weight: static activation scales (cpinfer quantizes activations dynamically on CUDA and not
# at all on CPU) and static KV-cache scales (read by the FP8 KV cache, `engine/kv/fp8.py`, not by the model)
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
_AUX_SUFFIXES = (".input_scale", ".input_scale_ub", "_input_scale") + _KV_SCALE_SUFFIXES
SUPPORTED = ("fbgemm_fp8", "fp8", "compressed-tensors")


class TensorSlice:
    """A loaded tensor behind safetensors' slice interface (`[...]`, `get_shape()`), for a `WeightSlicer`."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> Tensor:
        return self.tensor[index]


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one FP8 weight is scaled: "row" (one scale per output row: [..., out, 1]), "tensor" (one scale, or one
    per stacked expert) or "block" ([..., ceil(out/bo), ceil(in/bi)] for blocks `block` = (bo, bi))."""

    strategy: str
    scale_suffix: str = "weight_scale"  # the scale's name: `<module>.<suffix>` (fused experts: `<param>_scale...`)
    block: tuple[int, int] | None = None

    def __post_init__(self):
        if self.strategy not in ("row", "tensor", "block"):
            raise ValueError(f"FP8 weight strategy must be row, tensor or block, got {self.strategy!r}")
        if (self.strategy == "block") != (self.block is not None):
            raise ValueError("a block size goes with (and only with) the block strategy")
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"block size must be two positive integers, got {self.block!r}")

    def scale_name(self, weight_name: str) -> str:
        """`...q_proj.weight` -> `...q_proj.weight_scale[_inv]`; a fused expert parameter `...gate_up_proj` ->
        `...gate_up_proj_scale[_inv]`."""
        if weight_name.endswith(".weight"):
            return weight_name[: -len("weight")] + self.scale_suffix
        return weight_name + self.scale_suffix[len("weight"):]

    def dequantize(self, name: str, w: Tensor, scale: Tensor) -> Tensor:
        """w [..., out, in] e4m3, scale in this scheme's shape -> fp32 [..., out, in]."""
        lead, (out, inp) = tuple(w.shape[:-2]), tuple(w.shape[-2:])
        s = scale.float()
        if self.strategy == "row":
            want = [lead + (out, 1), lead + (out,)]
            s = _expect(name, s, want).reshape(lead + (out, 1))
        elif self.strategy == "tensor":
            want = [(), (1,)] if not lead else [lead, lead + (1, 1), lead + (1,)]
            s = _expect(name, s, want).reshape(lead + (1, 1))
        else:
            bo, bi = self.block
            s = _expect(name, s, [lead + (-(-out // bo), -(-inp // bi))])
            s = s.repeat_interleave(bo, dim=-2)[..., :out, :].repeat_interleave(bi, dim=-1)[..., :inp]
        return w.float() * s  # [..., out, in]

    def native_scale(self, name: str, w: Tensor, scale: Tensor, kernels: frozenset[str]) -> "NativeScale | None":
        """The scale a 2-D weight stays FP8 with, if one of `kernels` runs its scheme: row-wise / per-tensor: [out]
        per row for `Fp8Linear` ("scaled_mm": both dims multiples of 16), else as blocks of one row by all columns
        ([out, 1], `ROW_BLOCK`) for `BlockFp8Linear`; block-wise: the block grid for `BlockFp8Linear`
        ("triton_block": a block K size divisible by 16). None: dequantize."""
        if w.dim() != 2:
            return None
        out, inp = w.shape
        if self.strategy == "block":
            if "triton_block" not in kernels or _block_k_for(self.block[1]) is None:
                return None
            s = _expect(name, scale.float(), [(-(-out // self.block[0]), -(-inp // self.block[1]))])
            return NativeScale(s.contiguous(), self.block)
        s = scale.float()
        if self.strategy == "row":
            s = _expect(name, s, [(out, 1), (out,)]).reshape(out)
        else:
            s = _expect(name, s, [(), (1,)]).reshape(1).expand(out)
        if "scaled_mm" in kernels and out % 16 == 0 and inp % 16 == 0:
            return NativeScale(s.contiguous())
        if "triton_block" in kernels:  # Ampere, or no row-wise _scaled_mm: the Triton GEMM, activations unquantized
            return NativeScale(s).as_row_blocks()
        return None


# a row-wise scale as a block scale: one block per output row spanning every input column (any K up to 2^30)
ROW_BLOCK = (1, 1 << 30)


@dataclasses.dataclass(frozen=True)
class NativeScale:
    """The scale of a weight that stays FP8: [out] fp32 per output row (`Fp8Linear`), or with `block` = (bo, bi)
    the [ceil(out/bo), ceil(in/bi)] fp32 block grid (`BlockFp8Linear`)."""

    scale: Tensor
    block: tuple[int, int] | None = None

    def to(self, device) -> "NativeScale":
        return dataclasses.replace(self, scale=self.scale.to(device))

    def cut(self, dim: int, start: int, stop: int) -> "NativeScale | None":
        """The scale of the weight's rows (dim 0) or columns (dim 1) [start, stop): row scales follow the rows and
        ignore columns; block scales follow both when `start` is on a block edge (the slice's last block may be
        partial, as at the weight's end); None when the slice would split a block."""
        if self.block is None:
            return dataclasses.replace(self, scale=self.scale[start:stop]) if dim == 0 else self
        if dim == 1 and self.scale.shape[1] == 1:  # one block spans all the columns: any column cut stays in it
            return self
        b = self.block[dim]
        if start % b:
            return None
        blocks = slice(start // b, -(-stop // b))
        return dataclasses.replace(self, scale=(self.scale[blocks] if dim == 0 else self.scale[:, blocks])
                                   .contiguous())

    def as_row_blocks(self) -> "NativeScale":
        """Row scales [out] as the Triton GEMM's [out, 1] blocks (`ROW_BLOCK`)."""
        return NativeScale(self.scale.reshape(-1, 1).contiguous(), ROW_BLOCK)


class Fp8Slice(TensorSlice):
    """An FP8 weight that may stay FP8, behind the slice interface: the index a `WeightSlicer` takes (all of it, a
    run of output rows, or `[:, run of input columns]` — TP's column- and row-parallel slices) slices the weight
    and its scale together, and `kept` holds that scale. A row-wise slice `_scaled_mm` cannot take (dims not
    multiples of 16) goes to the Triton GEMM as row blocks where `row_blocks` allows; any other index, a slice
    splitting a scale block, or such a row-wise slice without it gives the dequantized slice (`kept` None)."""

    def __init__(self, tensor: Tensor, native: NativeScale, dequantize, row_blocks: bool):
        super().__init__(tensor)
        self.native, self.dequantize = native, dequantize  # dequantize() -> the whole weight in fp32
        self.row_blocks = row_blocks
        self.kept: NativeScale | None = None

    def __getitem__(self, index) -> Tensor:
        cut = _cut_of(index, self.tensor.shape)
        kept = None if cut is None else self.native if cut == () else self.native.cut(*cut)
        part = self.tensor[index]
        if kept is not None and kept.block is None and (part.shape[0] % 16 or part.shape[1] % 16):
            kept = kept.as_row_blocks() if self.row_blocks else None
        self.kept = kept
        return part.contiguous() if kept is not None else self.dequantize()[index]


def _cut_of(index, shape) -> tuple | None:
    """A 2-D index as () (all), (dim, start, stop) (a unit-step run along one dim), or None (anything else)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > 2 or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        return None
    runs = [(d, *i.indices(shape[d])[:2]) for d, i in enumerate(index) if i.indices(shape[d])[:2] != (0, shape[d])]
    return () if not runs else runs[0] if len(runs) == 1 else None


def _expect(name: str, s: Tensor, shapes: list[tuple]) -> Tensor:
    if tuple(s.shape) not in [tuple(x) for x in shapes]:
        raise ValueError(f"FP8 weight {name!r}: its scale has shape {tuple(s.shape)}, expected one of "
                         f"{[tuple(x) for x in shapes]} for this quantization_config")
    return s


def _skip_match(module: str, entry: str) -> bool:
    """A `modules_to_not_convert` / `ignored_layers` / `ignore` entry: "re:<regex>" (matched from the start, as
    compressed-tensors does) or a dotted name that is the module or a run of its path (`lm_head`, `self_attn`)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return f".{entry}." in f".{module}."


@dataclasses.dataclass(frozen=True)
class QuantMethod:
    """One checkpoint format's linear method: which modules are FP8 and how their weights are scaled. Subclasses
    parse their own `quantization_config` (`from_config`)."""

    name: str
    skip: tuple[str, ...] = ()  # modules left in the checkpoint's dtype

    def scheme_for(self, module: str) -> WeightScheme:
        raise NotImplementedError

    def leaves(self, module: str) -> bool:
        """Whether the config leaves `module` in the checkpoint's dtype (a skip entry names it)."""
        return any(_skip_match(module, e) for e in self.skip)

    def check_module(self, module: str, weight_name: str) -> WeightScheme:
        """The scheme of an FP8 weight found in the checkpoint; an FP8 weight the config leaves out is an error."""
        if self.leaves(module):
            raise ValueError(f"checkpoint tensor {weight_name!r} is FP8 but quantization_config ({self.name}) leaves "
                             f"module {module!r} unquantized")
        return self.scheme_for(module)


@dataclasses.dataclass(frozen=True)
class FbgemmFp8Method(QuantMethod):
    """`fbgemm_fp8`: e4m3 weights with one scale per output row (`weight_scale` [out, 1]); activations quantized
    per row at run time, their scale bounded by `activation_scale_ub`."""

    activation_scale_ub: float | None = None

    @classmethod
    def from_config(cls, q: dict[str, Any]) -> "FbgemmFp8Method":
        return cls("fbgemm_fp8", tuple(q.get("modules_to_not_convert") or ()), q.get("activation_scale_ub"))

    def scheme_for(self, module: str) -> WeightScheme:
        return WeightScheme("row")


@dataclasses.dataclass(frozen=True)
class BlockFp8Method(QuantMethod):
    """`fp8`: with `weight_block_size` (DeepSeek-V3, Qwen3-FP8), e4m3 weights with one `weight_scale_inv` per
    [bo, bi] block (a multiplier, despite the name) and activations quantized per token-group at run time;
    without it, one `weight_scale` per tensor."""

    block: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"

    @classmethod
    def from_config(cls, q: dict[str, Any]) -> "BlockFp8Method":
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 quantization_config fmt {fmt!r} is not supported: cpinfer loads e4m3 weights")
        act = q.get("activation_scheme", "dynamic")
        block = q.get("weight_block_size")
        if act not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {act!r} is not supported: use dynamic or static")
        if block is not None and act != "dynamic":
            raise ValueError("fp8 with weight_block_size and a static activation_scheme is not supported (block-wise "
                             "checkpoints quantize activations dynamically)")
        skip = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
        return cls("fp8", skip, None if block is None else tuple(int(b) for b in block), act)

    def scheme_for(self, module: str) -> WeightScheme:
        if self.block is None:
            return WeightScheme("tensor")
        return WeightScheme("block", "weight_scale_inv", self.block)


@dataclasses.dataclass(frozen=True)
class CompressedTensorsFp8Method(QuantMethod):
    """`compressed-tensors` in its float-quantized format: per config group (matched by `targets`), 8-bit float
    weights scaled per tensor, per channel or per block, activations dynamic per token or static per tensor."""

    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...] = ()  # (targets, weight scheme) in config order

    @classmethod
    def from_config(cls, q: dict[str, Any]) -> "CompressedTensorsFp8Method":
        fmt = q.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported: cpinfer loads FP8 weights "
                             "(format float-quantized or naive-quantized)")
        groups = q.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        parsed = tuple((tuple(g.get("targets") or ("Linear",)), _ct_weight_scheme(name, g))
                       for name, g in groups.items())
        return cls("compressed-tensors", tuple(q.get("ignore") or ()), parsed)

    def scheme_for(self, module: str) -> WeightScheme:
        for targets, scheme in self.groups:
            if any(t == "Linear" or _skip_match(module, t) for t in targets):
                return scheme
        raise ValueError(f"module {module!r} has an FP8 weight but no compressed-tensors config group targets it")


def _ct_weight_scheme(group: str, g: dict[str, Any]) -> WeightScheme:
    """One compressed-tensors config group -> its weight scheme; what cpinfer cannot run is named."""
    w = g.get("weights") or {}
    where = f"compressed-tensors config group {group!r}"
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"{where}: weights of type {w.get('type')!r} with {w.get('num_bits')} bits are not "
                         "supported: cpinfer loads 8-bit float (FP8) weights")
    if not w.get("symmetric", True) or w.get("dynamic", False):
        raise ValueError(f"{where}: asymmetric or dynamic weight quantization is not supported")
    act = g.get("input_activations")
    if act is not None:
        if act.get("type") != "float" or act.get("num_bits") != 8:
            raise ValueError(f"{where}: input activations of type {act.get('type')!r} with {act.get('num_bits')} "
                             "bits are not supported: cpinfer runs FP8 (or unquantized) activations")
        ok = {True: ("token", "tensor"), False: ("tensor",)}[bool(act.get("dynamic", False))]
        if act.get("strategy") not in ok:
            raise ValueError(f"{where}: input activation strategy {act.get('strategy')!r} "
                             f"(dynamic={bool(act.get('dynamic'))}) is not supported: expected one of {ok}")
    strategy = w.get("strategy")
    if strategy == "channel":
        return WeightScheme("row")
    if strategy == "tensor":
        return WeightScheme("tensor")
    if strategy == "block":
        return WeightScheme("block", "weight_scale", tuple(int(b) for b in w["block_structure"]))
    raise ValueError(f"{where}: weight strategy {strategy!r} is not supported: cpinfer loads tensor, channel or "
                     "block FP8 scales")


_METHODS = {"fbgemm_fp8": FbgemmFp8Method, "fp8": BlockFp8Method, "compressed-tensors": CompressedTensorsFp8Method}


def parse_quantization(q: Any) -> QuantMethod | None:
    """config.json's `quantization_config` -> its method (None when absent); a format cpinfer cannot run
    (MXFP4, GPTQ, AWQ, bitsandbytes, int8 / int4 compressed-tensors, e5m2, ...) is a ValueError naming it."""
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {q!r}")
    method = q.get("quant_method", "?")
    if method not in _METHODS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported: cpinfer loads "
                         f"{', '.join(SUPPORTED)} (FP8) checkpoints, or unquantized (bf16 / fp16 / fp32) weights")
    return _METHODS[method].from_config(q)


def _module_of(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name.rpartition(".")[0]


@dataclasses.dataclass(frozen=True)
class NativePlan:
    """Which FP8 weights may stay FP8 at load: `names` (`nn.Linear` weights the model calls as modules) and the
    `kernels` that run on the device ("scaled_mm": `Fp8Linear`; "triton_block": `BlockFp8Linear`)."""

    names: frozenset[str]
    kernels: frozenset[str]


_NOT_SCALES = ("router.per_expert_scale",)  # model parameters named like a scale (Gemma 4's router)


def checkpoint_tensors(handles: dict, method: QuantMethod | None, native: NativePlan | None = None,
                       ) -> Iterator[tuple[str, Any]]:
    """Every weight of a checkpoint as (name, lazy slice): FP8 weights come dequantized to fp32 (their scales
    consumed), or, for `native`'s names whose scheme one of its kernels runs, as an `Fp8Slice` that may stay FP8
    (its `kept` scale, once sliced). `handles`: tensor name -> the open safetensors file holding it."""
    fp8 = {n for n, f in handles.items() if f.get_slice(n).get_dtype().startswith("F8")}
    if fp8 and method is None:
        raise ValueError(f"checkpoint tensor {sorted(fp8)[0]!r} is FP8 but config.json has no quantization_config")
    schemes, scales = {}, set()
    for n in sorted(fp8):
        dt = handles[n].get_slice(n).get_dtype()
        if dt not in _FP8_FILE_DTYPES:
            raise ValueError(f"checkpoint tensor {n!r} has dtype {dt}: cpinfer dequantizes FP8 e4m3 (F8_E4M3) only")
        schemes[n] = method.check_module(_module_of(n), n)
        s = schemes[n].scale_name(n)
        if s not in handles:
            raise ValueError(f"FP8 weight {n!r} has no scale tensor {s!r} in the checkpoint")
        scales.add(s)
    for name, f in handles.items():
        aux = name.endswith(_AUX_SUFFIXES if method is not None else _KV_SCALE_SUFFIXES)
        if name in scales or aux:
            continue
        if name in fp8:
            w, s = f.get_slice(name)[:], handles[schemes[name].scale_name(name)].get_slice(
                schemes[name].scale_name(name))[:]
            scheme = schemes[name]
            keep = scheme.native_scale(name, w, s, native.kernels) \
                if native is not None and name in native.names else None
            if keep is not None:
                yield name, Fp8Slice(w, keep, lambda n=name, w=w, s=s, sc=scheme: sc.dequantize(n, w, s),
                                     "triton_block" in native.kernels)
            else:
                yield name, TensorSlice(scheme.dequantize(name, w, s))
            continue
        if method is not None and name.endswith(("_scale", "_scale_inv")) and not name.endswith(_NOT_SCALES):
            raise ValueError(f"checkpoint tensor {name!r} looks like an FP8 scale but no FP8 weight uses it")
        yield name, f.get_slice(name)


# ---------------------------------------------------------------- FP8 linears that stay FP8 (CUDA)

def quantize_rows(x: Tensor, ub: float | None = None) -> tuple[Tensor, Tensor]:
    """Dynamic per-row e4m3 quantization: x [M, K] -> (xq [M, K] e4m3, scale [M, 1] fp32) with x ≈ xq * scale;
    `ub` bounds each row's absolute maximum (fbgemm's activation_scale_ub)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [M, 1]
    if ub is not None:
        amax = amax.clamp(max=ub)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W kept e4m3 [out, in] and one fp32 scale per output row [out]: activations quantized
    per token, one `torch._scaled_mm` with row-wise scales (Hopper and later; CPU in recent PyTorch)."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, ub: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] e4m3
        self.weight_scale = nn.Parameter(scale.reshape(1, -1).float(), requires_grad=False)  # [1, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ub = ub

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def product(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out] in x's dtype, x W^T without the bias
        lead = x.shape[:-1]
        xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]), self.ub)  # [M, in] e4m3, [M, 1]
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=x.dtype)
        return y.reshape(lead + (self.out_features,))

    def forward(self, x: Tensor) -> Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias


def scaled_mm_runs(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` with row-wise fp32 scales runs on `device` (probed with a 16x16 product)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        a = torch.ones(16, 16, device=device).to(FP8)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def triton_gemm_runs(device: torch.device) -> bool:
    """Whether the block FP8 Triton GEMM can run on `device`: Triton installed, and a CUDA GPU with 16-bit tensor
    cores (compute capability 8.0+) or Triton's CPU interpreter (TRITON_INTERPRET=1, tests)."""
    try:
        from cpinfer.model import fp8_gemm
    except ImportError:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return fp8_gemm.interpreting()


def _block_k_for(qk: int) -> int | None:
    from cpinfer.model.fp8_gemm import block_k_for  # imports triton: only for block formats

    return block_k_for(qk)


# linears whose weight the model reads as a tensor instead of calling the module: MLA folds kv_b_proj into the
# queries and the output (mla.py), so it is dequantized whatever the format
_READ_AS_TENSOR = ("lm_head", "kv_b_proj")


def native_candidates(model: nn.Module, method: QuantMethod | None, device: torch.device,
                      force: bool | None = None) -> NativePlan | None:
    """Which FP8 linears may stay FP8, and through which kernels: with `force` None, on CUDA (`_scaled_mm` for
    row-wise / per-tensor scales where its probe runs, the Triton GEMM for block scales); True / False force it
    on / off (tests: then on any device where the kernels run). None: dequantize all."""
    on = force if force is not None else device.type == "cuda"
    if not on or method is None:
        return None
    kernels = frozenset(k for k, runs in (("scaled_mm", scaled_mm_runs), ("triton_block", triton_gemm_runs))
                        if runs(device))
    names = frozenset(f"{n}.weight" for n, m in model.named_modules()
                      if type(m) is nn.Linear and n.rpartition(".")[2] not in _READ_AS_TENSOR)
    return NativePlan(names, kernels) if kernels else None


class BlockFp8Linear(nn.Module):
    """y = x W^T (+ b) with W kept e4m3 [out, in] and its block scales [ceil(out/bo), ceil(in/bi)]: the Triton GEMM
    (`fp8_gemm.py`) dequantizes each weight tile in registers; activations are not quantized."""

    def __init__(self, weight: Tensor, scale: Tensor, block: tuple[int, int], bias: Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] e4m3
        self.weight_scale_inv = nn.Parameter(scale.float(), requires_grad=False)  # [ceil(out/bo), ceil(in/bi)]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.block = block

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def product(self, x: Tensor, bias: bool = False) -> Tensor:  # [..., in] -> [..., out] in x's dtype
        from cpinfer.model.fp8_gemm import block_fp8_linear

        return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, bias=True)  # the bias added in the kernel


def product_without_bias(linear: nn.Module, x: Tensor) -> Tensor:
    """x W^T of an `nn.Linear`, `Fp8Linear` or `BlockFp8Linear`, its bias left out (a row-parallel linear adds it
    once, after the all-reduce)."""
    if isinstance(linear, (Fp8Linear, BlockFp8Linear)):
        return linear.product(x)
    return torch.nn.functional.linear(x, linear.weight)


def process_weights(model: nn.Module, scales: dict[str, NativeScale], method: QuantMethod) -> None:
    """After load: each linear whose weight stayed FP8 becomes an `Fp8Linear` (row scales) or a `BlockFp8Linear`
    (block scales) over the same tensors."""
    ub = getattr(method, "activation_scale_ub", None)
    for name, ns in scales.items():
        owner = name[: -len(".weight")]
        parent, _, leaf = owner.rpartition(".")
        lin = model.get_submodule(owner)
        bias = None if lin.bias is None else lin.bias.data
        fp8 = Fp8Linear(lin.weight.data, ns.scale, bias, ub) if ns.block is None else \
            BlockFp8Linear(lin.weight.data, ns.scale, ns.block, bias)
        setattr(model.get_submodule(parent), leaf, fp8)
