"""Step kernels: the residual step of a stack of layers and its adjoint, as strategies
chosen once per layer kind, device and dtype (`strategies`), each checked against the typed
contract of what the propagators call (`contract`): torch's hand-written kernels for
chains of Linear, same-padded Conv2d and simple activations (`chain`), native CPU kernels
compiled from C on first use (`native`, `dense`) and CUDA kernels compiled with nvcc
(`cuda`), both built into one cache by `build`; whether native kernels may run, and which of
two kernels is faster for given shapes (`choice`)."""
