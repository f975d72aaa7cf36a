"""The `mgrit train` job: a training run with metrics, progress, checkpoints, traces and
export; each of its steps is `loop.train_step`. The network is a `models.TrainedModel`,
chosen once, so the run reads the same serial and layer-parallel."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.config import Config
from ..nn.engine.atomic import AppendedFile, WriteError, write_atomically
from . import data as datasets
from .collective import agreed, on_rank_zero
from .data import batches
from .devices import node_rank, rank_device, synchronize
from .loop import correct, evaluate, sequence_cross_entropy
from .models import build_model
from .network import is_language_model, make_optimizer, network_for, restore_capturable
from .outputs import intact_hint, latest_checkpoint, prepare_output, publish_checkpoint
from .progress import Progress
from .records import launch_record, probe_record, step_fields, step_record
from .resuming import checkpoint_name, data_parallel_refusal, not_written, resume_notice, \
    truncate_metrics
from .settings import Settings, SettingsError, check, plain_options

log = logging.getLogger("mgrit.train")


def refuse_layout(settings: Settings, size: int, resume: bool) -> None:
    """The error for [training] and [output] settings that `size` ranks cannot run."""
    t, trace = settings.training, settings.output.trace
    if t.serial and size > 1:
        raise SettingsError("[training] serial = true trains in one process; launch it "
                            "without mpiexec (or with -n 1)")
    if size % t.data_parallel:
        raise SettingsError(data_parallel_refusal(t.data_parallel, size, resume))
    if t.batch_size % t.data_parallel:
        raise SettingsError(f"[training] batch_size = {t.batch_size} must be a multiple of "
                            f"data_parallel = {t.data_parallel}")
    if trace and t.device != "cpu":
        raise SettingsError(f"[output] trace = {trace}: traces time each rank's work on the "
                            f"host, which on a GPU runs ahead of the device; trace with "
                            f"[training] device = 'cpu', not {t.device!r}")
    if trace and (t.serial or t.data_parallel > 1):
        raise SettingsError(f"[output] trace = {trace}: traces record layer-parallel "
                            "training without data parallelism (training.serial = false, "
                            "training.data_parallel = 1)")


def steps_per_epoch(settings: Settings, split: datasets.Split) -> int:
    """The training steps of an epoch, or the error for data too small for the settings."""
    t, name = settings.training, settings.data.name
    if len(split.x_test) == 0:
        raise SettingsError(f"[data] context = {settings.data.context} leaves no window in "
                            f"the test part of {name}: choose a shorter context")
    steps = len(split.x_train) // t.batch_size
    if steps == 0:
        raise SettingsError(f"[training] batch_size = {t.batch_size} is larger than the "
                            f"{len(split.x_train)} training examples of {name}: an epoch "
                            "would have no step")
    if t.steps_per_epoch:
        steps = min(steps, t.steps_per_epoch)
    trace = settings.output.trace
    if trace and trace >= steps:
        raise SettingsError(f"[output] trace = {trace}: the first epoch has {steps} steps; "
                            "at most steps - 1 are traced (the first step is a warm-up)")
    return steps


def _summary(config: Config) -> str:
    """'exact (one sweep)', or the levels, coarsening, cycles and start of a hierarchy."""
    if config.levels == 1:
        return "exact (one sweep)"
    return (f"{config.levels} levels, coarsening {config.coarsening}, {config.max_iter} "
            f"cycle(s) from a {config.initial_guess} start")


class Run:
    """One `mgrit train` run on the ranks of `world` (an mpi4py communicator, or None)."""

    def __init__(self, settings: Settings, world: Any = None, resume: bool = False,
                 reset_optimizer: bool = False) -> None:
        self.settings = check(settings)
        self.world = world
        self.rank = world.Get_rank() if world is not None else 0
        self.size = world.Get_size() if world is not None else 1
        self.out = Path(settings.output.dir)
        t = settings.training
        refuse_layout(settings, self.size, resume)
        self.device = torch.device("cpu")
        if t.device != "cpu":
            index = node_rank(world)
            self.device = agreed(world, lambda: rank_device(t.device, index))
            torch.cuda.set_device(self.device)
        split = datasets.load(settings.data.name, settings.data.root, settings.data.download,
                              settings.data.test_fraction, settings.data.samples, seed=0,
                              context=settings.data.context)
        # all of it on the device at once: the data sets are small beside the network's
        # activations, and a batch is then drawn there without a copy
        self.split = dataclasses.replace(
            split, x_train=split.x_train.to(self.device), y_train=split.y_train.to(self.device),
            x_test=split.x_test.to(self.device), y_test=split.y_test.to(self.device))
        self.steps_per_epoch = steps_per_epoch(settings, self.split)
        self.layer_comm = self.data_comm = None
        if world is not None and not t.serial:
            from ..comm import split_world

            self.layer_comm, self.data_comm = split_world(world, self.size // t.data_parallel)
        self.traces = None
        comm: Any = self.layer_comm
        if settings.output.trace:
            from .step_traces import StepTraces

            self.traces = StepTraces(settings.output.trace, world, self.out,
                                     settings.as_dict())
            comm = self.traces.comm(comm)
        torch.manual_seed(t.seed)
        self.model = build_model(settings, network_for(settings, self.split), comm,
                                 self.data_comm, self.device)
        self.loss_fn = (sequence_cross_entropy if is_language_model(settings)
                        else nn.functional.cross_entropy)
        self.optimizer = make_optimizer(settings, self.model.module.parameters())
        self.generator = torch.Generator().manual_seed(t.seed)
        self.start_epoch = 1
        self.partial: dict[str, Any] | None = None   # where a checkpoint within an epoch was
        self.resuming = resume
        overwrite = settings.output.overwrite
        on_rank_zero(world, lambda: prepare_output(self.out, resume, overwrite))
        # [control] choose: a new run's solver options, picked before its first step, once
        # its output directory is known to be its own (a resumed run takes them from its
        # checkpoint)
        self.chosen: tuple[Config, Config] | None = None
        self.choice: dict[str, Any] | None = None      # its metrics record
        if settings.control.choose and not resume:
            self._choose()
        self.controller = self.model.controller(settings.control)
        if resume:
            self._resume(reset_optimizer)

    def _choose(self) -> None:
        """Train with the solver options `choose_settings` picks on the run's first batch
        (drawn from a generator of its own: the run's data order stays as it was)."""
        t = self.settings.training
        xb, yb = next(iter(batches(self.split.x_train, self.split.y_train, t.batch_size,
                                   torch.Generator().manual_seed(t.seed))))
        xb, yb = self._batch_part(xb, yb)
        start = time.perf_counter()
        chosen = self.model.choose(self.settings.control, self.loss_fn, xb, yb)
        if chosen is None:
            return
        self.chosen = chosen
        self.choice = {"type": "choice", "epoch": 0,
                       "forward": plain_options(chosen[0].describe()),
                       "backward": plain_options(chosen[1].describe()),
                       "seconds": time.perf_counter() - start}
        if self.rank == 0:
            sys.stdout.write(f"solver options chosen on the first batch: forward "
                             f"{_summary(chosen[0])}; backward {_summary(chosen[1])}\n")

    # checkpoints --------------------------------------------------------------------------
    def _resume(self, reset_optimizer: bool) -> None:
        folder = latest_checkpoint(self.out)
        optimizer = None if reset_optimizer else self.optimizer
        try:
            extra = agreed(self.world, lambda: self.model.load(folder, optimizer))
        except SettingsError as err:
            raise SettingsError(f"--resume: the checkpoint in {folder} cannot be loaded: {err}"
                                f"{intact_hint(self.out, folder.name)}") from None
        # what the resumed run's settings say now, as the restored optimizer's state had it
        t = self.settings.training
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = t.lr, t.weight_decay
            if "momentum" in group:
                group["momentum"] = t.momentum
        restore_capturable(self.optimizer, self.settings)
        self.generator.set_state(extra["generator"])
        # the random draws of the next training step (checkpoints of earlier runs, whose
        # networks had none, lack the count)
        self.model.draw_step = int(extra.get("draw_step", 0))
        solvers = extra.get("solvers")
        if solvers is not None:
            # the options the run chose before its first step; the controller starts from
            # them, as it did in that run
            self.chosen = (Config(**solvers["forward"]), Config(**solvers["backward"]))
            self.model.set_solvers(*self.chosen)
            self.controller = self.model.controller(self.settings.control)
        # the controller decides on as it would have (a checkpoint of a run without one, or
        # of an earlier version, starts it afresh)
        if self.controller is not None and "control" in extra:
            self.controller.load_state_dict(extra["control"])
        self.start_epoch = extra["epoch"] + 1
        self.partial = extra.get("partial")
        if self.rank == 0:
            sys.stdout.write(resume_notice(folder, extra["epoch"], self.partial))
        last = (extra["epoch"] * self.steps_per_epoch + self.partial["step"]
                if self.partial is not None else None)
        on_rank_zero(self.world, lambda: truncate_metrics(self.out / "metrics.jsonl",
                                                          extra["epoch"], last))

    def _save_checkpoint(self, epoch: int, partial: dict[str, Any] | None = None,
                         generator: Tensor | None = None) -> None:
        """All ranks write into a temporary folder; once all are done rank 0 renames it and
        points `latest` at it, so an interrupted run always leaves a complete checkpoint.
        `epoch` epochs are done, and with `partial` its steps of the next one, which a
        resume repeats from the data order of `generator` (its state at that epoch's start)."""
        name = checkpoint_name(epoch, partial)
        tmp = self.out / f".{name}.tmp"
        extra = {"epoch": epoch, "generator": generator if partial else self.generator.get_state(),
                 "draw_step": self.model.draw_step, "partial": partial}
        if self.controller is not None:
            extra["control"] = self.controller.state_dict()
        if self.chosen is not None:
            extra["solvers"] = {"forward": self.chosen[0].describe(),
                                "backward": self.chosen[1].describe()}
        try:
            self.model.save(tmp, self.optimizer, extra)
        except WriteError as err:   # the earlier checkpoint stays `latest`
            raise not_written(self.out, tmp, name, err, self.size == 1) from None
        if self.world is not None:
            self.world.Barrier()
        if self.rank == 0:
            publish_checkpoint(self.out, tmp, name, {
                "epoch": epoch, "ranks": self.size,
                "identity": self.settings.network_identity(),
                "settings": self.settings.as_dict()})
        if self.world is not None:
            self.world.Barrier()

    # training -----------------------------------------------------------------------------
    def _mean(self, value: float) -> float:
        if self.data_comm is None or self.data_comm.Get_size() == 1:
            return value
        return self.data_comm.allreduce(value) / self.data_comm.Get_size()

    def _batch_part(self, xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        d = self.settings.training.data_parallel
        if d == 1:
            return xb, yb
        part = len(xb) // d
        r = self.data_comm.Get_rank()
        return xb[r * part:(r + 1) * part], yb[r * part:(r + 1) * part]

    def run(self) -> dict[str, Any]:
        s = self.settings
        t, o = s.training, s.output
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "settings.json").write_text(json.dumps(s.as_dict(), indent=2))
        if self.start_epoch > t.epochs:
            if self.rank == 0:
                sys.stderr.write(f"nothing to train: the checkpoint in {self.out} is at epoch "
                                 f"{self.start_epoch - 1} and [training] epochs = {t.epochs}; "
                                 "pass a larger --epochs to train further\n")
            return {}
        # a new run starts its own metrics; a resumed one continues them (cut back to the
        # checkpoint's epoch when it was loaded)
        mode = "a" if self.resuming else "w"
        first = ((self.start_epoch - 1) * self.steps_per_epoch
                 + (self.partial["step"] if self.partial is not None else 0) + 1)
        launch = launch_record(self.world, self.device, self.start_epoch, first,
                               self.resuming)
        metrics = AppendedFile(self.out / "metrics.jsonl", mode) if self.rank == 0 else None
        if metrics is not None:
            if self.choice is not None:
                metrics.write(json.dumps(self.choice) + "\n")
            metrics.write(json.dumps(launch) + "\n")
        summary: dict[str, Any] = {}
        try:
            for epoch in range(self.start_epoch, t.epochs + 1):
                summary = self._epoch(epoch, self.steps_per_epoch, metrics)
                if o.checkpoint:
                    self._save_checkpoint(epoch)
        finally:
            if metrics is not None:
                metrics.close()
        if o.export:
            plain = self.model.to_serial()
            if plain is not None and self.device.type != "cpu":
                # exported for any machine: `torch.load` of it needs no GPU
                plain = copy.deepcopy(plain).cpu()
            if self.rank == 0 and plain is not None:
                write_atomically(self.out / "model.pt", lambda f: torch.save(plain, f))
        return summary

    def _epoch(self, epoch: int, steps: int, metrics: Any) -> dict[str, Any]:
        s, t = self.settings, self.settings.training
        # resumed within this epoch: the same data order, its first steps skipped
        begun, self.partial = self.partial or {"step": 0}, None
        epoch_start, every = self.generator.get_state(), s.output.checkpoint_every
        progress = Progress(self.rank == 0 and s.output.progress, epoch, t.epochs, steps,
                            label=s.output.label or None)
        self.model.module.train()
        start = time.perf_counter()
        losses, right, seen = begun.get("losses", []), begun.get("right", 0), begun.get("seen", 0)
        gradient_error = begun.get("gradient_error")    # measured by the latest probe
        for step, (xb, yb) in enumerate(batches(self.split.x_train, self.split.y_train,
                                                t.batch_size, self.generator), 1):
            if step > steps:            # [training] steps_per_epoch
                break
            if step <= begun["step"]:
                continue
            xb, yb = self._batch_part(xb, yb)
            ran = step - begun["step"]      # steps of this epoch this process ran (traced)
            # traced: steps 2..K+1 of the first epoch this process runs
            tracing = (self.traces is not None and epoch == self.start_epoch
                       and self.traces.begins(ran))
            mark = (lambda: self.traces.mark(f"forward{ran - 1}")) if tracing else None
            t0 = time.perf_counter()
            loss, out = self.model.train_step(self.optimizer, self.loss_fn, xb, yb, mark,
                                              self.controller)
            synchronize(self.device)
            seconds = time.perf_counter() - t0
            if tracing:
                self.traces.done(ran - 1, seconds)
            value = self._mean(float(loss))
            right += correct(out, yb)
            seen += yb.numel()
            losses.append(value)
            stats = self.model.stats
            number = (epoch - 1) * steps + step
            control = self.controller.last if self.controller is not None else {}
            if metrics is not None:
                metrics.write(json.dumps(step_record(epoch, number, value, seconds, stats,
                                                     control)) + "\n")
                if "probe" in control:
                    metrics.write(json.dumps(probe_record(epoch, number, control)) + "\n")
            if "probe" in control:
                gradient_error = control["probe"]["error"]
            configured = self.controller.base.label if self.controller is not None else None
            progress.update(step, step_fields(value, right / max(seen, 1), seconds, stats,
                                              control, configured))
            if s.output.checkpoint and every and step % every == 0 and step < steps:
                if metrics is not None:
                    metrics.flush()      # a resume keeps the records up to this step
                self._save_checkpoint(epoch - 1, {"step": step, "losses": losses, "right": right,
                                                  "seen": seen, "gradient_error": gradient_error},
                                      epoch_start)
            if s.output.verbose:
                log.info("rank %d epoch %d step %d loss %.4f", self.rank, epoch, step, value)
        train_seconds = time.perf_counter() - start
        test_loss, test_acc = evaluate(self.model.module, self.split.x_test, self.split.y_test,
                                       self.loss_fn)
        record = {"type": "epoch", "epoch": epoch, "train_loss": sum(losses) / len(losses),
                  "train_accuracy": self._mean(right / max(seen, 1)), "test_loss": test_loss,
                  "test_accuracy": test_acc, "seconds": train_seconds,
                  "seconds_per_step": train_seconds / max(len(losses), 1)}
        if self.controller is not None:
            # a stalled test loss is one of the controller's signals
            record["stalled"] = self.controller.validation(test_loss)
            record["setting"] = self.controller.setting.label
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        closing: dict[str, Any] = {"loss": record["train_loss"], "test_acc": test_acc,
                                   "ms_per_step": record["seconds_per_step"] * 1e3}
        if self.controller is not None:
            closing["setting"] = record["setting"]
            closing["gradient_error"] = gradient_error
        if is_language_model(s):
            # a language model's test loss (nats per character) says more than its
            # next-token accuracy
            closing["test_loss"] = test_loss
        progress.close(closing)
        return record
