#!/usr/bin/env bash
# One-shot GPU check of mgrit's CUDA kernels and of layer-parallel training, for a machine
# with an NVIDIA GPU (written for an H200). Run it once, from anywhere:
#
#     bash benchmarks/gpu_check.sh                 # results in ./gpu-out
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Steps (a few minutes: step 4 is cut off after $CHECK_TIMEOUT s, default 420; a torch
# install, when needed, comes on top):
#   1. Python: $PYTHON (default python3) if it can import mgrit (the checkout is put on
#      PYTHONPATH); otherwise a fresh venv $VENV (default /tmp/mgrit-gpu-venv) with
#      `pip install "torch>=2.3"` (on Linux pip's default torch is the CUDA build) and
#      `pip install -e .`.
#   2. nvidia-smi and nvcc versions into $OUT/environment.txt.
#   3. python -m mgrit.kernels.build cuda (-arch=native, nvcc's default arch if that
#      fails), into the kernels' cache: $OUT/build.log.
#   4. benchmarks/gpu_check.py: kernels against their pure-torch twins (asserted), kernel
#      timings, the batched and stream executors against the loop executor (asserted) and
#      their timings, serial PyTorch against layer-parallel MGRIT on W2 and W2b; writes
#      $OUT/gpu_check.json (after every section) and $OUT/gpu_check.md; log in $OUT/check.log.
#
# Exit status: 0 when everything passed; 2 without a usable GPU; otherwise non-zero (a
# failed build or section; whatever was measured is still in $OUT).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "${OUT:-gpu-out}"
OUT=$(cd "${OUT:-gpu-out}" && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if command -v nvidia-smi >/dev/null && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: nvidia-smi finds no usable NVIDIA GPU on this machine:" >&2
    nvidia-smi -L >&2
    exit 2
fi

PY=${PYTHON:-python3}
if ! "$PY" -c "import mgrit" 2>/dev/null; then
    VENV=${VENV:-${TMPDIR:-/tmp}/mgrit-gpu-venv}
    echo "mgrit does not import with $PY: installing into $VENV"
    python3 -m venv "$VENV" || exit 1
    PY=$VENV/bin/python
    "$PY" -m pip install --quiet --upgrade pip || exit 1
    "$PY" -m pip install --quiet "torch>=2.3" || exit 1
    "$PY" -m pip install --quiet -e . || exit 1
fi

{
    echo "python: $("$PY" --version 2>&1) ($PY)"
    command -v nvidia-smi >/dev/null && nvidia-smi || echo "nvidia-smi: not found"
    command -v nvcc >/dev/null && nvcc --version || echo "nvcc on PATH: not found (NVCC=${NVCC:-})"
} >"$OUT/environment.txt" 2>&1

"$PY" -m mgrit.kernels.build cuda 2>&1 | tee "$OUT/build.log"
build_status=${PIPESTATUS[0]}

timeout "${CHECK_TIMEOUT:-420}" "$PY" benchmarks/gpu_check.py --out "$OUT" 2>&1 \
    | tee "$OUT/check.log"
check_status=${PIPESTATUS[0]}

echo "build exit $build_status, check exit $check_status; results in $OUT"
if [ "$check_status" -ne 0 ]; then
    exit "$check_status"
fi
exit "$build_status"
