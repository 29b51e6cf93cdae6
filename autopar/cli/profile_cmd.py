"""``autopar profile``: measure this machine and write a catalog YAML usable as ``cluster=PATH``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

from autopar.calibrate.profile import profile_machine, write_profile
from autopar.calibrate.recalibrate import recalibrate
from autopar.cli.common import progress
from autopar.errors import AutoparError
from autopar.report.fmt import seconds


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float) -> str:
    return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"


def profile_text(data: dict, path: Path) -> str:
    """A small table of what was measured."""
    dev, node, eff = data["device"], data["node"], data["device"]["efficiency"]
    prof = data["profile"]
    rows = [(f"peak {k}", _si(v, "FLOP/s")) for k, v in dev["peak_flops"].items()]
    rows += [
        ("kernel overhead", _seconds(dev["kernel_overhead_s"])),
        ("attention / peak", f"{eff['attention']:.2f}"),
        ("memory bandwidth", _si(dev["memory_bandwidth"], "B/s")),
        ("memory per device", _si(dev["memory_bytes"], "B")),
        ("host bandwidth", _si(node["host_bandwidth"], "B/s")),
        ("comm beside compute", f"{dev['overlap']['concurrent']:.2f} concurrent, compute "
                                f"{dev['overlap']['compute_slowdown']:.0%} slower"),
    ]
    lines = [f"{data['name']}: {dev['type']} x {node['devices_per_node']} ({dev['backend']}, "
             f"{prof['nprocs']} processes, {prof['seconds']} s)"]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    if data["collectives"]:
        lines.append(f"  {'collective':<15} {'latency':>10} {'bandwidth':>12}")
        for name, fit in data["collectives"].items():
            lines.append(f"  {name:<15} {_seconds(fit['alpha']):>10} "
                         f"{_si(fit['beta'], 'B/s'):>12}")
    lines.append(f"wrote {path}  (use it as cluster={path})")
    return "\n".join(lines)


@click.command("profile", short_help="Measure this machine into a catalog YAML (cluster=PATH).")
@click.option("--out", "out", default="profile.yaml", show_default=True,
              type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="Where to write the profile YAML.")
@click.option("--nprocs", default=2, show_default=True, type=click.IntRange(min=1),
              help="Local processes (devices) for the collective benchmarks; 1 skips them.")
@click.option("--quick", is_flag=True, help="Fewer sizes and repeats (seconds, not minutes).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
              show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--from-run", "runs", multiple=True, type=click.Path(file_okay=False),
              help="Fit the profile to an artifact DIR trained with `autopar run --profile` "
                   "instead of measuring (repeatable: several runs fit one profile).")
@click.option("--base", default=None,
              help="With --from-run: the cluster file to start from [default: the runs' "
                   "plan cluster].")
def profile_cmd(out: Path, nprocs: int, quick: bool, fmt: str, quiet: bool,
                runs: tuple[str, ...], base: str | None) -> None:
    """Measure matmul, memory and collective speed here; write a catalog YAML to --out.
    With --from-run DIR, fit the cost model to what runs measured instead: matmul
    efficiency by shape class, each collective's latency and bandwidth, the overlap of
    data-parallel collectives with compute, and the per-op overhead that makes the model's
    step times equal the runs' (docs/cost-model.md, "Recalibrating from runs").

    Uses CUDA (nccl, one GPU per process) when torch sees a GPU, else the CPU (gloo, the cores
    split among --nprocs processes). The file loads with `cluster=PATH` wherever a catalog
    name is accepted; peak numbers are the best measured, so its efficiencies are 1.0.

    \b
    Examples:
      autopar profile --quick
      autopar profile --nprocs 4 --out cost_models/my-box.yaml
      autopar profile --quick --format json --quiet
      autopar profile --from-run run-a --from-run run-b --out fitted.yaml
    """
    if not out.parent.is_dir():
        raise AutoparError(f"cannot write {out}: folder {out.parent} does not exist")
    if runs:
        _from_runs(list(runs), base, out, fmt, quiet)
        return
    if base is not None:
        raise AutoparError("--base goes with --from-run: it names the cluster file the fit "
                           "starts from")
    with progress(f"profiling this machine ({'quick' if quick else 'about a minute'})", quiet):
        data = profile_machine(nprocs=nprocs, quick=quick)
    argv = ["autopar", "profile", "--out", str(out), "--nprocs", str(nprocs)]
    path = write_profile(data, out, command=shlex.join(argv + ["--quick"] * quick))
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(profile_text(data, path))


def _from_runs(runs: list[str], base: str | None, out: Path, fmt: str, quiet: bool) -> None:
    with progress(f"fitting the cost model to {len(runs)} run(s)", quiet):
        data = recalibrate(runs, base)
    argv = ["autopar", "profile", "--out", str(out)] + [a for r in runs for a in
                                                        ("--from-run", r)]
    path = write_profile(data, out, command=shlex.join(argv + (["--base", base] if base
                                                                else [])),
                         note="Fitted to runs of this machine (see calibration:), starting from "
                              f"{data['calibration']['base']}.")
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(from_run_text(data, path))


def from_run_text(data: dict, path: Path) -> str:
    """What the fit changed, and each run's step measured and predicted before and after."""
    dev = data["device"]
    lines = [f"{data['name']}: fitted to {len(data['calibration']['runs'])} run(s)",
             f"  per-op overhead      {_seconds(dev['kernel_overhead_s'])}",
             f"  overlap              {dev['overlap']['concurrent']:.2f} of data-parallel "
             f"collective time beside compute"]
    for upper, eff in dev["efficiency"].get("matmul_by_flops", []):
        bound = "larger" if upper >= 1e29 else f"<= {upper:.0e} FLOP"
        lines.append(f"  matmul {bound:<13} {eff:.2f} of peak")
    for kind, fit in (data.get("collectives") or {}).items():
        for ranks, sized in sorted((fit.get("by_ranks") or {}).items()):
            lines.append(f"  {kind + ' on ' + str(ranks):<20} {_seconds(sized['alpha'])} per "
                         f"step, {_si(sized['beta'], 'B/s')} ({sized['samples']} samples)")
    lines.append(f"  {'run':<28} {'measured':>9} {'before':>9} {'after':>9}")
    for r in data["calibration"]["runs"]:
        lines.append(f"  {Path(r['directory']).name:<28} {seconds(r['measured_step_s']):>9} "
                     f"{seconds(r['predicted_before_s']):>9} "
                     f"{seconds(r['predicted_after_s']):>9}")
    lines.append(f"wrote {path}  (use it as cluster={path})")
    return "\n".join(lines)
