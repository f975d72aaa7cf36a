"""Checkpoints that outlive the rank count: written on P layer-parallel ranks, loaded on any
Q; their export to a plain serial state_dict; and the errors of damaged or foreign ones,
each naming the file."""

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import mgrit
from mgrit.comm.base import SerialComm
from mgrit.comm.virtual import run_ranks
from mgrit.nn import CheckpointError, serial_state_dict
from mgrit.nn.checkpoint import CHECKPOINT_FORMAT

from nets import build, data

EXACT = mgrit.Config(levels=1)
WARM_F = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=2,
                      min_coarse=1, initial_guess="warm")
WARM_B = mgrit.Config(levels=3, coarsening=2, relax=("F", "FCF"), tol=0.0, max_iter=1,
                      min_coarse=1, initial_guess="warm")
NUM_STEPS = 16


def train(model, opt, steps: int, seed: int = 5) -> None:
    x, y = data("dense", 4, seed)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """The optimizer's per-parameter state tensors, in a fixed order."""
    state = opt.state_dict()["state"]
    return [v for i in sorted(state) for _, v in sorted(state[i].items())
            if isinstance(v, torch.Tensor)]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.mpi
def test_checkpoints_resume_on_another_rank_count(mpi, tmp_path):
    """Written on 1, 2 and 4 ranks, resumed on 1, 2 and 3 (pairs 2->1, 2->3, 4->2, 1->2 and
    2->2), with SGD-momentum and Adam, exact (levels=1) and inexact multilevel solves: each
    rank loads exactly the layers, optimizer state and extras the files hold, the export
    of the checkpoint equals `to_serial()`, and the next step equals the uninterrupted
    run's. Warm-start states survive only the unchanged partition (2->2)."""
    run = mpi("checkpoint_ranks.py", 4, str(tmp_path), timeout=150)
    assert run.returncode == 0, run.stderr
    cases: dict[str, list[dict]] = {}
    for rank, rep in run.by_rank().items():
        for case, res in rep["results"].items():
            if case.startswith("P"):
                continue
            cases.setdefault(case, []).append(res)
            assert res["params"] == 0.0 and res["optimizer"] == 0.0, (rank, case, res)
            assert res["optimizer_entries"] > 0 and res["extra"] == {"step": 2}
            if "export" in res:
                assert res["export_keys"] and res["export"] == 0.0, (case, res)
            same = case.split()[0] == "2->2"
            warm = case.endswith("warm-sgd")
            assert res["warm_kept"] == (same and warm), (rank, case, res)
            if warm and not same:
                # a cold start gives another step (not the uninterrupted one), of the same size
                assert 0 < res["next_params"] < 0.1, (rank, case, res)
            else:
                assert res["next_params"] <= 1e-12 and res["next_optimizer"] <= 1e-12, \
                    (rank, case, res)
    assert len(cases) == 5 * 4
    for case, per_rank in cases.items():
        ranks = int(case.split()[0].split("->")[1])
        assert len(per_rank) == ranks
        spans = sorted(tuple(r["layers"]) for r in per_rank)
        assert spans[0][0] == 0 and spans[-1][1] == NUM_STEPS - 1
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(spans)), (case, spans)


def test_one_rank_resume_continues_exactly(tmp_path):
    """1 -> 1 with warm starts: parameters, optimizer state (SGD momentum and Adam) and
    the next steps equal the uninterrupted run's."""
    for make_opt in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                     lambda p: torch.optim.Adam(p, lr=0.01)):
        folder = tmp_path / "ck"
        model, _ = build("dense", NUM_STEPS, WARM_F, WARM_B)
        opt = make_opt(model.parameters())
        train(model, opt, 2)
        model.save_checkpoint(folder, opt, step=2)
        saved = [p.detach().clone() for p in model.parameters()]
        saved_opt = [t.clone() for t in optimizer_tensors(opt)]
        train(model, opt, 2)

        resumed, _ = build("dense", NUM_STEPS, WARM_F, WARM_B, seed=99)
        opt2 = make_opt(resumed.parameters())
        assert resumed.load_checkpoint(folder, opt2) == {"step": 2}
        assert_same([p.detach() for p in resumed.parameters()], saved)
        assert_same(optimizer_tensors(opt2), saved_opt)
        assert any(resumed._passes.warm_states().values())
        train(resumed, opt2, 2)
        assert_same([p.detach() for p in resumed.parameters()],
                    [p.detach() for p in model.parameters()])
        assert_same(optimizer_tensors(opt2), optimizer_tensors(opt))
        shutil.rmtree(folder)


