"""FP8 checkpoints (cpinfer/model/quant.py): every format x family loads, dequantized at load on CPU, bit-identical to
the same model saved with the dequantized weights and within 1e-4 of transformers running those weights; per-expert
and fused experts; TP 2 and CP 2 engines on an FP8 checkpoint; the FP8 linear that stays FP8 (`torch._scaled_mm`);
formats and layouts cpinfer cannot run are named at load."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpinfer.model import ModelConfig, ReferenceAttention, build_model, load_model, load_weights
from cpinfer.model.quant import Fp8Linear, parse_quantization, quantize_rows
from fp8_checkpoint import FORMATS, quantize, write_fp8_pair

transformers = pytest.importorskip("transformers")
from checkpoints import load_hf_model  # noqa: E402

# family -> tiny variant (tests/checkpoints.py)
FAMILIES = {"llama": "gqa", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
            "smollm3": "smollm3", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral",
            "gpt_oss": "gpt_oss", "llama4_text": "llama4", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
            "minimax_m2": "minimax_m2", "gemma4_text": "gemma4"}
# every family block-wise (DeepSeek / Qwen3 style: every linear, experts included); row-wise (fbgemm: MLPs and
# experts only, attention left out by modules_to_not_convert) on a dense, a windowed and two MoE families; every
# other scheme on Llama, compressed-tensors per channel on Qwen3-MoE's per-expert tensors, and fused experts
# (the experts' [E, 2I, H] tensors quantized as stored). The scheme changes only the scales, not which modules load.
CASES = ([(f, "fp8_block") for f in FAMILIES] + [(f, "fbgemm_fp8") for f in ("llama", "gemma3", "mixtral")]
         + [("llama", fmt) for fmt in ("fp8_tensor", "ct_channel_dynamic", "ct_tensor_static", "ct_block")]
         + [("qwen3_moe", "ct_channel_dynamic"), ("qwen3_moe_fused", "fp8_block"), ("llama4_text", "fbgemm_fp8")])
RESULTS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if RESULTS:
        fmts = list(FORMATS)
        fams = list(dict.fromkeys(f for f, _ in RESULTS))
        rows = [f"| {f} | " + " | ".join(f"{RESULTS[(f, m)]:.1e}" if (f, m) in RESULTS else "-" for m in fmts)
                + " |" for f in fams]
        print("\nmax |Δ log-prob| vs transformers on the dequantized weights\n| family | " + " | ".join(fmts)
              + " |\n|" + "---|" * (len(fmts) + 1) + "\n" + "\n".join(rows))


@torch.no_grad()
def _logprobs(model, cfg, ids):
    pos = torch.arange(len(ids))
    attn = ReferenceAttention(torch.zeros(len(ids), dtype=torch.long), pos, config=cfg)
    return model.compute_logits(model(ids, pos, attn)).log_softmax(-1)


@pytest.mark.parametrize("family, fmt", CASES)
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(llama_checkpoint, tmp_path, family, fmt):
    fused = family.endswith("_fused")
    src = llama_checkpoint(FAMILIES[family.removesuffix("_fused")])
    fp8_dir, deq_dir = tmp_path / "fp8", tmp_path / "deq"
    write_fp8_pair(src, fp8_dir, deq_dir, fmt, fuse_experts=fused)
    stored = load_file(str(fp8_dir / "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    if fused:
        assert stored["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    cfg, ours = load_model(fp8_dir)
    assert cfg.quantization is not None and cfg.quantization.name == FORMATS[fmt][0]["quant_method"]
    lp = _logprobs(ours, cfg, ids)
    plain_cfg, plain = load_model(deq_dir)
    torch.testing.assert_close(lp, _logprobs(plain, plain_cfg, ids), rtol=0, atol=0)  # dequantized at load exactly
    with torch.no_grad():
        ref = load_hf_model(deq_dir)(ids[None], use_cache=False).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-4)
    RESULTS[(family, fmt)] = float((lp - ref).abs().max())


def test_fp8_linear_stays_fp8_through_scaled_mm(llama_checkpoint, tmp_path):
    """fp8_native: row-wise FP8 linears become `Fp8Linear` (what CUDA runs); equal to the same math written out —
    activations quantized per token, the product of the dequantized operands — and close to the dequantized model."""
    src = llama_checkpoint("qwen3")
    write_fp8_pair(src, tmp_path / "fp8", tmp_path / "deq", "ct_channel_dynamic")
    cfg = ModelConfig.from_pretrained(tmp_path / "fp8")
    native = build_model(cfg)
    load_weights(native, tmp_path / "fp8", fp8_native=True)
    lin = native.model.layers[0].mlp.down_proj
    assert isinstance(lin, Fp8Linear) and lin.weight.dtype == torch.float8_e4m3fn
    assert isinstance(native.model.layers[0].self_attn.q_proj, Fp8Linear)
    x = torch.randn(5, lin.weight.shape[1])
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ (lin.weight.float() * lin.weight_scale.reshape(-1, 1)).t()
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    ids = torch.randint(3, 256, (32,), generator=torch.Generator().manual_seed(2))
    _, plain = load_model(tmp_path / "deq")
    a, b = _logprobs(native, cfg, ids), _logprobs(plain, cfg, ids)
    assert float((a - b).abs().median()) < 0.05  # activation quantization error only


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static activation"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({**FORMATS["ct_channel_dynamic"][0], "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "type 'int' with 4 bits"),
    ({**FORMATS["ct_channel_dynamic"][0], "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy 'group' is not supported"),
    ({**FORMATS["ct_channel_dynamic"][0], "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}, "input_activations": {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}, "input activations of type 'int'"),
])
def test_unsupported_quantization_is_named(quant, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization(quant)


def _rewrite(src, dst, edit_sd=None, edit_cfg=None):
    shutil.copytree(src, dst)
    if edit_sd:
        sd = load_file(str(dst / "model.safetensors"))
        edit_sd(sd)
        save_file(sd, str(dst / "model.safetensors"))
    if edit_cfg:
        cfg = json.loads((dst / "config.json").read_text())
        edit_cfg(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_fp8_checkpoints_are_named(llama_checkpoint, tmp_path):
    src = llama_checkpoint("gqa")
    good = tmp_path / "fp8"
    write_fp8_pair(src, good, tmp_path / "deq", "fp8_block")
    scale = "model.layers.0.mlp.up_proj.weight_scale_inv"
    cases = [
        (lambda sd: sd.pop(scale), None, "has no scale tensor 'model.layers.0.mlp.up_proj.weight_scale_inv'"),
        (lambda sd: sd.__setitem__(scale, sd[scale][:1]), None, "its scale has shape"),
        (lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight",
                                   sd["model.layers.0.mlp.up_proj.weight"].float().to(torch.float8_e5m2)), None,
         "dtype F8_E5M2"),
        (None, lambda c: c.pop("quantization_config"), "FP8 but config.json has no quantization_config"),
        (None, lambda c: c["quantization_config"].__setitem__("modules_to_not_convert", ["mlp"]),
         "leaves module 'model.layers.0.mlp.down_proj' unquantized"),
        (lambda sd: sd.__setitem__("model.layers.0.mlp.gate_proj.weight_scale", torch.ones(1)), None,
         "looks like an FP8 scale but no FP8 weight uses it"),
    ]
    for i, (sd_edit, cfg_edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            load_model(_rewrite(good, tmp_path / f"bad{i}", sd_edit, cfg_edit))


def test_quantize_helper_round_trips_within_e4m3():
    w = torch.randn(40, 72)
    for strategy, block in (("row", None), ("tensor", None), ("block", (32, 32))):
        _, _, d = quantize(w, strategy, block)
        assert float(((d - w).abs() / w.abs().clamp(min=1e-3)).median()) < 0.07  # e4m3: 3 mantissa bits
