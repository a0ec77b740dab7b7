#!/usr/bin/env bash
# Every GPU number in one command (docs/gpu.md):   bash scripts/gpu_check.sh OUT_DIR [--only a,e]
#
# Runs the parts of cpinfer/bench/gpu_check.py, most valuable first, each in its own process under its own limit,
# all within GPU_CHECK_BUDGET_S seconds (default 450; `python -m cpinfer.bench.gpu_check list` prints them):
#   b  attention TFLOP/s per backend at 8K-128K beside a bf16 GEMM
#   c  prefill MFU at CP1, bf16, the full-depth Llama-3-8B shape at 32K and 128K (and the embedded model's shape
#      at 8K) with Hugging Face beside it on the same weights
#   d  decode against its floors: CUDA graphs vs eager, host time per step, the 8B shape vs its memory floor
#   f  FP8 weight GEMMs vs bf16 (cpinfer bench fp8-gemm)
#   a  kernel exactness: compiled Triton kernels, offsets past 2^31, 128K tokens, torch-flash vs float64
#   e  CP2 equals CP1 (both ranks on the one GPU when there is one)
# A part that would not fit what is left of the budget is skipped with one line, and the last line gives the
# command that runs exactly the skipped parts (`--only`, into OUT_DIR-2). OUT_DIR (created) receives, as it goes:
# results.json (every row as soon as it is measured), gpu_check.md (rewritten after every part), logs.tar.gz.
# At home: python -m cpinfer.bench.gpu_check report --from OUT_DIR [OUT_DIR-2] --write-doc docs/benchmarks.md
#
# Nothing is installed: python3 with torch, triton, transformers, safetensors, numpy and pytest is enough (the
# embedded model's shape runs with random weights when its package is absent). Python: $PYTHON, else
# .venv/bin/python, else python3. GPU_CHECK_DEVICE=cpu runs every part on the CPU at toy sizes (what CI runs);
# without a GPU and without it, the script says so in one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

OUT=
ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY=(--only "${2:?--only needs part names, e.g. --only a,e}"); shift ;;
    --only=*) ONLY=(--only "${1#--only=}") ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "gpu_check: one OUT_DIR only (got $OUT and $1)" >&2; exit 2; }; OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "usage: bash scripts/gpu_check.sh OUT_DIR [--only a,e]" >&2; exit 2; }

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: FAIL: '$PY' cannot import torch (set PYTHON=/path/to/python)" >&2
  exit 1
fi

if [ "${GPU_CHECK_DEVICE:-cuda}" = cpu ]; then
  export TRITON_INTERPRET=1  # the Triton kernels run in the interpreter on the CPU
elif ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if ! err=$("$PY" -m cpinfer.bench.gpu_check imports 2>&1); then
    echo "$err" >&2
    echo "gpu_check: FAIL: no GPU here, and the parts' Python imports fail (above)" >&2
    exit 1
  fi
  echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False): nothing to run; the parts" \
       "import (GPU_CHECK_DEVICE=cpu runs them at toy sizes)"
  exit 0
fi

exec "$PY" -u -m cpinfer.bench.gpu_check all "$OUT" ${ONLY[@]+"${ONLY[@]}"} --script "bash scripts/gpu_check.sh"
