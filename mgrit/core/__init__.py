"""The numerical algorithm: solver options, grid and partition maths, level storage,
relaxation, FAS cycles and the propagator contract. It knows no network, no MPI library, no
kernel and no tool: it moves states through a `mgrit.comm.Comm` and runs independent work
through a `mgrit.execute` executor."""
