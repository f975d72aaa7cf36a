"""Checkpoint files of a layer-parallel network (one per rank: its layers, opening,
closing, optimizer state and warm-start states) that any number of ranks can resume from;
their export to a plain serial network is `export`'s.

A checkpoint written on P layer-parallel ranks loads on Q ranks: every loading rank reads
the layouts of all P files (memory-mapped: their tensors are not read) and slices its own
layers out of the files that hold them (whose CRCs it checks). Warm-start states belong to
one partition of the layers and survive only when the partition is the same."""

from __future__ import annotations

import copy
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.grid import layer_ranges
from .engine.atomic import write_atomically
from .engine.ghosts import placement
from .engine.passes import Passes

if TYPE_CHECKING:
    from .layer_parallel import LayerParallel

# the version of the checkpoint files' layout (their keys); files of another are refused
CHECKPOINT_FORMAT = 1

# what a rank's file is called (see `checkpoint_path`); `.tmp` files being written never match
_FILE_NAME = re.compile(r"rank(\d{5,})-of-(\d{5,})(?:-data(\d{5,}))?\.pt")
_ENTRIES = ("layout", "model", "optimizer", "warm", "extra")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing or incomplete, unreadable, or of another
    network. The message names the file (or folder) and what is wrong with it."""


class FailedElsewhere(CheckpointError):
    """Raised on the ranks whose own part loaded while another rank's failed: that rank's
    error is the informative one."""


def _file_name(rank: int, ranks: int, data: int | None) -> str:
    suffix = f"-data{data:05d}" if data is not None else ""
    return f"rank{rank:05d}-of-{ranks:05d}{suffix}.pt"


def checkpoint_path(model: LayerParallel, directory: str | os.PathLike) -> Path:
    """This rank's file in `directory`: one per layer-parallel rank and data replica."""
    data = model.data_comm.rank if model.data_comm is not None else None
    return Path(directory) / _file_name(model.comm.rank, model.comm.size, data)


def _layout(model: LayerParallel) -> dict[str, Any]:
    """The network's shape and this rank's part of it, as written into its file."""
    layers = model.layers
    return {"num_steps": model.num_steps, "t_final": model.t_final, "ranks": model.comm.size,
            "rank": model.comm.rank, "layers": model.layer_range,
            "parameters": [(n, tuple(p.shape[1:])) for n, p in
                           zip(layers.names, layers.params.values())]}


def save(model: LayerParallel, passes: Passes, directory: str | os.PathLike,
         optimizer: torch.optim.Optimizer | None, extra: dict[str, Any]) -> Path:
    """Write this rank's checkpoint (see `LayerParallel.save_checkpoint`)."""
    path = checkpoint_path(model, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, "layout": _layout(model),
             "model": model.state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "warm": passes.warm_states(), "extra": extra,
             # the keyed random draws continue where they were (mgrit.nn.engine.randomness)
             "draws": {"seed": model.draw_seed, "step": model.draw_step}}
    # a failed write (a full disk) removes its temporary file and names the file and
    # why; the rank's earlier file at `path` stays
    return write_atomically(path, lambda stream: torch.save(state, stream))


# reading a checkpoint folder ----------------------------------------------------------
@dataclass
class RankFile:
    """One rank's file, read: its path, rank and state (tensors memory-mapped)."""

    path: Path
    rank: int
    state: dict[str, Any]

    @property
    def layers(self) -> tuple[int, int]:
        lo, hi = self.state["layout"]["layers"]
        return int(lo), int(hi)


