"""What a training run writes for each step and epoch: the records of metrics.jsonl and
the fields of the progress line."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from .environment import mpi_library, versions

CONTROL_FIELDS = ("setting", "forward_cycles", "backward_cycles", "levels", "estimate")


def launch_record(world: Any, device: torch.device, epoch: int, step: int,
                  resumed: bool) -> dict[str, Any]:
    """The metrics record of one launch of a run (its start, and each `--resume`): the
    epoch and the training step (counted over all epochs) it starts at, and what it ran on
    and with: versions of mgrit, torch, Python and the MPI library, the ranks, the hosts and
    the devices; run from a git checkout, its commit (`versions`). A run continued on
    another machine, device or version says so in its metrics. Collective over `world` (an
    mpi4py communicator, or None); the record is rank 0's."""
    here = (platform.node(), _device_name(device))
    seen = world.allgather(here) if world is not None else [here]
    rank = world.Get_rank() if world is not None else 0
    # the MPI library of a launch under mpiexec; a one-process run leaves MPI unloaded
    mpi = sys.modules.get("mpi4py.MPI")
    return {"type": "launch", "epoch": epoch, "step": step, "resumed": resumed,
            # only rank 0 asks git: its record is the one written
            **versions(source=rank == 0), "mpi": mpi_library(mpi) if mpi else None,
            "ranks": len(seen), "hosts": sorted({h for h, _ in seen}),
            "devices": sorted({d for _, d in seen}), "threads": torch.get_num_threads()}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def probe_record(epoch: int, step: int, control: dict[str, Any]) -> dict[str, Any]:
    """The metrics record of a probed step: the setting, the training gradient's error and
    cosine against the exact one (overall and per group), what other settings were measured
    and the decision; "seconds" is what the probe took on rank 0."""
    probe = control["probe"]
    record = {"type": "probe", "epoch": epoch, "step": step, "setting": control["setting"],
              "error": probe["error"], "cosine": probe["cosine"], "groups": probe["groups"],
              "candidates": probe["candidates"], "seconds": probe["seconds"]}
    if "decision" in probe:
        record["decision"] = probe["decision"]
    return record


def step_record(epoch: int, step: int, loss: float, seconds: float, stats: dict[str, Any],
                control: dict[str, Any]) -> dict[str, Any]:
    """The metrics record of training step `step` (counted over all epochs): its loss and
    time, the solvers' residuals and what the controller (if any) chose."""
    record = {"type": "step", "epoch": epoch, "step": step, "loss": loss, "seconds": seconds,
              "forward_residuals": stats.get("forward", {}).get("residuals", []),
              "backward_residuals": stats.get("backward", {}).get("residuals", [])}
    if control:
        record["control"] = {k: control[k] for k in CONTROL_FIELDS}
    return record


def step_fields(loss: float, accuracy: float, seconds: float, stats: dict[str, Any],
                control: dict[str, Any], configured: str | None) -> dict[str, Any]:
    """The progress line's fields after a step: loss, accuracy, the solvers' cycles and
    last residuals, and the controller's setting once it differs from the `configured`
    one."""
    fields: dict[str, Any] = {"loss": loss, "acc": accuracy}
    for kind in ("forward", "backward"):
        if kind in stats:
            fields[f"{kind}_cycles"] = stats[kind]["iterations"]
            residuals = stats[kind]["residuals"]
            fields[f"{kind}_residual"] = residuals[-1] if residuals else None
    if control and control["setting"] != configured:
        # the fwd and bwd pieces show the cycles; the controller's setting (and its error)
        # once it differs from the configured one
        fields["setting"] = control["setting"]
        fields["gradient_error"] = (control["probe"]["error"] if "probe" in control
                                    else control["estimate"])
    fields["ms_per_step"] = seconds * 1e3
    return fields
