"""The `mgrit` tool: the command line, the training loop and the training job,
serial-against-parallel comparisons, figures, data sets, settings files, trace replay and
the launcher of mpiexec runs. Built on the library; nothing in the library imports it."""
