"""Predicted speedups past this machine (docs/design.md, section 7; docs/scaling.md).

Layer-parallel training runs for P virtual ranks in one process (`virtual`): the real
`LayerParallel` code, one thread per rank, one rank at a time, each rank's compute measured
as its thread's CPU time between communication calls. In W1 the convolutions are charged
from a cost table measured here instead of computed (`virtual.KernelCosts`), so that 1024
conv layers need not be computed again for every P; everything else runs. The traces are
replayed on a modelled network (`mgrit.app.replay.replay`). Serial PyTorch and layer-wise
model parallelism are modelled from measured per-layer costs of the plain network and
replayed the same way (`serial`). The study (`study`) checks the model against 1 and 2 real
MPI ranks first (`validation`). `cases` holds what all of them run.
Finished investigations built on these parts live in `benchmarks.studies`.

    python -m benchmarks.scaling OUT_DIR      writes OUT_DIR/scaling.json and
                                              OUT_DIR/figures/scaling.png
    python -m benchmarks.scaling OUT_DIR --cases w4[,w5,w4-1024] [--ranks 1,2,...]
                                              the transformers' curves alone, checked on 1 and
                                              2 MPI ranks first (OUT_DIR/scaling-CASES.json)
"""
