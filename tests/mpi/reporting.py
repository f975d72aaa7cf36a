"""How MPI test scripts hand results back to pytest: one JSON file per rank."""

import json
import os
from pathlib import Path


def report(rank: int, **data) -> None:
    """Write this rank's results to $MGRIT_REPORT_DIR/rank-<rank>.json (atomically)."""
    folder = Path(os.environ["MGRIT_REPORT_DIR"])
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, **data}))
    tmp.rename(folder / f"rank-{rank}.json")
