"""The arithmetic efficiency is read with (`cpinfer.bench.efficiency`): the paper's App. A FLOP count, MFU, the
decode memory floor, the catalog's dense peaks, report lines; and the GPU check's CPU-checkable pieces of parts
(c) and (d): HF holding the engine's own weights, the OOM fallback, the profiler's kernel table, host timings."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cpinfer.bench import efficiency as E
from cpinfer.bench import gpu_check
from cpinfer.model import ModelConfig
from cpinfer.model.random_checkpoint import random_config_dict
from cpinfer.perf.catalog import dense_bf16_peak

SMOL = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig.from_dict(random_config_dict(**kw))


def test_prefill_flops_reproduce_the_papers_app_a():
    """App. A: Llama 3 405B at 1M tokens: GEMM 2 x 405B x 1M = 8.1e17, ATTN 1/2 x 4 x 1M^2 x 16384 x 126 = 4.1e18,
    total 4.9e18, which over 77 s on 128 H100s is 502 TF/s per GPU."""
    f = E.prefill_flops(405_000_000_000, 1_000_000, 126, 16384)
    assert f["gemm"] == pytest.approx(8.1e17, rel=1e-12)
    assert f["attn"] == pytest.approx(0.5 * 4 * 1e12 * 16384 * 126, rel=1e-12)
    assert round(f["attn"] / 1e18, 1) == 4.1 and round(f["total"] / 1e18, 1) == 4.9
    assert f["total"] / 77 / 128 / 1e12 == pytest.approx(502, abs=1)
    assert E.prefill_flops(10, 4, 2, 8, batch=3)["total"] == 2 * 10 * 4 * 3 + 0.5 * 4 * 3 * 16 * 8 * 2
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        E.prefill_flops(10, 0, 2, 8)


def test_model_sizes_and_decode_bytes():
    """W of Llama-3-8B (8,030,261,248 parameters) and SmolLM2-135M (134,515,008, tied); the bytes a decode step
    reads: every weight but an untied input embedding, and the K/V of the context."""
    big = _cfg(**gpu_check.LLAMA3_8B)
    assert E.model_params(big) == 8_030_261_248
    assert E.model_params(_cfg(**SMOL)) == 134_515_008
    assert E.decode_weight_bytes(big, 2) == (8_030_261_248 - 128256 * 4096) * 2
    assert E.decode_weight_bytes(_cfg(**SMOL), 2) == 134_515_008 * 2  # tied: the embedding is the lm_head
    assert E.kv_bytes(big, 32768, 2) == 32 * 8 * 2 * 128 * 2 * 32768 == 4 << 30
    f = E.config_prefill_flops(big, 131072)
    assert f["gemm"] == 2 * 8_030_261_248 * 131072 and f["attn"] == 2 * 131072 ** 2 * 4096 * 32


def test_mfu_floor_and_verdicts():
    e = E.PrefillEfficiency(flops=989e12 * 0.5, ttft_s=1.0, peak_tflops=989.0, gemm_tflops=700.0)
    assert e.tflops == pytest.approx(494.5) and e.mfu == pytest.approx(0.5) and e.of_gemm == pytest.approx(494.5 / 700)
    assert E.PrefillEfficiency(1e12, 2.0, None, 100.0).mfu is None
    with pytest.raises(ValueError, match="must be positive"):
        E.PrefillEfficiency(1e12, 0.0, 989.0, 100.0)
    assert E.decode_floor_s(15 << 30, 1 << 30, float(1 << 30)) == 16.0
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        E.decode_floor_s(1, 1, 0)
    assert E.verdict("batch 1:", 1.9, 2.0, " ms") == "PASS: batch 1: 1.9 ms <= 2 ms"
    assert E.verdict("ratio", 1.31, 1.3) == "FAIL: ratio 1.31 > 1.3"
    assert E.verdict("MFU", 0.6, 0.55, at_least=True) == "PASS: MFU 0.6 >= 0.55"
    assert E.verdict("MFU", 0.5, 0.55, at_least=True) == "FAIL: MFU 0.5 < 0.55"
    row = gpu_check.decode_floor_row(_cfg(**gpu_check.LLAMA3_8B), 32768, ttit=0.008, bandwidth=3e12)
    assert row["floor_s"] == pytest.approx(((8_030_261_248 - 128256 * 4096) * 2 + (4 << 30)) / 3e12)
    assert row["ratio"] == pytest.approx(0.008 / row["floor_s"])


def test_dense_peaks_by_device_name():
    assert dense_bf16_peak("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert dense_bf16_peak("NVIDIA H100 PCIe")[0] == 756.0
    assert dense_bf16_peak("NVIDIA H200")[0] == 989.0
    assert dense_bf16_peak("NVIDIA A100-SXM4-80GB")[0] == 312.0
    assert dense_bf16_peak("Some Future GPU") is None


def test_prefill_report_rows():
    rows = E.prefill_table([
        {"model": "m", "tokens": 131072, "ttft_s": 10.0, "flops": 5e15, "peak_tflops": 1000.0, "gemm_tflops": 800.0,
         "hf_ttft_s": 12.5},
        {"model": "m", "tokens": 8, "ttft_s": 1.0, "flops": 1e12, "peak_tflops": None, "gemm_tflops": 1.0,
         "hf_ttft_s": None}])
    assert rows[0] == ["m", "131072", "10.000", "5.00", "500", "50.0%", "62.5%", "12.500", "1.25"]
    assert rows[1][5] == "-" and rows[1][7:] == ["-", "-"]
    assert len(E.PREFILL_HEADER) == len(rows[0])


def test_limits_measure_on_any_device():
    """The same-run limits' timing code (GEMM rate, copy bandwidth) runs; on the CPU with host clocks."""
    assert E.gemm_rate(n=64, repeat=3, device="cpu") > 0
    assert E.copy_bandwidth(nbytes=1 << 20, repeat=3, device="cpu") > 0


