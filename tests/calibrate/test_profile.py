"""``autopar profile``: the quick profile of this machine loads as a cluster and fits its points."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from autopar.calibrate.profile import profile_machine, write_profile
from autopar.calibrate.profile_comm import fit_alpha_beta, predict
from autopar.cost.hardware import load_cluster

# the sweeps time this machine: nothing else may run beside them
pytestmark = pytest.mark.exclusive


def run_cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> tuple[dict, object]:
    data = profile_machine(nprocs=2, quick=True, device="cpu")
    path = tmp_path_factory.mktemp("profile") / "profile.yaml"
    write_profile(data, path, command="pytest")
    return data, path


@pytest.mark.dist
def test_profile_loads_as_cluster(profiled) -> None:
    data, path = profiled
    cluster = load_cluster(path)
    assert cluster.device.type == "cpu" and cluster.device.backend == "gloo"
    assert cluster.devices_per_node == 2
    assert 0 < cluster.device.flops_for("fp32") < 1e13
    assert 0 < cluster.device.flops_for("bf16") < 1e14
    assert cluster.device.memory_bandwidth > 0
    assert cluster.device.efficiency.matmul == 1.0
    assert 0 < cluster.device.kernel_overhead_s < 1e-3
    assert cluster.device.tensor_core_dtypes == ()  # a CPU trains in fp32 by default
    assert 0 < cluster.device.efficiency.attention <= 1.0
    assert 0 < cluster.node.intra_latency < 1.0
    assert cluster.node.intra_bandwidth > 0
    assert cluster.node.inter_bandwidth == cluster.node.intra_bandwidth
    text = path.read_text()
    assert text.startswith("# Written by `autopar profile`") and "# command: pytest" in text
    assert set(yaml.safe_load(text)["collectives"]) == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"}


@pytest.mark.dist
def test_profile_writes_the_host_an_offloaded_step_runs_on(profiled) -> None:
    """The host fields the loader requires: this machine's cores and its measured DRAM
    bandwidth (the copy rate before it is divided among the processes), and the allocator
    headroom (none on a CPU), each with its source."""
    data, path = profiled
    cluster = load_cluster(path)
    assert cluster.node.host_cores == (os.cpu_count() or 1)
    assert cluster.node.host_memory_bandwidth >= cluster.device.memory_bandwidth > 0
    assert cluster.device.allocator_fragmentation == 0.0
    assert cluster.device.usable_memory_bytes == cluster.device.memory_bytes * \
        cluster.device.usable_fraction
    for key in ("host_cores", "host_memory_bandwidth", "allocator_fragmentation"):
        assert data["sources"][key]


@pytest.mark.dist
def test_collective_fits_are_sane(profiled) -> None:
    data, path = profiled
    fits = yaml.safe_load(path.read_text())["collectives"]
    for name, fit in fits.items():
        assert 0 < fit["alpha"] < 1.0, name
        assert fit["beta"] > 0, name
        assert len(fit["points"]) >= 4, name


@pytest.mark.dist
def test_all_reduce_fit_predicts_large_message(profiled) -> None:
    data, _ = profiled
    fit = dict(data["collectives"]["all_reduce"], collective="all_reduce")
    nbytes, measured = max(fit["points"])
    assert nbytes >= 1 << 20
    predicted = predict(fit, nbytes, 2)
    assert abs(predicted - measured) / measured < 0.5, (predicted, measured, fit)


@pytest.mark.dist
def test_cost_model_uses_the_measured_fits_and_overlap(profiled) -> None:
    from autopar.cost.comm import Link, axis_collective_time, ring_time
    from autopar.cost.config import ParallelConfig

    data, path = profiled
    cluster = load_cluster(path)
    assert 0.0 <= cluster.device.overlap.concurrent <= 1.0
    assert 0.0 <= cluster.device.overlap.compute_slowdown <= 4.0
    fits = {kind: (alpha, beta) for kind, alpha, beta in cluster.collective_fits}
    alpha, beta = fits["reduce_scatter"]
    got = axis_collective_time("reduce_scatter", 8e6, ParallelConfig(dp=2), "dp", cluster)
    assert got == pytest.approx(ring_time("reduce_scatter", 8e6, 2, Link(beta, alpha)))


def test_fits_recover_known_parameters() -> None:
    alpha, beta, n = 5e-5, 2e9, 4
    points = [(b, 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / beta) for b in
              (4096 << 2 * i for i in range(8))]
    points[2] = (points[2][0], points[2][1] * 10)  # one descheduled sample
    fit = fit_alpha_beta("all_reduce", n, points)
    assert fit["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta"] == pytest.approx(beta, rel=1e-6)
    assert fit["outliers"] == 1


@pytest.mark.dist
def test_cli_quick_profile(tmp_path) -> None:
    out = tmp_path / "box.yaml"
    result = run_cli("profile", "--quick", "--quiet", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file()
    assert "all_reduce" in result.stdout and f"cluster={out}" in result.stdout
    assert load_cluster(out).devices_per_node == 2
    assert [p.name for p in tmp_path.iterdir()] == ["box.yaml"]  # no temp file left


def test_cli_bad_nprocs_exits_2_with_one_line(tmp_path) -> None:
    out = tmp_path / "never.yaml"
    result = run_cli("profile", "--nprocs", "0", "--out", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error:"), result.stderr
    assert "--nprocs" in lines[0]
    assert not out.exists()
    missing = run_cli("profile", "--quick", "--out", str(tmp_path / "no" / "dir.yaml"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
