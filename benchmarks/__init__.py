"""The research tools of a source checkout, built on mgrit and not part of the library: the
reference workloads (`workloads`), `mgrit bench` (`bench`, `training`, `baselines`), the
speed floors of `make bench-check` (`check`), the scaling study (`scaling`) and the GPU check
(`gpu_check`)."""

from mgrit import hold_freed_memory

# every method a benchmark times, in this process and in the ranks it launches, runs with
# the same malloc thresholds as `mgrit` itself (mgrit.execute.host_memory)
hold_freed_memory()