def test_hf_holds_the_engines_own_weights(tmp_path):
    """Part (c) hands the engine's random weights to Hugging Face's model without copying them: the same tensors,
    and HF computes exactly what it computes with those weights read from a checkpoint."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from cpinfer.model.loader import random_model

    d = random_config_dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2, rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(d))
    weights = dict(random_model(ModelConfig.from_dict(d), seed=3).state_dict())
    hf = gpu_check.hf_with_weights(str(tmp_path), weights, device="cpu", dtype=torch.float32)
    assert hf.model.layers[1].mlp.up_proj.weight.data_ptr() == weights["model.layers.1.mlp.up_proj.weight"].data_ptr()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits)
    seconds, lp = gpu_check.hf_ttft(hf, ids[0].tolist(), device="cpu")
    assert seconds > 0 and lp.shape == (96,)
    torch.testing.assert_close(lp, torch.log_softmax(ref(ids).logits[0, -1], -1))


def test_hf_largest_halves_after_oom():
    """The longest length running out of memory is reported and halved until one fits; shorter ones still run."""
    class Fake:
        def __init__(self, fits: int):
            self.fits, self.seen = fits, []

        def __call__(self, ids, logits_to_keep):
            self.seen.append(ids.shape[1])
            if ids.shape[1] > self.fits:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return SimpleNamespace(logits=torch.zeros(1, 1, 5))

    prompts = {32: list(range(32)), 128: list(range(128))}
    model = Fake(fits=70)
    res = gpu_check.hf_largest(model, prompts, device="cpu")
    assert res[128] == "OOM" and isinstance(res[64], tuple) and isinstance(res[32], tuple)
    assert model.seen == [128, 32, 32, 64, 64]  # each length warmed up once (an OOM ends at the warm-up)
    assert set(gpu_check.hf_largest(Fake(fits=1000), prompts, device="cpu")) == {32, 128}


def test_kernel_table_from_a_profile():
    """The profile's top entries with their share of the device's time (here the CPU's, on a CPU profile)."""
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, a).relu()
    rows = gpu_check.top_kernels(prof.key_averages(), torch.autograd.DeviceType.CPU, top=4)
    assert rows and all(r[2] >= 0 and 0 <= r[3] <= 1 for r in rows)
    assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)
    assert any("mm" in r[0] for r in rows)
    text = gpu_check.kernels_table([("void gemm<128|64>", 32, 812.5, 0.4125)])
    assert "| void gemm<128/64> | 32 | 812.5 | 41.2% |" in text


