"""Settings of a training run: sections of typed keys, read from TOML or YAML and overridden
by command-line flags. Every key is checked; an unknown key or value names the valid ones."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..core.config import Config
from ..nn import controller
from ..nn.defaults import training_options
from .data import IMAGE_SHAPES, TEXTS

DATASETS = ("digits", "peaks", "mnist1d", "mnist", "fashion-mnist", "cifar10", "topics")
NETWORKS = ("dense", "conv", "gpt", "vit")
# networks of transformer blocks: their [network] heads and dropout apply
TRANSFORMERS = ("gpt", "vit")
ACTIVATIONS = ("tanh", "relu", "sigmoid")
OPTIMIZERS = ("sgd", "adam")


class SettingsError(ValueError):
    """A setting that is unknown, of the wrong type, or out of range."""


@dataclass
class DataSettings:
    name: str = "digits"            # one of DATASETS
    root: str = "data"              # where torchvision data sets live / are downloaded to
    download: bool = False          # let torchvision download missing data
    test_fraction: float = 0.3      # held-out part for digits, peaks, mnist1d
    samples: int = 5000             # generated examples for peaks and mnist1d
    context: int = 64               # characters per window of topics (a gpt's context)


@dataclass
class NetworkSettings:
    kind: str = "dense"             # dense: Linear steps; conv: 3x3 Conv2d steps (images);
                                    # gpt: causal transformer blocks (text); vit: transformer
                                    # blocks on image patches
    width: int = 32                 # state size of dense steps, model width of gpt and vit
    channels: int = 8               # channels of conv steps
    steps: int = 32                 # layers N (time steps; the blocks of gpt and vit)
    t_final: float = 1.0            # T; the step size is h = T / N
    activation: str = "tanh"        # activation inside dense steps
    heads: int = 4                  # attention heads of gpt and vit (they divide width)
    dropout: float = 0.0            # dropout of gpt and vit blocks (keyed draws)
    patch: int = 2                  # vit: side of the square image patches (the tokens)


@dataclass
class TrainingSettings:
    epochs: int = 10
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9           # SGD momentum
    weight_decay: float = 0.0
    seed: int = 0
    steps_per_epoch: int = 0        # optimizer steps per epoch; 0: one pass over the data
    data_parallel: int = 1          # replicas; ranks / data_parallel ranks hold the layers
    serial: bool = False            # train the plain network with autograd (the baseline)
    device: str = "cpu"             # cpu; cuda: each rank a GPU of its node (its index
                                    # there modulo the node's GPUs); cuda:N: GPU N on every rank
    # every training step on static buffers, without host reads: on CUDA captured as CUDA
    # graphs and replayed (mgrit.nn.CapturedStep; a serial network's step as one graph),
    # elsewhere the same step run eagerly
    capture: bool = False


@dataclass
class OutputSettings:
    dir: str = "out"
    checkpoint: bool = True         # write a checkpoint after every epoch
    checkpoint_every: int = 0       # ... and every this many training steps (0: epochs only)
    export: bool = True             # write the exported serial model at the end
    progress: bool = True           # progress bar on rank 0
    verbose: bool = False           # every rank logs its own progress
    trace: int = 0                  # record this many training steps to OUT/trace.json
    overwrite: bool = False         # replace the results of another run in dir
    label: str = ""                 # prefixes the progress lines (mgrit compare: the run)


@dataclass
class ControlSettings:
    enabled: bool = True            # measure the gradients' error and control the solvers
    threshold: float = controller.THRESHOLD   # relative gradient error to stay below
    every: int = controller.EVERY   # steps between probes at first
    max_every: int = controller.MAX_EVERY     # ... and at most
    max_cycles: int = controller.MAX_CYCLES   # most cycles of either pass
    # the cost model's batched-call gain; 0: prices measured on the run's own layers and
    # batch at the first probe (`mgrit.nn.calibrate`), kept in checkpoints
    batching: float = 0.0
    warm: bool = True               # try warm starts; kept where they cut the error
    # before the first step, train with the solver options `mgrit.nn.choose_settings` picks
    # on the first batch within `threshold` (timed against exact stepping, either pass
    # exact included); a resumed run keeps the options its checkpoint was written with
    choose: bool = False


def plain_options(options: dict[str, Any]) -> dict[str, Any]:
    """Solver options as settings and metrics records hold them: per-level values as
    lists, as a TOML, YAML or JSON file writes them."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in options.items()}


SOLVER_DEFAULTS = {direction: plain_options(training_options(direction))
                   for direction in ("forward", "backward")}
SOLVER_KEYS = tuple(f.name for f in fields(Config))


