"""The `mgrit` tool: the command line, the training job, serial-against-parallel
comparisons, figures, data sets, settings files and trace replay. Built on the library;
nothing in the library imports it."""
