"""The built-in hardware profiles, each number with its source (paper §4.1, §4.2, App. A, D; spec sheets).

Five numbers of `h100-gtt` are fitted (kind "fitted") to the paper's public statements: `cpinfer.perf.fit`
reproduces them, `cpinfer.perf.statements` lists the statements, docs/planning.md reports leave-one-out errors.
"""
from __future__ import annotations

from cpinfer.perf.hardware_profile import HardwareProfile

PAPER = "paper"
ASSUMED = "assumption"

# Fitted on h100-gtt by cpinfer.perf.fit.fit_h100_gtt() to public statements of the paper (rounded); each
# source names the statement(s) that determine it. Reused where the same GPUs and software run.
FIT = dict(gemm_efficiency=0.389, attn_overhead_tokens=34.0, inter_gbs=18.4, inter_latency_us=28.7,
           ring_step_us=413.0)

# The attention curve's prior: FA3's published causal forward benchmark (head dim 128, BF16, H100) roughly halves
# from 8K to 1K tokens and gains ~5% from 8K to 16K; L0 = 560 keys per query row-tile reproduces that shape. The
# fit starts there (cpinfer.perf.fit.FITTED) and the paper's attention-dominated TTFTs move it.
FA3_L0 = 560.0

FIT_SOURCES = dict(
    attn_overhead_tokens="fitted (cpinfer.perf.fit) from the prior 560 (FA3's published causal curve): the 1M "
                         "TTFTs (77 s CP16 §4.2.3, 1200 s one host §1) pull it to ~37, i.e. the sustained 500 W "
                         "ring runs long blocks no faster than the 8K benchmark's 540 TF/s",
    gemm_efficiency="fitted (cpinfer.perf.fit) on the nominal 800 / 1600 TF/s peaks: 128K prefills, GEMM-dominated "
                    "(CP8 5.85 s §4.2.1, one host 1M 1200 s §1, halving §4.2.1); the 500 W cap binds GEMMs",
    inter_gbs="fitted (cpinfer.perf.fit): pass-KV = pass-Q within 1% at T=6400, P+T=128000, CP4 (§4.2.4); the "
              "rate of one SendRecv flow while the ring's attention runs beside it",
    inter_latency_us="fitted (cpinfer.perf.fit): CP4 decode TTIT 71 ms and TP32 47 ms at 128K (§4.3)",
    ring_step_us="fitted (cpinfer.perf.fit): CP16 128K = 3.8 s (§4.2.3) against CP8 5.85 s and the halving (§4.2.1); "
                 "only that CP8 -> CP16 gap determines it",
)

_H100_GPU = dict(
    peak_tflops=(800.0, f"{PAPER} App. A: BF16 peak of the 500 W power-limited H100 of GTT/GTI"),
    peak_tflops_fp8=(1600.0, f"{ASSUMED}: 2x the BF16 peak, the H100 spec-sheet FP8/BF16 ratio (1979/989)"),
    attn_tflops=(540.0, f"{PAPER} App. A, §4.2.3: Flash Attention 3 causal, 8K tokens, one H100"),
    attn_ref_tokens=(8192.0, f"{PAPER} App. A: the 540 TF/s FA3 benchmark is a causal 8K square"),
    attn_overhead_tokens=(FIT["attn_overhead_tokens"], FIT_SOURCES["attn_overhead_tokens"]),
    gemm_efficiency=(FIT["gemm_efficiency"], FIT_SOURCES["gemm_efficiency"]),
    mem_gb=(96.0, f"{PAPER} §4.1: 96 GB HBM2e per H100"),
    mem_tbps=(2.4, f"{PAPER} §4.1: 2.4 TB/s HBM2e"),
    mem_efficiency=(0.8, f"{ASSUMED}: streaming kernels reach ~80% of HBM peak"),
    devices_per_node=(8, f"{PAPER} §4.1: 8 H100 per Grand Teton host, NVLink all-to-all"),
    intra_gbs=(480.0, f"{ASSUMED}: NCCL NVLS all-reduce bus bandwidth on 8 NVLink4 H100, the top of what it reaches "
                      "(fitted freely, the paper's statements push it there)"),
    intra_latency_us=(10.0, f"{ASSUMED}: NCCL small-message all-reduce inside one NVLink node"),
    ring_step_us=(FIT["ring_step_us"], FIT_SOURCES["ring_step_us"]),
    kernel_overhead_us=(3.0, f"{ASSUMED}: per-kernel slot under CUDA graphs (paper §4.3 decodes with graphs)"),
    comm_overlap=(1.0, f"{PAPER} §3.4, §3.5.2: SendRecv overlapped with attention (NIC DMA beside the SMs)"),
)

