"""The machinery behind `LayerParallel`: what a user never calls directly.

The layers a rank owns (`stack`), the forward and adjoint propagators (`propagators`)
computing through a step strategy chosen by `module_strategy`, their solvers (`passes`), the
copies of other ranks' layers (`ghosts`), parameter gradients (`gradients`), autocast
carried into the adjoint (`precision`), weights tied across depth (`tied`), the keyed random
draws of stochastic layers (`randomness`, whose public names `mgrit.nn` re-exports) and
atomic file writes (`atomic`). The public modules one level up build on these; nothing here
imports them, so the engine can change without touching the API."""
