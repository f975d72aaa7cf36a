"""A full disk while a checkpoint is written: the error names the file and ENOSPC, the
temporary file is gone, the earlier checkpoint stays loadable, and a resume removes the
run's leftovers before it rewrites metrics.jsonl. /dev/full stands in for the full disk
(every write to it fails with ENOSPC), linked where the temporary file is written."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from mgrit import Config
from mgrit.app.settings import load
from mgrit.app import train
from mgrit.app.train import Run
from mgrit.nn import LayerParallel, serial_state_dict
from mgrit.nn.engine.atomic import WriteError, write_atomically

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def _full(path: Path) -> Path:
    """Make writes to `path` + '.tmp' fail as on a full disk."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.symlink_to("/dev/full")
    return tmp


def test_torch_save_by_name_hides_the_reason_that_the_writer_gives():
    # the reason for the writer: torch's own file writer loses the errno
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"a": torch.zeros(1000)}, "/dev/full")


def test_failed_write_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "state.pt"
    write_atomically(path, lambda f: torch.save({"a": torch.ones(3)}, f))
    tmp = _full(path)
    with pytest.raises(WriteError) as info:
        write_atomically(path, lambda f: torch.save({"a": torch.zeros(1000)}, f))
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value) and "ENOSPC" in str(info.value)
    assert "No space left on device" in str(info.value)
    assert not os.path.lexists(tmp)
    assert torch.equal(torch.load(path)["a"], torch.ones(3))


def test_layer_parallel_checkpoint_on_a_full_disk(tmp_path):
    torch.manual_seed(0)
    one = Config(levels=1)
    model = LayerParallel(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 4, 1.0,
                          forward=one, backward=one)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = tmp_path / "ckpt"
    path = model.save_checkpoint(folder, optimizer, epoch=1)
    saved = {k: v.clone() for k, v in model.to_serial().state_dict().items()}
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    tmp = _full(path)
    with pytest.raises(OSError) as info:
        model.save_checkpoint(folder, optimizer, epoch=2)
    assert str(path) in str(info.value) and "ENOSPC" in str(info.value)
    assert not os.path.lexists(tmp)
    assert sorted(p.name for p in folder.iterdir()) == [path.name]
    kept = serial_state_dict(folder)
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in saved)


def _settings(out: Path, epochs: int):
    return load(None, [{"data": {"name": "peaks"}, "network": {"steps": 8, "width": 8},
                        "training": {"epochs": epochs},
                        "forward": {"levels": 2, "relax": "F"},
                        "backward": {"levels": 2, "relax": "F"},
                        "output": {"dir": str(out), "progress": False}}])


def test_training_run_on_a_full_disk_keeps_its_checkpoint_and_resumes(tmp_path, monkeypatch,
                                                                      capsys):
    out = tmp_path / "run"
    Run(_settings(out, 1)).run()
    first = serial_state_dict(out / "checkpoint-0001")
    run = Run(_settings(out, 2), resume=True)
    rank_file = out / ".checkpoint-0002.tmp" / "rank00000-of-00001.pt"
    _full(rank_file)
    with pytest.raises(OSError) as info:
        run.run()
    message = str(info.value)
    assert str(rank_file) in message and "ENOSPC" in message
    assert str(out / "checkpoint-0001") in message and "--resume" in message
    assert (out / "latest").read_text() == "checkpoint-0001"
    assert not list(out.glob(".checkpoint-*")), "the failed checkpoint's folder stays"
    kept = serial_state_dict(out / "checkpoint-0001")
    assert all(torch.equal(first[k], kept[k]) for k in first)
    # the failed run wrote epoch 2's metrics; a resume on a freed disk cuts them back, after
    # removing what an interrupted write left (a stale folder, planted here)
    stale = out / ".checkpoint-0002.tmp"
    stale.mkdir()
    (stale / "rank00000-of-00001.pt.tmp").write_bytes(b"\0" * 4096)
    order = []
    truncate = train.truncate_metrics

    def watched(*args):
        order.append(("stale left", bool(list(out.glob(".checkpoint-*.tmp")))))
        truncate(*args)
    monkeypatch.setattr(train, "truncate_metrics", watched)
    capsys.readouterr()
    resumed = Run(_settings(out, 2), resume=True)
    assert order == [("stale left", False)]
    assert f"resuming from {out / 'checkpoint-0001'}: epoch 1 done" in capsys.readouterr().out
    epochs = [json.loads(line)["epoch"] for line in
              (out / "metrics.jsonl").read_text().splitlines()]
    assert set(epochs) == {1}
    resumed.run()
    assert (out / "latest").read_text() == "checkpoint-0002"


def test_metrics_on_a_full_disk_name_the_file(tmp_path):
    out = tmp_path / "run"
    run = Run(_settings(out, 1))
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").symlink_to("/dev/full")
    with pytest.raises(WriteError) as info:
        run.run()
    message = str(info.value)
    assert str(out / "metrics.jsonl") in message and "ENOSPC" in message
    assert "free some space" in message