_GTT_NET = dict(
    inter_gbs_peak=(50.0, f"{PAPER} §4.1: GTT backend RDMA, 400 Gb/s per GPU"),
    inter_gbs=(FIT["inter_gbs"], FIT_SOURCES["inter_gbs"]),
    inter_latency_us=(FIT["inter_latency_us"], FIT_SOURCES["inter_latency_us"]),
    inter_coll_gbs=(50.0, f"{ASSUMED}: the 400 Gb/s NIC's line rate for large all-reduces (fitted freely, TP16 vs "
                          "CP2 of §4.2.2 pushes it there; TP64 vs CP8 would need more)"),
)

_GTI_NET = dict(
    inter_gbs_peak=(12.5, f"{PAPER} §4.1: GTI frontend TCP/IP, 100 Gb/s per GPU"),
    inter_gbs=(3.0, f"{PAPER} §4.2.1: ~3 GB/s per rank achieved in the GTI traces"),
    inter_latency_us=(FIT["inter_latency_us"] * 2, f"{ASSUMED}: TCP twice the RDMA latency fitted on GTT"),
    inter_coll_gbs=(12.5, f"{ASSUMED}: the NIC's 12.5 GB/s, as the fit puts GTT's at its NIC's 50 GB/s"),
)

_H200 = dict(
    peak_tflops=(989.0, "NVIDIA H200 SXM spec: 989 TF/s dense BF16"),
    peak_tflops_fp8=(1979.0, "NVIDIA H200 SXM spec: 1979 TF/s dense FP8"),
    attn_tflops=(668.0, f"{ASSUMED}: FA3 at the GTT H100's 540/800 of peak, scaled to 989"),
    attn_ref_tokens=(8192.0, f"{ASSUMED}: as the GTT H100's reference"),
    attn_overhead_tokens=(FIT["attn_overhead_tokens"], f"{ASSUMED}: the attention curve fitted on h100-gtt"),
    gemm_efficiency=(FIT["gemm_efficiency"], f"{ASSUMED}: the GEMM efficiency fitted on h100-gtt"),
    mem_gb=(141.0, "NVIDIA H200 SXM spec: 141 GB HBM3e"),
    mem_tbps=(4.8, "NVIDIA H200 SXM spec: 4.8 TB/s"),
    mem_efficiency=(0.8, f"{ASSUMED}: streaming kernels reach ~80% of HBM peak"),
    devices_per_node=(8, "NVIDIA HGX H200: 8 GPUs per board, NVLink4 switch"),
    intra_gbs=(480.0, f"{ASSUMED}: NCCL NVLS all-reduce bus bandwidth on 8 NVLink4 GPUs, as on h100-gtt"),
    intra_latency_us=(10.0, f"{ASSUMED}: NCCL small-message all-reduce inside one NVLink node"),
    inter_gbs_peak=(50.0, f"{ASSUMED}: one 400 Gb/s NIC per GPU, the usual HGX H200 build"),
    inter_gbs=(FIT["inter_gbs"], f"{ASSUMED}: the SendRecv bandwidth fitted on h100-gtt"),
    inter_latency_us=(FIT["inter_latency_us"], f"{ASSUMED}: the inter-node latency fitted on h100-gtt"),
    inter_coll_gbs=(50.0, f"{ASSUMED}: the 400 Gb/s NIC's line rate for large all-reduces, as on h100-gtt"),
    ring_step_us=(FIT["ring_step_us"], f"{ASSUMED}: the per-step ring cost fitted on h100-gtt"),
    kernel_overhead_us=(3.0, f"{ASSUMED}: per-kernel slot under CUDA graphs"),
    comm_overlap=(1.0, f"{ASSUMED}: NIC DMA beside the SMs, as on the paper's H100 hosts"),
)

