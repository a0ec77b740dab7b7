"""Load a Hugging Face checkpoint of any supported family (config.json + safetensors, single or sharded).

The model is built on the meta device and each parameter is replaced by the loaded tensor. A `WeightSlicer`
hook lets a tensor-parallel rank read only its slice of each tensor (after resizing the meta model itself).
Per-expert tensors (`...experts.<e>.gate_proj.weight`, the Hub's Qwen-MoE / Mixtral layout) are stacked into
the MoE block's fused parameters; fused checkpoints (what transformers 5 holds, gpt-oss, Llama 4) load directly.
FP8 checkpoints reach this loop as ordinary tensors through their `quantization_config`'s method (`quant.py`):
dequantized, or kept FP8 on CUDA.
"""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors import safe_open
from torch import Tensor, nn

from cpinfer.model.config import ModelConfig
from cpinfer.model.decoder import CausalLM
from cpinfer.model.families import FAMILIES
from cpinfer.model.moe import PER_EXPERT_NAME, Experts
from cpinfer.model.quant import Fp8Slice, checkpoint_tensors, native_candidates, process_weights

INDEX_FILE = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
UNIT_SCALES = ("layer_scalar", "router.scale", "per_expert_scale")  # random weights: around 1, as norms are
_SHARED_KV_WEIGHTS = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")
_TEXT_PREFIX = "model.language_model."  # Qwen3.5 folders hold the text model under this prefix
_HYBRID_EXTRAS = ("model.visual.", "mtp.")  # tensors of Qwen3.5 / Qwen3-Next folders outside the text decoder


class SafeSlice(Protocol):
    """What safetensors' `get_slice(name)` returns: lazy, sliceable with `[...]`, shape via `get_shape()`."""

    def get_shape(self) -> list[int]: ...
    def __getitem__(self, index) -> Tensor: ...


# (parameter name, lazy view of the full tensor in the file) -> the tensor this process keeps.
WeightSlicer = Callable[[str, SafeSlice], Tensor]


def full_tensor(name: str, sl: SafeSlice) -> Tensor:
    """The default `WeightSlicer`: read the whole tensor."""
    return sl[:]


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    """An unloaded model on the meta device (no memory); resize its linears here before loading for TP."""
    with torch.device("meta"):
        return CausalLM(config).to(dtype)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               slicer: WeightSlicer = full_tensor) -> tuple[ModelConfig, CausalLM]:
    """Read `path`'s config and weights; returns (config, model in eval mode on `device`)."""
    path = _check_dir(path)
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, dtype)
    load_weights(model, path, dtype=dtype, device=device, slicer=slicer)
    return config, model


