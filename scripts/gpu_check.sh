#!/usr/bin/env bash
# The one command a GPU user runs (nothing here has run on a GPU yet; see docs/gpu.md):
#   1. the Triton kernels (step attention, merge) and CP2 cp_attention against the float64 reference, compiled on CUDA;
#   2. the engine at CP2 on two GPUs against CP1 (greedy tokens, fp32 and bf16);
#   3. attention TFLOP/s at 8K-128K against the bf16 matmul rate of the same run (`cpinfer bench gpu`).
# Needs a CUDA build of torch in .venv (CPINFER_SKIP_TORCH=1 bash scripts/setup.sh keeps one). Exit 1 if a part fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False); nothing was checked" >&2
  exit 2
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "GPUs:",
  [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
failed=0

echo "== 1. kernels vs the float64 reference on CUDA"
CPINFER_TRITON_ON_GPU=1 "$PY" -m pytest -q tests/test_triton.py tests/test_backends.py || failed=1

echo "== 2. engine CP2 vs CP1"
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  "$PY" - <<'EOF' || failed=1
from cpinfer import LLM, SamplingParams

prompts = ["Summarise context parallelism in one sentence.", "List three prime numbers." * 40]
params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
if __name__ == "__main__":
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for cp in (1, 2):
            with LLM(context_parallel_size=cp, device="cuda", dtype=dtype, attention_backend="auto") as llm:
                runs[cp] = llm.generate(prompts, params)
        same = sum(a.token_ids == b.token_ids for a, b in zip(runs[1], runs[2]))
        gap = max(abs(x - y) for a, b in zip(runs[1], runs[2]) for x, y in zip(a.logprobs, b.logprobs))
        print(f"{dtype}: CP2 tokens equal CP1 on {same}/{len(prompts)} prompts; max |logprob gap| {gap:.2e}")
        if dtype == "float32" and same != len(prompts):
            raise SystemExit("engine CP2 differs from CP1 in fp32")
EOF
else
  echo "skipped: needs two GPUs"
fi

echo "== 3. attention TFLOP/s vs matmul"
"$PY" -m cpinfer bench gpu || failed=1

if [ "$failed" = 0 ]; then echo "gpu_check: PASS"; else echo "gpu_check: FAIL" >&2; fi
exit "$failed"
