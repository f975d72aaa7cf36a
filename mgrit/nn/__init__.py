"""The network layer: residual networks whose layers are time steps, spread over ranks.

The public modules: `layer_parallel` (`LayerParallel`, an `nn.Module` whose forward and
backward passes are MGRIT solves over the layers each rank owns), `serial` (the plain
network it computes), `blocks` (both built from one description), `transformer` (the batched
transformer block), `checkpoint` and `export` (checkpoints, and the plain network out of
one or a live model), `checks` (what it checks before it solves), `clipping` (gradient clipping by
the whole network's norm), `defaults` (training's solver settings) and `controller` (how far
the inexact gradients are from exact ones, and changing the solvers between steps to keep
them close, at the least cost by a model calibrated on the network: `calibrate`,
`choose_settings`), `capture` (a whole training step, or a forward pass without gradients,
on static buffers without host reads, as one CUDA graph where it can). The machinery behind
them (layer stack, propagators, solvers, ghost layers, gradients, keyed random draws) lives
in `engine`, which never imports these modules."""

from .checkpoint import CheckpointError
from .export import serial_state_dict
from .engine.atomic import WriteError
from .engine.randomness import Dropout, draws, layer_key
from .layer_parallel import LayerParallel
from .capture import CapturedForward, CapturedStep, CaptureError
from .controller import (Calibration, Controller, Policy, ProbeResult, Setting, calibrate,
                         choose_settings, gradient_agreement, probe)
from .serial import ResidualNetwork, ResidualStep, serial_resnet
from .transformer import TransformerBlock

__all__ = ["Calibration", "CaptureError", "CapturedForward", "CapturedStep", "CheckpointError",
           "Controller", "Dropout", "LayerParallel", "Policy", "ProbeResult",
           "ResidualNetwork", "ResidualStep", "Setting", "TransformerBlock", "calibrate",
           "choose_settings", "WriteError", "draws", "gradient_agreement", "layer_key",
           "probe", "serial_resnet", "serial_state_dict"]
