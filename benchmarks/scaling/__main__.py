"""python -m benchmarks.scaling OUT_DIR"""

import sys

from .study import main

if __name__ == "__main__":  # not again in the processes that `virtual.fresh` spawns
    main(sys.argv[1:])
