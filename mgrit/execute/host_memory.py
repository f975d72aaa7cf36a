"""Host memory that freed tensors give back to the operating system, and how often.

glibc's malloc serves a request of at least its mmap threshold (128 KiB at first, raised
as such blocks are freed) with a fresh mapping, and trims the top of its heap once more than
twice that is free. A training step allocates and frees the same few blocks every time (a
1024-layer W2 step: state stacks of 128 KiB and more), so in some processes every step
maps, trims and faults the same pages in again (measured in docs/performance.md, "Host
memory"). Which process is hit depends on the order of its first allocations, so two runs
of one command differ without a change between them.

`hold_freed_memory` fixes both thresholds, in this process and, through the environment,
in every process it launches: freed blocks up to 32 MiB stay in the heap and the heap is
trimmed past 256 MiB free. Both are needed: either one alone turns glibc's dynamic
threshold off at 128 KiB and makes every step map its states afresh.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # where glibc's dynamic threshold stops on 64-bit systems
TRIM_THRESHOLD = 256 << 20

# glibc reads these at a process's start
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
               "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}

# MGRIT_HOLD_FREED_MEMORY=0: glibc's own behaviour (a process short of memory, or a
# comparison against it)
OPT_OUT = "MGRIT_HOLD_FREED_MEMORY"
_applied = False


def hold_freed_memory() -> bool:
    """Fix malloc's thresholds in this process and in the processes it launches from now
    on (see the module's docstring); True where applied, False where the C library is not
    glibc, the user set either threshold in the environment or MGRIT_HOLD_FREED_MEMORY=0
    (then nothing is changed)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in ENVIRONMENT) or os.environ.get(OPT_OUT) == "0":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    applied = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
               and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if applied:
        os.environ.update(ENVIRONMENT)
        _applied = True
    return applied
