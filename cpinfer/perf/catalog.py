"""The built-in hardware profiles, each number with its source (paper §4.1, §4.2, App. A, D; spec sheets).

Four numbers of `h100-gtt` are fitted (kind "fitted"): see `cpinfer.perf.fit` for the procedure that
reproduces them from the paper's public numbers, and docs/planning.md for the discussion.
"""
from __future__ import annotations

from cpinfer.perf.hardware import HardwareProfile

PAPER = "paper"
ASSUMED = "assumption"

# Fitted on h100-gtt by cpinfer.perf.fit.fit_h100_gtt() (rounded); reused where the same GPUs and software run.
FIT_GEMM_EFFICIENCY = 0.436
FIT_RING_STEP_FLOOR_US = 902.0
FIT_INTER_GBS = 11.3
FIT_INTER_LATENCY_US = 61.0

_H100_GPU = dict(
    peak_tflops=(800.0, f"{PAPER} App. A: BF16 peak of the 500 W power-limited H100 of GTT/GTI"),
    peak_tflops_fp8=(1600.0, f"{ASSUMED}: 2x the BF16 peak, the H100 spec-sheet FP8/BF16 ratio (1979/989)"),
    attn_tflops=(540.0, f"{PAPER} App. A, §4.2.3: Flash Attention 3 causal, 8K tokens, one H100"),
    gemm_efficiency=(FIT_GEMM_EFFICIENCY, "fitted: CP8 128K full prefill TTFT = 5.85 s (paper §4.2.1)"),
    mem_gb=(96.0, f"{PAPER} §4.1: 96 GB HBM2e per H100"),
    mem_tbps=(2.4, f"{PAPER} §4.1: 2.4 TB/s HBM2e"),
    mem_efficiency=(0.8, f"{ASSUMED}: streaming kernels reach ~80% of HBM peak"),
    devices_per_node=(8, f"{PAPER} §4.1: 8 H100 per Grand Teton host, NVLink all-to-all"),
    intra_gbs=(360.0, f"{ASSUMED}: ~80% of NVLink4 450 GB/s per direction (spec 900 GB/s bidirectional)"),
    intra_latency_us=(10.0, f"{ASSUMED}: NCCL small-message all-reduce inside one NVLink node"),
    ring_step_floor_us=(FIT_RING_STEP_FLOOR_US, "fitted: CP16 128K full prefill TTFT = 3.8 s (paper §4.2.3)"),
    kernel_overhead_us=(3.0, f"{ASSUMED}: per-kernel gap under CUDA graphs (paper §4.3 decodes with graphs)"),
)

_GTT_NET = dict(
    inter_gbs_peak=(50.0, f"{PAPER} §4.1: GTT backend RDMA, 400 Gb/s per GPU"),
    inter_gbs=(FIT_INTER_GBS, "fitted: pass-KV/pass-Q tipping point at T=6400, T+P=128000, CP4 (paper §4.2.4)"),
    inter_latency_us=(FIT_INTER_LATENCY_US, "fitted: CP4 decode TTIT at 128K, batch 1 = 71 ms (paper §4.3)"),
)

_GTI_NET = dict(
    inter_gbs_peak=(12.5, f"{PAPER} §4.1: GTI frontend TCP/IP, 100 Gb/s per GPU"),
    inter_gbs=(3.0, f"{PAPER} §4.2.1: ~3 GB/s per rank achieved in the GTI traces"),
    inter_latency_us=(100.0, f"{ASSUMED}: one TCP SendRecv between hosts (RDMA on GTT fitted to 61 us)"),
)