class Scaled(nn.Module):
    """A step module with a buffer, whose name has a dot inside the step module."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.body.register_buffer("scale", torch.rand(8))

    def forward(self, u):
        return self.body(u) * self.body.scale


def scaled_model(comm=None):
    torch.manual_seed(3)
    model = mgrit.LayerParallel(Scaled, 10, 1.0, forward=EXACT, backward=EXACT, comm=comm,
                                opening=nn.Linear(5, 8), closing=nn.Linear(8, 3))
    return model.double()


def test_serial_state_dict_equals_to_serial(tmp_path):
    """One rank, and two (virtual) ranks: the export of the checkpoint files equals
    `to_serial().state_dict()` key by key, and loads into the plain network."""
    model = scaled_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, 1)
    model.save_checkpoint(tmp_path / "one", opt)
    reference = model.to_serial().state_dict()
    exported = serial_state_dict(tmp_path / "one")
    assert list(exported) == list(reference)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key

    def two_ranks(comm):
        m = scaled_model(comm)
        m.save_checkpoint(tmp_path / "two")
        plain = m.to_serial()
        return plain.state_dict() if plain is not None else None

    reference = run_ranks(2, two_ranks)[0]
    exported = serial_state_dict(tmp_path / "two")
    assert sorted(exported) == sorted(reference)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key
    # the exported weights in a plain network built with other ones compute what the
    # layer-parallel network that wrote them computes
    torch.manual_seed(4)
    plain = mgrit.serial_resnet(Scaled, 10, 1.0, nn.Linear(5, 8), nn.Linear(8, 3)).double()
    plain.load_state_dict(exported)
    written = scaled_model().eval()
    x, _ = data("dense", 4)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), written(x), rtol=1e-12, atol=1e-14)


def test_virtual_ranks_two_to_three_and_back_to_one(tmp_path):
    """The multi-file path without MPI: written on 2 virtual ranks, loaded on 3 and on 1,
    each rank holds the checkpoint's layers and optimizer state."""
    def save(comm):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        train(model, opt, 1)
        model.save_checkpoint(tmp_path, opt, step=1)

    run_ranks(2, save)
    expected = serial_state_dict(tmp_path)

    def load(comm):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm, seed=99)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        extra = model.load_checkpoint(tmp_path, opt)
        lo, hi = model.layer_range
        step = {i: s["step"] for i, s in opt.state_dict()["state"].items()}
        rows = {f"{n + 1}.f.0.weight": model.layers.params["0__weight"][n - lo].detach()
                for n in range(lo, hi + 1)}
        return extra, rows, step, model.closing.weight.detach()

    for ranks in (3, 1):
        results = run_ranks(ranks, load)
        seen = {}
        for extra, rows, step, closing in results:
            assert extra == {"step": 1}
            assert all(float(s) == 1.0 for s in step.values())
            assert torch.equal(closing, expected[f"{NUM_STEPS + 1}.weight"])
            seen.update(rows)
        assert len(seen) == NUM_STEPS
        for key, row in seen.items():
            assert torch.equal(row, expected[key]), key


def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path):
    """One rank's optimizer does not fit the checkpoint: that rank names the file, the
    other learns that loading failed elsewhere instead of training on alone."""
    def save(comm):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm)
        model.save_checkpoint(tmp_path, torch.optim.SGD(model.parameters(), lr=0.1))

    run_ranks(2, save)

    def load(comm):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm)
        params = list(model.parameters())
        groups = ([{"params": params[:1]}, {"params": params[1:]}] if comm.rank == 1
                  else [{"params": params}])
        try:
            model.load_checkpoint(tmp_path, torch.optim.SGD(groups, lr=0.1))
        except CheckpointError as err:
            return str(err)
        return None

    first, second = run_ranks(2, load)
    assert "failed on another rank" in first and str(tmp_path) in first
    assert "rank00001-of-00002.pt" in second and "parameter groups" in second


