"""Finished investigations of where a layer-parallel training step's time goes, each run on
its own (`python -m benchmarks.studies.NAME`); every module's docstring says the question it
answered, its command and where its result is recorded. The scaling study proper, whose
virtual ranks, cases and cluster network they reuse, is `benchmarks.scaling`.

    fixed        the costs of one rank's step that do not shrink with its layers, and what
                 a 2-rank step adds to sequential stepping's
    hierarchies  W2's step at 64 ranks with other MGRIT hierarchies (used by levels, pathwork)
    hops         the critical path's cost per hop, and its arithmetic floor
    levels       the critical path's compute and hops by multigrid level and pass
    warm         virtual ranks run again alone, with warm caches
    pathwork     layer evaluations on the critical path against sequential stepping's
    gathered     coarse levels gathered onto every rank (Config.agglomerate) against
                 rank-to-rank ones: hops and predicted times of a plain propagator
    nested       W2 and W1-1024 at 64 ranks with the settings choose_settings picks
                 (nested starts, fewer cycles) against sequential stepping, validated
"""
