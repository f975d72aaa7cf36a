"""[training] device (`--device`): which device each rank of a run trains on, the refusals
before any work where it cannot, and (on a GPU) a run there against the same run on the
CPU, its checkpoint resumed on the CPU and its export loaded without a GPU."""

from types import SimpleNamespace

import pytest
import torch

from mgrit.app.devices import rank_device
from mgrit.app.settings import SettingsError, load, resumed

from runs import launches, mgrit, records

# a dense network small enough for seconds, with fixed solvers (the controller's choices
# follow timings, which differ between devices), on generated data (the GPU machine's
# Python has torch and mgrit's own needs, not the scikit-learn of the digits)
SMALL = ["--dataset", "peaks", "--epochs", "1", "--steps", "8", "--width", "8",
         "--no-progress", "--no-control", "--set", "training.steps_per_epoch=4",
         "--set", "forward.levels=2", "--set", "backward.levels=2"]


def fake_cuda(count):
    return SimpleNamespace(is_available=lambda: count > 0, device_count=lambda: count)


def test_cpu_is_the_default_and_needs_no_gpu():
    assert load().training.device == "cpu"
    assert rank_device("cpu", 3, fake_cuda(0)) == torch.device("cpu")


def test_cuda_gives_each_rank_of_a_node_a_gpu_in_turn():
    assert [rank_device("cuda", i, fake_cuda(2)) for i in range(5)] == [
        torch.device("cuda", i % 2) for i in range(5)]


def test_cuda_n_is_that_gpu_on_every_rank():
    assert {rank_device("cuda:1", i, fake_cuda(2)) for i in range(3)} == {
        torch.device("cuda", 1)}


def test_a_gpu_the_node_lacks_is_refused():
    with pytest.raises(SettingsError, match=r"device = 'cuda:2': this node has 2 CUDA "
                                            r"device\(s\), cuda:0 to cuda:1"):
        rank_device("cuda:2", 0, fake_cuda(2))


@pytest.mark.parametrize("setting", ["cuda", "cuda:0"])
def test_cuda_without_a_cuda_device_is_refused(setting):
    with pytest.raises(SettingsError, match=f"device = '{setting}': torch .* (finds no CUDA "
                                            "device here|is built without CUDA); train with "
                                            "device = 'cpu'"):
        rank_device(setting, 0, fake_cuda(0))


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "mps"])
def test_other_device_names_are_refused(value):
    with pytest.raises(SettingsError, match=f"device = '{value}' is not valid; choose 'cpu', "
                                            "'cuda'"):
        load(overrides=[{"training": {"device": value}}])


def test_a_resume_may_move_to_another_device():
    saved = load().as_dict()
    given = load(overrides=[{"training": {"device": "cuda:1"}}])
    assert resumed(saved, given).training.device == "cuda:1"


def test_trace_on_a_gpu_is_refused_before_any_file(tmp_path):
    out = tmp_path / "out"
    run = mgrit("train", *SMALL, "--device", "cuda", "--trace", "2", "--out", str(out),
                check=False)
    assert run.returncode == 2
    assert "[output] trace = 2: traces time each rank's work on the host" in run.stderr
    assert not out.exists()


