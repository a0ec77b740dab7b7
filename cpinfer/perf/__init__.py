"""Performance model, hardware/model catalogs, deployment planner (paper §3.4, §4, App. A, C, D).

hardware        HardwareProfile (frozen, validated, every number with its source), JSON round trip
catalog         built-in profiles: h100-gtt, h100-gti, h200, cpu-gloo
models          ModelSpec (sliding-window layers included) from a catalog name or any HF config.json, weight formats
model_catalog   Llama 3.1, Qwen2.5 (incl. 1M), Qwen3, Mistral Small 3.1, Gemma 3, each from its published config
implementations what differs between the paper's ring and cpinfer's, with sources
costs           GEMM (dtype, tiles), flash-decoding, TP all-reduce; the ring parts are cpinfer.cp.cost_model
simulator       TTFT (pass-KV / pass-Q), TTIT (pass-Q decode), memory per GPU
statements      every quantitative statement of the paper's public text, with its source, as a model check
fit             fits the h100-gtt parameters to those statements; leave-one-out cross-validation
planner         `cpinfer plan`: one deployment, or the smallest CP meeting a TTFT target; report renders it (--explain)
pd              prefill on CP-N, decode on separate CP-M groups: the KV transfer (bytes, bandwidth, exposed) and TTIT
speculative     the decode tokens/s gain of verifying k drafted tokens in one ring step at acceptance a
planning_doc    regenerates docs/planning.md (python -m cpinfer.perf.planning_doc docs/planning.md)
"""
from cpinfer.perf.hardware import load_hardware_profile
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.model_spec import ModelSpec
from cpinfer.perf.models import load_model_spec

__all__ = ["HardwareProfile", "ModelSpec", "load_hardware_profile", "load_model_spec"]
