"""The network layer: residual networks whose layers are time steps, spread over ranks.

`LayerParallel` is an `nn.Module` whose forward and backward (adjoint) passes are MGRIT
solves over the layers a rank owns (`LayerStack`), with the forward and adjoint
propagators built on them; `serial_resnet` is the plain network it computes."""

from .layer_parallel import LayerParallel
from .serial import ResidualStep, serial_resnet

__all__ = ["LayerParallel", "ResidualStep", "serial_resnet"]
