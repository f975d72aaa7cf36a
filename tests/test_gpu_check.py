"""benchmarks/gpu_check.py's dry run on the CPU (small workloads, every path but the
CUDA-only calls), so that the one-call GPU script cannot rot between GPU visits: every
method of every workload is timed or recorded with a reason, the update and output checks
tell exact methods from MGRIT's few cycles, the table is written from the records, and a
job cut off by its time limit keeps its place in the record instead of ending the run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _run(out: Path, *args: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess,
                                                                  dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=timeout)
    return proc, json.loads((out / "gpu-cpu.json").read_text())


@pytest.mark.slow
def test_dry_run_times_or_explains_every_method(tmp_path):
    from benchmarks import gpu_check

    proc, data = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mgrit
    from mgrit.app.environment import source_commit

    # the record says which code made it
    assert (data["environment"]["mgrit"], data["environment"]["source"]) == (
        mgrit.__version__, source_commit())
    rows = {(r["workload"], r["method"], r["metric"]): r
            for r in data["speed"] + data["unmeasured"]}
    expected = {(w, m.name, metric) for w in gpu_check.WORKLOADS for m in gpu_check.METHODS
                if not m.only or w in m.only for metric in gpu_check.METRICS}
    expected |= {("w2", gpu_check.COMPILED.name, metric) for metric in gpu_check.METRICS}
    assert set(rows) == expected
    for (workload, method, metric), r in rows.items():
        if method == "serial pytorch, cuda graph":
            assert (r["status"], r["reason"]) == ("not available", "needs a CUDA device")
        else:
            assert r["status"] == "measured", r
            assert r["seconds"] > 0 and r["first_call_seconds"] > 0
            error = r["forward_error" if metric == "forward" else "update_error"]
            # exact methods compute serial autograd's step; two forward and one backward
            # MGRIT cycles do not, and the check must see that
            if r["exact"]:
                assert error <= 1e-5, r
            else:
                assert error > 1e-4, r
    # the captured methods are timed first (the baseline needs CUDA), whatever their place
    # in the table
    early = [m.name for m in gpu_check.METHODS if m.early and not m.cuda_only]
    for w in gpu_check.WORKLOADS:
        timed = [r["method"] for r in data["speed"] if r["workload"] == w]
        assert timed[:2 * len(early)] == [m for m in early for _ in gpu_check.METRICS], timed
    # the table: every measured time, each method's row in the methods' order
    table = (tmp_path / "gpu-cpu.md").read_text()
    for r in data["speed"]:
        assert f"{r['seconds'] * 1e3:.3f} ms" in table
    lines = [line for line in table.splitlines() if line.startswith("| w2 | train step")]
    assert len(lines) == 1 and "serial pytorch, cuda graph | not available" in lines[0]
    # no target is judged without the one-graph baseline, and each says why
    assert len(data["targets"]) == len(gpu_check.TARGETS) * len(gpu_check.CAPTURED)
    assert {(v["met"], v["reason"]) for v in data["targets"]} == {
        (None, "serial pytorch, cuda graph: not available, needs a CUDA device")}
    assert table.count("not judged (serial pytorch, cuda graph: not available") == len(
        data["targets"])


def record(times, unmeasured=()):
    """A gpu_check record of (workload, method, metric) -> seconds, and of unmeasured
    (workload, method, metric, status, reason)."""
    return {"speed": [{"workload": w, "method": m, "metric": k, "status": "measured",
                       "seconds": s, "update_error": 0.01, "forward_error": 0.02}
                      for (w, m, k), s in times.items()],
            "unmeasured": [dict(zip(("workload", "method", "metric", "status", "reason"), u))
                           for u in unmeasured]}


def test_targets_are_judged_against_the_one_graph_baseline():
    """Each captured setting's time over the one-graph step's, against every target's
    bound: at the bound is met, W4's strict bound is not met at parity; a target whose
    baseline or method has no time is not judged, with the record's reason."""
    from benchmarks import gpu_check

    base, step, fast = "serial pytorch, cuda graph", *gpu_check.CAPTURED
    # powers of two: a ratio at the bound is exactly the bound
    times = {("w2", base, "train_step"): 2.0 ** -6, ("w2", step, "train_step"): 2.0 ** -8,
             ("w2", fast, "train_step"): 0.0038,
             ("w2", base, "forward"): 0.010, ("w2", step, "forward"): 0.0021,
             ("w2", fast, "forward"): 0.0015,
             ("w4", base, "train_step"): 0.030, ("w4", step, "train_step"): 0.030,
             ("w4", fast, "train_step"): 0.029, ("w2b", base, "train_step"): 0.040}
    got = {(v["workload"], v["metric"], v["method"]): v
           for v in gpu_check.verdicts(record(times, [("w2b", step, "train_step", "failed",
                                                       "CaptureError: no")]))}
    assert set(got) == {(w, k, m) for w, k, _, _ in gpu_check.TARGETS
                        for m in gpu_check.CAPTURED}
    expected = {("w2", "train_step", step): (0.25, True), ("w2", "train_step", fast):
                (0.0038 * 64, True), ("w2", "forward", step): (0.21, False),
                ("w2", "forward", fast): (0.15, True), ("w4", "train_step", step): (1.0, False),
                ("w4", "train_step", fast): (29 / 30, True)}
    for key, (ratio, met) in expected.items():
        assert (got[key]["ratio"], got[key]["met"]) == (pytest.approx(ratio), met), key
    assert got[("w2", "forward", step)]["error"] == 0.02
    assert got[("w2", "train_step", step)]["error"] == 0.01
    failed, untimed = got[("w2b", "train_step", step)], got[("w2b", "train_step", fast)]
    assert (failed["met"], failed["reason"]) == (None, f"{step}: failed, CaptureError: no")
    assert (untimed["met"], untimed["reason"]) == (None, f"{fast}: not timed in this run")
    table = gpu_check.targets_table(record(times))
    assert "| w2 train step at most 0.25x | mgrit captured step | 0.25 | 1.0e-02 | met |" in table
    assert "| w4 train step below 1x | mgrit captured step | 1.00 | 1.0e-02 | not met |" in table


