#!/usr/bin/env bash
# Create .venv (if absent) and install portakern with its test, opencl and cuda extras, from nothing
# (the opencl extra brings pyopencl and PoCL's CPU device, which CI's opencl tests run on; the cuda extra
# brings cuda-bindings and NVRTC, with which CI lowers the cuda backend's kernels without a GPU).
# torch is pinned to the CPU build first so the `test` extra does not pull a multi-GB CUDA build;
# on a GPU machine install your CUDA torch into .venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test,opencl,cuda]"
.venv/bin/python -m pip install -q --no-deps -e examples/portakern-torch-eager
