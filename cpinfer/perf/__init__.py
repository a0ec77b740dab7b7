"""Performance model, hardware/model catalogs, deployment planner (paper §3.4, App. A, C, D).

models     ModelSpec (Llama-3 catalog or any HF config.json), weight formats incl. row-wise FP8 FFN
hardware   HardwareProfile (frozen, validated, every number with its source), JSON round trip
catalog    built-in profiles: h100-gtt, h100-gti, h200, cpu-gloo
costs      GEMM (dtype, tiles), attention (block-length curve), flash-decoding, merge, SendRecv, All2All, all-reduce
ring       block shapes of load-balanced ring attention (rank i holds chunks i and 2N-1-i)
simulator  TTFT (pass-KV / pass-Q), TTIT (pass-Q decode), memory per GPU
statements every quantitative statement of the paper's public text, with its source, as a model check
fit        fits the h100-gtt parameters to those statements; leave-one-out cross-validation
planner    `cpinfer plan`: one deployment, or the smallest CP meeting a TTFT target; report renders it (--explain)
"""
from cpinfer.perf.hardware import HardwareProfile, load_hardware_profile
from cpinfer.perf.models import ModelSpec, load_model_spec

__all__ = ["HardwareProfile", "ModelSpec", "load_hardware_profile", "load_model_spec"]