def random_model(config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, std: float = 0.02) -> CausalLM:
    """A model of `config`'s shape with random weights made on `device` in `dtype` directly (no float32 copy, no
    checkpoint: what benchmarks of large shapes need): ~N(0, std), norms their identity plus N(0, 0.1) noise,
    attention sinks ~N(0, 1); deterministic per (seed, device)."""
    model = build_model(config, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    identity = 0.0 if config.norm_style == "gemma" else 1.0
    for name, p in list(model.named_parameters()):  # meta: names and shapes only
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):  # a Gated DeltaNet's gated norm scales by its weight, whatever the style
            t.normal_(1.0 if name.endswith("linear_attn.norm.weight") else identity, 0.1, generator=gen)
        elif name.endswith(UNIT_SCALES):  # multipliers whose identity is 1 (Gemma 4)
            t.normal_(1.0, 0.1, generator=gen)
        elif name.endswith("self_attn.sinks"):
            t.normal_(0.0, 1.0, generator=gen)
        else:
            t.normal_(0.0, std, generator=gen)
        _assign(model, name, t)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def load_weights(model: CausalLM, path: str | Path, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", slicer: WeightSlicer = full_tensor,
                 fp8_native: bool | None = None) -> None:
    """Replace every parameter of `model` by its tensor from the safetensors files in `path`. FP8 weights are
    dequantized to `dtype`, except linears that may stay FP8 (`quant.native_candidates`: on CUDA, or with
    `fp8_native` True, where their kernel runs; a TP slicer's slice takes its scale along, `quant.Fp8Slice`)."""
    path = _check_dir(path)
    expected = dict(model.named_parameters())  # tied lm_head.weight is listed once, as embed_tokens.weight
    loaded: set[str] = set()
    unexpected: list[str] = []
    stacks = _ExpertStacks(model, expected, dtype, device)
    method = model.config.quantization
    native = native_candidates(model, method, torch.device(device), fp8_native)
    kept = {}  # FP8 weight name -> its scale, for the linears that stay FP8
    with ExitStack() as files:
        handles = {}
        for file in checkpoint_files(path):
            f = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update(dict.fromkeys(f.keys(), f))
        prefix = model.config.weights_prefix  # a multimodal folder: the text model's weights, the towers skipped
        family = FAMILIES.get(model.config.model_type)
        renames = [(re.compile(a), b) for a, b in (family.renames if family else ())]
        for name, sl in checkpoint_tensors(handles, method, native):
            if prefix:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
                elif name.startswith("model."):
                    continue
            elif name.startswith(_TEXT_PREFIX):  # a multimodal folder's text model (Qwen3.5): model.language_model.*
                name = "model." + name[len(_TEXT_PREFIX):]
            for pattern, replacement in renames:  # the family's own names (Nemotron-H's backbone.*, ...)
                name = pattern.sub(replacement, name, count=1)
            if name not in expected:
                if stacks.accepts(name):
                    stacks.add(name, slicer(name, sl))
                elif not _ignorable(name, model):
                    unexpected.append(name)
                continue
            tensor = slicer(name, sl)
            _check_shape(name, tensor, expected[name])
            scale = sl.kept if isinstance(sl, Fp8Slice) else None
            if scale is not None:  # stays FP8; `process_weights` makes its linear an Fp8Linear / BlockFp8Linear
                kept[name] = scale.to(device)
                _assign(model, name, tensor.to(device=device))
            else:
                _assign(model, name, tensor.to(device=device, dtype=dtype))
            loaded.add(name)
    loaded |= stacks.finish(path)
    missing = sorted(set(expected) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {missing}")
    if unexpected:
        raise ValueError(f"checkpoint {path} has unexpected tensor(s): {sorted(unexpected)}")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    if kept:
        process_weights(model, kept, method)
    model.eval()


class _ExpertStacks:
    """Stacks per-expert checkpoint tensors into the experts' [E, ...] parameters as they are read."""

    def __init__(self, model: nn.Module, expected: dict, dtype: torch.dtype, device):
        self.model, self.expected, self.dtype, self.device = model, expected, dtype, device
        self.buffers: dict[str, Tensor] = {}  # full parameter name -> the stacked tensor being filled
        self.filled: dict[str, set] = {}  # ... -> the (expert, part) indices written so far

    def accepts(self, name: str) -> bool:
        m = PER_EXPERT_NAME.match(name)
        return bool(m) and isinstance(self._experts(m["experts"]), Experts)

    def _experts(self, prefix: str):
        try:
            return self.model.get_submodule(prefix)
        except AttributeError:
            return None

    def add(self, name: str, tensor: Tensor) -> None:
        m = PER_EXPERT_NAME.match(name)
        experts = self._experts(m["experts"])
        leaf, index = experts.checkpoint_part(int(m["expert"]), m["proj"])
        full = f"{m['experts']}.{leaf}"
        if full not in self.buffers:
            self.buffers[full] = torch.empty(self.expected[full].shape, dtype=self.dtype, device=self.device)
            self.filled[full] = set()
        target = self.buffers[full][index]
        # the per-expert linear is [out, in]; the stacked parameter holds it as is
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint, expected "
                             f"{tuple(target.shape)} (a slice of {full})")
        target.copy_(tensor)
        self.filled[full].add(str(index))

    def finish(self, path: Path) -> set[str]:
        """Assign every complete stack; a stack missing some expert's tensor is an error."""
        for full, buf in self.buffers.items():
            owner, _, leaf = full.rpartition(".")
            need = self.model.get_submodule(owner).parts_expected(leaf)
            if len(self.filled[full]) != need:
                raise ValueError(f"checkpoint {path} holds {len(self.filled[full])} of the {need} per-expert "
                                 f"tensors of {full}")
            _assign(self.model, full, buf)
        return set(self.buffers)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the shard index, else all `*.safetensors`."""
    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise ValueError(f"{index} names shard {shard!r}, which does not exist in {path}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist (or is not a directory)")
    return path


def _ignorable(name: str, model: CausalLM) -> bool:
    """Non-parameters HF may store, an lm_head a tied checkpoint may still carry, a KV-sharing layer's own K/V
    weights (Gemma 4: unused, as transformers skips them), and DeepSeek-V3's (MiniMax-M2's) multi-token prediction
    layers (`model.layers.<n>` past num_hidden_layers: a draft head, not part of the model's math)."""
    tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
    if model.config.hybrid and name.startswith(_HYBRID_EXTRAS):  # Qwen3.5 / Qwen3-Next: vision tower, MTP head
        return True
    mtp = _LAYER.match(name)
    if mtp is not None and int(mtp[1]) < model.config.num_hidden_layers:
        layer = int(mtp[1])
        if model.config.kv_source(layer) != layer and name[mtp.end():].startswith(_SHARED_KV_WEIGHTS):
            return True
    mtp_family = model.config.mla is not None or model.config.model_type == "minimax_m2"
    extra_layer = mtp_family and mtp is not None and int(mtp[1]) >= model.config.num_hidden_layers
    return tied_head or extra_layer or name.endswith(_IGNORED_SUFFIXES)


def _check_shape(name: str, tensor: Tensor, param: nn.Parameter) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                         f"expected {tuple(param.shape)}")


def _assign(model: nn.Module, name: str, tensor: Tensor) -> None:
    """Replace parameter `name` (dotted path) by `tensor`, frozen for inference."""
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
