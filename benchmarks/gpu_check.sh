#!/usr/bin/env bash
# One-shot check of mgrit on a machine with an NVIDIA GPU and several CPU cores (written for
# one H100 or H200 and 16 cores, to end within about 9 minutes). Run it once, from anywhere:
#
#     bash benchmarks/gpu_check.sh                 # results in ./gpu-out
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Steps, each under its own time limit, each run whatever the one before did; the last
# gets what is left of TOTAL seconds (default 540):
#   1. What is there: Python, torch and its CUDA, the GPU, nvcc, mpi4py and its MPI library,
#      mpiexec (printed first, and into $OUT/environment.txt). Without a usable mpi4py and
#      mpiexec, MPICH and mpi4py are installed from carried wheels in $WHEELS (default
#      ./.whl; no package registry is needed) into $MPI_PREFIX (default /tmp/mgrit-mpi);
#      MPI_FROM_WHEELS=1 installs them in any case. The wheels come from a machine with a
#      package registry, for the GPU machine's Python (3.12 in this command):
#          pip download --only-binary=:all: --python-version 3.12 \
#              --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
#              -d .whl mpi4py mpich
#      (.whl is ignored by git: name it among what travels to the GPU machine).
#   2. python -m mgrit.kernels.build cuda (BUILD_TIMEOUT, 120 s); then `mgrit env --json`
#      (at most 60 s; its status fails nothing) records what mgrit itself finds, the built
#      kernels included, in $OUT/env.json.
#   3. Correctness: python -m pytest -m gpu (PYTEST_TIMEOUT, 240 s) with
#      MGRIT_TEST_REQUIRE_GPU=1 and MGRIT_TEST_REQUIRE_ALL=1, so that a GPU test cannot
#      pass by skipping (the MPI test needs mpiexec: carry the wheels): the CUDA
#      kernels against their twins, the executors against the loop executor, levels=1
#      against serial autograd, two ranks sharing the GPU against one, and their steps
#      captured as graphs between the messages against eager ones, `mgrit train --device
#      cuda` (eager and --capture) against the CPU; $OUT/pytest.xml.
#   4. Speed: benchmarks/gpu_check.py (its docstring lists the methods; TIMING_TIMEOUT,
#      250 s; DEVICE=cpu is its dry run without a GPU; WORKLOADS and COMPILE choose its
#      workloads and those torch.compile runs on, COMPILE= none): $OUT/gpu-<device>.json
#      after every method and $OUT/gpu-<device>.md, to be copied to docs/results/.
#   5. python -m benchmarks.scaling.ranks at RANKS (default 1,2,4,8,16; never more than the
#      cores; RANKS= leaves it out; at most RANKS_TIMEOUT, 240 s): $OUT/ranks.json, written
#      after every rank count measured; the predictions come after them and may be cut off
#      (they can be replayed from the file elsewhere), which fails nothing.
# Each step that runs past its limit gets SIGTERM, and SIGKILL 15 s later; a launch of MPI
# ranks ends its ranks first, and pytest still writes its report.
# Everything printed is in $OUT/check.log too.
#
# Exit status: 0 when everything passed; 2 without a usable GPU; otherwise non-zero (a
# failed step; whatever was measured is still in $OUT).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "${OUT:-gpu-out}"
OUT=$(cd "${OUT:-gpu-out}" && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
MPI_PREFIX=${MPI_PREFIX:-/tmp/mgrit-mpi}
LOG="$OUT/check.log"
: >"$LOG"

mpi_usable() {  # mpi4py imports and 2 ranks start and talk, within a minute
    [ -n "${MPI_FROM_WHEELS:-}" ] && return 1
    local exe
    exe=$(timeout 60 "$PY" -c "from mgrit.app.launch import find_mpiexec; print(find_mpiexec() or '')" 2>/dev/null)
    [ -n "$exe" ] && timeout 60 "$exe" -n 2 "$PY" -m mpi4py -c \
        "from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2" >/dev/null 2>&1
}

{
    echo "== what this machine has"
    echo "python: $("$PY" --version 2>&1) ($(command -v "$PY"))"
    timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1
    command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
    command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc on PATH: not found (NVCC=${NVCC:-})"
    echo "cores: $(nproc)"
    timeout 60 "$PY" -c "import mpi4py; from mpi4py import MPI; print('mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0])" 2>&1 | tail -1
    echo "mpiexec on PATH: $(command -v mpiexec || echo none)"
    if ! mpi_usable; then
        if ls "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl >/dev/null 2>&1; then
            echo "no usable mpi4py and mpiexec: installing the carried wheels into $MPI_PREFIX"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
                --prefix "$MPI_PREFIX" "$WHEELS"/mpi4py-*.whl "$WHEELS"/mpich-*.whl 2>&1 | tail -3
        else
            echo "no usable mpi4py and mpiexec, and no wheels in $WHEELS: the MPI steps will fail"
        fi
    fi
} 2>&1 | tee "$OUT/environment.txt" | tee -a "$LOG"
if [ -d "$MPI_PREFIX" ]; then
    SITE=$(ls -d "$MPI_PREFIX"/lib/python3*/site-packages 2>/dev/null | head -1)
    export PYTHONPATH="$SITE:$PYTHONPATH" LD_LIBRARY_PATH="$MPI_PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$MPI_PREFIX/bin:$PATH" MGRIT_MPIEXEC="$MPI_PREFIX/bin/mpiexec"
    timeout 60 "$PY" -c "import mpi4py; from mpi4py import MPI; print('now mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0], '| mpiexec $MGRIT_MPIEXEC')" 2>&1 | tee -a "$OUT/environment.txt" "$LOG"
fi

if [ "${DEVICE:-cuda}" = cuda ] && command -v nvidia-smi >/dev/null && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: nvidia-smi finds no usable NVIDIA GPU on this machine" | tee -a "$LOG" >&2
    exit 2
fi

left() {  # seconds of the TOTAL budget still unspent, at most $1
    local rest=$(( ${TOTAL:-540} - SECONDS ))
    [ "$rest" -lt "$1" ] && echo $(( rest > 0 ? rest : 1 )) || echo "$1"
}

echo "== build" | tee -a "$LOG"
timeout -k 15 "$(left "${BUILD_TIMEOUT:-120}")" "$PY" -m mgrit.kernels.build cuda 2>&1 | tee -a "$LOG"
build_status=${PIPESTATUS[0]}
timeout -k 5 "$(left 60)" "$PY" -m mgrit env --json >"$OUT/env.json" 2>>"$LOG" \
    || echo "mgrit env: exit $? (see $OUT/env.json)" | tee -a "$LOG"

echo "== pytest -m gpu" | tee -a "$LOG"
# --continue-on-collection-errors: a test module that cannot be imported here costs its own
# tests, not every GPU test
# on the GPU machine a test that would skip (no CUDA device, no mpiexec) fails instead
[ "${DEVICE:-cuda}" = cuda ] && export MGRIT_TEST_REQUIRE_GPU=1 MGRIT_TEST_REQUIRE_ALL=1
timeout -k 15 "$(left "${PYTEST_TIMEOUT:-240}")" "$PY" -m pytest -m gpu -q \
    -p no:cacheprovider --continue-on-collection-errors -o timeout=120 \
    --junitxml "$OUT/pytest.xml" 2>&1 | tee -a "$LOG"
pytest_status=${PIPESTATUS[0]}

echo "== timing: gpu_check.py" | tee -a "$LOG"
timing_limit=$(left "${TIMING_TIMEOUT:-250}")
timeout -k 15 "$timing_limit" "$PY" benchmarks/gpu_check.py --out "$OUT" --device "${DEVICE:-cuda}" \
    --budget $(( timing_limit > 30 ? timing_limit - 20 : 10 )) \
    ${WORKLOADS:+--workloads "$WORKLOADS"} ${COMPILE+--compile "$COMPILE"} 2>&1 | tee -a "$LOG"
timing_status=${PIPESTATUS[0]}

ranks_status=0
RANKS=${RANKS-1,2,4,8,16}
if [ -n "$RANKS" ] && [ "$(left 60)" -ge 60 ]; then
    echo "== real ranks: $RANKS" | tee -a "$LOG"
    # one virtual-rank run per point (RANKS_PROCESSES): with the cases' own 2-3 runs per
    # point the predictions did not finish within the first run's limit (docs/scaling.md)
    timeout -k 15 "$(left "${RANKS_TIMEOUT:-240}")" "$PY" -m benchmarks.scaling.ranks "$OUT" \
        --ranks "$RANKS" --processes "${RANKS_PROCESSES:-1}" --repeats "${RANKS_REPEATS:-3}" \
        2>&1 | tee -a "$LOG"
    ranks_status=${PIPESTATUS[0]}
    # the rank counts are written as they are measured and the predictions come last: a cut
    # at the limit after the first count keeps what was measured, and is no failure
    if { [ "$ranks_status" -eq 124 ] || [ "$ranks_status" -eq 137 ]; } && [ -s "$OUT/ranks.json" ]; then
        echo "real ranks: cut off at its limit; $OUT/ranks.json holds the rank counts measured" \
            | tee -a "$LOG"
        ranks_status=0
    fi
elif [ -n "$RANKS" ]; then
    echo "== real ranks: left out, under a minute of the ${TOTAL:-540} s is left" | tee -a "$LOG"
fi

echo "build exit $build_status, pytest exit $pytest_status, timing exit $timing_status, ranks" \
    "exit $ranks_status, $SECONDS s in all; results in $OUT" | tee -a "$LOG"
for status in "$pytest_status" "$timing_status" "$build_status" "$ranks_status"; do
    if [ "$status" -ne 0 ]; then
        exit "$status"
    fi
done
exit 0