def _read(path: Path) -> dict[str, Any]:
    """A rank file's contents, its tensors memory-mapped (a loading rank touches only the
    rows it keeps), or a CheckpointError saying why not."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err})") from err
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): it was truncated or never written")
    try:
        # torch's files are zip archives; asking zipfile first gives a plain reason for a
        # truncated or foreign file, where torch's mmap loader would blame the save options
        with zipfile.ZipFile(path):
            pass
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # anything a damaged file makes the unpickler raise
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}): it is "
                              "truncated or corrupt") from err
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path} is not a mgrit checkpoint file (it holds a "
                              f"{type(state).__name__} without a 'format' entry)")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is a mgrit checkpoint of format {state['format']!r}; "
                              f"this version reads format {CHECKPOINT_FORMAT} only")
    missing = [key for key in _ENTRIES if key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a complete mgrit checkpoint: it has no "
                              f"{', '.join(repr(k) for k in missing)} entry")
    return state


def verify(f: RankFile) -> None:
    """Check the CRCs of a file this rank takes tensors from: torch reads a tensor's bytes
    without checking them, so damage inside the data would load as wrong weights."""
    try:
        with zipfile.ZipFile(f.path) as archive:
            bad = archive.testzip()
    except Exception as err:  # a damaged record header, a decompression error, ...
        raise CheckpointError(f"{f.path} cannot be read ({type(err).__name__}: {err}): it is "
                              "truncated or corrupt") from err
    if bad is not None:
        raise CheckpointError(f"{f.path} is corrupt: its record {bad!r} fails its CRC check")


def _check_network(path: Path, layout: dict[str, Any], mine: dict[str, Any]) -> None:
    """Refuse a file of another network, naming the first difference."""
    for key in ("num_steps", "t_final"):
        if layout.get(key) != mine[key]:
            raise CheckpointError(f"{path} holds a different network: {key} is "
                                  f"{layout.get(key)!r} there and {mine[key]!r} here")
    there, here = dict(layout.get("parameters", [])), dict(mine["parameters"])
    for name in [*here, *(n for n in there if n not in here)]:
        if there.get(name) != here.get(name):
            shape = {k: (f"shape {tuple(v[name])}" if name in v else "absent")
                     for k, v in (("there", there), ("here", here))}
            raise CheckpointError(f"{path} holds a different network: the step module's "
                                  f"parameter {name!r} is {shape['there']} there and "
                                  f"{shape['here']} here")


def _choose_files(directory: Path, ranks: int | None, replicas: int | None, replica: int
                  ) -> tuple[int, dict[int, Path], int | None]:
    """(P, rank -> path, data index) of the checkpoint set in `directory` that a model of
    `ranks` layer-parallel ranks and `replicas` data replicas (None: any) loads, for its
    replica `replica`."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint folder: it does not exist"
                              if not directory.exists() else
                              f"{directory} is not a checkpoint folder: it is a file")
    found: dict[int, dict[int | None, dict[int, Path]]] = {}
    for path in directory.iterdir():
        match = _FILE_NAME.fullmatch(path.name)
        if match:
            rank, count = int(match[1]), int(match[2])
            data = int(match[3]) if match[3] is not None else None
            found.setdefault(count, {}).setdefault(data, {})[rank] = path
    if not found:
        raise CheckpointError(f"{directory} holds no checkpoint files (named like "
                              f"{_file_name(0, 2, None)})")
    if len(found) == 1:
        count = next(iter(found))
    elif ranks in found:
        # a folder written twice by different rank counts: the set of this rank count is
        # the one that loaded before checkpoints could change rank count
        count = ranks
    else:
        raise CheckpointError(f"{directory} holds checkpoint files of several rank counts "
                              f"({', '.join(map(str, sorted(found)))}): which one to load "
                              "is ambiguous; remove the stale files")
    sets = found[count]
    if None in sets and len(sets) > 1:
        example = next(iter(sets[None].values()))
        raise CheckpointError(f"{directory} mixes files with and without data replica "
                              f"numbers ({example.name} and -dataNNNNN files); remove the "
                              "stale ones")
    there = 1 if None in sets else max(sets) + 1
    if replicas is not None and there != replicas:
        example = next(iter(next(iter(sets.values())).values()))
        raise CheckpointError(f"{directory} holds a checkpoint of {there} data-parallel "
                              f"replica(s) (e.g. {example.name}) and this model has {replicas}: "
                              "it must stay the same (the number of layer-parallel ranks may "
                              "change); mgrit.nn.serial_state_dict reads its weights anyway")
    data = None if None in sets else replica
    return count, sets.get(data, {}), data


