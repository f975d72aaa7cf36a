"""The step-strategy contract (`mgrit.kernels.contract`): a strategy that lacks a method the
propagators call is refused when it is chosen, with a message naming the method, and each
class is checked once; mgrit's own strategies meet it."""

import pytest
import torch
from torch import nn

from mgrit.kernels import contract, strategies
from mgrit.kernels.chain import Chain
from mgrit.nn.engine import module_strategy

from nets import build, data


class _Minimal:
    """The least a strategy that keeps no op outputs must have: f(u) = -u."""

    skips_zeros = False
    keeps_values = False

    def step(self, layer, t, u, dt):
        return u - dt * u

    def batch(self, t, states, dt):
        return states - dt * states

    def wants_values(self, want_params):
        return False

    def vjp(self, t, us, ws, dt, values, want_params):
        return ws - dt * ws, None

    def vjp_single(self, layer, u, w, dt):
        return w - dt * w


class _NoVjp(_Minimal):
    vjp = None


class _KeepsNothing(_Minimal):
    keeps_values = True          # promises kept outputs but has none of their methods


class _HalfPhases(_Minimal):
    def program_parallel(self, values, adjoint):
        return 1

    def program(self, tensors, rows, dt):
        return None


class _WrongArguments(_Minimal):
    def batch(self, t, states):
        return states


def test_a_strategy_without_a_required_method_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"_NoVjp is not a StepStrategy: it lacks vjp"):
        contract.check_strategy(_NoVjp())
    with pytest.raises(TypeError, match=r"KeptStrategy .*lacks step_into, batch_into, values"):
        contract.check_strategy(_KeepsNothing())
    with pytest.raises(TypeError, match=r"part of PhaseStrategy but lacks keep_program, "
                                        r"vjp_program, phase_values, phase_cotangents"):
        contract.check_strategy(_HalfPhases())
    with pytest.raises(TypeError, match=r"batch \(cannot be called as batch\(t, states, dt\)\)"):
        contract.check_strategy(_WrongArguments())
    assert contract.check_strategy(_Minimal()) == contract.Contract(phases=False)


def test_each_class_is_checked_once(monkeypatch):
    calls = []
    missing = contract._missing
    monkeypatch.setattr(contract, "_missing", lambda *a: calls.append(a) or missing(*a))
    monkeypatch.setattr(contract, "_CHECKED", {})
    first = contract.check_strategy(_Minimal())
    checked = len(calls)
    assert checked >= 2            # StepStrategy, SingleAdjoint and PhaseStrategy
    assert contract.check_strategy(_Minimal()) is first
    assert len(calls) == checked


def test_the_strategies_mgrit_chooses_meet_the_contract():
    """Every strategy class of mgrit passes; the dense tanh ones on a CPU offer compiled
    phases (they define `program`), torch's chain and the CUDA kernels do not."""
    chain = Chain.of(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    for cls in (strategies.ChainSteps, strategies.NativeDenseSteps,
                strategies.TorchDenseSteps, strategies.CudaDenseSteps,
                module_strategy.ModuleSteps):
        strategy = cls.__new__(cls)
        assert contract.has_phases(strategy) == hasattr(cls, "program"), cls
    assert contract.has_phases(strategies.TorchDenseSteps.__new__(strategies.TorchDenseSteps))
    chosen = strategies.chain_steps(chain, torch.Size([3, 4]), torch.float64,
                                    torch.device("cpu"), "torch")
    assert contract.has_phases(chosen)


def test_layer_parallel_refuses_a_broken_strategy_before_solving(monkeypatch):
    """A strategy lacking `vjp` stops the forward pass at its choice, naming the method,
    before any step runs."""
    stepped = []

    class Broken(_NoVjp):
        def batch(self, t, states, dt):
            stepped.append(1)
            return super().batch(t, states, dt)

    monkeypatch.setattr(module_strategy, "chain_steps", lambda *a: Broken())
    model, _ = build("dense", 16)
    x, _ = data("dense", 4)
    with pytest.raises(TypeError, match="Broken is not a StepStrategy: it lacks vjp"):
        model(x)
    assert not stepped