@dataclass
class Settings:
    data: DataSettings = field(default_factory=DataSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    control: ControlSettings = field(default_factory=ControlSettings)
    forward: dict[str, Any] = field(default_factory=lambda: dict(SOLVER_DEFAULTS["forward"]))
    backward: dict[str, Any] = field(default_factory=lambda: dict(SOLVER_DEFAULTS["backward"]))

    def solver(self, kind: str) -> Config:
        """The mgrit.Config of the forward or backward solve."""
        values = dict(getattr(self, kind))
        for key in ("coarsening", "relax"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        try:
            return Config(**values)
        except (TypeError, ValueError) as err:
            raise SettingsError(f"[{kind}] {err}") from None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def explicit(self) -> set[tuple[str, str]]:
        """The (section, key) pairs a settings file or an override gave, as opposed to the
        defaults: a resumed run takes these from the command line and the rest from its
        checkpoint."""
        return self.__dict__.setdefault("_explicit", set())

    def network_identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: data, network and solvers."""
        d = self.as_dict()
        return {"data": {k: d["data"][k]
                         for k in ("name", "test_fraction", "samples", "context")},
                "network": d["network"], "forward": d["forward"], "backward": d["backward"],
                "serial": d["training"]["serial"],
                "data_parallel": d["training"]["data_parallel"]}


SECTIONS = {"data": DataSettings, "network": NetworkSettings, "training": TrainingSettings,
            "output": OutputSettings, "control": ControlSettings}
CHOICES = {("data", "name"): DATASETS, ("network", "kind"): NETWORKS,
           ("network", "activation"): ACTIVATIONS, ("training", "optimizer"): OPTIMIZERS}
POSITIVE = {("data", "samples"), ("data", "context"), ("network", "width"),
            ("network", "channels"), ("network", "steps"), ("network", "heads"),
            ("network", "patch"), ("training", "epochs"), ("training", "batch_size"),
            ("training", "data_parallel"), ("control", "every"), ("control", "max_every"),
            ("control", "max_cycles")}


def _coerce(section: str, key: str, value: Any, kind: Any) -> Any:
    """Check (and where harmless convert) a value against the key's declared type."""
    where = f"[{section}] {key}"
    if kind is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{where} must be true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingsError(f"{where} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingsError(f"{where} must be a number, got {value!r}")
        value = float(value)
    elif kind is str and not isinstance(value, str):
        raise SettingsError(f"{where} must be a string, got {value!r}")
    choices = CHOICES.get((section, key))
    if choices is not None and value not in choices:
        raise SettingsError(f"{where} = {value!r} is not valid; choose one of "
                            f"{', '.join(map(repr, choices))}")
    if (section, key) in POSITIVE and value < 1:
        raise SettingsError(f"{where} must be >= 1, got {value}")
    if (section, key) == ("data", "test_fraction") and not 0 < value < 1:
        raise SettingsError(f"{where} must lie in (0, 1), got {value}")
    if (section, key) in (("output", "trace"), ("output", "checkpoint_every")) and value < 0:
        raise SettingsError(f"{where} must be >= 0 (training steps), got {value}")
    if (section, key) == ("training", "device") and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise SettingsError(f"{where} = {value!r} is not valid; choose 'cpu', 'cuda' (each "
                            "rank a GPU of its node) or 'cuda:N' (GPU N)")
    if kind is float and not math.isfinite(value):
        raise SettingsError(f"{where} must be a finite number, got {value}")
    if (section, key) == ("training", "lr") and not value > 0:
        raise SettingsError(f"{where} must be > 0, got {value}")
    if (section, key) == ("network", "t_final") and not value > 0:
        raise SettingsError(f"{where} must be > 0, got {value}")
    if (section, key) == ("training", "momentum") and not 0 <= value < 1:
        raise SettingsError(f"{where} must lie in [0, 1), got {value}")
    if (section, key) == ("training", "weight_decay") and value < 0:
        raise SettingsError(f"{where} must be >= 0, got {value}")
    if (section, key) == ("training", "steps_per_epoch") and value < 0:
        raise SettingsError(f"{where} must be >= 0 (0: one pass over the data), got {value}")
    if (section, key) == ("network", "dropout") and not 0 <= value < 1:
        raise SettingsError(f"{where} must lie in [0, 1), got {value}")
    if (section, key) == ("control", "threshold") and not value > 0:
        raise SettingsError(f"{where} must be > 0, got {value}")
    if (section, key) == ("control", "batching") and value < 0:
        raise SettingsError(f"{where} must be >= 0 (0: prices measured on the run's own "
                            f"layers), got {value}")
    return value


def check(settings: Settings) -> Settings:
    """The checks that involve more than one key: the network against the data, the
    transformer's shape and the probe intervals. They need no data loaded, so a run refuses
    such settings before anything is read or written. They apply to a run's final settings
    (a resumed run's come from its checkpoint), not to a file or flags alone. Returns
    `settings`."""
    name, net = settings.data.name, settings.network
    kind = net.kind
    if kind == "gpt" and name not in TEXTS:
        raise SettingsError(f"[network] kind = 'gpt' is a language model: it needs text data "
                            f"([data] name = {' or '.join(map(repr, TEXTS))}), not {name!r}")
    if name in TEXTS and kind != "gpt":
        raise SettingsError(f"[data] name = {name!r} is text (token ids): train it with "
                            f"[network] kind = 'gpt', not {kind!r}")
    if kind in ("conv", "vit") and name not in IMAGE_SHAPES:
        raise SettingsError(f"[network] kind = {kind!r} needs image data (C, H, W): "
                            f"{', '.join(map(repr, IMAGE_SHAPES))}, not {name!r}")
    if kind in TRANSFORMERS and net.width % net.heads:
        raise SettingsError(f"[network] width = {net.width} must be a multiple of heads = "
                            f"{net.heads} (each head takes width / heads of the state)")
    control = settings.control
    if control.max_every < control.every:
        raise SettingsError(f"[control] max_every = {control.max_every} must be at least "
                            f"every = {control.every} (the probe interval grows from every "
                            "to max_every)")
    if settings.output.checkpoint_every and not settings.output.checkpoint:
        raise SettingsError(f"[output] checkpoint_every = {settings.output.checkpoint_every} "
                            "asks for checkpoints and checkpoint = false (--no-checkpoint) "
                            "for none: choose one")
    if settings.training.capture:
        _check_capture(settings)
    if kind == "vit":
        size = IMAGE_SHAPES[name][-1]
        if size % net.patch:
            raise SettingsError(f"[network] patch = {net.patch} must divide the {size}x{size} "
                                f"images of {name} (the patches tile the image)")
    return settings


def _check_capture(settings: Settings) -> None:
    """What a captured training step cannot hold, refused with the setting to change."""
    net = settings.network
    if net.kind in TRANSFORMERS and net.dropout > 0:
        raise SettingsError(f"[training] capture = true and [network] dropout = {net.dropout}: "
                            "dropout's keys are made on the host for every step, which a "
                            "replayed graph would repeat; use dropout = 0 or no capture")
    if settings.output.trace:
        raise SettingsError(f"[training] capture = true and [output] trace = "
                            f"{settings.output.trace}: a trace marks the end of each "
                            "forward pass, inside the captured step; trace without capture")
    if settings.training.serial:
        return
    for kind in ("forward", "backward"):
        solver = settings.solver(kind)
        if solver.tol != 0.0:
            raise SettingsError(f"[training] capture = true and [{kind}] tol = {solver.tol}: "
                                f"a captured step runs max_iter cycles, with no residual "
                                f"read between them; set {kind}.tol = 0")
        if solver.cuda_graphs:
            raise SettingsError(f"[training] capture = true and [{kind}] cuda_graphs = true: "
                                "the captured step is captured whole, and graphs do not "
                                f"nest; set {kind}.cuda_graphs = false")


def _field_type(cls: type, key: str) -> Any:
    hints = {"str": str, "int": int, "float": float, "bool": bool}
    annotation = {f.name: f.type for f in fields(cls)}[key]
    return hints.get(annotation, annotation) if isinstance(annotation, str) else annotation


def apply(settings: Settings, values: dict[str, Any]) -> Settings:
    """Settings with the nested `values` ({section: {key: value}}) applied and checked."""
    for section, entries in values.items():
        if section in ("forward", "backward"):
            if not isinstance(entries, dict):
                raise SettingsError(f"[{section}] must be a table of solver options")
            solver = getattr(settings, section)
            for key, value in entries.items():
                if key not in SOLVER_KEYS:
                    raise SettingsError(f"unknown key {key!r} in [{section}]; valid keys: "
                                        f"{', '.join(SOLVER_KEYS)}")
                solver[key] = value
                settings.explicit.add((section, key))
            if "levels" in entries and (section, "relax") not in settings.explicit:
                # the default relaxation is per level (F on the fine level, FCF below): it
                # follows the number of levels unless the user chose one
                relax = training_options(section, max(int(solver["levels"]), 1))["relax"]
                solver["relax"] = list(relax) if isinstance(relax, tuple) else relax
            settings.solver(section)
            continue
        if section not in SECTIONS:
            raise SettingsError(f"unknown section [{section}]; valid sections: "
                                f"{', '.join(list(SECTIONS) + ['forward', 'backward'])}")
        if not isinstance(entries, dict):
            raise SettingsError(f"[{section}] must be a table of keys")
        target = getattr(settings, section)
        valid = [f.name for f in fields(target)]
        for key, value in entries.items():
            if key not in valid:
                raise SettingsError(f"unknown key {key!r} in [{section}]; valid keys: "
                                    f"{', '.join(valid)}")
            setattr(target, key, _coerce(section, key, value, _field_type(type(target), key)))
            settings.explicit.add((section, key))
    return settings


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML (.toml), YAML (.yaml, .yml) or JSON settings file as nested dicts."""
    path = Path(path)
    if not path.exists():
        raise SettingsError(f"settings file {path} does not exist")
    try:
        # an editor's byte-order mark is no error; other encodings are, naming the file
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SettingsError(f"settings file {path} is not UTF-8 text (byte {err.start}: "
                            f"{err.reason}); save it as UTF-8") from None
    if path.suffix == ".toml":
        return _toml().loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SettingsError(f"reading {path} needs PyYAML: pip install pyyaml "
                                "(or write the settings as TOML)") from None
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise SettingsError(f"{path} must hold a mapping of sections")
        return data
    raise SettingsError(f"settings file {path} must end in .toml, .yaml, .yml or .json")


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
        return tomllib
    import tomli  # pragma: no cover - Python 3.10
    return tomli


def parse_override(text: str) -> dict[str, Any]:
    """'section.key=value' as {section: {key: value}}; the value is read as TOML (numbers,
    true/false, ["lists"]) and otherwise taken as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise SettingsError(f"--set expects section.key=value, got {text!r}")
    name, raw = text.split("=", 1)
    section, key = name.strip().split(".", 1)
    try:
        value = _toml().loads(f"v = {raw}")["v"]
    except Exception:
        value = raw
    return {section: {key.strip(): value}}


def load(path: str | Path | None = None, overrides: list[dict[str, Any]] = ()) -> Settings:
    """Defaults, then the file, then each override in order."""
    settings = Settings()
    if path is not None:
        apply(settings, read_file(path))
    for values in overrides:
        apply(settings, values)
    return settings


def dumps(settings: Settings) -> str:
    return json.dumps(settings.as_dict(), indent=2)


def describe_keys() -> list[tuple[str, str, Any]]:
    """(section, key, default) of every setting, for the documentation and --help."""
    out = []
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            out.append((section, f.name, getattr(cls(), f.name)))
    for section in ("forward", "backward"):
        for key in SOLVER_KEYS:
            default = SOLVER_DEFAULTS[section].get(key, getattr(Config(), key))
            out.append((section, key, default))
    return out



# resuming ------------------------------------------------------------------------------

# What a resumed run may change; it takes effect from the resumed epoch on. Everything else
# defines the network, its partition, the data or their order, and is refused with the key
# and both values. The hierarchy of a solve (levels, coarsening, min_coarse) stays too: the
# checkpoint's warm-start states are shaped by it.
RESUMABLE = {
    "data": {"root", "download"},
    "training": {"epochs", "lr", "momentum", "weight_decay", "device", "capture"},
    "output": {f.name for f in fields(OutputSettings)},
    "control": {f.name for f in fields(ControlSettings)},
    "forward": set(SOLVER_KEYS) - {"levels", "coarsening", "min_coarse"},
    "backward": set(SOLVER_KEYS) - {"levels", "coarsening", "min_coarse"},
}


def resumed(saved: dict[str, Any], given: Settings, reset_optimizer: bool = False) -> Settings:
    """The settings of a resumed run: those the checkpoint was written with (`saved`, as
    `Settings.as_dict` gave them), with what the user gave now (`given.explicit`) applied
    where a resume may change it (`RESUMABLE`; the optimizer kind too with
    `reset_optimizer`). Anything else that differs is refused, naming key and values."""
    settings = Settings()
    known = {section: {k: v for k, v in entries.items()
                       if section in ("forward", "backward") or
                       k in {f.name for f in fields(SECTIONS[section])}}
             for section, entries in saved.items()
             if section in SECTIONS or section in ("forward", "backward")}
    apply(settings, known)
    settings.explicit.clear()
    # the saved run's --overwrite was about how it started, not about this one
    settings.output.overwrite = False
    refused = []
    current = given.as_dict()
    for section, key in sorted(given.explicit):
        old = known.get(section, {}).get(key)
        new = current[section].get(key)
        if old == new:
            continue
        if key in RESUMABLE.get(section, ()) or (
                reset_optimizer and (section, key) == ("training", "optimizer")):
            apply(settings, {section: {key: new}})
        else:
            refused.append(f"{section}.{key} (the checkpoint's {old!r}, now {new!r})")
    if refused:
        hint = (" (or --reset-optimizer to start a fresh optimizer)"
                if any(r.startswith("training.optimizer ") for r in refused) else "")
        raise SettingsError("--resume cannot change " + "; ".join(refused) + ": resume with "
                            "the checkpoint's values" + hint + ", or start a new run in "
                            "another output directory")
    return settings
