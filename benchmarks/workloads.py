"""The reference workloads of docs/design.md (section 6), in one registry.

- `SOLVE_WORKLOADS`: W0 and heat, MGRIT solves of a time-stepping problem (`SolveWorkload`);
- `TRAINING_WORKLOADS`: W1, W2, W2b, W4 and W5, training steps of a network
  (`TrainingWorkload`);
- `W3_SETTINGS`: W3's training on the digits;
- the networks they train, each a `mgrit.nn.blocks.ResNetSpec`: `w1`, `w2`, `digits_dense`,
  and the transformers `w4` (a character language model) and `w5` (a vision transformer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

from mgrit.app.data import Split, Text, digits, topics_text
from mgrit.app.loop import sequence_cross_entropy
from mgrit.core.config import Config
from mgrit.core.cycle import Result, solve
from mgrit.core.propagator import Propagator, Step
from mgrit.nn.blocks import ResNetSpec, conv_step, dense_step, gpt, vit
from mgrit.nn.defaults import training_config
from mgrit.problems import Dahlquist, Heat1D

# Networks --------------------------------------------------------------------------------


class RepeatChannels(nn.Module):
    """Opening of W1: repeat a one-channel image to `channels` channels (no parameters)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat(1, self.channels, 1, 1)


def w1(channels: int = 3, num_steps: int = 32) -> ResNetSpec:
    """W1: MNIST-shaped conv ResNet; log-probabilities of 10 classes for 1x28x28 images."""
    closing = nn.Sequential(nn.Flatten(), nn.Linear(channels * 28 * 28, 32), nn.ReLU(),
                            nn.Linear(32, 10), nn.LogSoftmax(dim=1))
    return ResNetSpec(RepeatChannels(channels), conv_step(channels), closing, num_steps)


def w2(width: int = 32, num_steps: int = 1024, classes: int = 10) -> ResNetSpec:
    """W2: deep and narrow dense ResNet, u + h*tanh(W u + b); logits of `classes`."""
    return ResNetSpec(None, dense_step(width), nn.Linear(width, classes), num_steps)


def digits_dense(width: int = 32, num_steps: int = 32) -> ResNetSpec:
    """W3's network: 8x8 digit images (64 features) -> width, dense tanh steps, 10 logits."""
    opening = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh())
    return ResNetSpec(opening, dense_step(width), nn.Linear(width, 10), num_steps)


@functools.lru_cache(maxsize=None)
def topics_corpus() -> Text:
    """W4's text, read once per process (every build of the network needs its vocabulary)."""
    return topics_text()


@functools.lru_cache(maxsize=None)
def digit_images() -> Split:
    """W5's images, read once per process."""
    return digits()


# The transformers' sizes and optimizer (docs/results.md, "Layer-parallel transformers")
W4_SETTINGS = dict(width=64, heads=4, num_steps=32, context=64, dropout=0.1, batch=16, lr=3e-3)
W5_SETTINGS = dict(width=32, heads=4, num_steps=16, patch=2, dropout=0.0, batch=32, lr=3e-3)


def w4(num_steps: int = W4_SETTINGS["num_steps"], width: int = W4_SETTINGS["width"],
       heads: int = W4_SETTINGS["heads"], context: int = W4_SETTINGS["context"],
       dropout: float = W4_SETTINGS["dropout"], t_final: float = 1.0) -> ResNetSpec:
    """W4: a GPT-style character language model of the Python reference topics
    (`mgrit.nn.blocks.gpt`): causal pre-norm blocks, logits (batch, tokens, vocabulary)."""
    return gpt(len(topics_corpus().vocab), width, heads, num_steps, context, dropout, t_final)


def w5(num_steps: int = W5_SETTINGS["num_steps"], width: int = W5_SETTINGS["width"],
       heads: int = W5_SETTINGS["heads"], patch: int = W5_SETTINGS["patch"],
       dropout: float = W5_SETTINGS["dropout"], t_final: float = 1.0) -> ResNetSpec:
    """W5: a small vision transformer on the 8x8 digits (`mgrit.nn.blocks.vit`), its
    patches as tokens, mean-pooled logits of 10 classes."""
    return vit(1, 8, patch, width, heads, num_steps, 10, dropout, t_final)


