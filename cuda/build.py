"""Compile the hand-written CUDA kernels (residual_dense.cu) into libmgrit_cuda.so with nvcc.

    python cuda/build.py [--out DIR] [--arch ARCH]

nvcc is $NVCC, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc. The library is written
under a temporary name and renamed, so concurrent builds (several MPI ranks) never load a
half-written file. `--arch native` compiles for the GPUs of this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

SOURCE = Path(__file__).resolve().with_name("residual_dense.cu")
LIBRARY = "libmgrit_cuda.so"
DEFAULT_OUT = Path(__file__).resolve().with_name("build")
FALLBACK_NVCC = Path("/usr/local/cuda/bin/nvcc")


class BuildError(RuntimeError):
    """nvcc is missing or failed."""


def find_nvcc() -> str:
    """The nvcc to use: $NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc."""
    if os.environ.get("NVCC"):
        nvcc = os.environ["NVCC"]
        if shutil.which(nvcc) is None:
            raise BuildError(f"$NVCC is {nvcc!r}, which is not an executable")
        return nvcc
    found = shutil.which("nvcc")
    if found:
        return found
    if os.access(FALLBACK_NVCC, os.X_OK):
        return str(FALLBACK_NVCC)
    raise BuildError("nvcc not found: set $NVCC, put nvcc on PATH or install the CUDA toolkit "
                     f"at {FALLBACK_NVCC.parent.parent}")


def nvcc_command(nvcc: str, output: Path, arch: str | None = None) -> list[str]:
    """The nvcc command line that compiles SOURCE into the shared library `output`."""
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC"]
    if arch:
        cmd.append(f"-arch={arch}")
    return [*cmd, str(SOURCE), "-o", str(output)]


def build(out_dir: Path | str = DEFAULT_OUT, arch: str | None = None,
          report: Callable[[str], None] | None = None) -> Path:
    """Compile the library into out_dir and return its path; `report` receives the command."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY
    partial = out_dir / f".{LIBRARY}.{os.getpid()}.tmp"
    cmd = nvcc_command(find_nvcc(), partial, arch)
    if report is not None:
        report(" ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed (exit {proc.returncode}) compiling {SOURCE}:\n"
                             f"{proc.stdout}{proc.stderr}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--arch", help="nvcc -arch value, e.g. sm_90 or native "
                        "(default: nvcc's own)")
    args = parser.parse_args(argv)
    try:
        path = build(args.out, args.arch, report=print)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
