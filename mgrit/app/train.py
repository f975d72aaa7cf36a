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

from ..nn import LayerParallel, serial_resnet
from ..nn.blocks import ResNetSpec, conv_step, dense_step
from . import data as datasets
from .data import batches
from .loop import evaluate, train_step
from .settings import Settings, SettingsError

log = logging.getLogger("mgrit.train")


# the network of a run ------------------------------------------------------------------

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def network_for(settings: Settings, split: datasets.Split) -> ResNetSpec:
    """Opening, step and closing for the data's shape and the [network] settings."""
    net = settings.network
    shape = split.feature_shape
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


def make_optimizer(settings: Settings, params) -> torch.optim.Optimizer:
    t = settings.training
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


# progress ------------------------------------------------------------------------------

class Progress:
    """One line per epoch on rank 0: a bar redrawn in place on a terminal, else the final
    line only."""

    def __init__(self, enabled: bool, epoch: int, epochs: int, total: int) -> None:
        self.enabled, self.epoch, self.epochs, self.total = enabled, epoch, epochs, total
        self.tty = sys.stderr.isatty()

    def _line(self, done: int, fields: str) -> str:
        width = 24
        filled = int(width * done / max(self.total, 1))
        return (f"epoch {self.epoch}/{self.epochs} [{'#' * filled}{'.' * (width - filled)}] "
                f"{done}/{self.total} {fields}")

    def update(self, done: int, fields: str) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r" + self._line(done, fields)[:160].ljust(160))
            sys.stderr.flush()

    def close(self, fields: str) -> None:
        if self.enabled:
            sys.stderr.write(("\r" if self.tty else "") + self._line(self.total, fields) + "\n")
            sys.stderr.flush()


def _fmt(residuals: list[float]) -> str:
    return f"{residuals[-1]:.1e}" if residuals else "-"


# the job -------------------------------------------------------------------------------