def read_set(directory: str | os.PathLike, ranks: int | None, replicas: int | None,
              replica: int, mine: dict[str, Any] | None) -> list[RankFile]:
    """All files of one replica's checkpoint, read and checked: each readable, of this
    network (`mine`, the loading model's layout; None: any network but the same in every
    file), named after its rank, and together holding every layer exactly once."""
    directory = Path(directory)
    count, paths, data = _choose_files(directory, ranks, replicas, replica)
    files = [RankFile(path, rank, _read(path)) for rank, path in sorted(paths.items())]
    for f in files:
        layout = f.state["layout"]
        if mine is None:
            mine = {k: layout.get(k) for k in ("num_steps", "t_final", "parameters")}
        _check_network(f.path, layout, mine)
        if layout.get("ranks") != count or layout.get("rank") != f.rank:
            raise CheckpointError(f"{f.path} holds rank {layout.get('rank')!r} of "
                                  f"{layout.get('ranks')!r}, not what its name says: it was "
                                  "renamed or copied from another checkpoint")
    num_steps = mine["num_steps"]
    covered = _spans([f.layers for f in files])
    absent = [r for r in range(count) if r not in paths]
    if absent:
        missing = directory / _file_name(absent[0], count, data)
        more = f" (and {len(absent) - 1} more rank file(s))" if len(absent) > 1 else ""
        raise CheckpointError(f"{missing} is missing{more}: the checkpoint's {len(files)} of "
                              f"{count} rank files cover layers {covered or 'none'} of "
                              f"0-{num_steps - 1} only")
    expected = 0
    for f in files:
        lo, hi = f.layers
        if hi >= lo and lo != expected:
            raise CheckpointError(f"{f.path} holds layers {lo}-{hi} where layer {expected} "
                                  f"was due: the files cover layers {covered} of "
                                  f"0-{num_steps - 1}; they are not one checkpoint")
        expected = max(expected, hi + 1)
    if expected != num_steps:
        raise CheckpointError(f"{files[-1].path} ends the checkpoint at layer {expected - 1}: "
                              f"the files cover layers {covered} of 0-{num_steps - 1} only")
    return files


def _spans(ranges: list[tuple[int, int]]) -> str:
    """Layer ranges as '0-7, 12-15' (adjacent ones merged)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] >= r[0]):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return ", ".join(f"{lo}-{hi}" for lo, hi in merged)


def _pieces(files: list[RankFile], lo: int, hi: int, base: RankFile
            ) -> list[tuple[RankFile, int, int]]:
    """(file, start, stop): the rows of each file that make up layers lo..hi, in order; one
    empty slice of `base` for a rank without layers (it still needs tensors of 0 rows)."""
    out = []
    for f in files:
        a, b = f.layers
        first, last = max(a, lo), min(b, hi)
        if last >= first:
            out.append((f, first - a, last - a + 1))
    return out or [(base, 0, 0)]


def _rows(pieces: list[tuple[RankFile, int, int]], key: str, like: Tensor) -> Tensor:
    """The stacked model entry `key` of this rank's layers (stacked like `like`), from the
    files holding them."""
    parts = []
    for f, start, stop in pieces:
        if key not in f.state["model"]:
            raise CheckpointError(f"{f.path} holds a different network: it has no entry "
                                  f"{key!r}")
        stacked = f.state["model"][key]
        if stacked.shape[1:] != like.shape[1:]:
            raise CheckpointError(f"{f.path} holds a different network: a layer's {key} has "
                                  f"shape {tuple(stacked.shape[1:])} there and "
                                  f"{tuple(like.shape[1:])} here")
        parts.append(stacked[start:stop])
    return torch.cat(parts)   # a copy: nothing stays mapped to the file


def _model_state(model: LayerParallel, pieces: list[tuple[RankFile, int, int]],
                 base: RankFile) -> dict[str, Tensor]:
    """This rank's `state_dict`: its layers' rows from the files holding them, the
    replicated entries (opening, closing) from `base`."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("layers."):
            out[key] = _rows(pieces, key, value)
            continue
        if key not in base.state["model"]:
            raise CheckpointError(f"{base.path} holds a different network: it has no "
                                  f"entry {key!r}")
        saved = base.state["model"][key]
        if saved.shape != value.shape:
            raise CheckpointError(f"{base.path} holds a different network: {key} has shape "
                                  f"{tuple(saved.shape)} there and {tuple(value.shape)} here")
        out[key] = saved.clone()
    extra = [k for k in base.state["model"] if k not in out]
    if extra:
        raise CheckpointError(f"{base.path} holds a different network: it has entries this "
                              f"model lacks ({', '.join(extra[:3])})")
    return out


