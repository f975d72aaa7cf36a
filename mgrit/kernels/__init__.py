"""Step kernels: hand-written forward and adjoint kernels for chains of Linear, same-padded
Conv2d and simple activations (`chain`, torch), native CPU kernels compiled from C on first
use (`native`, `dense`), CUDA kernels compiled with nvcc (`cuda`), one build cache for both
(`build`), and the choice between them (`choice`)."""
