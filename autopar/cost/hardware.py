"""Hardware catalog: device and cluster descriptions loaded from ``cost_models/*.yaml``.

Units everywhere: bytes, seconds, FLOP/s, bytes/s (SI: 1 GB = 1e9 bytes).
A catalog file looks like::

    name: a100-80g
    device:
      type: cuda                  # torch device type: cuda | cpu | npu
      backend: nccl               # collective backend: nccl | gloo | hccl
      peak_flops: {fp32: 19.5e12, tf32: 156e12, bf16: 312e12, fp16: 312e12}
      memory_bytes: 85.9e9
      usable_fraction: 0.92       # what the framework can allocate
      memory_bandwidth: 2.039e12
      efficiency:                 # achieved / peak, by op kind (calibrated by `autopar profile`)
        matmul: 0.80              # large-shape matmul
        matmul_half_dim: 128      # a dimension of this size halves matmul efficiency
        memory: 0.85              # elementwise / norm / view-copy bandwidth
        attention: 0.70
        comm: 0.80                # collectives' achieved share of link bandwidth
        overlap: 1.0              # share of communication that can run under compute
    node:
      devices_per_node: 8
      intra_bandwidth: 300e9      # per device, one direction
      intra_latency: 5.0e-6
      inter_bandwidth: 25e9       # per device, one direction, across nodes
      inter_latency: 1.0e-5
      host_bandwidth: 25e9        # device <-> host (PCIe / C2C), for offload
      host_memory_bytes: 1.0e12   # per node
    sources: {peak_flops: "...", ...}

Every number carries its source as a comment or in ``sources``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from autopar._paths import data_dir
from autopar.errors import PlanError

DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "tf32": "tf32",
                 "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "fp32": "fp32", "fp16": "fp16",
                 "bf16": "bf16", "fp8": "fp8"}


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak, per op kind."""

    matmul: float = 0.75
    matmul_half_dim: float = 128.0
    memory: float = 0.8
    attention: float = 0.6
    comm: float = 1.0  # achieved / link bandwidth for collectives
    overlap: float = 1.0  # share of communication that can hide behind concurrent compute


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU socket share) as the cost model sees it."""

    name: str
    type: str  # torch device type
    backend: str  # collective backend
    peak_flops: dict[str, float]  # by dtype short name: fp32, tf32, bf16, fp16, fp8
    memory_bytes: float
    usable_fraction: float
    memory_bandwidth: float
    efficiency: Efficiency = field(default_factory=Efficiency)

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_fraction

    def flops_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for a dtype; a dtype the device lacks falls back to fp32's rate."""
        key = DTYPE_ALIASES.get(dtype, dtype)
        value = self.peak_flops.get(key)
        if value:
            return float(value)
        return float(self.peak_flops["fp32"])


@dataclass(frozen=True)
class NodeSpec:
    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    host_bandwidth: float
    host_memory_bytes: float