def test_host_breakdown_counts_each_forward_once():
    h1 = {"schedule_s": 1e-4, "forward_s": 2e-3, "rank0_plan_s": 1e-4, "rank0_model_s": 1.5e-3,
          "rank0_sample_s": 2e-4, "process_s": 3e-4, "detokenize_s": 1e-4}
    h2 = dict(h1, forward_s=3e-3)
    steps = [{"phase": "prefill", "host": dict(h1)}, {"phase": "decode", "host": h1}, {"phase": "decode", "host": h2}]
    outs = [SimpleNamespace(metrics={"steps": steps}), SimpleNamespace(metrics={"steps": steps[1:]})]
    med = gpu_check.host_breakdown(outs)
    assert med["steps"] == 2 and med["forward_s"] == pytest.approx(2.5e-3)
    assert med["outside_s"] == pytest.approx(1e-4 + 2.5e-3 - 1.5e-3 + 3e-4)
    row = gpu_check._host_row("x", med, 4e-3)
    assert len(row) == len(gpu_check.HOST_HEADER) and row[-1] == f"{100 * med['outside_s'] / 4e-3:.0f}%"


def test_parts_c_and_d_run_end_to_end_on_the_cpu(tmp_path, llama_checkpoint):
    """Parts (c) and (d) are the GPU check's; their code runs here on the CPU in fp32 at toy sizes (a tiny random
    checkpoint for the embedded model, a 2-layer random shape for the 8B one): the engine's tokens equal HF's (the
    same weights, shared), every row is recorded as it is measured, target lines and the profile are there."""
    from cpinfer.bench.gpu_results import Recorder, load

    setup = gpu_check.Setup.toy(small_model=str(llama_checkpoint("gqa", max_position_embeddings=256)))
    rec = Recorder(tmp_path, "c")
    c = gpu_check.prefill_efficiency(rec, setup, profile=True)
    assert [r["tokens"] for r in c["rows"]] == [64, 24, 40]
    assert all(ch["same_argmax"] == ch["tokens"] and ch["max_logprob_diff"] < 1e-3 for ch in c["checks"])
    assert len(c["checks"]) == 3 and set(c["hf_lengths"]) == {"24", "40"} and not rec.failures
    saved = {t["name"]: t["rows"] for t in load(tmp_path)["parts"]["c"]["tables"]}
    assert [r[1] for r in saved["cpinfer prefill"]] == ["64", "24", "40"]
    assert saved["Hugging Face beside"][2][:2] == ["toy Llama", "40"] and "8/8" in saved["Hugging Face beside"][0][4]
    assert "cpinfer TTFT / HF TTFT" in c["markdown"]
    assert c["profile"]["rows"] and (tmp_path / "c-profile.txt").exists()
    assert "attention `auto` (cpu-flash for the first model, cpu-flash for the large shape), prompts in chunks of " \
           "2048 tokens" in c["markdown"]
    rec = Recorder(tmp_path, "d")
    d = gpu_check.decode_floors(rec, setup)
    assert len(d["host"]) == 3 and len(d["targets"]) == 3 and d["floor"]["ratio"] > 0 and not rec.failures
    assert all(t.startswith(("PASS: ", "FAIL: ")) for t in d["targets"])
    saved = {t["name"]: t["rows"] for t in load(tmp_path)["parts"]["d"]["tables"]}
    assert [r[1] for r in saved["decode"]] == ["1", "8"] and saved["decode"][0][5] == "4/4"
    assert len(saved["host time per decode step"]) == 3 and len(saved["memory floor"]) == 1
    json.dumps({k: v for k, v in c.items()}, default=str)  # what run_part writes


def test_gpu_profile_script_at_toy_sizes(tmp_path, monkeypatch, capsys):
    """scripts/gpu_profile.py (where a GPU's time goes: prefill by chunk size, decode at the context) runs its code on
    the CPU at toy sizes: a section per run with its TTFT or time per token and a table of the profiled ops."""
    import importlib.util

    monkeypatch.setenv("GPU_CHECK_DEVICE", "cpu")
    spec = importlib.util.spec_from_file_location("gpu_profile", Path(__file__).parents[1] / "scripts" / "gpu_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path), "--steps", "3"]) == 0
    md = (tmp_path / "gpu_profile.md").read_text()
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == ["## Prefill, max_num_batched_tokens 16",
                                                 "## Decode at 32 context, batch 1, 3 steps",
                                                 "## Prefill, max_num_batched_tokens 64"]
    assert md.count("| kernel | calls | ms | share |") == 3 and "cpinfer::flash_attention" in md
    with pytest.raises(SystemExit):
        mod.main([str(tmp_path), "--chunks", "0"])
    assert "--chunks need positive sizes" in capsys.readouterr().err
