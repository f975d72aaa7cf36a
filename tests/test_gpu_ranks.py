"""Two MPI ranks sharing one GPU against one rank (tests/mpi/gpu_two_ranks.py): the states
and messages live on the device, and the ranks must compute what one rank computes alone.
Marked `gpu` and `mpi`; the same script runs on the CPU (W2, `slow`), so that the GPU run
finds it working."""

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
