"""The example scripts refuse arguments that do not fit together with an argparse error,
and pick defaults that fit the arguments given."""

import subprocess
import sys
from pathlib import Path

import pytest

LM = Path(__file__).parent.parent / "examples" / "transformer_lm.py"
SMALL = ["--steps", "2", "--every", "2", "--width", "16", "--heads", "2", "--context", "16",
         "--window", "8", "--batch", "4", "--validation", "16", "--sample", "10"]


def lm(*args):
    return subprocess.run([sys.executable, str(LM), *SMALL, *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_blocks_that_allow_fewer_levels_train_with_as_many_as_they_allow():
    default, two = lm("--blocks", "8"), lm("--blocks", "8", "--levels", "2")
    assert default.returncode == 0, default.stderr
    assert two.returncode == 0, two.stderr
    steps = [line for line in default.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2
    # 8 blocks coarsen once by 4: the default is then the 2-level solve
    assert default.stdout == two.stdout


@pytest.mark.parametrize("args,words", [
    (["--blocks", "8", "--levels", "3"], "--levels 3: 8 blocks allow 1 to 2 levels"),
    (["--blocks", "64", "--levels", "0"], "--levels 0: 64 blocks allow 1 to 4 levels"),
    (["--blocks", "0"], "--blocks 0: each of the 1 rank(s) needs a block"),
])
def test_arguments_that_do_not_fit_are_an_argparse_error(args, words):
    proc = lm(*args)
    assert proc.returncode == 2
    assert f"transformer_lm.py: error: {words}" in proc.stderr
    assert "Traceback" not in proc.stderr
