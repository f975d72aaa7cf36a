"""`mgrit.hold_freed_memory`: freed blocks stay in the process instead of being mapped and
faulted in again every step, in the process and in the ranks it launches; a threshold the
user set is left alone. Each case runs in a fresh interpreter, since the setting is the
process's."""

import os
import platform
import subprocess
import sys

import pytest

from mgrit.execute.host_memory import ENVIRONMENT

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="malloc's thresholds are glibc's")

# minor page faults while a step-like pattern (16 tensors of 512 KiB made, written and freed
# together) repeats 200 times. Without the thresholds, glibc trims the freed 8 MiB at the
# heap's top in most processes (which ones depends on their first allocations) and every
# repeat faults its 2048 pages in again: about 400000 faults.
FAULTS = """
import resource, sys
import torch
import mgrit
applied = mgrit.hold_freed_memory() if sys.argv[1] == "hold" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def steps(n):
    for _ in range(n):
        held = [torch.ones(1 << 17) for _ in range(16)]
        del held
torch.ones(1 << 18)
steps(5)
before = faults()
steps(200)
print(applied, faults() - before)
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=120, env={**clean, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_held_memory_is_not_faulted_in_again_each_step():
    applied, faults = _run(FAULTS, "hold").split()
    assert applied == "True"
    # a held heap faults none of the 8 MiB in again (a few pages for unrelated growth)
    assert int(faults) < 50


def test_launched_processes_inherit_the_thresholds():
    code = ("import os, subprocess, sys, mgrit; print(mgrit.hold_freed_memory()); "
            "sys.stdout.flush(); subprocess.run([sys.executable, '-c', "
            "'import os; print(os.environ[\"MALLOC_MMAP_THRESHOLD_\"], "
            "os.environ[\"MALLOC_TRIM_THRESHOLD_\"])'])")
    assert _run(code).split() == ["True", str(32 << 20), str(256 << 20)]


def test_a_threshold_the_user_set_is_kept():
    code = ("import os, mgrit; "
            "print(mgrit.hold_freed_memory(), os.environ['MALLOC_TRIM_THRESHOLD_'])")
    assert _run(code, env={"MALLOC_TRIM_THRESHOLD_": "1000"}).split() == ["False", "1000"]


def test_the_tool_holds_freed_memory_for_itself_and_its_ranks():
    code = ("import os\nfrom mgrit.app.cli import main\n"
            "try:\n    main(['replay', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('MALLOC_MMAP_THRESHOLD_'))")
    assert _run(code).splitlines()[-1] == str(32 << 20)


def test_the_user_can_keep_glibcs_own_behaviour():
    code = "import os, mgrit; print(mgrit.hold_freed_memory(), 'MALLOC_MMAP_THRESHOLD_' in os.environ)"
    assert _run(code, env={"MGRIT_HOLD_FREED_MEMORY": "0"}).split() == ["False", "False"]
