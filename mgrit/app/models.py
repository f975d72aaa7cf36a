"""The network a training run trains, behind one interface whichever way it is trained:
`SerialModel` in one process, `LayerParallelModel` across the ranks of a layer
communicator. A run picks one at construction (`build_model`); from then on checkpoints,
export, step statistics and random draws go through the same methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn

from ..core.config import Config
from ..execute import CudaCapture
from ..nn import CapturedStep, Controller, LayerParallel, choose_settings, draws, serial_resnet
from ..nn.engine.atomic import write_atomically
from ..nn.blocks import ResNetSpec
from ..nn.capture import keep_static
from .loop import LossFn, train_step
from .settings import TRANSFORMERS, ControlSettings, Settings, SettingsError

Mark = Callable[[], None]


class TrainedModel(Protocol):
    """What a run needs of its network."""

    module: nn.Module
    draw_step: int      # training forward passes so far: the random draws of the next one

    @property
    def stats(self) -> dict[str, Any]:
        """The last step's solver statistics per pass ("forward", "backward"), if any."""

    def controller(self, control: ControlSettings) -> Controller | None:
        """The [control] controller of this network, or None."""

    def choose(self, control: ControlSettings, loss_fn: LossFn, xb: Tensor, yb: Tensor
               ) -> tuple[Config, Config] | None:
        """[control] choose: train with the solver options chosen on the batch (xb, yb),
        which it returns; None where the network has no solvers. Collective."""

    def set_solvers(self, forward: Config, backward: Config) -> None:
        """Train with these solver options (those a resumed run's checkpoint names)."""

    def train_step(self, optimizer: torch.optim.Optimizer, loss_fn: LossFn, xb: Tensor,
                   yb: Tensor, mark: Mark | None, controller: Controller | None
                   ) -> tuple[Tensor, Tensor]:
        """One optimizer step on the batch: (loss, outputs)."""

    def save(self, folder: Path, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        """This rank's part of a checkpoint into `folder` (raises WriteError)."""

    def load(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Weights (and the optimizer's state, unless None) from `folder`; the `extra`
        saved with them."""

    def to_serial(self) -> nn.Module | None:
        """The plain network to export (None on ranks that do not hold it)."""


class SerialModel:
    """A plain residual network trained in one process; its checkpoint is one file. With
    `capture` its training steps run as one CUDA graph on a GPU (`OneGraphStep`)."""

    def __init__(self, module: nn.Module, seed: int, keyed_draws: bool,
                 capture: bool = False) -> None:
        self.module = module
        self.seed = seed
        self.capture = capture
        self._captured: OneGraphStep | None = None
        # a network with dropout draws the masks of the layer-parallel network's training
        # step of the same number (keyed by the seed and the step): both train the same
        # network, and a resumed run continues the draws (the count is checkpointed)
        self.keyed_draws = keyed_draws
        self.draw_step = 0

    @property
    def stats(self) -> dict[str, Any]:
        return {}

    def controller(self, control: ControlSettings) -> Controller | None:
        return None       # it tunes the MGRIT solvers, which a serial network has none of

    def choose(self, control: ControlSettings, loss_fn: LossFn, xb: Tensor, yb: Tensor
               ) -> tuple[Config, Config] | None:
        return None

    def set_solvers(self, forward: Config, backward: Config) -> None:
        raise SettingsError("a serial network has no solver options to set")

    def train_step(self, optimizer: torch.optim.Optimizer, loss_fn: LossFn, xb: Tensor,
                   yb: Tensor, mark: Mark | None, controller: Controller | None
                   ) -> tuple[Tensor, Tensor]:
        if self.capture:
            if self._captured is None:
                self._captured = OneGraphStep(self.module, optimizer, loss_fn, xb, yb)
            return self._captured.step(xb, yb)
        if not self.keyed_draws:
            return train_step(self.module, optimizer, loss_fn, xb, yb, mark, controller)
        with draws(self.seed, self.draw_step):
            result = train_step(self.module, optimizer, loss_fn, xb, yb, mark)
        self.draw_step += 1
        return result

    def save(self, folder: Path, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {"model": self.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "extra": extra}
        write_atomically(folder / "serial.pt", lambda f: torch.save(state, f))

    def load(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        path = folder / "serial.pt"
        try:
            # on the host: a checkpoint written on a GPU resumes on any device (loading
            # copies the weights and the optimizer's state to the network's)
            state = torch.load(path, map_location="cpu", weights_only=False)
        except FileNotFoundError:
            raise OSError(f"no checkpoint file {path}") from None
        except Exception as err:
            raise ValueError(f"{path} cannot be read ({type(err).__name__}: {err}): it is "
                             "truncated or corrupt") from None
        self.module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        return state["extra"]

    def to_serial(self) -> nn.Module | None:
        return self.module


class LayerParallelModel:
    """A `LayerParallel` network: each rank saves and loads its own layers. With `capture`
    its training steps are those of a `mgrit.nn.CapturedStep` (CUDA graphs on a GPU)."""

    def __init__(self, module: LayerParallel, capture: bool = False) -> None:
        self.module = module
        self.capture = capture
        self._captured: CapturedStep | None = None

    @property
    def draw_step(self) -> int:
        return self.module.draw_step

    @draw_step.setter
    def draw_step(self, step: int) -> None:
        self.module.draw_step = step

    @property
    def stats(self) -> dict[str, Any]:
        if self._captured is not None:
            # its residual norms are device tensors; read here, after the step
            return self._captured.stats()
        return self.module.stats

    def controller(self, control: ControlSettings) -> Controller | None:
        if not control.enabled:
            return None
        return Controller(self.module, control.threshold, control.every, control.max_every,
                          control.max_cycles, control.batching or None, control.warm)

    def choose(self, control: ControlSettings, loss_fn: LossFn, xb: Tensor, yb: Tensor
               ) -> tuple[Config, Config] | None:
        module = self.module
        module.train()
        forward, backward = choose_settings(module, lambda: loss_fn(module(xb), yb),
                                            threshold=control.threshold)
        module.set_solvers(forward, backward)
        return forward, backward

    def set_solvers(self, forward: Config, backward: Config) -> None:
        self.module.set_solvers(forward, backward)

    def train_step(self, optimizer: torch.optim.Optimizer, loss_fn: LossFn, xb: Tensor,
                   yb: Tensor, mark: Mark | None, controller: Controller | None
                   ) -> tuple[Tensor, Tensor]:
        if not self.capture:
            return train_step(self.module, optimizer, loss_fn, xb, yb, mark, controller)
        if self._captured is None:
            # built at the first step: after a resume has restored the optimizer's state
            # and the solvers it chose, whose storage the captured step then keeps
            self._captured = CapturedStep(self.module, loss_fn, optimizer, xb, yb,
                                          controller=controller)
        loss = self._captured.step(xb, yb)
        # the next step overwrites both
        return loss.clone(), self._captured.output.clone()

    def save(self, folder: Path, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        self.module.save_checkpoint(folder, optimizer, **extra)

    def load(self, folder: Path, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        return self.module.load_checkpoint(folder, optimizer)

    def to_serial(self) -> nn.Module | None:
        return self.module.to_serial()


class OneGraphStep:
    """A plain network's training step on static buffers (the batch copied in, the loss and
    the output kept in place): on CUDA the first step runs eagerly (it makes the
    optimizer's state), the second on the stream that captures, the third is captured as
    one CUDA graph and every later step replays it; elsewhere every step runs eagerly.
    What a layer-parallel `CapturedStep` is measured against."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
                 x: Tensor, y: Tensor) -> None:
        self.module, self.optimizer, self.loss_fn = module, optimizer, loss_fn
        self.inputs = (x.detach().clone(), y.detach().clone())
        self.graphs = x.device.type == "cuda"
        self._capturer = CudaCapture()
        self._graph: Any = None
        self.runs = 0
        self.loss: Tensor | None = None
        self.output: Tensor | None = None

    def _run(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        out = self.module(self.inputs[0])
        loss = self.loss_fn(out, self.inputs[1])
        loss.backward()
        self.optimizer.step()
        self.loss = keep_static(self.loss, loss)
        self.output = keep_static(self.output, out)

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """One step on (x, y), which have the first batch's shape (the batches of a run
        do); returns (loss, output), copies of the static ones."""
        for given, static in zip((x, y), self.inputs):
            static.copy_(given)
        if self._graph is not None:
            self._graph.replay()
        elif self.graphs and self.runs == 1:
            self._capturer.warm_up(self.inputs[0], self._run)
        elif self.graphs and self.runs == 2:
            self._graph = self._capturer.capture(self.inputs[0], self._run)
            self._graph.replay()
        else:
            self._run()
        self.runs += 1
        return self.loss.clone(), self.output.clone()


def build_model(settings: Settings, net: ResNetSpec, comm: Any, data_comm: Any,
                device: torch.device = torch.device("cpu")) -> TrainedModel:
    """The network of `net` on `device` as [training] says to train it: serial, or
    layer-parallel over `comm` (replicas summing gradients over `data_comm` when
    data_parallel > 1)."""
    t = settings.training
    if t.serial:
        keyed = settings.network.kind in TRANSFORMERS and settings.network.dropout > 0
        return SerialModel(serial_resnet(net.step, net.num_steps, net.t_final, net.opening,
                                         net.closing).to(device), t.seed, keyed, t.capture)
    try:
        return LayerParallelModel(LayerParallel(
            net.step, net.num_steps, net.t_final, settings.solver("forward"),
            settings.solver("backward"), comm=comm, opening=net.opening,
            closing=net.closing, data_comm=data_comm if t.data_parallel > 1 else None,
            seed=t.seed).to(device), t.capture)
    except (ValueError, TypeError) as err:
        # its checks see the same settings on every rank (or agree across them)
        raise SettingsError(str(err)) from None
