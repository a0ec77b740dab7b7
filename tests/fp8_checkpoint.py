"""Tiny FP8 checkpoints for tests: a random transformers checkpoint's linears quantized to e4m3 here, with their
scales written the way each format does (fbgemm_fp8 row-wise, fp8 block-wise / per-tensor, compressed-tensors),
and beside it the same model with the dequantized weights as a plain checkpoint (the transformers oracle)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0

_CT_W = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_CT_DYN = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
_CT_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def _ct(strategy: str, act: dict | None, **w) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**_CT_W, "strategy": strategy, **w},
                                          "input_activations": act}},
            "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*router$"]}


# format -> (quantization_config, weight strategy, block, scale suffix, which linears: "all" | "mlp")
FORMATS = {
    "fbgemm_fp8": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                    "modules_to_not_convert": ["lm_head", "self_attn"]}, "row", None, "weight_scale", "mlp"),
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]},
                  "block", (32, 32), "weight_scale_inv", "all"),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                   "tensor", None, "weight_scale", "all"),
    "ct_channel_dynamic": (_ct("channel", _CT_DYN), "row", None, "weight_scale", "all"),
    "ct_tensor_static": (_ct("tensor", _CT_STATIC), "tensor", None, "weight_scale", "all"),
    "ct_block": (_ct("block", _CT_DYN, block_structure=[32, 32]), "block", (32, 32), "weight_scale", "all"),
}

_NOT_LINEAR = re.compile(r"(embed_tokens|lm_head|norm|\.gate\.weight$|router|shared_expert_gate|sinks|bias)")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def _quantizable(name: str, t: torch.Tensor, which: str) -> bool:
    if _FUSED.search(name):
        return True
    if t.dim() != 2 or not name.endswith(".weight") or _NOT_LINEAR.search(name):
        return False
    return which == "all" or ".self_attn." not in name


def quantize(w: torch.Tensor, strategy: str, block=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., out, in] fp32 -> (e4m3 weight, scale as the format stores it, dequantized fp32 weight)."""
    lead, (out, inp) = w.shape[:-2], w.shape[-2:]
    if strategy == "row":
        s = w.abs().amax(-1, keepdim=True) / FP8_MAX  # [..., out, 1]
        full = s
    elif strategy == "tensor":
        s = w.abs().reshape(*lead, -1).amax(-1) / FP8_MAX  # [...] (one per stacked expert)
        full = s.reshape(*lead, 1, 1)
        s = s.reshape(1) if not lead else s
    else:
        bo, bi = block
        po, pi = -(-out // bo) * bo, -(-inp // bi) * bi
        padded = torch.zeros(*lead, po, pi)
        padded[..., :out, :inp] = w
        s = padded.reshape(*lead, po // bo, bo, pi // bi, bi).abs().amax((-3, -1)) / FP8_MAX  # [..., out/bo, in/bi]
        full = s.repeat_interleave(bo, -2)[..., :out, :].repeat_interleave(bi, -1)[..., :inp]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s.float(), q.float() * full


def _scale_name(name: str, suffix: str) -> str:
    return name[: -len("weight")] + suffix if name.endswith(".weight") else name + suffix[len("weight"):]


def write_fp8_pair(src: Path, fp8_dir: Path, deq_dir: Path, fmt: str, fuse_experts: bool = False) -> None:
    """From the plain checkpoint `src`: `fp8_dir` in format `fmt`, `deq_dir` the same model dequantized.
    `fuse_experts`: stack per-expert tensors into experts.gate_up_proj / down_proj first (transformers 5's layout)."""
    qcfg, strategy, block, suffix, which = FORMATS[fmt]
    sd = load_file(str(src / "model.safetensors"))
    if fuse_experts:
        sd = fuse(sd)
    fp8, deq = {}, {}
    for name, t in sd.items():
        if _quantizable(name, t, which):
            q, s, d = quantize(t.float(), strategy, block)
            fp8[name], fp8[_scale_name(name, suffix)], deq[name] = q, s, d
            if qcfg.get("activation_scheme") == "static" or fmt == "ct_tensor_static":
                fp8[_scale_name(name, "input_scale")] = torch.tensor([0.05])
        else:
            fp8[name] = deq[name] = t
    for d, tensors, q in ((fp8_dir, fp8, qcfg), (deq_dir, deq, None)):
        d.mkdir(parents=True, exist_ok=True)
        config = json.loads((src / "config.json").read_text())
        if q is not None:
            config["quantization_config"] = q
        (d / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(d / "model.safetensors"))
        for extra in ("generation_config.json",):
            if (src / extra).exists():
                shutil.copy(src / extra, d / extra)


def fuse(sd: dict) -> dict:
    """Per-expert `experts.<e>.{gate,up,down}_proj.weight` -> `experts.gate_up_proj` [E, 2I, H], `down_proj`."""
    pat = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict] = {}
    out = {}
    for k, v in sd.items():
        m = pat.match(k)
        if m:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[k] = v
    for p, g in groups.items():
        n = max(e for e, _ in g) + 1
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat((g[(e, "gate_proj")], g[(e, "up_proj")])) for e in range(n)])
        out[f"{p}.down_proj"] = torch.stack([g[(e, "down_proj")] for e in range(n)])
    return out
