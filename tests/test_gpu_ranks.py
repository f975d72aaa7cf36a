"""Two MPI ranks sharing one GPU against one rank (tests/mpi/gpu_two_ranks.py): the states
and messages live on the device, and the ranks must compute what one rank computes alone;
and their captured steps (graphs between the messages) against their eager steps
(tests/mpi/captured_ranks.py). Marked `gpu` and `mpi`; the same scripts run on the CPU (W2,
`slow`), so that the GPU run finds them working."""

import pytest

# relative to the one-rank result's largest entry (residual histories: each entry's own)
TOLERANCE = {"torch.float64": 1e-11, "torch.float32": 1e-4}


@pytest.mark.mpi
@pytest.mark.parametrize("device,workloads", [
    pytest.param("cpu", "w2", marks=pytest.mark.slow),
    pytest.param("cuda", "w2,w2b", marks=pytest.mark.gpu)])
def test_two_ranks_on_one_device_equal_one_rank(mpi, device, workloads):
    run = mpi("gpu_two_ranks.py", 2, device, workloads, timeout=240)
    assert run.returncode == 0, run.stderr
    reports = run.by_rank()
    for rank, got in reports.items():
        records = got["records"]
        kinds = ["staged"] + (["cuda-aware"] if got["cuda_aware"] and device == "cuda" else [])
        assert {(r["workload"], r["dtype"], r["messages"]) for r in records} == {
            (w, d, k) for w in workloads.split(",") for d in TOLERANCE for k in kinds}
        for r in records:
            assert r["device"].startswith(device)
            # each rank holds a part of the layers, and together they hold all of them
            assert r["layers"][0] <= r["layers"][1] and r["gradients"] > 2
            errors = (r["output_error"], r["gradient_error"], r["residual_error"])
            assert all(e <= TOLERANCE[r["dtype"]] for e in errors), (rank, r)
    for rec0, rec1 in zip(reports[0]["records"], reports[1]["records"]):
        assert rec0["layers"][1] + 1 == rec1["layers"][0]


# relative to the eager run's largest entry: float64 throughout; on CUDA the replayed
# kernels are the eager ones, but a reduction's order may differ between launches
CAPTURED_TOLERANCE = 1e-12


@pytest.mark.mpi
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_captured_steps_on_two_ranks_equal_eager_steps(mpi, device):
    """Two ranks (sharing the GPU on CUDA): six captured steps and four captured forward
    passes of W2 against eager ones on the same ranks. On CUDA the step and the pass are
    graphs between their messages, captured once each and replayed (the step three times,
    the pass once); on the CPU they run eagerly and nothing is captured."""
    run = mpi("captured_ranks.py", 2, device, "w2", timeout=240)
    assert run.returncode == 0, run.stderr
    for rank, got in run.by_rank().items():
        r, = got["records"]
        assert r["device"].startswith(device)
        errors = (r["loss_error"], r["parameter_error"], r["output_error"])
        assert all(e <= CAPTURED_TOLERANCE for e in errors), (rank, r)
        if device == "cuda":
            assert (r["step_captures"], r["forward_captures"]) == (1, 1), (rank, r)
            assert (r["step_replays"], r["forward_replays"]) == (3, 1), (rank, r)
            assert min(r["step_graphs"], r["step_host_steps"], r["forward_graphs"],
                       r["forward_host_steps"]) > 0, (rank, r)
        else:
            assert r["step_captures"] == r["forward_captures"] == 0, (rank, r)