class Replica(SerialComm):
    """Replica `rank` of `size` for a data-parallel model in one process (loading only
    agrees over it; nothing is averaged without a backward pass)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_data_parallel_replicas_load_their_own_files_on_another_rank_count(tmp_path):
    """2 replicas of 1 layer rank saved (with different weights, so that a replica must
    take its own files), loaded as 2 replicas of 2 layer ranks."""
    for replica in range(2):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, data_comm=Replica(replica, 2),
                         seed=10 + replica)
        model.save_checkpoint(tmp_path, step=replica)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rank00000-of-00001-data00000.pt", "rank00000-of-00001-data00001.pt"]
    for replica in range(2):
        def load(comm, replica=replica):
            model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm, seed=99,
                             data_comm=Replica(replica, 2))
            extra = model.load_checkpoint(tmp_path)
            return extra, model.layer_range, model.layers.params["0__weight"].detach()

        reference, _ = build("dense", NUM_STEPS, EXACT, EXACT, seed=10 + replica)
        for extra, (lo, hi), rows in run_ranks(2, load):
            assert extra == {"step": replica}
            assert torch.equal(rows, reference.layers.params["0__weight"][lo: hi + 1].detach())
    model, _ = build("dense", NUM_STEPS, EXACT, EXACT, data_comm=Replica(0, 3))
    with pytest.raises(CheckpointError, match="2 data-parallel replica.*this model has 3"):
        model.load_checkpoint(tmp_path)


# errors, each naming the file ----------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    """A checkpoint of the dense 16-layer network written on 2 (virtual) ranks."""
    folder = tmp_path_factory.mktemp("two") / "ck"

    def save(comm):
        model, _ = build("dense", NUM_STEPS, EXACT, EXACT, comm=comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, 1)
        model.save_checkpoint(folder, opt, step=1)
        return model.layer_range

    ranges = run_ranks(2, save)
    return folder, ranges


@pytest.fixture
def checkpoint(two_rank_checkpoint, tmp_path):
    """A copy of the 2-rank checkpoint to damage: (folder, layer ranges of its ranks)."""
    folder, ranges = two_rank_checkpoint
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    return copy, ranges


def load_one_rank(folder: Path, num_steps: int = NUM_STEPS, **kwargs) -> dict:
    model, _ = build("dense", num_steps, EXACT, EXACT, **kwargs)
    return model.load_checkpoint(folder, torch.optim.SGD(model.parameters(), lr=0.1))


def refusal(folder: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_one_rank(folder, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_the_intact_checkpoint_loads_on_one_rank(checkpoint):
    folder, _ = checkpoint
    assert load_one_rank(folder) == {"step": 1}


def test_truncated_file(checkpoint):
    folder, _ = checkpoint
    path = folder / "rank00001-of-00002.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = refusal(folder)
    assert f"{path} cannot be read (" in message and "truncated or corrupt" in message
    with pytest.raises(CheckpointError, match="rank00001-of-00002.pt cannot be read"):
        serial_state_dict(folder)


def test_garbage_file(checkpoint):
    folder, _ = checkpoint
    path = folder / "rank00000-of-00002.pt"
    path.write_bytes(b"not a checkpoint at all\n" * 40)
    message = refusal(folder)
    assert f"{path} cannot be read (BadZipFile: " in message


def test_damage_inside_the_tensor_data(checkpoint):
    """Torch reads tensor bytes unchecked; the zip records' CRCs catch the damage."""
    folder, _ = checkpoint
    path = folder / "rank00000-of-00002.pt"
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 3: len(damaged) // 3 + 64] = bytes(64)
    path.write_bytes(bytes(damaged))
    message = refusal(folder)
    assert f"{path} is corrupt: its record" in message and "fails its CRC check" in message


