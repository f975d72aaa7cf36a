"""Refusals of `mgrit train` and of the library that name the problem before any work:
settings files in other encodings, fewer layers than ranks, a data-parallel checkpoint on
a rank count its replicas do not divide."""

import json
import shutil

import pytest
import torch
from torch import nn

from mgrit import Config
from mgrit.app.settings import SettingsError, load
from mgrit.comm.virtual import run_ranks
from mgrit.nn import CheckpointError, LayerParallel, serial_state_dict

from runs import mgrit

TINY = ["--epochs", "1", "--steps", "8", "--width", "8", "--no-progress",
        "--set", "forward.levels=2", "--set", "backward.levels=2",
        "--set", "forward.relax=\"F\"", "--set", "backward.relax=\"F\""]


@pytest.mark.parametrize("name,text", [
    ("run.toml", '[network]\nwidth = 12\n[data]\nname = "peaks"\n'),
    ("run.json", json.dumps({"network": {"width": 12}, "data": {"name": "peaks"}})),
])
def test_settings_file_with_a_byte_order_mark_is_read(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    s = load(path)
    assert (s.network.width, s.data.name) == (12, "peaks")


def test_settings_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes('[output]\nlabel = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(SettingsError) as info:
        load(path)
    assert f"settings file {path} is not UTF-8" in str(info.value)


@pytest.mark.parametrize("ranks,layers", [(2, 1), (3, 2), (4, 3)])
def test_fewer_layers_than_ranks_is_refused_at_construction(ranks, layers):
    # the partition gives such a rank no layer, and the adjoint solve none of its states
    one = Config(levels=1)
    with pytest.raises(ValueError, match=f"num_steps={layers} layers cannot be shared by "
                                         f"{ranks} ranks: every rank needs at least one"):
        run_ranks(ranks, lambda comm: LayerParallel(lambda: nn.Linear(3, 3), layers, 1.0,
                                                    forward=one, backward=one, comm=comm))


def test_as_many_layers_as_ranks_is_accepted():
    one = Config(levels=1)
    ranges = run_ranks(3, lambda comm: LayerParallel(lambda: nn.Linear(3, 3), 3, 1.0,
                                                     forward=one, backward=one,
                                                     comm=comm).layer_range)
    assert ranges == [(0, 0), (1, 1), (2, 2)]


@pytest.mark.mpi
def test_train_with_fewer_layers_than_ranks_fails_before_any_file(tmp_path):
    out = tmp_path / "run"
    proc = mgrit("train", *TINY, "--steps", "1", "--levels", "1", "--out", str(out),
                 ranks=2, check=False, timeout=120)
    assert proc.returncode == 2
    assert "num_steps=1 layers cannot be shared by 2 ranks" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.mpi
def test_data_parallel_checkpoint_on_another_rank_count_names_its_origin(tmp_path):
    out = tmp_path / "run"
    mgrit("train", *TINY, "--set", "training.data_parallel=2", "--out", str(out), ranks=2,
          timeout=180)
    before = (out / "metrics.jsonl").read_text()
    proc = mgrit("train", *TINY, "--epochs", "2", "--out", str(out), "--resume", check=False)
    assert proc.returncode == 2
    assert ("the checkpoint was written with [training] data_parallel = 2, which must "
            "divide the 1 ranks") in proc.stderr
    assert "mgrit.nn.serial_state_dict" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before
    # what the message points at reads that checkpoint
    weights = serial_state_dict(out / "checkpoint-0001")
    trained = torch.load(out / "model.pt", weights_only=False).state_dict()
    assert weights.keys() == trained.keys()
    assert all(torch.equal(weights[k], trained[k]) for k in trained)


def test_library_refusal_of_another_replica_count_points_at_the_export(tmp_path):
    one = Config(levels=1)
    torch.manual_seed(0)
    model = LayerParallel(lambda: nn.Linear(3, 3), 4, 1.0, forward=one, backward=one)
    path = model.save_checkpoint(tmp_path)
    shutil.copy(path, path.with_name(path.stem + "-data00001.pt"))
    path.rename(path.with_name(path.stem + "-data00000.pt"))
    with pytest.raises(CheckpointError, match="mgrit.nn.serial_state_dict reads its weights"):
        model.load_checkpoint(tmp_path)
    serial = model.to_serial().state_dict()
    exported = serial_state_dict(tmp_path)
    assert serial.keys() == exported.keys()
    assert all(torch.equal(serial[k], exported[k]) for k in serial)


@pytest.mark.parametrize("flags,message", [
    (["--ranks", "2", "--steps", "8", "--levels", "3"],
     "num_steps=8 is too small for the forward solver's levels=3"),
    (["--ranks", "3", "--steps", "2", "--levels", "1"],
     "num_steps=2 layers cannot be shared by 3 ranks"),
])
def test_compare_refuses_a_layer_parallel_run_before_the_serial_one_trains(
        tmp_path, flags, message):
    out = tmp_path / "out"
    run = mgrit("compare", *flags, "--epochs", "1", "--width", "8", "--no-progress",
                "--out", str(out), check=False)
    assert run.returncode == 2
    assert run.stderr.startswith(f"mgrit compare: error: {message}"), run.stderr
    assert not (out / "serial").exists()
