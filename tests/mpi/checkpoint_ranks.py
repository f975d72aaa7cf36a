"""Checkpoints that change rank count, on 4 ranks: small networks are trained on 1, 2 and 4
of them, writing a checkpoint after 2 steps and another after a third; then each
checkpoint is resumed on another rank count (1, 2 or 3 of the ranks), what was loaded is
compared with what the rank files hold, and the third step is taken again and compared
with the uninterrupted run's. One launch does both: starting ranks costs more here than
the work.

The expected values are read straight from the rank files here (each layer from the file
whose layout lists it), independently of the loader under test.
"""

import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent.parent))  # nets.py
import mgrit  # noqa: E402
from mgrit.app.launch import report  # noqa: E402
from mgrit.nn import serial_state_dict  # noqa: E402
from nets import build, data, relative  # noqa: E402

torch.set_num_threads(1)
world = MPI.COMM_WORLD
folder = Path(sys.argv[1])
NUM_STEPS = 16
EXACT = mgrit.Config(levels=1)
INEXACT_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                         min_coarse=1)
INEXACT_B = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                         min_coarse=1)
WARM_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                      min_coarse=1, initial_guess="warm")
WARM_B = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                      min_coarse=1, initial_guess="warm")


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


# name -> (forward options, backward options, optimizer); the inexact multilevel solves
# give the same numbers on any rank count, so a resumed step matches there too
CONFIGS = {"exact-sgd": (EXACT, EXACT, sgd), "exact-adam": (EXACT, EXACT, adam),
           "inexact-adam": (INEXACT_F, INEXACT_B, adam), "warm-sgd": (WARM_F, WARM_B, sgd)}
# (ranks that save, ranks that load); 2 -> 2 keeps the partition and the warm starts
PAIRS = [(2, 1), (2, 3), (4, 2), (1, 2), (2, 2)]
x, y = data("dense", 4)


def step(model, opt):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def group(size):
    """A communicator of world ranks 0..size-1 (None on the others). The ranks left out
    wait in a sleeping barrier first: more ranks than cores here, and a rank spinning in
    MPI would take a core from those at work."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.005)
    sub = world.Split(0 if world.rank < size else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else sub


def saved(path: Path, names: list[str]) -> dict:
    """What the rank files in `path` hold, per layer and for the replicated parts:
    {"layers": {n: {"model": {key: row}, "opt": {index: {key: row or value}}}},
     "replicated": {"model": {key: tensor}, "opt": {index: state}}, "extra": ...}.
    `names` are the model's parameter names in optimizer order."""
    out = {"layers": {}}
    for file in sorted(path.glob("rank*.pt")):
        st = torch.load(file, weights_only=False)
        lo, hi = st["layout"]["layers"]
        opt = st["optimizer"]["state"]
        for n in range(lo, hi + 1):
            out["layers"][n] = {
                "model": {k: v[n - lo] for k, v in st["model"].items()
                          if k.startswith("layers.")},
                "opt": {i: {k: v[n - lo] if isinstance(v, Tensor) and v.dim() else v
                            for k, v in s.items()}
                        for i, s in opt.items() if names[i].startswith("layers.")}}
        if st["layout"]["rank"] == 0:
            out["replicated"] = {
                "model": {k: v for k, v in st["model"].items() if not k.startswith("layers.")},
                "opt": {i: s for i, s in opt.items() if not names[i].startswith("layers.")}}
            out["extra"] = st["extra"]
    return out


def pairs_with(model, opt, expected) -> tuple[list, list]:
    """(model pairs, optimizer pairs) of (this rank's tensor, the expected one)."""
    names = [n for n, _ in model.named_parameters()]
    state = model.state_dict()
    opt_state = opt.state_dict()["state"]
    lo, hi = model.layer_range
    model_pairs, opt_pairs = [], []
    for key, value in state.items():
        if key.startswith("layers."):
            model_pairs += [(value[n - lo], expected["layers"][n]["model"][key])
                            for n in range(lo, hi + 1)]
        else:
            model_pairs.append((value, expected["replicated"]["model"][key]))
    for i, name in enumerate(names):
        for key, value in opt_state.get(i, {}).items():
            if not isinstance(value, Tensor):
                continue
            if name.startswith("layers.") and value.dim():
                opt_pairs += [(value[n - lo], expected["layers"][n]["opt"][i][key])
                              for n in range(lo, hi + 1)]
            else:
                ref = (expected["layers"][0]["opt"][i][key] if name.startswith("layers.")
                       else expected["replicated"]["opt"][i][key])
                opt_pairs.append((value, ref))
    return model_pairs, opt_pairs


def max_difference(pairs) -> float:
    return max((float((a.double() - b.double()).abs().max()) for a, b in pairs
                if a.numel()), default=0.0)


def save_all(results: dict) -> None:
    """Train every configuration on each saving rank count; checkpoints after 2 and 3 steps."""
    for ranks in sorted({p for p, _ in PAIRS}):
        comm = group(ranks)
        if comm is None:
            continue
        for name, (fwd, bwd, make_opt) in CONFIGS.items():
            model, _ = build("dense", NUM_STEPS, fwd, bwd, comm=comm)
            opt = make_opt(model.parameters())
            for _ in range(2):
                step(model, opt)
            model.save_checkpoint(folder / f"P{ranks}-{name}", opt, step=2)
            step(model, opt)
            model.save_checkpoint(folder / f"P{ranks}-{name}-next", opt, step=3)
        results[f"P{ranks}"] = sorted(p.name for p in (folder / f"P{ranks}-exact-sgd").iterdir())


def resume_all(results: dict) -> None:
    """Resume every checkpoint on the loading rank count of its pair and take one step."""
    for saved_on, ranks in PAIRS:
        comm = group(ranks)
        if comm is None:
            continue
        for name, (fwd, bwd, make_opt) in CONFIGS.items():
            path = folder / f"P{saved_on}-{name}"
            # another seed: whatever was not loaded would show
            model, _ = build("dense", NUM_STEPS, fwd, bwd, comm=comm, seed=99)
            opt = make_opt(model.parameters())
            names = [n for n, _ in model.named_parameters()]
            extra = model.load_checkpoint(path, opt)
            warm = model._passes.warm_states()
            model_pairs, opt_pairs = pairs_with(model, opt, saved(path, names))
            out = {"layers": list(model.layer_range), "extra": extra,
                   "params": max_difference(model_pairs),
                   "optimizer": max_difference(opt_pairs), "optimizer_entries": len(opt_pairs),
                   "warm_kept": any(bool(v) for v in warm.values())}
            plain = model.to_serial()
            if plain is not None:
                reference, exported = plain.state_dict(), serial_state_dict(path)
                out["export_keys"] = sorted(reference) == sorted(exported)
                out["export"] = max_difference((exported[k], v) for k, v in reference.items()
                                               if k in exported)
            step(model, opt)
            next_model, next_opt = pairs_with(model, opt,
                                              saved(folder / f"{path.name}-next", names))
            out["next_params"] = relative(next_model)
            out["next_optimizer"] = relative(next_opt)
            results[f"{saved_on}->{ranks} {name}"] = out


results: dict = {}
save_all(results)
resume_all(results)
report({"size": world.size, "results": results})
