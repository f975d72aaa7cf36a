"""Ready propagators: Dahlquist, the 1D heat equation, dense ResNet steps."""

from .dahlquist import Dahlquist
from .heat import Heat1D
from .resnet import DenseResNet, ModuleResNet

__all__ = ["Dahlquist", "DenseResNet", "Heat1D", "ModuleResNet"]
