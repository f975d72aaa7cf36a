"""The network layer: residual networks whose layers are time steps, spread over ranks.

`LayerParallel` is an `nn.Module` whose forward and backward (adjoint) passes are MGRIT
solves over the layers a rank owns (`stack.LayerStack`). It composes the forward and
adjoint propagators (`propagators`, computing through a step strategy chosen by `steps`),
their solvers (`passes`), the copies of other ranks' layers (`ghosts`), parameter gradients
(`gradients`) and checkpoints and export (`checkpoint`); `serial_resnet` is the plain
network it computes, `blocks` builds both from one description, `defaults` holds
training's solver settings."""

from .checkpoint import CheckpointError, serial_state_dict
from .layer_parallel import LayerParallel
from .serial import ResidualStep, serial_resnet

__all__ = ["CheckpointError", "LayerParallel", "ResidualStep", "serial_resnet",
           "serial_state_dict"]