def _optimizer_state(model: LayerParallel, optimizer: torch.optim.Optimizer,
                     pieces: list[tuple[RankFile, int, int]], base: RankFile
                     ) -> dict[str, Any]:
    """An optimizer `state_dict` for this rank. Torch keys per-parameter state by the
    parameter's position in the optimizer's groups, the same on every rank (the same names
    in the same order); state of a layer parameter's shape is sliced per layer like the
    parameter (momentum, Adam's moments), anything else (Adam's step) is copied."""
    for f in [base, *(p[0] for p in pieces)]:
        if f.state["optimizer"] is None:
            raise CheckpointError(f"{f.path} has no optimizer state (it was saved without "
                                  "an optimizer)")
    saved = base.state["optimizer"]
    here = optimizer.state_dict()
    sizes_there = [len(g["params"]) for g in saved["param_groups"]]
    sizes_here = [len(g["params"]) for g in here["param_groups"]]
    if sizes_there != sizes_here:
        raise CheckpointError(f"{base.path} holds the state of an optimizer with parameter "
                              f"groups of {sizes_there} parameters and this optimizer has "
                              f"{sizes_here}")
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(order):
        if name is None or not name.startswith("layers."):
            if index in saved["state"]:
                state[index] = _clone(saved["state"][index])
            continue
        entries = [(f, start, stop, f.state["optimizer"]["state"].get(index))
                   for f, start, stop in pieces]
        holding = [e[0].path for e in entries if e[3] is not None]
        if not holding:
            continue        # no state yet (before the first step, or a frozen parameter)
        if len(holding) < len(entries):
            lacking = next(e[0].path for e in entries if e[3] is None)
            raise CheckpointError(f"{lacking} has no optimizer state for {name} and "
                                  f"{holding[0]} has: the files are not one checkpoint")
        merged = {}
        for key, value in entries[0][3].items():
            parts = []
            for f, start, stop, st in entries:
                stacked = f.state["model"][name].shape
                v = st.get(key)
                if isinstance(v, Tensor) and v.dim() > 0 and v.shape == stacked:
                    parts.append(v[start:stop])
                elif parts:
                    got = f"shape {tuple(v.shape)}" if isinstance(v, Tensor) else repr(v)
                    raise CheckpointError(f"{f.path}: the optimizer's {key!r} of {name} is "
                                          f"{got} where {tuple(stacked)} (a row per layer) "
                                          "was expected: the files are not one checkpoint")
            merged[key] = torch.cat(parts) if parts else _clone(value)
        state[index] = merged
    groups = []
    for g_saved, g_here in zip(saved["param_groups"], here["param_groups"]):
        groups.append({**copy.deepcopy({k: v for k, v in g_saved.items() if k != "params"}),
                       "params": g_here["params"]})
    return {"state": state, "param_groups": groups}


def _clone(value: Any) -> Any:
    """A deep copy whose tensors no longer map the file."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _assemble(model: LayerParallel, passes: Passes, directory: str | os.PathLike,
              optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Everything this rank loads, read and checked but not yet applied."""
    data = model.data_comm
    files = read_set(directory, model.comm.size, data.size if data is not None else 1,
                      data.rank if data is not None else 0, _layout(model))
    partition = layer_ranges(passes.blocks, passes.num_steps)
    same = len(files) == model.comm.size and [f.layers for f in files] == [
        tuple(r) for r in partition]
    # with the partition unchanged this rank's own file supplies everything, exactly as it
    # was written; otherwise every rank takes the replicated parts from the same file
    base = files[model.comm.rank] if same else files[0]
    lo, hi = model.layer_range
    pieces = _pieces(files, lo, hi, base)
    for f in {id(f): f for f in [base, *(p[0] for p in pieces)]}.values():
        verify(f)
    out = {"model": _model_state(model, pieces, base),
           "extra": _clone(base.state["extra"]),
           "warm": _clone(base.state["warm"]) if same else None,
           "draws": base.state.get("draws")}
    if optimizer is not None:
        out["optimizer"] = _optimizer_state(model, optimizer, pieces, base)
    return out


def load(model: LayerParallel, passes: Passes, directory: str | os.PathLike,
         optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore a checkpoint written on any number of layer-parallel ranks; returns its
    extra entries (see `LayerParallel.load_checkpoint`). Collective: every rank of the model
    (and of its data-parallel group) calls it, and a failure on one raises on all, so no
    rank goes on to train alone."""
    try:
        loaded, failure = _assemble(model, passes, directory, optimizer), None
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks know
        loaded, failure = None, err
    # a rank's own error is the informative one; the others learn that some rank failed
    failed = model.comm.allreduce_sum(1.0 if failure is not None else 0.0)
    if model.data_comm is not None:
        failed = model.data_comm.allreduce_sum(1.0 if failed else 0.0)
    if failure is not None:
        raise failure
    if failed:
        raise FailedElsewhere(f"loading the checkpoint in {directory} failed on another rank "
                              "(its error names the file)")
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if loaded["draws"] is not None:
        model.set_draw_seed(int(loaded["draws"]["seed"]))
        model.draw_step = int(loaded["draws"]["step"])
    if loaded["warm"] is not None:
        _, device = placement(model.layers)
        passes.set_warm_states(_to(loaded["warm"], device), device)
    return loaded["extra"]
