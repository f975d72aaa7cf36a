"""Measured and traced runs for tests/test_trace.py: W0's distributed solve and W2's training
step and no-grad forward on this launch's ranks, and a ping-pong on 2 ranks.

Rank 0 reports the whole record (measured times, every rank's traces); the others report
that they finished.
"""

import sys

import torch

from benchmarks.scaling.validation import validation_record
from mgrit.app.launch import report

torch.set_num_threads(1)
record = validation_record(cases=("w0", "w2"), repeats=int(sys.argv[1]))
report({"record": record})
