"""The `mgrit train` job: a training run with metrics, progress, checkpoints, traces and
export; each of its steps is `loop.train_step`."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..nn import Controller, LayerParallel, draws, serial_resnet
from ..nn.blocks import ResNetSpec, conv_step, dense_step, gpt, vit
from ..nn.atomic import WriteError, write_atomically
from ..nn.checkpoint import FailedElsewhere
from . import data as datasets
from .data import batches
from .loop import correct, evaluate, sequence_cross_entropy, train_step
from .progress import Progress
from .resuming import (checkpoint_name, data_parallel_refusal, not_written, remove_leftovers,
                       resume_notice, truncate_metrics)
from .settings import TRANSFORMERS, Settings, SettingsError, check

log = logging.getLogger("mgrit.train")


# the network of a run ------------------------------------------------------------------

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}
# what a run writes into its output directory (besides checkpoint-NNNN folders)
RESULT_FILES = ("settings.json", "metrics.jsonl", "latest", "model.pt", "trace.json")
KEPT_CHECKPOINTS = 2


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


def is_language_model(settings: Settings) -> bool:
    """Whether the run predicts the next token at every position (outputs (batch, tokens,
    vocabulary) against targets (batch, tokens)) rather than one class per example."""
    return settings.network.kind == "gpt"


def make_optimizer(settings: Settings, params) -> torch.optim.Optimizer:
    t = settings.training
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def results_in(folder: Path) -> list[Path]:
    """The files and folders of a run's results in `folder`."""
    if not folder.is_dir():
        return []
    named = [folder / n for n in RESULT_FILES if (folder / n).exists()]
    return named + sorted(folder.glob("checkpoint-*"))


def refuse_used(folder: Path, overwrite: bool) -> None:
    """The error for a folder that holds another run's results, unless `overwrite`."""
    results = results_in(folder)
    if results and not overwrite:
        names = ", ".join(p.name for p in results[:4]) + (", ..." if len(results) > 4 else "")
        raise SettingsError(f"{folder} holds the results of another run ({names}); pass "
                            "--resume to continue it, --overwrite to replace it, or choose "
                            "another output directory")