# Spec-sheet profiles of single GPUs: the compute, memory and NVLink figures from NVIDIA's datasheets (dense, i.e.
# without the 2:4 sparsity the datasheets also quote); the achieved fractions and the network as on h200 above.
_H100_SXM_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"
_B200_SHEET = "NVIDIA DGX B200 / HGX B200 datasheet (8 GPUs: 1,440 GB and 64 TB/s HBM3e in all), per GPU"
_H100_SXM = _H200 | dict(
    peak_tflops=(989.0, f"{_H100_SXM_SHEET}: 1,979 TF/s BF16 with sparsity, 989 dense"),
    peak_tflops_fp8=(1979.0, f"{_H100_SXM_SHEET}: 3,958 TF/s FP8 with sparsity, 1,979 dense"),
    mem_gb=(80.0, f"{_H100_SXM_SHEET}: 80 GB HBM3"),
    mem_tbps=(3.35, f"{_H100_SXM_SHEET}: 3.35 TB/s"),
    devices_per_node=(8, "NVIDIA HGX H100: 8 GPUs per board, NVLink 900 GB/s per GPU through NVSwitch"),
)
_B200 = _H200 | dict(
    peak_tflops=(2250.0, f"{_B200_SHEET}: 36 PF/s BF16 with sparsity / 8 GPUs / 2 = 2,250 TF/s dense"),
    peak_tflops_fp8=(4500.0, f"{_B200_SHEET}: 72 PF/s FP8 with sparsity / 8 GPUs / 2 = 4,500 TF/s dense"),
    attn_tflops=(1519.0, f"{ASSUMED}: FA3-class attention at the GTT H100's 540/800 of peak, scaled to 2,250"),
    mem_gb=(180.0, f"{_B200_SHEET}: 1,440 GB / 8 = 180 GB HBM3e"),
    mem_tbps=(8.0, f"{_B200_SHEET}: 64 TB/s / 8 = 8 TB/s"),
    devices_per_node=(8, "NVIDIA HGX B200: 8 GPUs per board, fifth-generation NVLink 1.8 TB/s per GPU"),
    intra_gbs=(960.0, f"{ASSUMED}: twice h200's NVLink4 all-reduce bus bandwidth, as NVLink5 doubles the link"),
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
    ring_step_us=(200.0, f"{_CPU}: Python and dispatch per ring step"),
    attn_ref_tokens=(4096.0, f"{_CPU}: block length of the SDPA estimate"),
    attn_overhead_tokens=(0.0, f"{_CPU}: no short-block slowdown assumed"),
    inter_coll_gbs=(2.0, f"{_CPU}: gloo over loopback TCP"),
    comm_overlap=(0.0, f"{_CPU}: gloo moves bytes on the cores that compute (calibrate measured ~0% hidden)"),
    kernel_overhead_us=(20.0, f"{_CPU}: eager op dispatch"),
)

def _profile(name: str, kind: str, numbers: dict) -> HardwareProfile:
    values = {k: v for k, (v, _) in numbers.items()}
    sources = {k: s for k, (_, s) in numbers.items()}
    return HardwareProfile(name=name, kind=kind, sources=sources, **values)


# No profile here carries App. D's coefficients (cpinfer.cp.heuristics.PAPER_EMPIRICAL, what method "empirical"
# falls back to): on the paper's own CP4 128K grid they pick pass-Q at 10% miss and above 12.5%, where §4.2.4
# states pass-KV, so the engine's default rule on these profiles is Alg. 5 (docs/planning.md).
HARDWARE = {
    "h100-gtt": _profile("h100-gtt", "fitted", _H100_GPU | _GTT_NET),
    "h100-gti": _profile("h100-gti", "fitted", _H100_GPU | _GTI_NET),
    "h100-sxm": _profile("h100-sxm", "spec", _H100_SXM),
    "h200": _profile("h200", "spec", _H200),
    "b200": _profile("b200", "spec", _B200),
    "cpu-gloo": _profile("cpu-gloo", "estimate", _CPU_GLOO),
}


# Dense (no sparsity) BF16 tensor-core peaks by the name torch.cuda.get_device_name() reports, most specific first:
# what MFU is taken against (`dense_bf16_peak`). The datasheets quote "with sparsity" figures twice these.
DENSE_BF16_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756.0, "NVIDIA H100 PCIe spec: 1513 TF/s BF16 with sparsity, 756 dense"),
    ("H100 NVL", 835.0, "NVIDIA H100 NVL spec: 1671 TF/s BF16 with sparsity, 835 dense"),
    ("H100", 989.0, f"{_H100_SXM_SHEET}: 989 TF/s dense BF16 (the paper's App. A figure for a 700 W H100)"),
    ("H200", _H200["peak_tflops"][0], _H200["peak_tflops"][1]),
    ("B200", _B200["peak_tflops"][0], _B200["peak_tflops"][1]),
    ("A100", 312.0, "NVIDIA A100 spec: 312 TF/s dense BF16"),
    ("L40S", 362.0, "NVIDIA L40S spec: 362 TF/s dense BF16"),
)


def dense_bf16_peak(device_name: str) -> tuple[float, str] | None:
    """(dense BF16 peak TFLOP/s, its source) of a GPU by its reported name, or None when the catalog lacks it."""
    name = device_name.lower()
    for key, tflops, source in DENSE_BF16_PEAKS:
        if key.lower() in name:
            return tflops, source
    return None