# mean cross entropy over every position: logits (..., vocabulary), targets (...), the loss
# `mgrit train` gives a language model
token_cross_entropy = sequence_cross_entropy


# Solves: W0 and heat -----------------------------------------------------------------------

# Residual history of W0 from an established MGRIT implementation (PyMGRIT), see
# docs/results.md; a correct solver reproduces it to about 1e-8 relative.
W0_REFERENCE = [2.5279539685028364e-02, 1.7930034195332422e-03, 1.6194919210368527e-04,
                1.5250703496904307e-05, 1.4712661282858573e-06, 1.4400735860047092e-07,
                1.4234196484315547e-08, 1.4167735802542508e-09, 1.4174687264778850e-10,
                1.4238166031588226e-11]


@dataclass
class SolveWorkload:
    """One problem to solve: a propagator, its grid and the solver settings; `reference`:
    a residual history the solve must reproduce, if one is known."""

    name: str
    description: str
    prop: Propagator
    u0: Tensor
    num_steps: int
    t0: float
    t1: float
    config: Config
    reference: list[float] = field(default_factory=list)

    def solve(self, comm: Any = None, config: Config | None = None) -> Result:
        """The MGRIT solve (with `config` in place of the workload's, if given)."""
        return solve(self.prop, self.u0, self.num_steps, self.t0, self.t1,
                     self.config if config is None else config, comm=comm)

    def sequential(self) -> Tensor:
        """Plain time stepping of the propagator; the final state only, as a user's loop
        keeps it."""
        h = (self.t1 - self.t0) / self.num_steps
        u = self.u0
        for n in range(self.num_steps):
            u = self.prop.step(u, Step(0, n, n, self.t0 + n * h, h))
        return u


def w0_workload() -> SolveWorkload:
    """W0: Dahlquist, the standard MGRIT speed case."""
    return SolveWorkload(
        "w0", "u' = -u, backward Euler, h = 0.05, N = 16384, levels 5, m = 4, FCF, "
        "V-cycle, zero guess, tol 1e-10", Dahlquist(-1.0),
        torch.tensor(1.0, dtype=torch.float64), 16384, 0.0, 16384 * 0.05,
        Config(levels=5, coarsening=4, relax="FCF", cycle="V", initial_guess="zero",
               tol=1e-10, max_iter=50), W0_REFERENCE)


def heat_workload(nx: int = 20001, num_steps: int = 1024) -> SolveWorkload:
    """A costly step: the heat equation on nx points, one tridiagonal solve per step."""
    prop = Heat1D.sine_solution(nx)
    return SolveWorkload(
        "heat", f"u_t = u_xx + b, nx = {nx}, N = {num_steps} on [0, 2], levels 4, m = 4, "
        "FCF, V-cycle, tol 1e-8", prop, prop.initial_sine(), num_steps, 0.0, 2.0,
        Config(levels=4, coarsening=4, relax="FCF", cycle="V", tol=1e-8, max_iter=50))


SOLVE_WORKLOADS: dict[str, Callable[[], SolveWorkload]] = {"w0": w0_workload,
                                                           "heat": heat_workload}


# Training: W1, W2, W2b, W3, W4 and W5 ------------------------------------------------------

@dataclass
class TrainingWorkload:
    """Training steps of a network: the network, the MGRIT settings of its forward and
    backward solves, a batch (drawn from a generator), the loss and the optimizer."""

    name: str
    description: str
    network: Callable[[], ResNetSpec]
    forward: Config
    backward: Config
    inputs: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    microbatches: int = 1           # of the GPipe baseline

    def with_solver(self, **options: Any) -> "TrainingWorkload":
        """The workload with `options` replaced in both its forward and backward solver
        settings."""
        return replace(self, forward=replace(self.forward, **options),
                       backward=replace(self.backward, **options))