def test_empty_file(checkpoint):
    folder, _ = checkpoint
    path = folder / "rank00001-of-00002.pt"
    path.write_bytes(b"")
    assert f"{path} is empty (0 bytes)" in refusal(folder)


def test_a_torch_file_that_is_not_a_checkpoint(checkpoint):
    folder, _ = checkpoint
    path = folder / "rank00001-of-00002.pt"
    torch.save([1, 2, 3], path)
    assert f"{path} is not a mgrit checkpoint file" in refusal(folder)
    state = torch.load(folder / "rank00000-of-00002.pt", weights_only=False)
    torch.save({**state, "format": CHECKPOINT_FORMAT + 1}, path)
    assert (f"{path} is a mgrit checkpoint of format {CHECKPOINT_FORMAT + 1}; this version "
            f"reads format {CHECKPOINT_FORMAT} only") in refusal(folder)


def test_missing_rank_file(checkpoint):
    folder, ranges = checkpoint
    path = folder / "rank00001-of-00002.pt"
    path.unlink()
    lo, hi = ranges[0]
    message = refusal(folder)
    assert f"{path} is missing" in message
    assert f"cover layers {lo}-{hi} of 0-{NUM_STEPS - 1} only" in message
    with pytest.raises(CheckpointError, match="rank00001-of-00002.pt is missing"):
        serial_state_dict(folder)


def test_no_checkpoint_files(tmp_path):
    (tmp_path / "ck").mkdir()
    assert f"{tmp_path / 'ck'} holds no checkpoint files" in refusal(tmp_path / "ck")
    assert f"{tmp_path / 'nowhere'} is not a checkpoint folder" in refusal(tmp_path / "nowhere")


def test_a_renamed_file(checkpoint):
    folder, _ = checkpoint
    first, second = folder / "rank00000-of-00002.pt", folder / "rank00001-of-00002.pt"
    first.rename(folder / "tmp.pt")
    second.rename(first)
    message = refusal(folder)
    assert f"{first} holds rank 1 of 2, not what its name says" in message


def test_a_different_network(checkpoint):
    folder, _ = checkpoint
    message = refusal(folder, num_steps=15)
    assert "rank00000-of-00002.pt holds a different network: num_steps is 16 there and 15 " \
           "here" in message
    torch.manual_seed(1)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()),
                                NUM_STEPS, 1.0, forward=EXACT, backward=EXACT,
                                opening=nn.Linear(5, 8), closing=nn.Linear(8, 3)).double()
    with pytest.raises(CheckpointError) as info:
        model.load_checkpoint(folder)
    assert ("rank00000-of-00002.pt holds a different network: the step module's parameter "
            "'0.bias' is shape (8,) there and absent here") in str(info.value)
    torch.manual_seed(1)
    model = mgrit.LayerParallel(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                NUM_STEPS, 1.0, forward=EXACT, backward=EXACT,
                                opening=nn.Linear(6, 8), closing=nn.Linear(8, 3)).double()
    with pytest.raises(CheckpointError) as info:
        model.load_checkpoint(folder)
    assert ("rank00000-of-00002.pt holds a different network: opening.weight has shape "
            "(8, 5) there and (8, 6) here") in str(info.value)


def test_a_checkpoint_without_optimizer_state(tmp_path):
    model, _ = build("dense", NUM_STEPS, EXACT, EXACT)
    path = model.save_checkpoint(tmp_path)
    assert f"{path} has no optimizer state" in refusal(tmp_path)
    assert model.load_checkpoint(tmp_path) == {}     # without an optimizer it loads


def test_the_number_of_data_replicas_must_stay_the_same(checkpoint):
    folder, _ = checkpoint
    for path in sorted(folder.iterdir()):
        shutil.copy(path, path.with_name(path.stem + "-data00001.pt"))
        path.rename(path.with_name(path.stem + "-data00000.pt"))
    message = refusal(folder)
    assert f"{folder} holds a checkpoint of 2 data-parallel replica(s)" in message
    assert "rank0000" in message and "this model has 1" in message
