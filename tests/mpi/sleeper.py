"""Each rank writes its process id into the folder named on the command line, then waits
far longer than any test: a launch that ends has to end it."""

import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

folder = Path(sys.argv[1])
(folder / f"{MPI.COMM_WORLD.Get_rank()}.pid").write_text(str(os.getpid()))
time.sleep(300)