class Run:
    """One `mgrit train` run on the ranks of `world` (an mpi4py communicator, or None)."""

    def __init__(self, settings: Settings, world: Any = None, resume: bool = False) -> None:
        self.settings = settings
        self.world = world
        self.rank = world.Get_rank() if world is not None else 0
        self.size = world.Get_size() if world is not None else 1
        self.out = Path(settings.output.dir)
        t = settings.training
        if t.serial and self.size > 1:
            raise SettingsError("[training] serial = true trains in one process; launch it "
                                "without mpiexec (or with -n 1)")
        if self.size % t.data_parallel:
            raise SettingsError(f"[training] data_parallel = {t.data_parallel} must divide the "
                                f"{self.size} ranks")
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
                                   settings.data.samples, seed=0)
        self.steps_per_epoch = steps = len(self.split.x_train) // t.batch_size
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
            self.model = LayerParallel(net.step, net.num_steps, net.t_final,
                                       settings.solver("forward"), settings.solver("backward"),
                                       comm=comm, opening=net.opening,
                                       closing=net.closing,
                                       data_comm=self.data_comm if t.data_parallel > 1 else None)
        self.optimizer = make_optimizer(settings, self.model.parameters())
        self.generator = torch.Generator().manual_seed(t.seed)
        self.loss_fn = nn.functional.cross_entropy
        self.start_epoch = 1
        self._check_output(resume)
        if resume:
            self._resume()

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

    def _check_output(self, resume: bool) -> None:
        def check() -> None:
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
        self._collective(check)

    def _checkpoint_dir(self) -> Path:
        return self.out / (self.out / "latest").read_text().strip()

    def _resume(self) -> None:
        folder = self._checkpoint_dir()
        meta = json.loads((folder / "meta.json").read_text())
        mine = json.loads(json.dumps(self.settings.network_identity()))
        if meta["identity"] != mine:
            diff = [k for k in mine if meta["identity"].get(k) != mine[k]]
            raise SettingsError(f"--resume: the checkpoint in {folder} is of a different "
                                f"network or run: {', '.join(diff)} differ")
        if meta["ranks"] != self.size:
            raise SettingsError(f"--resume: the checkpoint was written by {meta['ranks']} ranks, "
                                f"this run has {self.size}")
        if isinstance(self.model, LayerParallel):
            extra = self.model.load_checkpoint(folder, self.optimizer)
        else:
            state = torch.load(folder / "serial.pt", weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            extra = state["extra"]
        self.generator.set_state(extra["generator"])
        self.start_epoch = meta["epoch"] + 1
        if self.rank == 0:
            self._truncate_metrics(meta["epoch"])

    def _truncate_metrics(self, epoch: int) -> None:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        kept = [line for line in path.read_text().splitlines()
                if line and json.loads(line)["epoch"] <= epoch]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)

    def _save_checkpoint(self, epoch: int) -> None:
        """All ranks write into a temporary folder; once all are done rank 0 renames it and
        points `latest` at it, so an interrupted run always leaves a complete checkpoint."""
        name = f"checkpoint-{epoch:04d}"
        tmp = self.out / f".{name}.tmp"
        extra = {"epoch": epoch, "generator": self.generator.get_state()}
        if isinstance(self.model, LayerParallel):
            self.model.save_checkpoint(tmp, self.optimizer, **extra)
        else:
            tmp.mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.model.state_dict(),
                        "optimizer": self.optimizer.state_dict(), "extra": extra},
                       tmp / "serial.pt")
        if self.world is not None:
            self.world.Barrier()
        if self.rank == 0:
            meta = {"epoch": epoch, "ranks": self.size,
                    "identity": self.settings.network_identity()}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            final = self.out / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest = self.out / ".latest.tmp"
            latest.write_text(name)
            os.replace(latest, self.out / "latest")
            for old in self.out.glob("checkpoint-*"):
                if old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
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
            for stale in self.out.glob(".checkpoint-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            (self.out / ".trace.json.tmp").unlink(missing_ok=True)
        metrics = open(self.out / "metrics.jsonl", "a") if self.rank == 0 else None
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
        progress = Progress(self.rank == 0 and s.output.progress, epoch, t.epochs, steps)
        self.model.train()
        start = time.perf_counter()
        losses, correct, seen = [], 0, 0
        for step, (xb, yb) in enumerate(batches(self.split.x_train, self.split.y_train,
                                                t.batch_size, self.generator), 1):
            xb, yb = self._batch_part(xb, yb)
            tracing = self._trace_step(epoch, step)
            mark = (lambda: self.tracer.mark(f"forward{step - 1}")) if tracing else None
            t0 = time.perf_counter()
            loss, out = train_step(self.model, self.optimizer, self.loss_fn, xb, yb, mark)
            seconds = time.perf_counter() - t0
            if tracing:
                self._traced(step - 1, seconds)
            value = self._mean(float(loss))
            correct += int((out.argmax(1) == yb).sum())
            seen += len(yb)
            losses.append(value)
            stats = getattr(self.model, "stats", {})
            record = {"type": "step", "epoch": epoch, "step": (epoch - 1) * steps + step,
                      "loss": value, "seconds": seconds,
                      "forward_residuals": stats.get("forward", {}).get("residuals", []),
                      "backward_residuals": stats.get("backward", {}).get("residuals", [])}
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
            progress.update(step, f"loss {value:.4f} acc {correct / max(seen, 1) * 100:.1f}% "
                                  f"res f {_fmt(record['forward_residuals'])} "
                                  f"b {_fmt(record['backward_residuals'])} "
                                  f"{seconds * 1e3:.1f} ms/step")
            if s.output.verbose:
                log.info("rank %d epoch %d step %d loss %.4f", self.rank, epoch, step, value)
        train_seconds = time.perf_counter() - start
        test_loss, test_acc = evaluate(self.model, self.split.x_test, self.split.y_test,
                                       self.loss_fn)
        record = {"type": "epoch", "epoch": epoch, "train_loss": sum(losses) / len(losses),
                  "train_accuracy": self._mean(correct / max(seen, 1)), "test_loss": test_loss,
                  "test_accuracy": test_acc, "seconds": train_seconds,
                  "seconds_per_step": train_seconds / max(len(losses), 1)}
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        progress.close(f"loss {record['train_loss']:.4f} test acc {test_acc * 100:.2f}% "
                       f"{record['seconds_per_step'] * 1e3:.1f} ms/step")
        return record

    # tracing (output.trace = K: steps 2..K+1 of the first epoch) -------------------------
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
            tmp = self.out / ".model.pt.tmp"
            torch.save(plain, tmp)
            os.replace(tmp, self.out / "model.pt")