_H200 = dict(
    peak_tflops=(989.0, "NVIDIA H200 SXM spec: 989 TF/s dense BF16"),
    peak_tflops_fp8=(1979.0, "NVIDIA H200 SXM spec: 1979 TF/s dense FP8"),
    attn_tflops=(668.0, f"{ASSUMED}: FA3 at the GTT H100's 540/800 of peak, scaled to 989"),
    gemm_efficiency=(FIT_GEMM_EFFICIENCY, f"{ASSUMED}: the GEMM efficiency fitted on h100-gtt"),
    mem_gb=(141.0, "NVIDIA H200 SXM spec: 141 GB HBM3e"),
    mem_tbps=(4.8, "NVIDIA H200 SXM spec: 4.8 TB/s"),
    mem_efficiency=(0.8, f"{ASSUMED}: streaming kernels reach ~80% of HBM peak"),
    devices_per_node=(8, "NVIDIA HGX H200: 8 GPUs per board, NVLink4 switch"),
    intra_gbs=(360.0, f"{ASSUMED}: ~80% of NVLink4 450 GB/s per direction (spec 900 GB/s bidirectional)"),
    intra_latency_us=(10.0, f"{ASSUMED}: NCCL small-message all-reduce inside one NVLink node"),
    inter_gbs_peak=(50.0, f"{ASSUMED}: one 400 Gb/s NIC per GPU, the usual HGX H200 build"),
    inter_gbs=(FIT_INTER_GBS, f"{ASSUMED}: the SendRecv bandwidth fitted on h100-gtt"),
    inter_latency_us=(FIT_INTER_LATENCY_US, f"{ASSUMED}: the inter-node latency fitted on h100-gtt"),
    ring_step_floor_us=(FIT_RING_STEP_FLOOR_US, f"{ASSUMED}: the ring-step floor fitted on h100-gtt"),
    kernel_overhead_us=(3.0, f"{ASSUMED}: per-kernel gap under CUDA graphs"),
)

_CPU = "estimate for a 2-core AMD EPYC (Zen 5) VM, torch fp32, gloo over loopback; replace with `cpinfer calibrate`"
_CPU_GLOO = dict(
    peak_tflops=(0.33, f"{_CPU}: 2 cores x 64 fp32 FLOP/cycle (AVX-512 FMA) x ~2.6 GHz"),
    peak_tflops_fp8=(0.0, f"{_CPU}: no FP8 GEMMs on CPU"),
    attn_tflops=(0.15, f"{_CPU}: SDPA fp32, ~0.18 TF/s seen once on an idle machine"),
    gemm_efficiency=(0.55, f"{_CPU}: 1024^3 fp32 matmul ~0.19 TF/s seen once"),
    mem_gb=(5.0, f"{_CPU}: ~20 GB RAM shared by up to 4 ranks"),
    mem_tbps=(0.02, f"{_CPU}: DRAM streaming, ~10-20 GB/s for the VM"),
    mem_efficiency=(0.7, f"{_CPU}: guess"),
    devices_per_node=(4, f"{_CPU}: tests spawn up to 4 ranks on this machine"),
    intra_gbs=(2.0, f"{_CPU}: gloo over loopback TCP"),
    intra_latency_us=(100.0, f"{_CPU}: gloo collective round trip on loopback"),
    inter_gbs_peak=(2.0, f"{_CPU}: gloo over loopback TCP (no second node)"),
    inter_gbs=(2.0, f"{_CPU}: gloo over loopback TCP (no second node)"),
    inter_latency_us=(100.0, f"{_CPU}: gloo send/recv round trip on loopback"),
    ring_step_floor_us=(200.0, f"{_CPU}: Python and dispatch per ring step"),
    kernel_overhead_us=(20.0, f"{_CPU}: eager op dispatch"),
)

PAPER_EMPIRICAL = (-1.059, 1.145, 12.112)  # App. D: alpha, beta, gamma (natural log), fitted on the paper's system


def _profile(name: str, kind: str, numbers: dict, empirical=None, empirical_source: str = "") -> HardwareProfile:
    values = {k: v for k, (v, _) in numbers.items()}
    sources = {k: s for k, (_, s) in numbers.items()}
    if empirical is not None:
        sources["empirical"] = empirical_source
    return HardwareProfile(name=name, kind=kind, empirical=empirical, sources=sources, **values)


HARDWARE = {
    "h100-gtt": _profile("h100-gtt", "fitted", _H100_GPU | _GTT_NET, PAPER_EMPIRICAL,
                         f"{PAPER} App. D: alpha=-1.059, beta=1.145, gamma=12.112"),
    "h100-gti": _profile("h100-gti", "fitted", _H100_GPU | _GTI_NET),
    "h200": _profile("h200", "spec", _H200),
    "cpu-gloo": _profile("cpu-gloo", "estimate", _CPU_GLOO),
}
