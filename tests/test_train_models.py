"""The two networks a training run can train (`mgrit.app.models`) behind one interface: a
checkpoint saved by either and loaded into a freshly built one restores the weights, the
optimizer's state and the extra record exactly, and the random-draw count reaches the
layer-parallel module itself; only a layer-parallel network gets a controller."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from mgrit.app import data as datasets
from mgrit.app.models import LayerParallelModel, SerialModel, build_model
from mgrit.app.network import make_optimizer, network_for
from mgrit.app.settings import load
from mgrit.nn import Controller


def _settings(serial: bool, seed: int):
    return load(None, [{"data": {"name": "peaks", "samples": 200},
                        "network": {"steps": 8, "width": 6},
                        "training": {"serial": serial, "seed": seed, "optimizer": "adam"},
                        "forward": {"levels": 2, "relax": "F"},
                        "backward": {"levels": 2, "relax": "F"}}])


def _built(serial: bool, seed: int):
    settings = _settings(serial, seed)
    split = datasets.load("peaks", samples=200)
    torch.manual_seed(seed)
    model = build_model(settings, network_for(settings, split), None, None)
    return model, make_optimizer(settings, model.module.parameters()), split


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.to_serial().state_dict().items()}


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "layer-parallel"])
def test_checkpoint_round_trip_restores_weights_optimizer_and_extra(tmp_path, serial):
    model, optimizer, split = _built(serial, seed=1)
    assert isinstance(model, SerialModel if serial else LayerParallelModel)
    x, y = split.x_train[:16], split.y_train[:16]
    for _ in range(2):     # the optimizer's moments are then not zero
        model.train_step(optimizer, nn.functional.cross_entropy, x, y, None, None)
    saved, moments = _weights(model), optimizer.state_dict()
    extra = {"epoch": 3, "generator": torch.Generator().manual_seed(5).get_state(),
             "draw_step": 7, "partial": {"step": 2}}
    model.save(tmp_path / "checkpoint", optimizer, extra)

    fresh, fresh_optimizer, _ = _built(serial, seed=2)
    before = _weights(fresh)
    assert any(not torch.equal(before[k], saved[k]) for k in saved), "seeds must differ"
    got = fresh.load(tmp_path / "checkpoint", fresh_optimizer)
    assert got["epoch"] == 3 and got["partial"] == {"step": 2} and got["draw_step"] == 7
    assert torch.equal(got["generator"], extra["generator"])
    restored = _weights(fresh)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    state = fresh_optimizer.state_dict()["state"]
    assert len(state) == len(moments["state"]) > 0
    for key, value in moments["state"].items():
        assert torch.equal(state[key]["exp_avg"], value["exp_avg"])
    # the next step from the restored state is the step the saved run takes
    loss_a = model.train_step(optimizer, nn.functional.cross_entropy, x, y, None, None)[0]
    loss_b = fresh.train_step(fresh_optimizer, nn.functional.cross_entropy, x, y, None, None)[0]
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model).values(),
                                                  _weights(fresh).values()))


def test_draw_count_is_the_layer_parallel_modules_own():
    model, _, _ = _built(serial=False, seed=1)
    model.draw_step = 5
    assert model.module.draw_step == 5
    model.module.draw_step = 9
    assert model.draw_step == 9



def test_only_an_enabled_control_of_a_layer_parallel_network_gives_a_controller():
    control = _settings(False, 1).control
    assert control.enabled                                      # the default
    off = replace(control, enabled=False)
    layer_parallel, _, _ = _built(serial=False, seed=1)
    serial, _, _ = _built(serial=True, seed=1)
    assert isinstance(layer_parallel.controller(control), Controller)
    assert layer_parallel.controller(off) is None
    assert serial.controller(control) is None and serial.controller(off) is None


def test_serial_draws_count_only_with_keyed_dropout():
    model, optimizer, split = _built(serial=True, seed=1)
    assert not model.keyed_draws          # a dense network has no dropout to key
    model.train_step(optimizer, nn.functional.cross_entropy, split.x_train[:8],
                     split.y_train[:8], None, None)
    assert model.draw_step == 0 and model.stats == {}
