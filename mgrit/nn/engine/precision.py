"""Mixed precision in layer-parallel passes: the autocast state of a forward pass, so that
its adjoint (run later by autograd, outside the user's `torch.autocast` block) computes the
same ops at the same precisions, and the test of whether the hand-written step kernels may
run (they compute in the states' dtype and know nothing of autocast's per-op casts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    """Whether autocast is on for a device type, and its dtype and weight-cast cache."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


def autocast_state(device_type: str) -> AutocastState:
    """The autocast state in force for `device_type` ("cpu", "cuda")."""
    return AutocastState(device_type, torch.is_autocast_enabled(device_type),
                         torch.get_autocast_dtype(device_type),
                         torch.is_autocast_cache_enabled())


def reentered(state: AutocastState):
    """A context under the autocast state `state`: on as it was, or off where it was off
    (also where the caller of backward() has it on: the adjoint must linearise the ops the
    forward pass computed)."""
    return torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled,
                          cache_enabled=state.cache_enabled)


def autocasting(device: torch.device) -> bool:
    """Whether ops on `device` run under autocast now: the step kernels must then give way
    to torch's own ops, which autocast casts op by op as in the serial network."""
    return torch.is_autocast_enabled(device.type)
