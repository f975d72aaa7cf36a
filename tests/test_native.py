"""The native (C) kernels against torch, at their limits and on random shapes, their build
(a failed one fails these tests; only a missing compiler skips them), and their use by the
layer kernels."""

import ctypes
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mgrit
from mgrit.comm.virtual import run_ranks
from mgrit.kernels import build as kernel_build
from mgrit.kernels import chain, choice, dense, native, strategies
from mgrit.kernels.chain import Chain

from nets import build, data, owned_pairs, relative


def no_compiler() -> str | None:
    """Why no C compiler is found here (none named by $CC, none on PATH), or None. A
    compiler that $CC names counts as found: if it does not run, the build is broken."""
    if os.environ.get("CC"):
        return None
    try:
        kernel_build.c_compiler()
    except kernel_build.BuildError as err:
        return str(err)
    return None


def load_native() -> None:
    """Skip the running test where no C compiler is found; otherwise load the native
    kernels, so that a build that fails with a compiler at hand (a compile error, a missing
    entry point, a cache that cannot be written) fails the test with the compiler's message.
    `native.available()` cannot tell these apart: it is False for all of them."""
    reason = no_compiler()
    if reason is not None:
        pytest.skip(reason)
    native.library()


@pytest.fixture
def native_kernels() -> None:
    load_native()


needs_native = pytest.mark.usefixtures("native_kernels")

# (N, Ci, Co, H, W, KH, KW): W1's layer, odd and rectangular kernels, 1x1, single pixels
SHAPES = [(50, 3, 3, 28, 28, 3, 3), (2, 2, 5, 7, 9, 5, 5), (3, 4, 1, 5, 6, 1, 1),
          (1, 1, 1, 1, 1, 3, 3), (2, 3, 6, 4, 11, 3, 1), (4, 5, 7, 6, 3, 1, 5),
          (2, 9, 2, 17, 5, 3, 3)]


def _operands(shape, dtype, seed=0):
    n, ci, co, h, w, kh, kw = shape
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, ci, h, w, generator=gen, dtype=dtype),
            torch.randn(co, ci, kh, kw, generator=gen, dtype=dtype),
            torch.randn(co, generator=gen, dtype=dtype),
            torch.randn(n, co, h, w, generator=gen, dtype=dtype))


