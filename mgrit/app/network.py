"""The network and optimizer a training run builds from its settings and data."""

from __future__ import annotations

import torch
from torch import nn

from ..nn.blocks import ResNetSpec, conv_step, dense_step, gpt, vit
from . import data as datasets
from .settings import Settings, SettingsError

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def network_for(settings: Settings, split: datasets.Split) -> ResNetSpec:
    """Opening, step and closing for the data's shape and the [network] settings."""
    net = settings.network
    shape = split.feature_shape
    if net.kind == "gpt":
        return gpt(split.classes, net.width, net.heads, net.steps, settings.data.context,
                   net.dropout, net.t_final)
    if net.kind == "vit":
        channels, height, width = shape
        return vit(channels, height, net.patch, net.width, net.heads, net.steps,
                   split.classes, net.dropout, net.t_final)
    if net.kind == "conv":
        if len(shape) != 3:
            raise SettingsError(f"[network] kind = 'conv' needs image data (C, H, W); "
                                f"{settings.data.name} has features of shape {shape}")
        channels, height, width = shape
        opening = nn.Sequential(nn.Conv2d(channels, net.channels, 3, padding=1), nn.ReLU())
        closing = nn.Sequential(nn.Flatten(), nn.Linear(net.channels * height * width,
                                                        split.classes))
        return ResNetSpec(opening, conv_step(net.channels), closing, net.steps,
                              net.t_final)
    features = 1
    for n in shape:
        features *= n
    opening = nn.Sequential(nn.Flatten(), nn.Linear(features, net.width),
                            _ACTIVATIONS[net.activation]())
    return ResNetSpec(opening, dense_step(net.width, _ACTIVATIONS[net.activation]),
                          nn.Linear(net.width, split.classes), net.steps, net.t_final)


def is_language_model(settings: Settings) -> bool:
    """Whether the run predicts the next token at every position (outputs (batch, tokens,
    vocabulary) against targets (batch, tokens)) rather than one class per example."""
    return settings.network.kind == "gpt"


def make_optimizer(settings: Settings, params) -> torch.optim.Optimizer:
    """The [training] optimizer over `params`."""
    t = settings.training
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay,
                                capturable=capturable(settings))
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def capturable(settings: Settings) -> bool:
    """Whether the optimizer keeps its step counts on the device: where a CUDA graph
    updates them (a captured run on a GPU), and only there (on the host torch refuses it)."""
    return settings.training.capture and settings.training.device != "cpu"


def restore_capturable(optimizer: torch.optim.Optimizer, settings: Settings) -> None:
    """After a resume: a restored optimizer takes the `capturable` flag of the run that
    wrote the checkpoint, on its device or another; it gets this run's again, and its step
    counts go where that flag keeps them (the parameters' device, or the host)."""
    wanted = capturable(settings)
    for group in optimizer.param_groups:
        if "capturable" not in group:
            continue
        group["capturable"] = wanted
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(p.device if wanted else "cpu")
