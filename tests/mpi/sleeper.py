"""Each rank writes its process id into the folder named on the command line, then waits
far longer than any test: a launch that ends has to end it."""

import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

folder = Path(sys.argv[1])
# whole or not there: the test reads the file as soon as it appears
tmp = folder / f".{MPI.COMM_WORLD.Get_rank()}.tmp"
tmp.write_text(str(os.getpid()))
tmp.rename(folder / f"{MPI.COMM_WORLD.Get_rank()}.pid")
time.sleep(300)