@dataclass(frozen=True)
class Cluster:
    """A device kind, how many per node, and how many nodes.

    ``Cluster(device="h100-80g", nodes=8)`` composes a topology from a catalog entry;
    ``devices_per_node`` overrides the catalog's node size.
    """

    device: DeviceSpec | str
    devices_per_node: int | None = None
    nodes: int | None = None
    node: NodeSpec | None = None
    # measured intra-node (alpha s, beta B/s) per collective, from `autopar profile`
    collective_fits: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.device, str):
            loaded = load_cluster(self.device)
            object.__setattr__(self, "device", loaded.device)
            if self.node is None:
                object.__setattr__(self, "node", loaded.node)
                object.__setattr__(self, "collective_fits", loaded.collective_fits)
        if self.node is None:
            raise PlanError("Cluster needs a node description; load one from cost_models/")
        if self.devices_per_node is not None and self.devices_per_node != self.node.devices_per_node:
            object.__setattr__(self, "node", replace(self.node, devices_per_node=self.devices_per_node))
        object.__setattr__(self, "devices_per_node", self.node.devices_per_node)

    @property
    def name(self) -> str:
        return self.device.name  # type: ignore[union-attr]

    @property
    def cache_key(self) -> str:
        """A content key for memoising costs (two equal clusters share it)."""
        key = self.__dict__.get("_cache_key")
        if key is None:
            key = repr((self.device, self.node, self.collective_fits))
            object.__setattr__(self, "_cache_key", key)
        return key

    def with_devices(self, total: int) -> Cluster:
        """The same cluster sized to ``total`` devices (nodes rounded up)."""
        per = self.node.devices_per_node  # type: ignore[union-attr]
        return replace(self, nodes=max(1, -(-total // per)))


def catalog_names() -> list[str]:
    return sorted(p.stem for p in data_dir("cost_models").glob("*.yaml"))


def _require(d: dict, key: str, where: str) -> object:
    if key not in d or d[key] is None:
        raise PlanError(f"{where}: missing '{key}'; see cost_models/README.md for the format")
    return d[key]


def parse_cluster(data: dict, where: str) -> Cluster:
    """Build a Cluster from a catalog mapping (the YAML's content)."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: not a mapping; see cost_models/README.md for the format")
    dev = _require(data, "device", where)
    node = _require(data, "node", where)
    for key, section in (("device", dev), ("node", node)):
        if not isinstance(section, dict):
            raise PlanError(f"{where}: '{key}' must be a mapping; see cost_models/README.md for the format")
    eff = dev.get("efficiency") or {}
    try:
        device = DeviceSpec(
            name=str(data.get("name") or Path(where).stem),
            type=str(dev.get("type", "cuda")),
            backend=str(dev.get("backend", "nccl")),
            peak_flops={k: float(v) for k, v in _require(dev, "peak_flops", where).items()
                        if v is not None},
            memory_bytes=float(_require(dev, "memory_bytes", where)),
            usable_fraction=float(dev.get("usable_fraction", 0.9)),
            memory_bandwidth=float(_require(dev, "memory_bandwidth", where)),
            efficiency=Efficiency(**{k: float(v) for k, v in eff.items()}),
        )
        node_spec = NodeSpec(
            devices_per_node=int(_require(node, "devices_per_node", where)),
            intra_bandwidth=float(_require(node, "intra_bandwidth", where)),
            intra_latency=float(node.get("intra_latency", 5e-6)),
            inter_bandwidth=float(_require(node, "inter_bandwidth", where)),
            inter_latency=float(node.get("inter_latency", 1e-5)),
            host_bandwidth=float(_require(node, "host_bandwidth", where)),
            host_memory_bytes=float(node.get("host_memory_bytes", 5e11)),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise PlanError(f"{where}: bad value ({exc}); numbers must be plain floats like 312e12") from None
    if "fp32" not in device.peak_flops:
        raise PlanError(f"{where}: peak_flops needs at least fp32")
    fits = []
    for kind, fit in sorted((data.get("collectives") or {}).items()):
        if isinstance(fit, dict) and fit.get("alpha") is not None and fit.get("beta"):
            fits.append((str(kind), float(fit["alpha"]), float(fit["beta"])))
    return Cluster(device=device, node=node_spec, collective_fits=tuple(fits))


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A Cluster from a catalog name (``"a100-80g"``), a YAML path, or a Cluster (returned as is)."""
    if isinstance(spec, Cluster):
        return spec
    path = Path(spec)
    if not path.is_file():
        path = data_dir("cost_models") / f"{spec}.yaml"
    if not path.is_file():
        raise PlanError(f"unknown cluster '{spec}': use one of {', '.join(catalog_names())} "
                        f"or a profile YAML written by `autopar profile`")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())  # YAML errors span several lines
        raise PlanError(f"cannot read cluster file {path}: {detail}") from None
    return parse_cluster(data, str(path))