@needs_native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
def test_conv2d_and_its_weight_gradient_equal_torch(shape, dtype, tol):
    x, w, b, g = _operands(shape, dtype)
    pad = (w.shape[2] // 2, w.shape[3] // 2)
    exact = F.conv2d(x.double(), w.double(), b.double(), padding=pad)
    for bias, ref in ((b, exact), (None, exact - b.double()[:, None, None])):
        y = native.conv2d(x, w, bias)
        assert y.dtype == dtype and y.shape == ref.shape
        assert float((y.double() - ref).norm() / ref.norm()) <= tol
    ref = torch.nn.grad.conv2d_weight(x.double(), w.shape, g.double(), padding=pad)
    gw = native.conv2d_weight(x, w.shape, g)
    assert gw.dtype == dtype and float((gw.double() - ref).norm() / ref.norm()) <= tol


@needs_native
def test_conv2d_takes_strided_inputs_and_empty_batches():
    x, w, b, _ = _operands(SHAPES[1], torch.float64)
    wide = x.transpose(2, 3).contiguous().transpose(2, 3)       # same values, other strides
    assert not wide.is_contiguous()
    assert torch.allclose(native.conv2d(wide, w, b), F.conv2d(x, w, b, padding=2),
                          rtol=1e-13, atol=1e-13)
    assert native.conv2d(x[:0], w, b).shape == (0, 5, 7, 9)


# conv2d.c's geometry: outputs in tiles of 2 vectors of 64 bytes (32 float32 or 16 float64
# values) over rows of the padded width W + KW - 1, output channels in blocks of 4. Shapes
# whose H (W + KW - 1) fills whole tiles of either dtype exactly or by one value more, with
# 4, 5, 8 and 9 output channels, and kernels larger than the image.
EDGES = [(2, 2, 4, 2, 6, 3, 3), (1, 3, 5, 1, 15, 1, 3), (2, 2, 8, 4, 6, 3, 3),
         (1, 2, 9, 3, 9, 5, 3), (3, 1, 4, 1, 16, 1, 1), (2, 3, 5, 1, 17, 3, 1),
         (2, 2, 3, 1, 2, 7, 5), (1, 4, 6, 3, 2, 5, 7)]


def _random_shape(seed):
    """(N, Ci, Co, H, W, KH, KW) drawn with `seed`: odd kernels of 1 to 7 taps a side,
    images from a single pixel to wider than a tile."""
    gen = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    return (draw(1, 4), draw(1, 6), draw(1, 9), draw(1, 19), draw(1, 19),
            2 * draw(0, 3) + 1, 2 * draw(0, 3) + 1)


@needs_native
@pytest.mark.parametrize("shape", EDGES + [_random_shape(seed) for seed in range(12)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_conv2d_and_its_weight_gradient_equal_torch_on_tile_edges_and_random_shapes(
        shape, dtype, tol):
    """Against torch's float64 convolution and weight gradient: a tile or channel block
    that the image or the channels fill only in part must read zeros, not what lies past
    the data."""
    x, w, b, g = _operands(shape, dtype, seed=sum(shape))
    pad = (w.shape[2] // 2, w.shape[3] // 2)
    ref = F.conv2d(x.double(), w.double(), b.double(), padding=pad)
    assert relative([(native.conv2d(x, w, b), ref)]) <= tol
    assert relative([(native.conv2d(x, w), ref - b.double()[:, None, None])]) <= tol
    ref = torch.nn.grad.conv2d_weight(x.double(), w.shape, g.double(), padding=pad)
    gw = native.conv2d_weight(x, w.shape, g)
    assert gw.dtype == dtype and relative([(gw, ref)]) <= tol


@pytest.mark.parametrize("args,error,words", [
    (((2, 3, 5, 5), (3, 3, 2, 3), None), ValueError, "odd kernel"),
    (((2, 3, 5, 5), (3, 4, 3, 3), None), ValueError, "Co, Ci, KH, KW"),
    (((2, 3, 5), (3, 3, 3, 3), None), ValueError, "N, Ci, H, W"),
    (((2, 3, 5, 5), (3, 3, 3, 3), (4,)), ValueError, "b must have shape"),
])
def test_conv2d_names_bad_arguments(args, error, words):
    x, w, b = (None if s is None else torch.zeros(s) for s in args)
    with pytest.raises(error, match=words):
        native.conv2d(x, w, b)


def test_conv2d_refuses_mixed_dtypes_and_a_wrong_cotangent():
    x = torch.zeros(2, 3, 5, 5)
    with pytest.raises(TypeError, match="w torch.float64"):
        native.conv2d(x, torch.zeros(3, 3, 3, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 or float64"):
        native.conv2d(x.half(), torch.zeros(3, 3, 3, 3).half())
    with pytest.raises(ValueError, match=r"g must have shape \(2, 4, 5, 5\)"):
        native.conv2d_weight(x, (4, 3, 3, 3), torch.zeros(2, 3, 5, 5))


@pytest.mark.parametrize("forced", [True, False])
def test_layer_kernels_match_serial_autograd_with_either_convolution(forced, monkeypatch):
    """Exact solves (levels=1) of a conv network, float64, with the native kernels forced on
    and off: output and every gradient equal serial autograd's, and the forced choice is
    the one that ran."""
    if forced:
        load_native()
    monkeypatch.setattr(choice, "_NATIVE_CHOICE", {})
    monkeypatch.setattr(choice, "_native_faster", lambda fns, operands: forced)
    calls = []
    for name in ("conv2d", "conv2d_weight"):
        original = getattr(native, name)
        monkeypatch.setattr(native, name,
                            lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    exact = mgrit.Config(levels=1)
    model, serial = build("conv", 7, exact, exact)
    x, y = data("conv", 4)
    out, ref = model(x), serial(x)
    assert float((out - ref).detach().norm() / ref.detach().norm()) <= 1e-12
    nn.functional.cross_entropy(out, y).backward()
    nn.functional.cross_entropy(ref, y).backward()
    assert relative(owned_pairs(model, serial, grad=True)) <= 1e-12
    assert set(calls) == ({"conv2d", "conv2d_weight"} if forced else set())


@needs_native
def test_operands_that_autograd_tracks_go_to_torch(monkeypatch):
    x, w, b, _ = _operands(SHAPES[1], torch.float64)
    monkeypatch.setattr(choice, "_NATIVE_CHOICE", {})
    monkeypatch.setattr(choice, "_native_faster", lambda fns, operands: True)
    w.requires_grad_()
    y = chain._conv2d(x, w, b, (2, 2), True)
    y.sum().backward()
    ref = torch.nn.grad.conv2d_weight(x, w.shape, torch.ones_like(y), padding=2)
    assert torch.allclose(w.grad, ref, rtol=1e-12, atol=1e-12)
    with torch.no_grad():         # the same operands without a graph take the native kernel
        assert choice._native_chosen("conv2d", (None, None), (x, w, b))


def test_the_choice_is_made_again_for_another_thread_count(monkeypatch):
    """torch's convolutions use every thread they may, the native kernel one: a choice timed
    at one thread count does not hold at another."""
    x, w, b, _ = _operands(SHAPES[0], torch.float32)
    monkeypatch.setattr(choice, "_NATIVE_CHOICE", {})
    monkeypatch.setattr(native, "available", lambda: True)
    timed = []
    monkeypatch.setattr(choice, "_native_faster",
                        lambda fns, operands: timed.append(torch.get_num_threads()) or
                        torch.get_num_threads() == 1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            assert choice._native_chosen("conv2d", (None, None), (x, w, b)) == (n == 1)
    finally:
        torch.set_num_threads(threads)
    assert timed == [1, 2]           # once per thread count


def test_mgrit_conv_selects_torch_and_refuses_unknown_values(monkeypatch):
    x, w, b, _ = _operands(SHAPES[0], torch.float32)
    monkeypatch.setattr(choice, "_NATIVE_CHOICE", {})
    monkeypatch.setattr(choice, "_native_faster", lambda fns, operands: True)
    # native kernels not allowed (a network's kernels="torch"): torch's, nothing timed
    assert torch.equal(chain._conv2d(x, w, b, (1, 1), False), F.conv2d(x, w, b, padding=1))
    assert choice._NATIVE_CHOICE == {}
    # the argument wins over the environment, which is only the default
    monkeypatch.setenv("MGRIT_NATIVE", "torch")
    assert choice.native_backend() == "torch"
    assert choice.native_backend("kernels") == "kernels"
    monkeypatch.setenv("MGRIT_NATIVE", "fast")
    with pytest.raises(ValueError, match="expected one of auto, kernels, torch, torch-steps"):
        choice.native_backend()
    with pytest.raises(ValueError, match="kernels='native': expected one of auto, kernels"):
        choice.native_backend("native")
    monkeypatch.delenv("MGRIT_NATIVE")
    torch.use_deterministic_algorithms(True)
    try:
        assert choice.native_backend() == "torch"
        assert choice.native_backend("kernels") == "torch"
        assert choice.native_backend("torch-steps") == "torch-steps"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_network_refuses_an_unknown_kernels_choice_before_any_work(monkeypatch):
    built = []
    with pytest.raises(ValueError, match="kernels='fast': expected one of auto, kernels, torch"):
        mgrit.LayerParallel(lambda: built.append(1) or nn.Linear(4, 4), 4, kernels="fast")
    assert built == []               # no layer was made


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_without_a_compiler_the_layer_kernels_use_torch(tmp_path):
    code = ("import torch, torch.nn.functional as F\n"
            "from mgrit.kernels import chain, choice, native\n"
            "x, w = torch.randn(50, 3, 28, 28), torch.randn(3, 3, 3, 3)\n"
            "assert not native.available()\n"
            "assert torch.equal(chain._conv2d(x, w, None, (1, 1), True),\n"
            "                   F.conv2d(x, w, padding=1))\n"
            "assert not any(choice._NATIVE_CHOICE.values())\n"
            "try:\n    native.conv2d(x, w)\nexcept RuntimeError as err:\n    print(err)\n")
    proc = _child(code, CC=str(tmp_path / "no-such-cc"), MGRIT_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "cannot be loaded" in proc.stdout and "no-such-cc" in proc.stdout


@needs_native
def test_the_library_is_built_once_into_the_cache(tmp_path):
    code = ("from mgrit.kernels import native\nassert native.available()\n"
            "print(native.library()._name)")
    first = _child(code, MGRIT_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert os.path.dirname(path) == str(tmp_path)
    built = os.stat(path).st_mtime_ns
    second = _child(code, MGRIT_CACHE_DIR=str(tmp_path))
    assert second.returncode == 0 and second.stdout.strip() == path, second.stderr
    assert os.stat(path).st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]


@needs_native
def test_a_build_without_the_vector_math_library_falls_back_to_the_scalar_tanh(tmp_path,
                                                                              monkeypatch):
    """The C recipe links glibc's vector math library first; where that link fails (here a
    library that does not exist stands for a missing libmvec), the next flag set builds a
    library whose dense kernels use the scalar tanh, and its steps agree with the linked
    build's to rounding."""
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path))
    assert any("-lmvec" in flags for flags in kernel_build.C.flag_sets[:1])
    missing = dataclasses.replace(
        kernel_build.C, flag_sets=(("-O3", "-DMGRIT_LIBMVEC", "-Wl,-z,defs",
                                    "-Wl,--no-as-needed", "-lmgrit_no_such_library"),
                                   ("-O3",)))
    path = kernel_build.built(missing, report=lambda line: None)
    assert path == missing.path(kernel_build.c_compiler(), ("-O3",))
    scalar = ctypes.CDLL(str(path))
    assert scalar.mgrit_dense_vector_tanh() == 0
    assert native.library().mgrit_dense_vector_tanh() == int(native.vector_tanh())
    w, b, u, _, _ = _dense_operands(3, 2, 13, torch.float64)
    outs = []
    for lib in (scalar, native.library()):
        fn = lib.mgrit_dense_tanh_f64
        fn.argtypes, fn.restype = native.library().mgrit_dense_tanh_f64.argtypes, ctypes.c_int
        out = torch.empty_like(u)
        assert fn(u.data_ptr(), u.stride(0), w.data_ptr(), w.stride(0), b.data_ptr(),
                  b.stride(0), None, 0, out.data_ptr(), out.stride(0), None, 0, 0.3, 3, 2,
                  13) == 0
        outs.append(out)
    assert relative([(outs[0], outs[1])]) <= 1e-15


def _raised(fn) -> BaseException | None:
    """What fn raised, or None; pytest's skip is caught too (it is no Exception)."""
    try:
        fn()
    except BaseException as err:
        return err
    return None


@pytest.mark.parametrize("breakage", ["compile error", "missing entry point",
                                      "cache not writable", "$CC not executable",
                                      "no compiler"])
def test_a_broken_build_fails_the_tests_that_need_it_and_only_no_compiler_skips(
        breakage, tmp_path, monkeypatch):
    """`load_native`, which every test of the native kernels runs first, against builds
    that fail where a compiler is found: each raises the compiler's or the loader's message,
    not a skip, while `native.available()` is False as ever (the layer kernels then use
    torch). Only where no compiler is found at all does it skip, without building."""
    if breakage not in ("$CC not executable", "no compiler") and no_compiler():
        pytest.skip(no_compiler())
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_library", native._library.fresh())
    recipe = kernel_build.C
    if breakage == "compile error":
        source = tmp_path / "broken.c"
        source.write_text("int mgrit_conv2d_f32(void) { return undeclared_here; }\n")
        recipe = dataclasses.replace(recipe, sources=(source,))
        words = [str(source), "undeclared_here"]
    elif breakage == "missing entry point":      # conv2d.c alone: no dense kernels
        recipe = dataclasses.replace(recipe, sources=recipe.sources[:1])
        words = ["mgrit_dense_tanh_f32"]
    elif breakage == "cache not writable":       # the cache folder would be below a file
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path / "file" / "cache"))
        words = [str(tmp_path / "file" / "cache")]
    elif breakage == "$CC not executable":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        words = ["no-such-cc", "which is not an executable"]
    else:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
        monkeypatch.setattr(native, "_library", kernel_build.LazyLibrary(
            "native kernels", lambda: pytest.fail("built without a compiler")))
    monkeypatch.setattr(native, "C", recipe)
    err = _raised(load_native)
    if breakage == "no compiler":
        assert isinstance(err, pytest.skip.Exception), err
        assert "no C compiler: set $CC or put cc, gcc or clang on PATH" in str(err)
        return
    assert not isinstance(err, pytest.skip.Exception), f"skipped: {err}"
    assert isinstance(err, RuntimeError), err
    assert "the mgrit native kernels cannot be loaded" in str(err)
    assert all(word in str(err) for word in words), str(err)
    assert not native.available()


@pytest.mark.parametrize("name,methods", [
    ("w1", ["layer-parallel mgrit", "sequential stepping, mgrit kernels",
            "layer-parallel mgrit, torch kernels"]),
    ("w2", ["layer-parallel mgrit", "sequential stepping, mgrit kernels",
            "layer-parallel mgrit, torch kernels"])])
def test_the_bench_times_networks_with_native_kernels_also_with_torch_kernels(name, methods,
                                                                              monkeypatch):
    from benchmarks import training as bench_train

    seen = []
    parallel_model = bench_train.parallel_model
    monkeypatch.setattr(bench_train, "parallel_model",
                        lambda work, comm=None, kernels=None: seen.append(
                            (kernels, os.environ.get("MGRIT_NATIVE"), work.forward.levels,
                             work.backward.levels)) or parallel_model(work, comm=comm,
                                                                     kernels=kernels))
    monkeypatch.setattr(bench_train, "median_seconds", lambda fn, repeats, barrier: 0.0)
    monkeypatch.setenv("MGRIT_NATIVE", "auto")
    work = bench_train.TRAINING_WORKLOADS[name]()
    out = bench_train.layer_parallel_methods(work, 1)
    assert list(out) == methods
    levels = (work.forward.levels, work.backward.levels)
    # the sequential row steps through the same code with one level each way; the torch
    # row asks for torch's kernels by argument and leaves the environment alone
    assert seen == [(None, "auto", *levels), (None, "auto", 1, 1),
                    ("torch", "auto", *levels)]


@needs_native
def test_a_cpu_with_other_features_gets_its_own_build(tmp_path, monkeypatch):
    """-march=native code built on one CPU can fault on another of the same model name with
    other vector units: the cache key holds the CPU's feature flags."""
    if os.path.exists("/proc/cpuinfo"):
        assert "flags" in kernel_build.cpu() or "Features" in kernel_build.cpu()
    monkeypatch.setenv("MGRIT_CACHE_DIR", str(tmp_path))
    paths = []
    for flags in ("flags : sse2 avx2", "flags : sse2 avx2 avx512f"):
        recipe = dataclasses.replace(kernel_build.C,
                                     hardware=lambda f=flags: "model name : AMD EPYC\n" + f)
        paths.append(kernel_build.build(recipe, ("-O3",)))
    assert paths[0] != paths[1] and all(p.exists() for p in paths)


# Dense tanh steps ------------------------------------------------------------------------

def _dense_operands(count, rows, d, dtype, seed=0):
    """Every other layer of a stack of 2*count (strided weights, as relaxation batches have
    them), states (count, rows, d), adjoint states and g."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2 * count, d, d, generator=gen, dtype=dtype)[::2] / d ** 0.5
    b = torch.randn(2 * count, d, generator=gen, dtype=dtype)[::2]
    u, a, g = (torch.randn(count, rows, d, generator=gen, dtype=dtype) for _ in range(3))
    return w, b, u, a, g


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
@pytest.mark.parametrize("count,rows,d", [(5, 3, 8), (1, 1, 32), (4, 2, 13), (2, 1, 1)])
def test_dense_tanh_step_and_adjoint_equal_autograd(dtype, tol, count, rows, d):
    w, b, u, a, g = _dense_operands(count, rows, d, dtype)
    x = u.double().requires_grad_()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    dt = 0.3
    y = torch.tanh(x @ wd.transpose(1, 2) + bd[:, None])
    step = x + dt * y
    du, dw, db = torch.autograd.grad(step, (x, wd, bd), a.double())
    y, step = y.detach(), step.detach()

    out, keep = torch.empty_like(u), torch.empty_like(u)
    native.dense_tanh(u, w, b, dt, out, None, keep)
    assert relative([(out, step), (keep, y)]) <= tol
    lean = [torch.empty_like(u), torch.empty_like(u)]        # the layer kernels' wrapper
    assert dense.NativeDense(dtype, d).step_batch(u, w, b, dt, lean[0], None, lean[1])
    assert torch.equal(lean[0], out) and torch.equal(lean[1], keep)
    native.dense_tanh(u, w, b, dt, out, g)
    assert relative([(out, g.double() + step)]) <= tol
    inplace = u.clone()                                  # out may be the input itself
    native.dense_tanh(inplace, w, b, dt, inplace, g)
    assert torch.equal(inplace, out)
    for n in range(count):                               # one layer at a time
        one = torch.empty_like(u[n])
        native.dense_tanh(u[n], w[n], b[n], dt, one)
        assert relative([(one, step[n])]) <= tol

    adj, gw, gb = torch.empty_like(a), torch.empty_like(w), torch.empty_like(b)
    native.dense_tanh_vjp(w, a, keep, dt, adj, None, u, (gw, gb))
    assert relative([(adj, du)]) <= tol
    # the parameter cotangents are not scaled by dt
    assert relative([(dt * gw, dw), (dt * gb, db)]) <= tol
    native.dense_tanh_vjp(w, a, keep, dt, adj, g)
    assert relative([(adj, g.double() + du)]) <= tol
    native.dense_tanh_vjp(w, a, keep, dt, None, None, u, (gw, None))   # parameters alone
    assert relative([(dt * gw, dw)]) <= tol


def _bad_dense(case):
    w, b, u, a, g = _dense_operands(3, 2, 4, torch.float64)
    out = torch.empty_like(u)
    calls = {
        "wide": lambda: native.dense_tanh(torch.zeros(1, 2000), torch.zeros(2000, 2000),
                                          None, 0.1, torch.zeros(1, 2000)),
        "square": lambda: native.dense_tanh(u, w[:, :3], b, 0.1, out),
        "state": lambda: native.dense_tanh(u[..., :3], w, b, 0.1, out),
        "dtype": lambda: native.dense_tanh(u.float(), w, b, 0.1, out),
        "count": lambda: native.dense_tanh(u[:2], w, b, 0.1, out[:2]),
        "entries": lambda: native.dense_tanh(u.transpose(1, 2), w, b, 0.1, out),
        "single": lambda: native.dense_tanh(torch.zeros(2, 8, dtype=u.dtype)[:, ::2], w[0], b[0],
                                            0.1, out[0]),
        "half": lambda: native.dense_tanh(u.half(), w.half(), b.half(), 0.1, out.half()),
        "grads": lambda: native.dense_tanh_vjp(w, a, u, 0.1, out, x=u),
    }
    return calls[case]


@pytest.mark.parametrize("case,error,words", [
    ("wide", ValueError, "width 2000 is above the kernels' limit of 1024"),
    ("square", ValueError, "w must be (d, d) or (count, d, d), got (3, 3, 4)"),
    ("state", ValueError, "states must be (..., 4) with a leading dimension of 3"),
    ("dtype", TypeError, "u must be a CPU tensor of torch.float64, got torch.float32"),
    ("count", ValueError, "u must have shape (3, 2, 4), got (2, 2, 4)"),
    ("entries", ValueError, "states must be (..., 4)"),
    ("single", ValueError, "u must be contiguous"),
    ("half", TypeError, "float32 or float64 tensors, got w of torch.float16"),
    ("grads", ValueError, "the parameter cotangents need x and grads together")])
def test_dense_tanh_names_bad_arguments(case, error, words):
    with pytest.raises(error) as info:
        _bad_dense(case)()
    assert words in str(info.value)


@needs_native
def test_dense_tanh_refuses_entries_that_are_not_contiguous():
    w, b, u, _, _ = _dense_operands(3, 4, 4, torch.float64)
    wide = torch.zeros(3, 4, 8, dtype=torch.float64)[..., ::2]      # rows 8 values apart
    with pytest.raises(ValueError, match="each entry of out must be contiguous"):
        native.dense_tanh(u, w, b, 0.1, wide)


def _count_native(monkeypatch):
    calls = []
    for name in ("step", "step_batch", "vjp", "vjp_single"):
        original = getattr(dense.NativeDense, name)
        monkeypatch.setattr(dense.NativeDense, name,
                            lambda self, *a, _f=original, _n=name, **k:
                            calls.append(_n) or _f(self, *a, **k))
    return calls


@needs_native
@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_dense_networks_agree_with_and_without_the_native_steps(backend, monkeypatch):
    """An inexact solve (two levels, one backward cycle: single steps, batches, the
    adjoint's recorded gradients) of a dense tanh network, float64: output and gradients
    with the native kernels equal those of torch's kernels to rounding; the native kernels
    ran for single and batched forward steps, single adjoint steps and adjoint batches, and
    only where the network's `kernels` allow them ("kernels": step by step, the twin of the compiled
    phases that tests/test_compiled.py checks)."""
    config = mgrit.Config(levels=2, coarsening=3, max_iter=1, tol=0.0)
    x, y = data("dense", 4)
    results = {}
    for mode in ("torch", backend):
        calls = _count_native(monkeypatch) if mode == backend else []
        model, _ = build("dense", 17, config, config, kernels=mode)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        results[mode] = [out.detach()] + [p.grad for p in model.parameters()]
        monkeypatch.undo()
    assert relative(list(zip(results[backend], results["torch"]))) <= 1e-12
    if backend == "kernels":
        assert {"step", "step_batch", "vjp", "vjp_single"} <= set(calls)
    else:
        assert calls == []


@needs_native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_adjoint_step_maps_a_zero_cotangent_to_g_without_reading_y(dtype):
    """The single adjoint kernel makes the adjoint's zero check itself: a cotangent of
    zeros (also -0.0) gives out = g, or zero without g, and the kept tanh y is not read
    (NaN there would show); a NaN in the cotangent is not zero."""
    w, _, _, a, g = _dense_operands(1, 3, 8, dtype)
    kernels = dense.NativeDense(dtype, 8)
    nan = torch.full_like(a[0], float("nan"))
    zero = torch.zeros_like(a[0])
    zero[1, 2] = -0.0
    out = torch.full_like(a[0], 7.0)
    assert kernels.vjp_single(w[0], zero, nan, 0.3, out, g[0])
    assert torch.equal(out, g[0])
    assert kernels.vjp_single(w[0], zero, nan, 0.3, out)
    assert torch.equal(out, torch.zeros_like(out))
    inplace = g[0].clone()                              # out may be g itself
    assert kernels.vjp_single(w[0], zero, nan, 0.3, inplace, inplace)
    assert torch.equal(inplace, g[0])
    zero[2, 5] = float("nan")
    assert kernels.vjp_single(w[0], zero, a[0], 0.3, out, g[0])
    assert out[2].isnan().any() and not out[:2].isnan().any()


@needs_native
def test_adjoint_batches_skip_zero_entries_without_reading_their_y_or_x():
    """In a batch, an entry whose cotangent is all zeros gets out = g and zero parameter
    cotangents, whatever its y and x hold; the other entries are those of the whole batch
    computed with every entry's real values."""
    w, b, u, a, g = _dense_operands(4, 3, 8, torch.float64)
    y = torch.tanh(u @ w.transpose(1, 2) + b[:, None])
    a[1] = 0.0
    a[3] = 0.0
    full = [torch.empty_like(a), torch.empty_like(w), torch.empty_like(b)]
    native.dense_tanh_vjp(w, a, y, 0.3, full[0], g, u, (full[1], full[2]))
    spoilt_y, spoilt_u = y.clone(), u.clone()
    spoilt_y[[1, 3]] = float("nan")
    spoilt_u[[1, 3]] = float("nan")
    got = [torch.full_like(t, 7.0) for t in full]
    native.dense_tanh_vjp(w, a, spoilt_y, 0.3, got[0], g, spoilt_u, (got[1], got[2]))
    assert all(torch.equal(x, z) for x, z in zip(got, full))
    assert torch.equal(got[0][[1, 3]], g[[1, 3]])
    assert not got[1][[1, 3]].any() and not got[2][[1, 3]].any()
    assert got[1][[0, 2]].abs().sum() > 0 and got[2][[0, 2]].abs().sum() > 0


@needs_native
def test_dense_networks_on_several_ranks_agree_with_and_without_the_native_steps(
        monkeypatch):
    """On 3 virtual ranks, where the adjoint's final sweep marches the F-points that a rank
    shares with the previous one (recorded single steps): output and every rank's
    gradients with the native kernels equal those of torch's kernels to rounding, and the
    recorded single steps ran natively (step by step, kernels="kernels": compiled
    phases record them in one call, tests/test_compiled.py)."""
    config = mgrit.Config(levels=2, coarsening=3, max_iter=1, tol=0.0)
    x, y = data("dense", 4)
    recorded = []
    original = strategies.NativeDenseSteps.record_single_into
    monkeypatch.setattr(strategies.NativeDenseSteps, "record_single_into",
                        lambda self, *a: recorded.append(original(self, *a)) or recorded[-1])

    def program(comm, mode):
        model, _ = build("dense", 17, config, config, comm=comm, kernels=mode)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        return [out.detach()] + [p.grad for p in model.parameters()]

    results = {}
    for mode in ("torch", "kernels"):
        recorded.clear()
        results[mode] = [t for rank in run_ranks(3, lambda comm: program(comm, mode))
                         for t in rank]
        assert (recorded != []) == (mode == "kernels")
        assert all(dp is not None for dp in recorded)
    assert relative(list(zip(results["kernels"], results["torch"]))) <= 1e-12


@needs_native
def test_states_wider_than_the_native_limit_stay_with_torch(monkeypatch):
    calls = _count_native(monkeypatch)
    config = mgrit.Config(levels=2, coarsening=3, max_iter=1, tol=0.0)
    rows = dense.DENSE_NATIVE_MAX_VALUES // 8 + 1          # width 8
    x, y = data("dense", rows)
    model, _ = build("dense", 9, config, config)
    nn.functional.cross_entropy(model(x), y).backward()
    assert calls == []
    x, y = data("dense", rows - 1)
    nn.functional.cross_entropy(model(x), y).backward()
    assert calls


# Dense kernels on random shapes and at their limits --------------------------------------

def _dense_against_autograd(count, rows, d, dtype, seed):
    """The largest relative error of the native dense step (with g and the kept tanh) and
    its adjoint (with g and the parameter cotangents), on operands drawn with `seed`,
    against autograd in float64."""
    w, b, u, a, g = _dense_operands(count, rows, d, dtype, seed)
    x, wd, bd = (t.double().requires_grad_() for t in (u, w, b))
    dt = 0.3
    y = torch.tanh(x @ wd.transpose(1, 2) + bd[:, None])
    step = x + dt * y
    du, dw, db = torch.autograd.grad(step, (x, wd, bd), a.double())
    out, keep = torch.empty_like(u), torch.empty_like(u)
    native.dense_tanh(u, w, b, dt, out, g, keep)
    adj, gw, gb = torch.empty_like(a), torch.empty_like(w), torch.empty_like(b)
    native.dense_tanh_vjp(w, a, keep, dt, adj, g, u, (gw, gb))
    return max(relative([(out, g.double() + step.detach())]), relative([(keep, y.detach())]),
               relative([(adj, g.double() + du)]), relative([(dt * gw, dw)]),
               relative([(dt * gb, db)]))


@needs_native
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_dense_tanh_step_and_adjoint_equal_autograd_on_random_shapes(seed, dtype, tol):
    """Widths on and off the vector lanes (4 float64 or 8 float32 values), any number of
    layers and rows."""
    gen = torch.Generator().manual_seed(seed)
    count, rows, d = (int(torch.randint(lo, hi + 1, (), generator=gen))
                      for lo, hi in ((1, 6), (1, 5), (1, 70)))
    assert _dense_against_autograd(count, rows, d, dtype, seed) <= tol, (count, rows, d)


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_dense_kernels_are_right_at_their_width_limit_and_refuse_past_it(dtype, tol):
    """At native.MAX_WIDTH the kernels equal autograd; one past it every entry point says
    so: the Python calls and NativeDense with a ValueError, the C functions themselves (the
    same limit, dense.c's MAX_WIDTH) with their code 2, before writing anything."""
    limit = native.MAX_WIDTH
    assert _dense_against_autograd(2, 2, limit, dtype, seed=3) <= tol
    assert dense.NativeDense(dtype, limit).width == limit
    d = limit + 1
    w, b, u, a, _ = _dense_operands(1, 2, d, dtype)
    out = torch.full_like(u, 7.0)
    message = f"width {d} is above the kernels' limit of {limit}"
    with pytest.raises(ValueError, match=message):
        native.dense_tanh(u, w, b, 0.1, out)
    with pytest.raises(ValueError, match=message):
        native.dense_tanh_vjp(w, a, u, 0.1, out)
    with pytest.raises(ValueError, match=message):
        dense.NativeDense(dtype, d)
    lib, suffix = native.library(), native.SUFFIX[dtype]
    pu, pw, pb, pa, po = (t.data_ptr() for t in (u, w, b, a, out))
    codes = [
        getattr(lib, f"mgrit_dense_tanh_{suffix}")(
            pu, 0, pw, 0, pb, 0, None, 0, po, 0, None, 0, 0.1, 1, 2, d),
        getattr(lib, f"mgrit_dense_tanh_vjp_{suffix}")(
            pw, 0, pa, 0, pu, 0, None, 0, po, 0, None, 0, None, 0, None, 0, 0.1, 1, 2, d),
        getattr(lib, f"mgrit_dense_tanh_one_{suffix}")(pu, pw, pb, None, po, None, 0.1, 2, d),
        getattr(lib, f"mgrit_dense_tanh_vjp_one_{suffix}")(pw, pa, pu, None, po, 0.1, 2, d)]
    assert codes == [2, 2, 2, 2]
    assert bool((out == 7.0).all())


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_the_dense_strategy_runs_natively_up_to_its_limits_and_on_torch_past_them(
        dtype, tol, monkeypatch):
    """`chain_steps` takes the native dense steps for states of at most
    DENSE_NATIVE_MAX_VALUES values (where the kernels choice allows them; else the same
    steps on torch's kernels, `TorchDenseSteps`, or "torch-steps" their twin
    `ChainSteps`), torch's chain kernels past that; its
    batches of forward steps run natively up to the kernels' `max_batch`
    values (DENSE_NATIVE_MAX_BATCH with a scalar tanh, no limit with glibc's vector one)
    and on torch past that. Either way a batch equals the step in float64."""
    cpu, d = torch.device("cpu"), 8
    chain = Chain.of(nn.Sequential(nn.Linear(d, d), nn.Tanh()))
    at = torch.Size([dense.DENSE_NATIVE_MAX_VALUES // d, d])
    past = torch.Size([dense.DENSE_NATIVE_MAX_VALUES // d + 1, d])
    for backend in ("auto", "kernels"):
        assert type(strategies.chain_steps(chain, at, dtype, cpu, backend)) is (
            strategies.NativeDenseSteps)
        assert type(strategies.chain_steps(chain, past, dtype, cpu, backend)) is (
            strategies.ChainSteps)
    assert type(strategies.chain_steps(chain, at, dtype, cpu, "torch")) is (
        strategies.TorchDenseSteps)
    assert type(strategies.chain_steps(chain, past, dtype, cpu, "torch")) is strategies.ChainSteps
    assert type(strategies.chain_steps(chain, at, dtype, cpu, "torch-steps")) is (
        strategies.ChainSteps)

    rows = 4
    strategy = strategies.chain_steps(chain, torch.Size([rows, d]), dtype, cpu, "auto")
    calls = _count_native(monkeypatch)
    limit = strategy.kernels.max_batch
    assert limit == (math.inf if native.vector_tanh() else dense.DENSE_NATIVE_MAX_BATCH)
    most = 64 if limit == math.inf else int(limit) // (rows * d)
    cases = ((most, True),) if limit == math.inf else ((most, True), (most + 1, False))
    for count, natively in cases:
        w, b, u, _, g = _dense_operands(count, rows, d, dtype, seed=count)
        t = {strategy.weight: w, strategy.bias: b}
        ref = u.double() + 0.3 * torch.tanh(u.double() @ w.double().transpose(1, 2)
                                            + b.double()[:, None])
        calls.clear()
        got = strategy.batch(t, u, 0.3)
        out = torch.empty_like(u)
        strategy.batch_into(t, u, 0.3, out, g, True)
        assert calls == (["step_batch"] * 2 if natively else []), count
        assert relative([(got, ref), (out, g.double() + ref)]) <= tol, count


@needs_native
def test_keyed_dropout_masks_are_the_tensor_hashes_bit_for_bit(monkeypatch):
    """The C keep masks (csrc/draws.c) against the int64 hash on tensors that the vmap path
    and other devices compute: keys at both ends of their range, several sites and shapes,
    probabilities 0 and 1 and near them; and keep_mask takes the C masks on the CPU."""
    from mgrit.nn.engine import randomness

    cpu = torch.device("cpu")
    calls = []
    keep_mask = native.keep_mask
    monkeypatch.setattr(native, "keep_mask",
                        lambda *args: calls.append(args) or keep_mask(*args))
    keys = torch.tensor([0, 1, 12345, 2**31, 2**32 - 1])
    for p in (0.0, 2.0**-32, 0.1, 0.5, 1 - 2.0**-33):
        for site in (0, 1, 7):
            for shape in ((1,), (3, 5), (16, 64, 64), (0, 4), (2, 1, 33)):
                randomness._masks.clear()
                before = len(calls)
                kernel = randomness.keep_mask(keys, site, shape, cpu, p)
                assert len(calls) - before == len(keys)
                tensor = torch.vmap(lambda k: randomness.keep_mask(k, site, shape, cpu, p))(keys)
                assert kernel.shape == tensor.shape == (len(keys), *shape)
                assert torch.equal(kernel, tensor), (p, site, shape)
    threshold = 1 << 32       # p = 1: nothing kept
    assert not native.keep_mask(5, (1000,), threshold).any()
    assert native.keep_mask(5, (1000,), 0).all()
    with pytest.raises(ValueError, match="key must be below 2\\*\\*32"):
        native.keep_mask(1 << 32, (3,), 0)
    with pytest.raises(ValueError, match="threshold at most 2\\*\\*32"):
        native.keep_mask(0, (3,), (1 << 32) + 1)


def test_keyed_dropout_masks_use_torch_where_native_kernels_are_not_allowed(monkeypatch):
    from mgrit.nn.engine import randomness

    monkeypatch.setenv("MGRIT_NATIVE", "torch")
    monkeypatch.setattr(native, "keep_mask", lambda *args: pytest.fail("C masks under torch"))
    randomness._masks.clear()
    keys = torch.tensor([3, 4])
    mask = randomness.keep_mask(keys, 0, (4, 5), torch.device("cpu"), 0.3)
    assert torch.equal(mask, torch.stack([randomness._bits(k, 0, (4, 5), torch.device("cpu"))
                                          >= int(0.3 * 2**32) for k in keys]))
    randomness._masks.clear()


@needs_native
@pytest.mark.slow
def test_the_mask_benchmark_times_both_hashes_and_restores_the_kernels_choice(tmp_path,
                                                                              monkeypatch):
    """`python -m benchmarks.masks`: one mask each way, then W4's steps with either next
    to serial PyTorch in every round; MGRIT_NATIVE is the caller's again afterwards."""
    from benchmarks import masks

    monkeypatch.setenv("MGRIT_NATIVE", "kernels")
    out = tmp_path / "masks.json"
    assert masks.main(["--rounds", "1", "--json", str(out)]) == 0
    assert os.environ["MGRIT_NATIVE"] == "kernels"
    record = json.loads(out.read_text())
    assert sorted(record["mask_seconds"]) == ["C masks", "torch masks"]
    assert all(s > 0 for s in record["mask_seconds"].values())
    for kind in ("exact", "mgrit"):
        times = record["steps"][kind]
        assert sorted(times) == ["C masks", "serial pytorch", "torch masks"]
        assert all(len(v) == 1 and v[0] > 0 for v in times.values())