def w1_workload() -> TrainingWorkload:
    return TrainingWorkload(
        "w1", "conv ResNet, 3 channels, 28x28, N = 32, batch 50, SGD(0.01, 0.9); MGRIT 3 "
        "levels, m = 4, F/FCF, 2 forward and 1 backward cycle", w1,
        training_config("forward"), training_config("backward"),
        lambda g: (torch.randn(50, 1, 28, 28, generator=g),
                   torch.randint(0, 10, (50,), generator=g)),
        nn.functional.nll_loss, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        microbatches=5)


def w2_workload(batch: int = 1) -> TrainingWorkload:
    """W2 (batch 1) or W2b (batch 32)."""
    return TrainingWorkload(
        "w2" if batch == 1 else "w2b", f"dense tanh ResNet, width 32, N = 1024, batch {batch}, "
        "SGD(0.01); MGRIT 4 levels, m = 4, F/FCF/FCF, 2 forward and 1 backward cycle, "
        "batched relaxation", w2,
        training_config("forward", levels=4), training_config("backward", levels=4),
        lambda g: (torch.randn(batch, 32, generator=g),
                   torch.randint(0, 10, (batch,), generator=g)),
        nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01),
        microbatches=min(batch, 4))


def w4_workload(batch: int = W4_SETTINGS["batch"], lr: float = W4_SETTINGS["lr"],
                **network: Any) -> TrainingWorkload:
    """W4 (`network`: `w4`'s sizes in place of its defaults): random windows of the
    training text and their next characters, cross entropy over every position."""
    settings = {**W4_SETTINGS, **network}
    context = settings["context"]
    return TrainingWorkload(
        "w4", f"GPT-style char LM on the Python reference topics, width {settings['width']}, "
        f"{settings['heads']} heads, N = {settings['num_steps']} causal pre-norm blocks, "
        f"context {context}, dropout {settings['dropout']}, batch {batch}, AdamW({lr}); MGRIT "
        "3 levels, m = 4, F/FCF, 2 forward and 1 backward cycle",
        lambda: w4(**network), training_config("forward"), training_config("backward"),
        lambda g: topics_corpus().sample(batch, context, g), token_cross_entropy,
        lambda p: torch.optim.AdamW(p, lr=lr), microbatches=min(batch, 4))


def w5_workload(batch: int = W5_SETTINGS["batch"], lr: float = W5_SETTINGS["lr"],
                **network: Any) -> TrainingWorkload:
    """W5 (`network`: `w5`'s sizes in place of its defaults): a batch of distinct
    training images of the digits."""
    settings = {**W5_SETTINGS, **network}

    def inputs(g: torch.Generator) -> tuple[Tensor, Tensor]:
        split = digit_images()
        pick = torch.randperm(len(split.x_train), generator=g)[:batch]
        return split.x_train[pick], split.y_train[pick]
    return TrainingWorkload(
        "w5", f"ViT on the 8x8 digits, {settings['patch']}x{settings['patch']} patches as "
        f"tokens, width {settings['width']}, {settings['heads']} heads, N = "
        f"{settings['num_steps']} pre-norm blocks, batch {batch}, AdamW({lr}); MGRIT 3 levels, "
        "m = 4, F/FCF, 2 forward and 1 backward cycle",
        lambda: w5(**network), training_config("forward"), training_config("backward"),
        inputs, nn.functional.cross_entropy, lambda p: torch.optim.AdamW(p, lr=lr),
        microbatches=min(batch, 4))


TRAINING_WORKLOADS: dict[str, Callable[[], TrainingWorkload]] = {
    "w1": w1_workload, "w2": w2_workload, "w2b": lambda: w2_workload(batch=32),
    "w4": w4_workload, "w5": w5_workload}

# W3: `digits_dense` trained on the digits with training's default solver settings
W3_SETTINGS = dict(width=32, num_steps=32, epochs=30, batch_size=32, lr=0.05, seed=0)
