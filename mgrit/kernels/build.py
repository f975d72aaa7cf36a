"""Building and loading the hand-written kernels: C for the CPU, CUDA for NVIDIA GPUs.

Both are compiled on first use, the same way: a `Recipe` names the sources (package data:
the C in `mgrit/kernels/csrc`, the CUDA in the repository's top-level `cuda/`, installed as
`mgrit/cuda`), the compiler and the flags to try in order; the library is written
into one cache folder ($MGRIT_CACHE_DIR, else $XDG_CACHE_HOME/mgrit, else ~/.cache/mgrit)
under a name that hashes the sources, the compiler, the flags and the hardware it was
compiled for, so a cache shared between machines never hands one a library built for
another, and a changed source is built anew. A library is written under a temporary name
and renamed, so ranks that build at once never load a half-written file.

    python -m mgrit.kernels.build {c,cuda}      build ahead of use; prints the library's path
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

_log = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"


def _cuda_sources() -> Path:
    """The folder of the CUDA sources: `mgrit/cuda` in an installed wheel (pyproject.toml maps
    the package mgrit.cuda to the top-level `cuda/`), else `cuda/` beside the `mgrit`
    package of a source tree, which an editable install and a PYTHONPATH checkout import."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "cuda"
    return installed if installed.is_dir() else package.parent / "cuda"


CUDA_SOURCES = _cuda_sources()
FALLBACK_NVCC = Path("/usr/local/cuda/bin/nvcc")
# the dtype suffix of both libraries' entry points (mgrit_conv2d_f32, mgrit_dense_step_f64, ...)
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


class BuildError(RuntimeError):
    """A compiler is missing or refused the sources."""


def cache_dir() -> Path:
    """Where built libraries are kept."""
    if os.environ.get("MGRIT_CACHE_DIR"):
        return Path(os.environ["MGRIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mgrit"


def _configured(variable: str) -> str | None:
    """The executable that an environment variable names, if it is set."""
    value = os.environ.get(variable)
    if value and shutil.which(value) is None:
        raise BuildError(f"${variable} is {value!r}, which is not an executable")
    return value or None


def c_compiler() -> str:
    """$CC, else cc, gcc or clang on PATH."""
    configured = _configured("CC")
    if configured:
        return configured
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    raise BuildError("no C compiler: set $CC or put cc, gcc or clang on PATH")


def nvcc() -> str:
    """$NVCC, else nvcc on PATH, else /usr/local/cuda/bin/nvcc."""
    configured = _configured("NVCC")
    if configured:
        return configured
    found = shutil.which("nvcc")
    if found:
        return found
    if os.access(FALLBACK_NVCC, os.X_OK):
        return str(FALLBACK_NVCC)
    raise BuildError("nvcc not found: set $NVCC, put nvcc on PATH or install the CUDA toolkit "
                     f"at {FALLBACK_NVCC.parent.parent}")


def cpu() -> str:
    """The CPU's model and instruction-set features (what -march=native compiles for): a
    model name alone, such as "AMD EPYC", covers generations with different vector units."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    seen: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
            seen[key] = line
    return "\n".join(seen.values()) or platform.processor()


def gpus() -> str:
    """The compute capabilities of this machine's GPUs (what -arch=native compiles for)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ",".join("sm_%d%d" % torch.cuda.get_device_capability(i)
                    for i in range(torch.cuda.device_count()))


@dataclass(frozen=True)
class Recipe:
    """How one kernel library is built: `sources` compiled by `compiler()` with the first of
    `flag_sets` that works, then `shared` (flags making a shared library) and `libraries`
    (linked after the sources); `hardware()` names what the flags compile for."""

    name: str
    sources: tuple[Path, ...]
    compiler: Callable[[], str]
    flag_sets: tuple[tuple[str, ...], ...]
    shared: tuple[str, ...]
    libraries: tuple[str, ...]
    hardware: Callable[[], str]

    def command(self, compiler: str, flags: tuple[str, ...], output: Path) -> list[str]:
        return [compiler, *flags, *self.shared, *map(str, self.sources), "-o", str(output),
                *self.libraries]

    def path(self, compiler: str, flags: tuple[str, ...]) -> Path:
        """The library's place in the cache."""
        parts = [*(src.read_text() for src in self.sources), compiler, *flags,
                 platform.machine(), self.hardware()]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
        return cache_dir() / f"libmgrit_{self.name}_{key}.so"


# The first flag set links glibc's vector math library for the dense kernels' tanh; where it
# is missing or lacks the functions, -z defs makes the link fail and the next set is tried.
C = Recipe("native", (CSRC / "conv2d.c", CSRC / "dense.c", CSRC / "draws.c"), c_compiler,
           (("-O3", "-march=native", "-DMGRIT_LIBMVEC", "-Wl,-z,defs", "-Wl,--no-as-needed",
             "-lmvec"), ("-O3", "-march=native"), ("-O3",)), ("-shared", "-fPIC"), ("-lm",),
           cpu)
CUDA = Recipe("cuda", (CUDA_SOURCES / "residual_dense.cu",), nvcc, (("-O3", "-arch=native"), ("-O3",)),
              ("-shared", "-Xcompiler", "-fPIC"), (), gpus)
RECIPES = {"c": C, "cuda": CUDA}


def build(recipe: Recipe, flags: tuple[str, ...], compiler: str | None = None,
          report: Callable[[str], None] | None = None) -> Path:
    """The library built with `flags` (compiled into the cache unless it is there)."""
    compiler = compiler or recipe.compiler()
    target = recipe.path(compiler, flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = recipe.command(compiler, flags, Path(partial))
    (report or (lambda line: _log.info("building: %s", line)))(" ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr).strip()}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def built(recipe: Recipe, report: Callable[[str], None] | None = None) -> Path:
    """The library built with the first of the recipe's flag sets that compiles."""
    compiler = recipe.compiler()
    errors = []
    for flags in recipe.flag_sets:
        try:
            return build(recipe, flags, compiler, report)
        except (BuildError, OSError) as err:
            errors.append(str(err))
    raise BuildError("\n".join(errors))


class LazyLibrary:
    """A ctypes library that `load` builds and opens on first use. A failure (no compiler,
    compile error, a folder that cannot be written) is remembered and raised again on later
    calls without another attempt."""

    def __init__(self, what: str, load: Callable[[], ctypes.CDLL]) -> None:
        self.what, self.load = what, load
        self._lock = threading.Lock()
        self._loaded: ctypes.CDLL | Exception | None = None

    def fresh(self) -> "LazyLibrary":
        """The same library, not loaded yet (tests)."""
        return LazyLibrary(self.what, self.load)

    def get(self) -> ctypes.CDLL:
        with self._lock:
            if self._loaded is None:
                try:
                    self._loaded = self.load()
                except Exception as err:  # remembered for every later call
                    _log.info("%s unavailable: %s", self.what, err)
                    self._loaded = err
        if isinstance(self._loaded, Exception):
            raise RuntimeError(f"the {self.what} cannot be loaded: {self._loaded}"
                               ) from self._loaded
        return self._loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgrit.kernels.build",
                                     description="Build mgrit's kernels into the cache.")
    parser.add_argument("kind", choices=sorted(RECIPES), help="c (CPU) or cuda (nvcc)")
    args = parser.parse_args(argv)
    try:
        path = built(RECIPES[args.kind], report=print)
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
