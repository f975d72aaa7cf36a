"""The CUDA kernels of mgrit.kernels.cuda: the build, the pure-torch twins against autograd,
(on a GPU) each kernel against its twin, and LayerParallel's CUDA path against serial
autograd: on a GPU with the kernels, anywhere with the twins in their place."""

import ctypes
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.kernels import build, cuda
from mgrit.kernels import strategies as kernel_steps
from mgrit.nn.engine import module_strategy as nn_steps

from nets import build as build_networks, data, owned_pairs, relative

ENTRY_POINTS = ["mgrit_dense_step_f32", "mgrit_dense_step_f64", "mgrit_dense_step_vjp_f32",
                "mgrit_dense_step_vjp_f64", "mgrit_dense_max_width", "mgrit_cuda_error_string"]


def _nvcc_missing() -> str | None:
    try:
        build.nvcc()
    except Exception as err:
        return str(err)
    return None


def _build_command(cache: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m mgrit.kernels.build cuda` with its cache in `cache`."""
    return subprocess.run([sys.executable, "-m", "mgrit.kernels.build", "cuda"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MGRIT_CACHE_DIR": str(cache), **env})


def _problem(B: int, S: int, d: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(B, S, d, generator=gen, dtype=dtype)
    W = torch.randn(B, d, d, generator=gen, dtype=dtype) / d ** 0.5
    b = torch.randn(B, d, generator=gen, dtype=dtype)
    g = torch.randn(B, S, d, generator=gen, dtype=dtype)
    return [t.to(device) for t in (u, W, b, g)]


def _layer_by_layer(u, W, b, dt):
    """u + dt * tanh(Linear_i(u_i)), one interval at a time."""
    return torch.stack([u[i] + dt * torch.tanh(F.linear(u[i], W[i], b[i]))
                        for i in range(len(u))])


def _relative_error(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


# (a) the build -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(_nvcc_missing() is not None, reason=f"no nvcc: {_nvcc_missing()}")
def test_build_command_compiles_the_library_into_the_cache(tmp_path):
    proc = _build_command(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "-O3 -arch=native -shared -Xcompiler -fPIC" in proc.stdout
    lib_path = Path(proc.stdout.splitlines()[-1].removeprefix("built "))
    assert lib_path.parent == tmp_path and lib_path.name.startswith("libmgrit_cuda_")
    assert [p.name for p in tmp_path.iterdir()] == [lib_path.name]
    lib = ctypes.CDLL(str(lib_path))
    for name in ENTRY_POINTS:
        assert hasattr(lib, name), name
    lib.mgrit_dense_max_width.restype = ctypes.c_int64
    assert lib.mgrit_dense_max_width(4) == 6144 and lib.mgrit_dense_max_width(8) == 3072


@pytest.mark.slow
@pytest.mark.skipif(_nvcc_missing() is not None, reason=f"no nvcc: {_nvcc_missing()}")
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_kernel_without_device_returns_an_error_code(tmp_path, monkeypatch):
    """Without a GPU a launch fails with a CUDA error code; the process is not aborted."""
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path))
    lib = build.built(build.CUDA)
    script = (
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({str(lib)!r})\n"
        "fn = lib.mgrit_dense_step_f32\n"
        "fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_double, "
        "ctypes.c_void_p]\n"
        "lib.mgrit_cuda_error_string.restype = ctypes.c_char_p\n"
        "code = fn(None, None, None, None, 2, 3, 4, 12, 16, 4, 0.5, None)\n"
        "print(code, lib.mgrit_cuda_error_string(code).decode())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    code, reason = proc.stdout.split(" ", 1)
    assert int(code) != 0 and reason.strip()


@pytest.mark.slow
def test_build_command_without_nvcc_fails_clearly(tmp_path):
    proc = _build_command(tmp_path / "cache", NVCC=str(tmp_path / "no-such-nvcc"))
    assert proc.returncode == 1
    assert "no-such-nvcc" in proc.stderr and "not an executable" in proc.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
@pytest.mark.skipif(_nvcc_missing() is not None, reason=f"no nvcc: {_nvcc_missing()}")
def test_library_is_built_on_first_use_and_again_for_changed_sources(tmp_path, monkeypatch):
    """Keyed as the C kernels are: the cache holds one library per source text, so an edited
    source is compiled anew and the old library is never loaded for it."""
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda, "_library", cuda._library.fresh())
    assert cuda.library().mgrit_dense_max_width(8) == 3072
    first = sorted((tmp_path / "cache").iterdir())
    assert len(first) == 1 and first[0].name.startswith("libmgrit_cuda_")
    edited = tmp_path / "residual_dense.cu"
    edited.write_text(build.CUDA.sources[0].read_text() + "\n// edited\n")
    monkeypatch.setattr(build, "CUDA", dataclasses.replace(build.CUDA, sources=(edited,)))
    monkeypatch.setattr(cuda, "CUDA", build.CUDA)
    monkeypatch.setattr(cuda, "_library", cuda._library.fresh())
    assert cuda.library().mgrit_dense_max_width(8) == 3072
    second = sorted((tmp_path / "cache").iterdir())
    assert len(second) == 2 and set(first) < set(second)


def test_library_failure_is_reported_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda, "_library", cuda._library.fresh())
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(RuntimeError, match="cannot be loaded: .*no-such-nvcc"):
        cuda.library()
    monkeypatch.delenv("NVCC")
    with pytest.raises(RuntimeError, match="no-such-nvcc"):
        cuda.library()


# (b) the twins against autograd ---------------------------------------------------------

@pytest.mark.parametrize("B,S,d", [(1, 1, 4), (6, 3, 7), (4, 5, 33)])
def test_reference_forward_is_the_residual_step(B, S, d):
    u, W, b, _ = _problem(B, S, d, torch.float64)
    expected = _layer_by_layer(u, W, b, 0.3)
    assert (cuda.dense_step_reference(u, W, b, 0.3) - expected).abs().max() <= 1e-12


@pytest.mark.parametrize("B,S,d", [(1, 1, 4), (6, 3, 7), (4, 5, 33)])
def test_reference_vjp_matches_autograd(B, S, d):
    u, W, b, g = _problem(B, S, d, torch.float64)
    u = u.requires_grad_()
    expected, = torch.autograd.grad(_layer_by_layer(u, W, b, 0.3), u, g)
    actual = cuda.dense_step_vjp_reference(u.detach(), W, b, g, 0.3)
    assert (actual - expected).abs().max() <= 1e-12


# argument checks (any machine) -----------------------------------------------------------

def test_available_needs_a_cuda_device_and_a_library_that_loads(monkeypatch):
    """True only with both, and without a device the library is not even built; then, on
    this machine as it is: False without a device, and with one True exactly where nvcc
    is found (the library must then build and load)."""
    loads = []

    def library(builds: bool) -> build.LazyLibrary:
        def load():
            loads.append(builds)
            if not builds:
                raise build.BuildError("nvcc refused the sources")
            return ctypes.CDLL(None)
        return build.LazyLibrary("mgrit CUDA kernels", load)

    for device, builds in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda device=device: device)
        monkeypatch.setattr(cuda, "_library", library(builds))
        loads.clear()
        assert cuda.available() is (device and builds), (device, builds)
        assert loads == ([builds] if device else []), (device, builds)
    monkeypatch.undo()
    assert cuda.available() is (torch.cuda.is_available() and _nvcc_missing() is None)


@pytest.mark.parametrize("change,error,message", [
    (lambda a: {**a, "W": a["W"][:, :, :-1]}, ValueError, "W must have shape"),
    (lambda a: {**a, "b": a["b"].float()}, TypeError, "b has dtype torch.float32"),
    (lambda a: {k: v.half() for k, v in a.items()}, TypeError, "dtype torch.float16"),
    (lambda a: {**a, "u": a["u"][0]}, ValueError, "u must have shape (B, S, d)"),
    (lambda a: {**a, "W": a["W"].transpose(1, 2)}, ValueError, "W must be contiguous"),
    (lambda a: {**a, "W": [1.0]}, TypeError, "W must be a torch.Tensor"),
    (lambda a: a, ValueError, "need CUDA tensors"),
])
def test_kernel_arguments_are_checked(change, error, message):
    u, W, b, _ = _problem(3, 2, 5, torch.float64)
    args = change({"u": u, "W": W, "b": b})
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cuda.dense_step(args["u"], args["W"], args["b"], 0.1)


def test_kernels_refuse_to_drop_autograd():
    u, W, b, g = _problem(3, 2, 5, torch.float64)
    with pytest.raises(RuntimeError, match="records no autograd graph"):
        cuda.dense_step_vjp(u, W.requires_grad_(), b, g, 0.1)


# (c) the kernels against their twins (GPU only) ------------------------------------------

# marked `gpu`: skipped without a CUDA device (tests/conftest.py)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
# W2's and W2b's shapes (256 intervals of width 32, 1 and 32 samples), tiles of 8 samples
# with partial tiles, widths off the warp size, and the one-sample path (a tile too wide
# for shared memory)
SHAPES = [(256, 1, 32), (256, 32, 32), (7, 1, 32), (5, 13, 40), (3, 9, 130), (2, 3, 800)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,S,d", SHAPES)
def test_kernels_match_their_twins(B, S, d, dtype):
    u, W, b, g = _problem(B, S, d, dtype, device="cuda")
    fwd = cuda.dense_step(u, W, b, 0.25)
    assert _relative_error(fwd, cuda.dense_step_reference(u, W, b, 0.25)) <= TOLERANCE[dtype]
    vjp = cuda.dense_step_vjp(u, W, b, g, 0.25)
    expected = cuda.dense_step_vjp_reference(u, W, b, g, 0.25)
    assert _relative_error(vjp, expected) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_take_strided_layer_views(dtype):
    """Every second layer of a stack, as LayerStack.rows gives a coarse level: no copy."""
    u, W, b, g = _problem(8, 5, 48, dtype, device="cuda")
    W2, b2 = W[::2], b[::2]
    u2, g2 = u[::2], g[::2]
    fwd = cuda.dense_step(u2, W2, b2, 0.5)
    assert _relative_error(fwd, cuda.dense_step_reference(u2, W2, b2, 0.5)) <= TOLERANCE[dtype]
    vjp = cuda.dense_step_vjp(u2, W2, b2, g2, 0.5)
    expected = cuda.dense_step_vjp_reference(u2, W2, b2, g2, 0.5)
    assert _relative_error(vjp, expected) <= TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_are_right_at_their_width_limit_and_refuse_past_it(dtype):
    limit = cuda.library().mgrit_dense_max_width(torch.finfo(dtype).bits // 8)
    assert limit == {torch.float32: 6144, torch.float64: 3072}[dtype]
    u, W, b, g = _problem(1, 2, limit, dtype, device="cuda")
    fwd = cuda.dense_step(u, W, b, 0.25)
    assert _relative_error(fwd, cuda.dense_step_reference(u, W, b, 0.25)) <= TOLERANCE[dtype]
    vjp = cuda.dense_step_vjp(u, W, b, g, 0.25)
    expected = cuda.dense_step_vjp_reference(u, W, b, g, 0.25)
    assert _relative_error(vjp, expected) <= TOLERANCE[dtype]
    u, W, b, g = _problem(1, 1, limit + 1, dtype, device="cuda")
    with pytest.raises(ValueError, match=f"width d = {limit + 1} exceeds"):
        cuda.dense_step(u, W, b, 0.1)
    with pytest.raises(ValueError, match=f"width d = {limit + 1} exceeds"):
        cuda.dense_step_vjp(u, W, b, g, 0.1)


# (d) LayerParallel's CUDA path: on a GPU, and on the CPU with the twins for kernels -------

def _device_blind_checks(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """The kernels' own argument checks (shapes, dtypes, layout within an interval, no
    autograd graph), all but the last, the device's: what the CUDA path hands a kernel
    must be what the kernel takes."""
    try:
        cuda._shape_checked(name, **tensors)
    except ValueError as err:
        if "the kernels need CUDA tensors" not in str(err):
            raise


def _counted_kernels(monkeypatch, twins: bool) -> dict[str, int]:
    """Count the calls of the CUDA kernels. With `twins`, LayerParallel takes its CUDA path
    on CPU tensors: the step strategy is chosen as for CUDA states where the kernels load
    (`chain_steps` told the states are on a CUDA device, `cuda.available()` True), and
    each kernel is its pure-torch twin, after the kernel's own argument checks."""
    calls = {"dense_step": 0, "dense_step_vjp": 0}
    for name in calls:
        kernel = getattr(cuda, f"{name}_reference" if twins else name)

        def counted(*args, _name=name, _kernel=kernel):
            calls[_name] += 1
            if twins:
                _device_blind_checks(_name, dict(zip(("u", "W", "b", "g"), args[:-1])))
            return _kernel(*args)
        monkeypatch.setattr(cuda, name, counted)
    if twins:
        choose = nn_steps.chain_steps
        monkeypatch.setattr(nn_steps, "chain_steps",
                            lambda chain, shape, dtype, device, backend:
                            choose(chain, shape, dtype, torch.device("cuda"), backend))
        monkeypatch.setattr(cuda, "available", lambda: True)
    return calls


# (forward, backward) solves: exact (one level), 3 levels converged, 3 levels inexact (2 and
# 1 cycles from a zero guess, where no converged fine level hides a wrong coarse one)
SOLVES = {"exact": (mgrit.Config(levels=1),) * 2,
          "converged": (mgrit.Config(levels=3, coarsening=2, tol=1e-13, max_iter=30,
                                     min_coarse=1),) * 2,
          "inexact": tuple(mgrit.Config(levels=3, coarsening=2, tol=0.0, max_iter=cycles,
                                        min_coarse=1) for cycles in (2, 1))}


def _dense_network_run(solves: str, device: str, ranks: int) -> list[dict]:
    """Per rank: a forward and backward pass of a dense tanh network of 16 layers, float64,
    on `ranks` virtual ranks, with the step strategies it chose, its solves' residual
    histories, its output, input gradient and parameter gradients, and those of serial
    autograd."""
    forward, backward = SOLVES[solves]

    def program(comm):
        model, serial = build_networks("dense", 16, forward, backward, comm=comm,
                                       kernels="torch")
        model, serial = model.to(device), serial.to(device)
        x, y = (t.to(device) for t in data("dense", 4))
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = model(mine), serial(theirs)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(ref, y).backward()
        passes = model._passes
        pairs = owned_pairs(model, serial, grad=True)
        return {"strategies": [type(s.prop.kernels) for solvers in (
                    passes.forward_solvers, passes.adjoint_solvers) for s in solvers.values()],
                "stats": model.stats,
                "result": [t.cpu() for t in (out.detach(), mine.grad, *(a for a, _ in pairs))],
                "serial": [t.cpu() for t in (ref.detach(), theirs.grad, *(b for _, b in pairs))]}

    return [program(None)] if ranks == 1 else run_ranks(ranks, program)


@pytest.mark.parametrize("device,solves,ranks", [
    ("cpu", "exact", 1), ("cpu", "converged", 1), ("cpu", "converged", 3),
    ("cpu", "inexact", 1), ("cpu", "inexact", 3),
    pytest.param("cuda", "exact", 1, marks=pytest.mark.gpu),
    pytest.param("cuda", "converged", 1, marks=pytest.mark.gpu),
    pytest.param("cuda", "inexact", 1, marks=pytest.mark.gpu)])
def test_layer_parallel_on_the_cuda_path_matches_autograd_and_torch_kernels(
        device, solves, ranks, monkeypatch):
    """A dense tanh network through `CudaDenseSteps` (batched steps and adjoint steps on
    the kernels, single steps and parameter cotangents on torch's): on the CPU with the
    kernels' twins, on a GPU with the kernels. Exact and converged solves: output, input
    gradient and every parameter gradient equal serial autograd's to round-off. Every
    solve: those and the residual histories equal the same solves' on torch's kernels
    (CPU). Both passes chose the CUDA strategy, and with several levels both kernels ran."""
    plain = _dense_network_run(solves, "cpu", ranks)
    calls = _counted_kernels(monkeypatch, twins=device == "cpu")
    results = _dense_network_run(solves, device, ranks)
    assert len(results) == len(plain) == ranks
    for rank, on_torch in zip(results, plain):
        assert rank["strategies"] == [kernel_steps.CudaDenseSteps] * 2
        # torch's kernels on a CPU: narrow dense tanh layers take `TorchDenseSteps`
        assert on_torch["strategies"] == [kernel_steps.TorchDenseSteps] * 2
        if solves != "inexact":
            assert relative(zip(rank["result"], rank["serial"])) <= 1e-13
        assert relative(zip(rank["result"], on_torch["result"])) <= 1e-13
        for kind in ("forward", "backward"):
            stats, config = rank["stats"][kind], SOLVES[solves][kind == "backward"]
            assert stats["residuals"] == pytest.approx(on_torch["stats"][kind]["residuals"],
                                                       rel=1e-9, abs=1e-13), kind
            if solves == "converged":
                assert stats["iterations"] < config.max_iter
                assert stats["residuals"][-1] <= config.tol
    if solves != "exact":
        assert calls["dense_step"] > 0 and calls["dense_step_vjp"] > 0, calls