def test_the_gpus_busy_time_counts_overlapping_operations_once():
    """What the speed table's GPU busy and overlap columns come from: the operations'
    summed times, and the time in which any ran (nested, overlapping, touching and apart)."""
    from benchmarks import gpu_check

    spans = [(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (40.0, 100.0), (50.0, 60.0),
             (100.0, 110.0)]
    got = gpu_check.device_activity(spans)
    assert got["device_op_seconds"] == pytest.approx(110e-6)
    assert got["device_busy_seconds"] == pytest.approx(95e-6)
    assert gpu_check.device_activity([]) == {"device_op_seconds": 0.0,
                                             "device_busy_seconds": 0.0}
    rec = record({("w2", "serial pytorch, cuda graph", "train_step"): 0.004,
                  ("w2", "mgrit captured step", "train_step"): 0.002})
    for r in rec["speed"]:
        r["first_call_seconds"] = 1.0
    rec["speed"][1].update(host_launches=1, device_ops=300, device_busy_seconds=0.0015,
                           device_op_seconds=0.003)
    rec["workloads"] = {"w2": "W2"}
    lines = gpu_check.speed_table(rec).splitlines()
    assert lines[2].endswith("| 1.0 s | - | - | - | - |"), lines[2]
    assert lines[3].endswith("| 1.0 s | 1 | 300 | 75% | 2.00 |"), lines[3]


@pytest.mark.slow
def test_a_job_past_its_limit_is_recorded_and_the_run_goes_on(tmp_path):
    """A one-second limit stops the methods job of W2 (its process is killed); the run goes
    on to the next workload's job, which the spent budget then leaves out."""
    proc, data = _run(tmp_path, "--workloads", "w2,w1", "--compile", "", "--job-limit", "1",
                      "--budget", "12")
    assert proc.returncode == 1, proc.stderr[-3000:]
    statuses = {(r["workload"], r["status"]) for r in data["unmeasured"]}
    assert ("w2", "timed out") in statuses
    assert data["jobs"][0]["workload"] == "w2" and data["jobs"][0]["exit"] is None
    left_out = {r["status"] for r in data["unmeasured"] if r["workload"] == "w1"}
    assert left_out <= {"timed out", "skipped"} and left_out


def test_the_workloads_with_targets_are_timed_first():
    """A run whose budget runs short loses the workloads without a target first."""
    from benchmarks import gpu_check

    targeted = {w for w, *_ in gpu_check.TARGETS}
    assert targeted <= set(gpu_check.WORKLOADS)
    first = [w in targeted for w in gpu_check.WORKLOADS]
    assert first == sorted(first, reverse=True)
    args = gpu_check.argparse.Namespace(workloads=list(gpu_check.WORKLOADS), compile=[])
    assert [name for _, name, _ in gpu_check.jobs(args)] == list(gpu_check.WORKLOADS)
