"""The research tools of a source checkout, built on mgrit and not part of the library: the
reference workloads (`workloads`), `mgrit bench` (`bench`, `training`, `baselines`), the
speed floors of `make bench-check` (`check`), the scaling study (`scaling`) and the GPU check
(`gpu_check`)."""
