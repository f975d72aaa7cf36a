"""The network layer: residual networks whose layers are time steps, spread over ranks.

`LayerParallel` is an `nn.Module` whose forward and backward (adjoint) passes are MGRIT
solves over the layers a rank owns (`stack.LayerStack`). It composes the forward and
adjoint propagators (`propagators`, computing through a step strategy chosen by
`module_strategy`), their solvers (`passes`), the copies of other ranks' layers (`ghosts`), parameter gradients
(`gradients`) and checkpoints and export (`checkpoint`); `serial_resnet` is the plain
network it computes, `blocks` builds both from one description, `defaults` holds
training's solver settings; `clipping` clips gradients by the whole network's norm,
`precision` carries autocast into the adjoint, `tied` trains weights tied across depth;
`randomness` defines the keyed random draws of stochastic layers
and `transformer` the batched transformer block; `controller` measures how far the inexact
gradients are from exact ones and changes the solvers between steps to keep them close."""

from .checkpoint import CheckpointError, serial_state_dict
from .randomness import Dropout, draws, layer_key
from .layer_parallel import LayerParallel
from .controller import Controller, Policy, ProbeResult, Setting, gradient_agreement, probe
from .serial import ResidualNetwork, ResidualStep, serial_resnet
from .transformer import TransformerBlock

__all__ = ["CheckpointError", "Controller", "Dropout", "LayerParallel", "Policy", "ProbeResult",
           "ResidualNetwork", "ResidualStep", "Setting", "TransformerBlock", "draws",
           "gradient_agreement", "layer_key", "probe", "serial_resnet", "serial_state_dict"]
