"""Performance model, hardware/model catalogs, deployment planner (paper §3.4, App. A, C, D).

models     ModelSpec (Llama-3 catalog or any HF config.json), weight formats incl. row-wise FP8 FFN
hardware   HardwareProfile (frozen, validated, every number with its source), JSON round trip
catalog    built-in profiles: h100-gtt, h100-gti, h200, cpu-gloo
costs      roofline cost of GEMM, attention block, merge, SendRecv, All2All, all-reduce
ring       block shapes of load-balanced ring attention (rank i holds chunks i and 2N-1-i)
simulator  TTFT (pass-KV / pass-Q), TTIT (pass-Q decode), memory per GPU
fit        how the fitted h100-gtt numbers are derived from the paper's public numbers
planner    `cpinfer plan`: one deployment, or the smallest CP meeting a TTFT target; report renders it
"""
from cpinfer.perf.hardware import HardwareProfile, load_hardware_profile
from cpinfer.perf.models import ModelSpec, load_model_spec

__all__ = ["HardwareProfile", "ModelSpec", "load_hardware_profile", "load_model_spec"]