# the job -------------------------------------------------------------------------------

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
        if t.serial and self.size > 1:
            raise SettingsError("[training] serial = true trains in one process; launch it "
                                "without mpiexec (or with -n 1)")
        if self.size % t.data_parallel:
            raise SettingsError(data_parallel_refusal(t.data_parallel, self.size, resume))
        if t.batch_size % t.data_parallel:
            raise SettingsError(f"[training] batch_size = {t.batch_size} must be a multiple of "
                                f"data_parallel = {t.data_parallel}")
        trace = settings.output.trace
        if trace and (t.serial or t.data_parallel > 1):
            raise SettingsError(f"[output] trace = {trace}: traces record layer-parallel "
                                "training without data parallelism (training.serial = false, "
                                "training.data_parallel = 1)")
        self.split = datasets.load(settings.data.name, settings.data.root,
                                   settings.data.download, settings.data.test_fraction,
                                   settings.data.samples, seed=0, context=settings.data.context)
        if len(self.split.x_test) == 0:
            raise SettingsError(f"[data] context = {settings.data.context} leaves no window "
                                f"in the test part of {settings.data.name}: choose a shorter "
                                "context")
        steps = len(self.split.x_train) // t.batch_size
        if steps == 0:
            raise SettingsError(f"[training] batch_size = {t.batch_size} is larger than the "
                                f"{len(self.split.x_train)} training examples of "
                                f"{settings.data.name}: an epoch would have no step")
        if t.steps_per_epoch:
            steps = min(steps, t.steps_per_epoch)
        self.steps_per_epoch = steps
        if trace and trace >= steps:
            raise SettingsError(f"[output] trace = {trace}: the first epoch has {steps} steps; "
                                "at most steps - 1 are traced (the first step is a warm-up)")
        self.layer_comm = self.data_comm = None
        if world is not None and not t.serial:
            from ..comm import split_world

            self.layer_comm, self.data_comm = split_world(world, self.size // t.data_parallel)
        self.tracer = None
        comm: Any = self.layer_comm
        if trace:
            from ..comm import SerialComm
            from ..comm.mpi import MPIComm
            from ..comm.tracing import Tracer, TracingComm

            self.tracer = Tracer()
            comm = TracingComm(MPIComm(comm) if comm is not None else SerialComm(), self.tracer)
        self.traced_steps: list[float] = []
        torch.manual_seed(t.seed)
        net = network_for(settings, self.split)
        if t.serial:
            self.model: nn.Module = serial_resnet(net.step, net.num_steps, net.t_final,
                                                  net.opening, net.closing)
        else:
            try:
                self.model = LayerParallel(net.step, net.num_steps, net.t_final,
                                           settings.solver("forward"),
                                           settings.solver("backward"), comm=comm,
                                           opening=net.opening, closing=net.closing,
                                           data_comm=self.data_comm if t.data_parallel > 1
                                           else None, seed=t.seed)
            except (ValueError, TypeError) as err:
                # its checks see the same settings on every rank (or agree across them)
                raise SettingsError(str(err)) from None
        self.controller: Controller | None = None
        c = settings.control
        if c.enabled and isinstance(self.model, LayerParallel):
            self.controller = Controller(self.model, c.threshold, c.every, c.max_every,
                                         c.max_cycles, c.batching, c.warm)
        self.optimizer = make_optimizer(settings, self.model.parameters())
        self.generator = torch.Generator().manual_seed(t.seed)
        self.loss_fn = (sequence_cross_entropy if is_language_model(settings)
                        else nn.functional.cross_entropy)
        # serial training draws the dropout masks of the layer-parallel network's training
        # step of the same number (keyed by the seed and the step): both train the same
        # network, and a resumed run continues the draws (the count is checkpointed)
        self.keyed_draws = (t.serial and settings.network.kind in TRANSFORMERS
                            and settings.network.dropout > 0)
        self.draw_step = 0
        self.start_epoch = 1
        self.partial: dict[str, Any] | None = None   # where a checkpoint within an epoch was
        self.resuming = resume
        self._check_output(resume)
        if resume:
            self._resume(reset_optimizer)

    # file system ------------------------------------------------------------------------
    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run fn on rank 0 and hand its result (or its error) to every rank."""
        result: Any = None
        if self.rank == 0:
            try:
                result = ("ok", fn())
            except (OSError, SettingsError) as err:  # raised again below, on every rank
                result = ("error", isinstance(err, SettingsError), str(err))
        if self.world is not None:
            result = self.world.bcast(result if self.rank == 0 else None, root=0)
        if result[0] == "error":
            raise (SettingsError if result[1] else OSError)(result[2])
        return result[1]

    def _results(self) -> list[Path]:
        return results_in(self.out)

    def _check_output(self, resume: bool) -> None:
        overwrite = self.settings.output.overwrite

        def check() -> None:
            if resume and overwrite:
                raise SettingsError("--resume continues the run in the output directory and "
                                    "--overwrite replaces it: choose one")
            existed = self.out.exists()
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                probe = self.out / f".write-test-{os.getpid()}"
                probe.write_text("")
                probe.unlink()
            except OSError as err:
                raise OSError(f"output directory {self.out} cannot be written: {err}") from None
            finally:
                if not existed and self.out.exists() and not any(self.out.iterdir()):
                    self.out.rmdir()
            if resume and not (self.out / "latest").exists():
                raise SettingsError(f"--resume: no checkpoint in {self.out} (no 'latest' file)")
            if not resume:
                refuse_used(self.out, overwrite)
                for path in self._results():      # --overwrite: the other run's results only
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
            # before a resume rewrites metrics.jsonl, which may need the room they take
            remove_leftovers(self.out)
        self._collective(check)

    def _checkpoint_dir(self) -> Path:
        return self.out / (self.out / "latest").read_text().strip()

    def _agreed(self, fn: Callable[[], Any]) -> Any:
        """fn() on every rank; if it fails on any, the same SettingsError on every rank,
        naming each failed rank and its error (so that one rank's unreadable file ends
        all ranks with its message, not with a hang or a bare abort)."""
        try:
            result, error = fn(), None
        except Exception as err:   # handed to every rank below, then raised there
            text = (str(err) if isinstance(err, (SettingsError, OSError, ValueError))
                    else f"{type(err).__name__}: {err}")
            # a rank that only learnt that another failed adds nothing to that rank's message
            result, error = None, (text, isinstance(err, FailedElsewhere))
        errors = self.world.allgather(error) if self.world is not None else [error]
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        if self.size == 1:
            raise SettingsError(failed[0][1][0])
        told = [(r, text) for r, (text, elsewhere) in failed if not elsewhere] or \
            [(r, text) for r, (text, _) in failed]
        by_message: dict[str, list[int]] = {}
        for r, text in told:
            by_message.setdefault(text, []).append(r)
        raise SettingsError("; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}"
            for m, rs in by_message.items()))

    def _resume(self, reset_optimizer: bool) -> None:
        folder = self._checkpoint_dir()
        optimizer = None if reset_optimizer else self.optimizer

        def load() -> dict[str, Any]:
            if isinstance(self.model, LayerParallel):
                return self.model.load_checkpoint(folder, optimizer)
            path = folder / "serial.pt"
            try:
                state = torch.load(path, weights_only=False)
            except FileNotFoundError:
                raise OSError(f"no checkpoint file {path}") from None
            except Exception as err:
                raise ValueError(f"{path} cannot be read ({type(err).__name__}: {err}): it is "
                                 "truncated or corrupt") from None
            self.model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(state["optimizer"])
            return state["extra"]

        try:
            extra = self._agreed(load)
        except SettingsError as err:
            raise SettingsError(f"--resume: the checkpoint in {folder} cannot be loaded: {err}"
                                f"{self._intact_hint(folder.name)}") from None
        # what the resumed run's settings say now, as the restored optimizer's state had it
        t = self.settings.training
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = t.lr, t.weight_decay
            if "momentum" in group:
                group["momentum"] = t.momentum
        self.generator.set_state(extra["generator"])
        # the random draws of the next training step (checkpoints of earlier runs, whose
        # networks had none, lack the count)
        self._set_draw_step(int(extra.get("draw_step", 0)))
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
        self._collective(lambda: truncate_metrics(self.out / "metrics.jsonl", extra["epoch"],
                                                  last))

    def _intact_hint(self, bad: str) -> str:
        earlier = sorted(p.name for p in self.out.glob("checkpoint-*") if p.name < bad)
        if not earlier:
            return ""
        return (f". The earlier checkpoint {self.out / earlier[-1]} is kept: to resume from "
                f"it, write its name into {self.out / 'latest'} (echo {earlier[-1]} > "
                f"{self.out / 'latest'}) and resume again")

    def _save_checkpoint(self, epoch: int, partial: dict[str, Any] | None = None,
                         generator: Tensor | None = None) -> None:
        """All ranks write into a temporary folder; once all are done rank 0 renames it and
        points `latest` at it, so an interrupted run always leaves a complete checkpoint.
        `epoch` epochs are done, and with `partial` its steps of the next one, which a
        resume repeats from the data order of `generator` (its state at that epoch's start)."""
        name = checkpoint_name(epoch, partial)
        tmp = self.out / f".{name}.tmp"
        extra = {"epoch": epoch, "generator": generator if partial else self.generator.get_state(),
                 "draw_step": self._get_draw_step(), "partial": partial}
        if self.controller is not None:
            extra["control"] = self.controller.state_dict()
        try:
            if isinstance(self.model, LayerParallel):
                self.model.save_checkpoint(tmp, self.optimizer, **extra)
            else:
                tmp.mkdir(parents=True, exist_ok=True)
                state = {"model": self.model.state_dict(),
                         "optimizer": self.optimizer.state_dict(), "extra": extra}
                write_atomically(tmp / "serial.pt", lambda f: torch.save(state, f))
        except WriteError as err:   # the earlier checkpoint stays `latest`
            raise not_written(self.out, tmp, name, err, self.size == 1) from None
        if self.world is not None:
            self.world.Barrier()
        if self.rank == 0:
            meta = {"epoch": epoch, "ranks": self.size,
                    "identity": self.settings.network_identity(),
                    "settings": self.settings.as_dict()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            final = self.out / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest = self.out / ".latest.tmp"
            latest.write_text(name)
            os.replace(latest, self.out / "latest")
            # the previous checkpoint stays: if the newest turns out unreadable (a disk
            # that lost it), there is one to go back to
            for old in sorted(self.out.glob("checkpoint-*"))[:-KEPT_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
        if self.world is not None:
            self.world.Barrier()

    # training -----------------------------------------------------------------------------
    def _get_draw_step(self) -> int:
        """Training forward passes so far: the random draws of the next one."""
        if isinstance(self.model, LayerParallel):
            return self.model.draw_step
        return self.draw_step

    def _set_draw_step(self, step: int) -> None:
        if isinstance(self.model, LayerParallel):
            self.model.draw_step = step
        else:
            self.draw_step = step

    def _train_step(self, xb: Tensor, yb: Tensor, mark: Callable[[], None] | None
                    ) -> tuple[Tensor, Tensor]:
        """`train_step` on the batch; a serial network with dropout draws under the key of
        this training step (see `keyed_draws`)."""
        if not self.keyed_draws:
            return train_step(self.model, self.optimizer, self.loss_fn, xb, yb, mark,
                              self.controller)
        with draws(self.settings.training.seed, self.draw_step):
            result = train_step(self.model, self.optimizer, self.loss_fn, xb, yb, mark)
        self.draw_step += 1
        return result

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
        metrics = open(self.out / "metrics.jsonl", mode) if self.rank == 0 else None
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
            self._export()
        return summary

    def _epoch(self, epoch: int, steps: int, metrics: Any) -> dict[str, Any]:
        s, t = self.settings, self.settings.training
        # resumed within this epoch: the same data order, its first steps skipped
        begun, self.partial = self.partial or {"step": 0}, None
        epoch_start, every = self.generator.get_state(), s.output.checkpoint_every
        progress = Progress(self.rank == 0 and s.output.progress, epoch, t.epochs, steps,
                            label=s.output.label or None)
        self.model.train()
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
            tracing = self._trace_step(epoch, ran)
            mark = (lambda: self.tracer.mark(f"forward{ran - 1}")) if tracing else None
            t0 = time.perf_counter()
            loss, out = self._train_step(xb, yb, mark)
            seconds = time.perf_counter() - t0
            if tracing:
                self._traced(ran - 1, seconds)
            value = self._mean(float(loss))
            right += correct(out, yb)
            seen += yb.numel()
            losses.append(value)
            stats = getattr(self.model, "stats", {})
            number = (epoch - 1) * steps + step
            record = {"type": "step", "epoch": epoch, "step": number,
                      "loss": value, "seconds": seconds,
                      "forward_residuals": stats.get("forward", {}).get("residuals", []),
                      "backward_residuals": stats.get("backward", {}).get("residuals", [])}
            control = self.controller.last if self.controller is not None else {}
            if control:
                record["control"] = {k: control[k] for k in
                                     ("setting", "forward_cycles", "backward_cycles",
                                      "levels", "estimate")}
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                if "probe" in control:
                    metrics.write(json.dumps(probe_record(epoch, number, control)) + "\n")
            fields: dict[str, Any] = {"loss": value, "acc": right / max(seen, 1)}
            for kind in ("forward", "backward"):
                if kind in stats:
                    fields[f"{kind}_cycles"] = stats[kind]["iterations"]
                    residuals = stats[kind]["residuals"]
                    fields[f"{kind}_residual"] = residuals[-1] if residuals else None
            if "probe" in control:
                gradient_error = control["probe"]["error"]
            if control and control["setting"] != self.controller.base.label:
                # the fwd and bwd pieces show the cycles; the controller's setting (and its
                # error) once it differs from the configured one
                fields["setting"] = control["setting"]
                fields["gradient_error"] = (control["probe"]["error"] if "probe" in control
                                            else control["estimate"])
            fields["ms_per_step"] = seconds * 1e3
            progress.update(step, fields)
            if s.output.checkpoint and every and step % every == 0 and step < steps:
                if metrics is not None:
                    metrics.flush()      # a resume keeps the records up to this step
                self._save_checkpoint(epoch - 1, {"step": step, "losses": losses, "right": right,
                                                  "seen": seen, "gradient_error": gradient_error},
                                      epoch_start)
            if s.output.verbose:
                log.info("rank %d epoch %d step %d loss %.4f", self.rank, epoch, step, value)
        train_seconds = time.perf_counter() - start
        test_loss, test_acc = evaluate(self.model, self.split.x_test, self.split.y_test,
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

    # tracing (output.trace = K: steps 2..K+1 of the first epoch this process runs) -------
    def _trace_step(self, epoch: int, step: int) -> bool:
        """Whether this step is traced; the tracer starts at the first traced step."""
        k = self.settings.output.trace
        if self.tracer is None or epoch != self.start_epoch or not 2 <= step <= k + 1:
            return False
        if step == 2:
            self.tracer.start()
        return True

    def _traced(self, k: int, seconds: float) -> None:
        """Traced step k done: mark it; after the last, gather every rank's trace and write
        OUT/trace.json on rank 0 (write, then rename)."""
        from .replay import save_traces

        self.tracer.mark(f"step{k}")
        self.traced_steps.append(seconds)
        if k < self.settings.output.trace:
            return
        events = self.tracer.stop()
        traces = self.world.gather(events, root=0) if self.world is not None else [events]
        if self.rank == 0:
            tmp = self.out / ".trace.json.tmp"
            save_traces(tmp, traces, ranks=self.size, clock="wall", first_step=2,
                        step_seconds=self.traced_steps, settings=self.settings.as_dict())
            tmp.replace(self.out / "trace.json")

    def _export(self) -> None:
        plain = (self.model.to_serial() if isinstance(self.model, LayerParallel)
                 else self.model)
        if self.rank == 0 and plain is not None:
            write_atomically(self.out / "model.pt", lambda f: torch.save(plain, f))
