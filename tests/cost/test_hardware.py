"""The shipped hardware catalog (cost_models/*.yaml) and its loader (autopar.cost.hardware)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from autopar import PlanError
from autopar._paths import data_dir
from autopar.cost.hardware import Cluster, catalog_names, load_cluster

SHIPPED = ["a100-40g", "a100-80g", "ascend-910b", "b200", "cpu", "h100-80g", "h200", "v100-16g"]
CATALOG = data_dir("cost_models")


def _one_line_plan_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_catalog_lists_the_shipped_entries():
    # a subset test: `autopar profile --out cost_models/my-box.yaml` may add local entries
    assert set(SHIPPED) <= set(catalog_names())
    assert catalog_names() == sorted(catalog_names())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_entry_loads_and_is_sane(name):
    cluster = load_cluster(name)
    dev, node = cluster.device, cluster.node
    assert dev.name == name  # the `name:` field matches the file name
    assert dev.type in {"cuda", "cpu", "npu"}
    assert dev.backend == {"cuda": "nccl", "cpu": "gloo", "npu": "hccl"}[dev.type]
    assert set(dev.peak_flops) <= {"fp32", "tf32", "bf16", "fp16", "fp8"}
    assert all(v > 0 for v in dev.peak_flops.values())
    assert dev.memory_bytes > 1e9 and dev.memory_bandwidth > 1e9
    assert 0.5 <= dev.usable_fraction <= 1.0
    eff = dev.efficiency
    assert all(0 < f <= 1 for f in (eff.matmul, eff.memory, eff.attention))
    assert set(dev.tensor_core_dtypes) <= set(dev.peak_flops)
    assert dev.compute_units >= 1 and all(t >= 1 for t in dev.matmul_tile)
    assert 0 < dev.kernel_overhead_s < 1e-4
    assert 0 <= dev.overlap.concurrent <= 1 and 0 <= dev.overlap.compute_slowdown <= 1
    assert 0 < node.intra_efficiency <= 1 and 0 < node.inter_efficiency <= 1
    assert 0 < node.collective_latency < 1e-3
    assert node.devices_per_node >= 1
    for value in (node.intra_bandwidth, node.inter_bandwidth, node.host_bandwidth,
                  node.host_memory_bytes):
        assert value > 1e8
    assert 0 < node.intra_latency <= node.inter_latency < 1e-2
    assert cluster.devices_per_node == node.devices_per_node


@pytest.mark.parametrize("name", [n for n in SHIPPED if n != "cpu"])
def test_accelerator_half_precision_beats_fp32(name):
    dev = load_cluster(name).device
    half = max(dev.peak_flops.get("bf16", 0), dev.peak_flops.get("fp16", 0))
    assert half >= 4 * dev.peak_flops["fp32"]


def test_datasheet_facts():
    a100 = load_cluster("a100-80g").device
    assert a100.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert a100.memory_bytes == 80 * 2**30 and a100.memory_bandwidth == 2.039e12
    a100_40 = load_cluster("a100-40g").device
    assert a100_40.memory_bytes == 40 * 2**30 and a100_40.memory_bandwidth == 1.555e12

    h100 = load_cluster("h100-80g").device
    assert h100.peak_flops["bf16"] == 989.4e12  # dense SXM5 (1,979 "with sparsity" / 2)
    assert h100.peak_flops["bf16"] == pytest.approx(989e12, rel=1e-3)
    assert h100.peak_flops["fp8"] == pytest.approx(2 * h100.peak_flops["bf16"], rel=1e-3)
    assert h100.memory_bytes == 80 * 2**30 and h100.memory_bandwidth == 3.35e12

    h200 = load_cluster("h200").device
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes == 143771 * 2**20 and h200.memory_bandwidth == 4.8e12

    b200 = load_cluster("b200").device
    assert b200.peak_flops["bf16"] == 2.25e15 and b200.peak_flops["fp8"] == 4.5e15
    assert b200.memory_bandwidth == 8e12

    v100 = load_cluster("v100-16g").device
    assert v100.peak_flops == {"fp32": 15.7e12, "fp16": 125e12}
    assert v100.memory_bytes == 16 * 2**30

    assert load_cluster("ascend-910b").device.memory_bytes == 64 * 2**30

    per_direction = {"a100-80g": 300e9, "h100-80g": 450e9, "h200": 450e9, "b200": 900e9,
                     "v100-16g": 150e9}
    for name, bw in per_direction.items():
        assert load_cluster(name).node.intra_bandwidth == bw, name
    assert load_cluster("a100-80g").node.inter_bandwidth == 25e9  # 200 Gb/s HDR per GPU
    assert load_cluster("h100-80g").node.inter_bandwidth == 50e9  # 400 Gb/s NDR per GPU


def test_devices_per_node():
    for name in SHIPPED:
        expected = 2 if name == "cpu" else 8
        assert load_cluster(name).node.devices_per_node == expected, name


def test_flops_for_aliases_and_fallback():
    a100 = load_cluster("a100-80g").device
    assert a100.flops_for("bfloat16") == a100.flops_for("bf16") == 312e12
    assert a100.flops_for("float16") == 312e12
    assert a100.flops_for("float32") == 19.5e12
    assert a100.flops_for("tf32") == 156e12
    assert a100.flops_for("float8_e4m3fn") == 19.5e12  # no fp8 on Ampere: the fp32 rate
    assert load_cluster("h100-80g").device.flops_for("float8_e4m3fn") == 1978.9e12
    assert load_cluster("v100-16g").device.flops_for("bfloat16") == 15.7e12


def test_cluster_composes_from_a_catalog_name():
    cluster = Cluster(device="h100-80g", nodes=4)
    assert cluster.name == "h100-80g" and cluster.nodes == 4
    assert cluster.devices_per_node == 8 and cluster.node.devices_per_node == 8
    assert cluster.device.peak_flops["bf16"] == 989.4e12
    assert cluster.with_devices(20).nodes == 3

    small = Cluster(device="h100-80g", nodes=2, devices_per_node=4)
    assert small.devices_per_node == 4 and small.node.devices_per_node == 4
    assert small.node.intra_bandwidth == cluster.node.intra_bandwidth
    assert small.with_devices(8).nodes == 2
    assert load_cluster("h100-80g").node.devices_per_node == 8  # the catalog is untouched

    assert load_cluster(cluster) is cluster


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((CATALOG / "a100-80g.yaml").read_text().replace("name: a100-80g\n", ""))
    cluster = load_cluster(path)
    assert cluster.name == "mine"  # no name: field => the file's stem
    assert load_cluster(str(path)).device.peak_flops["bf16"] == 312e12


def test_unknown_name_is_a_one_line_plan_error():
    with pytest.raises(PlanError) as excinfo:
        load_cluster("tpu-v9")
    message = _one_line_plan_error(excinfo)
    assert "tpu-v9" in message and "h100-80g" in message  # names it and lists the choices


def test_missing_file_is_a_one_line_plan_error(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(PlanError) as excinfo:
        load_cluster(missing)
    assert str(missing) in _one_line_plan_error(excinfo)


def _write_without(tmp_path: Path, section: str, key: str) -> Path:
    data = yaml.safe_load((CATALOG / "a100-80g.yaml").read_text())
    del data[section][key]
    path = tmp_path / f"no-{key}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


_REQUIRED = [("device", k) for k in (
    "type", "backend", "peak_flops", "tensor_core_dtypes", "compute_units", "matmul_tile",
    "kernel_overhead_s", "memory_bytes", "usable_fraction", "allocator_fragmentation",
    "memory_bandwidth", "efficiency", "overlap")] + [("node", k) for k in (
        "devices_per_node", "compute_slots", "intra_bandwidth", "intra_efficiency", "intra_latency",
        "inter_bandwidth", "inter_efficiency", "inter_latency", "collective_latency",
        "host_bandwidth", "host_memory_bytes", "host_cores", "host_memory_bandwidth")]


@pytest.mark.parametrize("section, key", _REQUIRED)
def test_missing_required_key_is_a_one_line_plan_error(tmp_path, section, key):
    """No silent defaults: every number of an entry is stated, or the entry does not load."""
    path = _write_without(tmp_path, section, key)
    with pytest.raises(PlanError) as excinfo:
        load_cluster(path)
    message = _one_line_plan_error(excinfo)
    assert str(path) in message and key in message


@pytest.mark.parametrize("sub, key", [("efficiency", k) for k in ("matmul", "memory",
                                                                  "attention")]
                         + [("overlap", k) for k in ("concurrent", "compute_slowdown")])
def test_missing_efficiency_or_overlap_figure_fails_to_load(tmp_path, sub, key):
    data = yaml.safe_load((CATALOG / "h100-80g.yaml").read_text())
    del data["device"][sub][key]
    path = tmp_path / "partial.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError) as excinfo:
        load_cluster(path)
    assert f"device.{sub}.{key}" in _one_line_plan_error(excinfo)


def test_default_precision_is_the_fastest_the_device_trains_in():
    from autopar.cost.precision import default_precision

    a100 = default_precision(load_cluster("a100-80g").device)
    assert (a100.param, a100.compute, a100.reduce, a100.loss_scaling) == \
        ("bf16", "bf16", "fp32", False)
    v100 = default_precision(load_cluster("v100-16g").device)  # no bf16 tensor cores
    assert (v100.compute, v100.loss_scaling) == ("fp16", True)
    cpu = default_precision(load_cluster("cpu").device)
    assert (cpu.param, cpu.compute, cpu.reduce) == ("fp32", "fp32", "fp32")


def _complete_with(**device: object) -> str:
    """The a100-80g entry with some device keys replaced, as YAML text."""
    data = yaml.safe_load((CATALOG / "a100-80g.yaml").read_text())
    data["device"].update(device)
    return yaml.safe_dump(data)


@pytest.mark.parametrize("text, needle", [
    ("name: x\n", "'device'"),
    ("device: {peak_flops: {fp32: 1e12}, memory_bytes: 1e9, memory_bandwidth: 1e11}\n", "'node'"),
    ("- just\n- a list\n", "not a mapping"),
    ("device: [1, 2]\nnode: {}\n", "'device' must be a mapping"),
    (_complete_with(peak_flops=[1, 2]), "'device.peak_flops' must be a mapping"),
    (_complete_with(peak_flops={"bf16": 1e12}, tensor_core_dtypes=[]), "fp32"),
    (_complete_with(peak_flops={"fp32": "fast"}), "bad value"),
    (_complete_with(tensor_core_dtypes=["int4"]), "bad value"),
    (_complete_with(tensor_core_dtypes=["fp8"]), "tensor_core_dtypes lists ['fp8']"),
    (_complete_with(matmul_tile=128), "bad value"),
    ("device: {peak_flops: {fp32: 1e12}\n  memory_bytes: [\n", "cannot read cluster file"),
])
def test_malformed_files_are_one_line_plan_errors(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PlanError) as excinfo:
        load_cluster(path)
    message = _one_line_plan_error(excinfo)
    assert str(path) in message and needle in message


# --- every number carries its source ------------------------------------------------------

_KEY_VALUE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_]+):\s*(?P<value>[^#]*?)\s*(?P<comment>#.*)?$")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _unsourced_numbers(text: str) -> list[str]:
    """Lines under device:/node: with a numeric value, no comment and no entry in sources:."""
    data = yaml.safe_load(text)
    sources = data.get("sources") or {}
    missing, section, parents = [], None, []
    for line in text.splitlines():
        m = _KEY_VALUE.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        if indent == 0:
            section, parents = m["key"], []
            continue
        parents = [(i, k) for i, k in parents if i < indent]
        if section in ("device", "node") and _is_number(m["value"]):
            covered = m["comment"] or any(k in sources for k in [m["key"], *(k for _, k in parents)])
            if not covered:
                missing.append(line.strip())
        parents.append((indent, m["key"]))
    return missing


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_has_a_source(name):
    text = (CATALOG / f"{name}.yaml").read_text()
    assert _unsourced_numbers(text) == []
    sources = yaml.safe_load(text)["sources"]
    assert isinstance(sources, dict) and sources
    assert all(isinstance(v, str) and v.strip() for v in sources.values())
    for key in ("peak_flops", "memory_bytes", "memory_bandwidth", "devices_per_node",
                "intra_bandwidth", "inter_bandwidth", "host_bandwidth"):
        assert key in sources, (name, key)


def test_source_check_catches_a_bare_number():
    text = (CATALOG / "a100-80g.yaml").read_text()
    bare = re.sub(r"(?m)^(  intra_latency: 3\.4e-6)\s+#.*$", r"\1", text)
    assert bare != text
    assert _unsourced_numbers(bare) == []  # still covered: intra_latency is in sources
    uncovered = re.sub(r'(?m)^  intra_latency: ".*"\n', "", bare)
    assert _unsourced_numbers(uncovered) == ["intra_latency: 3.4e-6"]


def test_cpu_entry_is_marked_placeholder():
    text = (CATALOG / "cpu.yaml").read_text()
    numeric = [line for line in text.splitlines()
               if (m := _KEY_VALUE.match(line)) and m["indent"] and _is_number(m["value"])]
    assert numeric
    for line in numeric:
        assert "placeholder" in line, line


@pytest.mark.parametrize("name", ["a100-40g", "a100-80g", "h100-80g", "h200", "b200"])
def test_gpu_entries_state_how_training_kernels_run(name):
    """Sustained clock, fused attention forward/backward and ramp, host dispatch: stated, in
    range, and the backward no faster than the forward."""
    device = load_cluster(name).device
    eff = device.efficiency
    assert 0.7 < eff.sustained_clock < 1.0
    assert 0 < eff.attention_backward <= eff.attention_forward <= 1.0
    assert eff.attention_ramp_tokens > 0
    assert device.dispatch_overhead_s > device.kernel_overhead_s


def test_a_profile_without_the_refinements_still_loads(tmp_path):
    """`autopar profile` writes catalogs without them: those load, priced as measured."""
    data = yaml.safe_load((CATALOG / "a100-80g.yaml").read_text())
    for key in ("sustained_clock", "attention_forward", "attention_backward",
                "attention_ramp_tokens"):
        del data["device"]["efficiency"][key]
    del data["device"]["dispatch_overhead_s"]
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    device = load_cluster(path).device
    assert device.efficiency.sustained == 1.0 and device.dispatch_overhead_s == 0.0
    data["device"]["efficiency"]["sustained_clock"] = 1.5
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match="sustained_clock"):
        load_cluster(path)


def test_a_run_can_name_the_attention_kernel_it_ran(tmp_path):
    """``efficiency.attention_kernels``: a catalog states other fused attention kernels' rates;
    ``with_attention_kernel`` prices a cluster's attention at them (FlashAttention in Triton
    below FlashAttention-2, Dao 2023 Sec. 4.1), and an unknown kernel is a one-line PlanError."""
    for name in ("a100-40g", "a100-80g", "h100-80g"):
        plain = load_cluster(name)
        triton = plain.with_attention_kernel("flash-attn-triton")
        eff, fa2 = triton.device.efficiency, plain.device.efficiency
        assert 0 < eff.attention_backward < fa2.attention_backward
        assert 0 < eff.attention_forward < fa2.attention_forward
        assert triton.node == plain.node and triton.cache_key != plain.cache_key
    with pytest.raises(PlanError) as excinfo:
        load_cluster("b200").with_attention_kernel("flash-attn-triton")
    assert "flash-attn-triton" in _one_line_plan_error(excinfo)
    data = yaml.safe_load((CATALOG / "a100-80g.yaml").read_text())
    data["device"]["efficiency"]["attention_kernels"] = {"x": {"forward": 0.5}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match="attention_kernels"):
        load_cluster(path)