def _missing_device() -> str:
    """A device this machine cannot train on: any GPU without CUDA, else one past its
    GPUs."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_a_missing_gpu_is_refused_before_any_file(tmp_path):
    out = tmp_path / "out"
    device = _missing_device()
    run = mgrit("train", *SMALL, "--device", device, "--out", str(out), check=False)
    assert run.returncode == 2
    assert run.stderr.startswith(f"mgrit train: error: [training] device = '{device}': ")
    assert not out.exists()


@pytest.mark.mpi
def test_a_missing_gpu_is_refused_by_all_ranks_at_once(tmp_path):
    # every rank learns its node index (a collective) and then agrees on the refusal: one
    # message naming both ranks, and both end
    out = tmp_path / "out"
    device = _missing_device()
    run = mgrit("train", *SMALL, "--device", device, "--out", str(out), ranks=2,
                check=False, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines == [line for line in lines if "error" in line] and len(lines) == 1, run.stderr
    assert f"ranks 0, 1: [training] device = '{device}'" in lines[0]
    assert not out.exists()


def test_a_launch_names_the_devices_and_hosts_of_its_ranks(monkeypatch):
    """A run's launch record names each distinct device (a GPU with its model) and host
    of its ranks, gathered from all of them; stand-ins for the GPU and the other rank."""
    from mgrit.app.records import launch_record

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Model of {device}")
    here = launch_record(None, torch.device("cuda", 1), 2, 9, True)
    gathered = []
    world = SimpleNamespace(Get_rank=lambda: 1, allgather=lambda mine: gathered.append(mine)
                            or [("node-b", "cuda:0 (Model of cuda:0)"), mine, mine])
    three = launch_record(world, torch.device("cuda", 1), 2, 9, True)
    assert gathered == [(here["hosts"][0], "cuda:1 (Model of cuda:1)")]
    assert (here["type"], here["epoch"], here["step"], here["resumed"]) == (
        "launch", 2, 9, True)
    assert here["devices"] == ["cuda:1 (Model of cuda:1)"] and here["ranks"] == 1
    assert three["ranks"] == 3 and three["hosts"] == sorted({here["hosts"][0], "node-b"})
    assert three["devices"] == ["cuda:0 (Model of cuda:0)", "cuda:1 (Model of cuda:1)"]
    # rank 0 writes the record: only it asks git for the source's commit
    assert three["source"] is None


def test_a_launch_from_a_git_checkout_names_its_commit(tmp_path):
    """The commit a run's code comes from, "+changes" once a tracked file differs from
    it (a new untracked file does not count); an installed package, outside any checkout,
    has none. A repository made here stands in for the source tree."""
    import subprocess

    from mgrit.app.environment import source_commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    assert source_commit(tmp_path) is None
    git("init", "-q")
    (tmp_path / "step.py").write_text("h = 0.1\n")
    git("add", "step.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "--short=12", "HEAD")
    assert source_commit(tmp_path) == head and len(head) == 12
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "step.py").write_text("h = 0.2\n")
    assert source_commit(tmp_path) == head + "+changes"


def _losses(folder):
    return [r["loss"] for r in records(folder) if r["type"] == "step"]


@pytest.fixture(scope="module")
def on_the_cpu(tmp_path_factory):
    """Two epochs of the small run on the CPU, the layer-parallel and the serial (Adam)
    network: the references of the GPU runs."""
    folder = tmp_path_factory.mktemp("cpu")
    mgrit("train", *SMALL, "--epochs", "2", "--out", str(folder / "layer-parallel"))
    mgrit("train", *SERIAL_ADAM, "--epochs", "2", "--out", str(folder / "serial"))
    return folder


SERIAL_ADAM = [*SMALL, "--serial", "--optimizer", "adam"]


@pytest.mark.gpu
@pytest.mark.mpi
def test_training_on_a_gpu_equals_training_on_the_cpu(tmp_path, on_the_cpu):
    """On the GPU against the CPU (float32: the kernels differ, so the losses agree to
    rounding): one rank eager and captured (`--capture`: steps 3 and 4 are replays of a
    CUDA graph), two ranks sharing the GPU captured (graphs between the messages; their
    eager steps are the library's tests)."""
    gpu, captured, two = tmp_path / "gpu", tmp_path / "captured", tmp_path / "captured-two"
    mgrit("train", *SMALL, "--device", "cuda", "--out", str(gpu))
    mgrit("train", *SMALL, "--device", "cuda", "--capture", "--out", str(captured))
    mgrit("train", *SMALL, "--device", "cuda", "--capture", "--out", str(two), ranks=2,
          timeout=240)
    expected = _losses(on_the_cpu / "layer-parallel")
    assert len(expected) == 8
    for folder in (gpu, captured, two):
        assert _losses(folder) == pytest.approx(expected[:4], rel=1e-4), folder
        assert all(r["seconds"] > 0 for r in records(folder) if "seconds" in r)


@pytest.mark.gpu
def test_gpu_checkpoints_resume_on_the_cpu(tmp_path, on_the_cpu):
    """The layer-parallel network's and the serial one's (its step one CUDA graph, Adam's
    step counts on the GPU) continue on the CPU as the CPU runs went on; the exported
    network loads on the host."""
    gpu, serial = tmp_path / "gpu", tmp_path / "serial"
    mgrit("train", *SMALL, "--device", "cuda", "--out", str(gpu))
    exported = torch.load(gpu / "model.pt", weights_only=False)
    assert {p.device.type for p in exported.parameters()} == {"cpu"}
    mgrit("train", *SMALL, "--epochs", "2", "--device", "cpu", "--resume", "--out", str(gpu))
    assert _losses(gpu) == pytest.approx(_losses(on_the_cpu / "layer-parallel"), rel=1e-4)
    # each launch says where it ran
    assert [launch["devices"] for launch in launches(gpu)] == [
        [f"cuda:0 ({torch.cuda.get_device_name(0)})"], ["cpu"]]
    mgrit("train", *SERIAL_ADAM, "--device", "cuda", "--capture", "--out", str(serial))
    mgrit("train", *SERIAL_ADAM, "--epochs", "2", "--device", "cpu", "--resume", "--out",
          str(serial))
    assert _losses(serial) == pytest.approx(_losses(on_the_cpu / "serial"), rel=1e-4)


@pytest.mark.gpu
def test_a_captured_gpu_run_with_the_controller_resumes_on_the_gpu(tmp_path):
    """Probes after replays (captured again where the controller changes the solvers),
    Adam's step counts on the GPU, an evaluation while a graph is held, and the run
    resumed on the GPU, captured again."""
    out = tmp_path / "out"
    adam = [flag for flag in SMALL if flag != "--no-control"] + ["--optimizer", "adam"]
    mgrit("train", *adam, "--device", "cuda", "--capture", "--out", str(out))
    mgrit("train", *adam, "--epochs", "2", "--device", "cuda", "--capture", "--resume",
          "--out", str(out))
    losses = _losses(out)
    assert len(losses) == 8 and all(0 < loss < 10 for loss in losses), losses
    assert [r for r in records(out) if r["type"] == "probe"]


@pytest.mark.parametrize("device,caption", [("cpu", "seed 0. "), ("cuda:1", "seed 0, on cuda:1.")])
def test_a_comparison_says_where_it_was_timed(device, caption):
    from mgrit.app.compare import markdown

    row = {"ranks": 1, "test_accuracy": 0.9, "accuracy_difference_pp": 0.0,
           "test_loss": 0.3, "seconds_per_step": 0.01, "time_ratio_to_serial": 1.0}
    rows = {"serial": row, "layer-parallel": dict(row, ranks=2, time_ratio_to_serial=0.8)}
    text = markdown(rows, load(overrides=[{"training": {"device": device}}]))
    assert caption in text.splitlines()[0] + " "
