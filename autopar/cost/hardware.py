"""Hardware catalog: device and cluster descriptions loaded from ``cost_models/*.yaml``.

Units everywhere: bytes, seconds, FLOP/s, bytes/s (SI: 1 GB = 1e9 bytes). The format is
documented in ``cost_models/README.md``. Every key is required: a catalog entry states each
number with its source, and one that leaves a number out fails to load, naming the key. There
is no silent default anywhere in the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from autopar._paths import data_dir
from autopar.errors import PlanError

# a plan above this share of the usable memory risks running out (the search's robust choice
# prefers plans below it; the report says so): the caching allocator's
# unusable share scatters over 6-10% of its pool between runs (meta-llama/llama-cookbook#120)
# around the 8% the usable memory already sets aside, so the last 5% is within that scatter
MEMORY_RISK_FRACTION = 0.95

DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "tf32": "tf32",
                 "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "fp32": "fp32", "fp16": "fp16",
                 "bf16": "bf16", "fp8": "fp8"}
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak, per op kind (large, well-shaped operations)."""

    matmul: float  # best-shape GEMM rate / dtype peak; tile and wave effects come on top
    memory: float  # elementwise / copy bandwidth / memory_bandwidth
    attention: float  # fused attention rate / dtype peak
    # measured by shape class (``autopar profile --from-run``): (most FLOPs of a call, its
    # achieved / peak rate), ascending; a call above the last class takes the last. Empty:
    # ``matmul`` for every shape (with the tile and wave effects)
    matmul_by_flops: tuple[tuple[float, float], ...] = ()
    # Refinements the shipped GPU catalogs state and a profile written from measurements may
    # leave out (None: the measured numbers above already are what the device sustains).
    # sustained / burst rate of Tensor-Core work at the power limit (a training loop runs hot)
    sustained_clock: float | None = None
    # a fused (flash) attention kernel: useful FLOP/s over peak, forward and backward, for long
    # sequences; ``attention`` above then prices only unfused (eager) attention matmuls
    attention_forward: float | None = None
    attention_backward: float | None = None
    # keys per query tile whose time a fused attention kernel spends outside its inner loop
    # (loading Q, normalising and storing O): the rate at s keys is s / (s + this) of the peak
    attention_ramp_tokens: float | None = None
    # best-shape fp8 GEMM rate / fp8 peak (cuBLAS FP8 kernels reach a smaller share of their
    # doubled peak than bf16 ones of theirs); None: ``matmul`` (a profile whose peak_flops are
    # measured per dtype)
    matmul_fp8: float | None = None
    # other fused attention kernels than the one ``attention_forward`` / ``attention_backward``
    # price (FlashAttention-2, behind SDPA): (name, forward, backward) rates over peak, for a
    # run that states which kernel it ran (:meth:`Cluster.with_attention_kernel`)
    attention_kernels: tuple[tuple[str, float, float], ...] = ()

    @property
    def sustained(self) -> float:
        """The factor on Tensor-Core rates for work that runs as long as a training step."""
        return 1.0 if self.sustained_clock is None else self.sustained_clock

    def matmul_for(self, dtype: str) -> float:
        """The best-shape GEMM efficiency of ``dtype`` (short name)."""
        if dtype == "fp8" and self.matmul_fp8 is not None:
            return self.matmul_fp8
        return self.matmul

    def matmul_at(self, flops: float) -> float | None:
        """The measured efficiency of a matmul call of ``flops`` FLOPs (None: no classes)."""
        if not self.matmul_by_flops:
            return None
        for upper, efficiency in self.matmul_by_flops:
            if flops <= upper:
                return efficiency
        return self.matmul_by_flops[-1][1]


@dataclass(frozen=True)
class Overlap:
    """How communication overlaps compute on this device.

    ``concurrent``: the share of a collective's time that can run while compute runs (1 where
    collectives run on their own engines or SMs; less where they share cores, as gloo on CPU).
    ``compute_slowdown``: compute that runs beside a collective takes ``1 + compute_slowdown``
    times as long (shared SMs, memory bandwidth and caches).
    """

    concurrent: float
    compute_slowdown: float


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU socket share) as the cost model sees it."""

    name: str
    type: str  # torch device type
    backend: str  # collective backend
    peak_flops: dict[str, float]  # by dtype short name: fp32, tf32, bf16, fp16, fp8
    tensor_core_dtypes: tuple[str, ...]  # dtypes the matrix units run (empty: none)
    compute_units: int  # streaming multiprocessors (1 for a CPU process: no wave effect)
    matmul_tile: tuple[int, int]  # output tile (rows, cols) one unit computes at a time
    kernel_overhead_s: float  # fixed time of every launched kernel (launch and ramp)
    memory_bytes: float
    # share of memory_bytes left to the framework's allocator (the runtime context, kernel
    # workspaces and communication buffers take the rest)
    usable_fraction: float
    # share of the allocator's pool that fragmentation leaves unusable at the peak: the caching
    # allocator's reserved bytes exceed the live (active) bytes by this share of reserved
    allocator_fragmentation: float
    memory_bandwidth: float
    efficiency: Efficiency
    overlap: Overlap
    # host time to issue one kernel from eager PyTorch (Python, dispatcher, autograd, driver):
    # a kernel shorter than this leaves the device waiting. 0: not stated (a profile)
    dispatch_overhead_s: float = 0.0
    # the best model-FLOPs utilisation ever published for this device class (the plausibility
    # ceiling a prediction is checked against); None: not stated
    best_published_mfu: float | None = None

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes the plan's live tensors may take at their peak: the allocator's share of the
        device, less the fragmentation headroom its caching pool needs."""
        return self.memory_bytes * self.usable_fraction * (1.0 - self.allocator_fragmentation)

    def flops_for(self, dtype: str) -> float:
        """Peak dense FLOP/s for a dtype; a dtype the device lacks falls back to fp32's rate."""
        key = DTYPE_ALIASES.get(dtype, dtype)
        value = self.peak_flops.get(key)
        if value:
            return float(value)
        return float(self.peak_flops["fp32"])


@dataclass(frozen=True)
class NodeSpec:
    """One node and its links. Bandwidths are per device and one direction; ``*_efficiency``
    is the share of that line rate collectives achieve (nccl-tests bus bandwidth / line rate);
    latencies are per ring step of the backend's bulk protocol, plus a fixed start-up
    ``collective_latency`` per collective."""

    devices_per_node: int
    # devices of the node that compute at full rate at once: devices_per_node where each has
    # its own chip; fewer where processes time-share CPU cores (peak_flops is then the rate
    # with all of them busy, and one computing alone runs faster)
    compute_slots: int
    intra_bandwidth: float
    intra_efficiency: float
    intra_latency: float
    inter_bandwidth: float
    inter_efficiency: float
    inter_latency: float
    collective_latency: float
    host_bandwidth: float
    host_memory_bytes: float
    # the host CPU that the node's devices share: its cores and the DRAM bandwidth they
    # achieve together (all sockets), which an offloaded optimizer step runs on
    host_cores: int
    host_memory_bandwidth: float
    # NCCL's cap on the LL protocol's bus bandwidth (``llMaxBws`` in src/graph/tuning.cc), for
    # one node, two nodes and three or more: per GPU generation inside a node, per host CPU
    # vendor across nodes. Empty: no cap (backends without NCCL's protocols)
    ll_max_bandwidth: tuple[float, ...] = ()

    def ll_cap(self, nodes: int) -> float:
        """NCCL's LL bus-bandwidth cap for a group spanning ``nodes`` nodes (inf: none)."""
        if not self.ll_max_bandwidth:
            return float("inf")
        return self.ll_max_bandwidth[min(max(nodes, 1), 3) - 1]


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
    # measured intra-node (alpha s, beta B/s) per collective, from `autopar profile`; a kind
    # "all_reduce@4" holds the fit for groups of 4 ranks (what runs measured, if they did)
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
            # a node of another size keeps the catalog's share of devices per compute slot
            share = self.node.devices_per_node / self.node.compute_slots
            slots = max(1, min(self.devices_per_node, round(self.devices_per_node / share)))
            object.__setattr__(self, "node", replace(self.node, devices_per_node=self.devices_per_node,
                                                     compute_slots=slots))
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

    def with_attention_kernel(self, kernel: str) -> Cluster:
        """This cluster with fused attention priced at the rates the catalog states for
        ``kernel`` (``device.efficiency.attention_kernels``) instead of FlashAttention-2's."""
        device = self.device
        assert isinstance(device, DeviceSpec)
        rates = {name: (fwd, bwd) for name, fwd, bwd in device.efficiency.attention_kernels}
        if kernel not in rates:
            known = ", ".join(sorted(rates)) or "none"
            raise PlanError(f"cluster '{device.name}' states no rates for attention kernel "
                            f"'{kernel}' (it states: {known})")
        efficiency = replace(device.efficiency, attention_forward=rates[kernel][0],
                             attention_backward=rates[kernel][1])
        return replace(self, device=replace(device, efficiency=efficiency),
                       devices_per_node=None)

    def perturbed(self, comm_slower: float = 1.0, overlap_scale: float = 1.0) -> Cluster:
        """This cluster with every collective and host transfer ``comm_slower`` times slower
        (bandwidths divided, latencies multiplied) and the concurrent share of communication scaled by
        ``overlap_scale``: what the robustness check of a plan asks."""
        node, device = self.node, self.device
        assert isinstance(device, DeviceSpec) and node is not None
        node = replace(node, intra_bandwidth=node.intra_bandwidth / comm_slower,
                       inter_bandwidth=node.inter_bandwidth / comm_slower,
                       intra_latency=node.intra_latency * comm_slower,
                       inter_latency=node.inter_latency * comm_slower,
                       collective_latency=node.collective_latency * comm_slower,
                       host_bandwidth=node.host_bandwidth / comm_slower)
        overlap = replace(device.overlap, concurrent=device.overlap.concurrent * overlap_scale)
        fits = tuple((k, a * comm_slower, b / comm_slower) for k, a, b in self.collective_fits)
        return replace(self, device=replace(device, overlap=overlap), node=node,
                       devices_per_node=None, collective_fits=fits)


def catalog_names() -> list[str]:
    return sorted(p.stem for p in data_dir("cost_models").glob("*.yaml"))


_FORMAT = "see cost_models/README.md for the format"


def _require(d: dict, key: str, where: str, section: str) -> object:
    if key not in d or d[key] is None:
        raise PlanError(f"{where}: missing '{section}.{key}'; every catalog number must be "
                        f"stated with its source ({_FORMAT})")
    return d[key]


def _section(d: dict, key: str, where: str, parent: str = "") -> dict:
    name = f"{parent}.{key}" if parent else key
    value = d.get(key)
    if value is None:
        raise PlanError(f"{where}: missing '{name}'; {_FORMAT}")
    if not isinstance(value, dict):
        raise PlanError(f"{where}: '{name}' must be a mapping; {_FORMAT}")
    return value


def _numbers(d: dict, cls: type, where: str, section: str) -> dict:
    """Every float field of ``cls`` (those with a default are optional refinements)."""
    from dataclasses import MISSING

    return {f.name: float(_require(d, f.name, where, section)) for f in fields(cls)
            if f.default is MISSING and f.default_factory is MISSING}


def _flop_classes(d: dict, where: str) -> tuple[tuple[float, float], ...]:
    """``efficiency.matmul_by_flops``: [[most FLOPs, efficiency], ...] with rising bounds."""
    raw = d.get("matmul_by_flops") or []
    classes = tuple((float(upper), float(eff)) for upper, eff in raw)
    if any(not 0 < e <= 10 for _, e in classes) or \
            any(a[0] >= b[0] for a, b in zip(classes, classes[1:], strict=False)):
        raise ValueError("efficiency.matmul_by_flops must be [most FLOPs, efficiency] pairs "
                         "with rising bounds and efficiencies in (0, 10]")
    return classes


_REFINEMENTS = ("sustained_clock", "attention_forward", "attention_backward",
                "attention_ramp_tokens", "matmul_fp8")


def _refinements(d: dict) -> dict:
    """The optional efficiency refinements a catalog states (see :class:`Efficiency`)."""
    values = {key: float(d[key]) for key in _REFINEMENTS if d.get(key) is not None}
    for key in ("sustained_clock", "attention_forward", "attention_backward", "matmul_fp8"):
        if key in values and not 0 < values[key] <= 1:
            raise ValueError(f"efficiency.{key} must lie in (0, 1]")
    if values.get("attention_ramp_tokens", 0.0) < 0:
        raise ValueError("efficiency.attention_ramp_tokens must be >= 0")
    return values


def _attention_kernels(d: dict) -> tuple[tuple[str, float, float], ...]:
    """``efficiency.attention_kernels``: {name: {forward: rate, backward: rate}, ...}."""
    raw = d.get("attention_kernels") or {}
    if not isinstance(raw, dict) or any(not isinstance(r, dict) or r.get("forward") is None
                                        or r.get("backward") is None for r in raw.values()):
        raise ValueError("efficiency.attention_kernels must map each kernel's name to "
                         "{forward: rate, backward: rate}")
    kernels = tuple((str(name), float(rates["forward"]), float(rates["backward"]))
                    for name, rates in sorted(raw.items()))
    if any(not (0 < f <= 1 and 0 < b <= 1) for _, f, b in kernels):
        raise ValueError("efficiency.attention_kernels rates must lie in (0, 1]")
    return kernels


def parse_cluster(data: dict, where: str) -> Cluster:
    """Build a Cluster from a catalog mapping (the YAML's content)."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: not a mapping; {_FORMAT}")
    dev = _section(data, "device", where)
    node = _section(data, "node", where)
    try:
        peak = _section(dev, "peak_flops", where, "device")
        tensor = _require(dev, "tensor_core_dtypes", where, "device")
        tile = _require(dev, "matmul_tile", where, "device")
        if not isinstance(tensor, list) or not set(tensor) <= set(DTYPES):
            raise ValueError(f"tensor_core_dtypes must be a list drawn from {list(DTYPES)}")
        if not isinstance(tile, list) or len(tile) != 2:
            raise ValueError("matmul_tile must be [rows, cols]")
        device = DeviceSpec(
            name=str(data.get("name") or Path(where).stem),
            type=str(_require(dev, "type", where, "device")),
            backend=str(_require(dev, "backend", where, "device")),
            peak_flops={k: float(v) for k, v in peak.items() if v is not None},
            tensor_core_dtypes=tuple(str(t) for t in tensor),
            compute_units=int(_require(dev, "compute_units", where, "device")),
            matmul_tile=(int(tile[0]), int(tile[1])),
            kernel_overhead_s=float(_require(dev, "kernel_overhead_s", where, "device")),
            memory_bytes=float(_require(dev, "memory_bytes", where, "device")),
            usable_fraction=float(_require(dev, "usable_fraction", where, "device")),
            allocator_fragmentation=float(_require(dev, "allocator_fragmentation", where,
                                                   "device")),
            memory_bandwidth=float(_require(dev, "memory_bandwidth", where, "device")),
            efficiency=Efficiency(**_numbers(_section(dev, "efficiency", where, "device"),
                                             Efficiency, where, "device.efficiency"),
                                  matmul_by_flops=_flop_classes(dev["efficiency"], where),
                                  attention_kernels=_attention_kernels(dev["efficiency"]),
                                  **_refinements(dev["efficiency"])),
            overlap=Overlap(**_numbers(_section(dev, "overlap", where, "device"), Overlap,
                                       where, "device.overlap")),
            dispatch_overhead_s=float(dev.get("dispatch_overhead_s") or 0.0),
            best_published_mfu=(None if dev.get("best_published_mfu") is None
                                else float(dev["best_published_mfu"])),
        )
        values = _numbers(node, NodeSpec, where, "node")
        node_spec = NodeSpec(**{**values, "devices_per_node": int(values["devices_per_node"]),
                                 "compute_slots": int(values["compute_slots"]),
                                 "host_cores": int(values["host_cores"])},
                             ll_max_bandwidth=tuple(float(v) for v in
                                                    node.get("ll_max_bandwidth") or ()))
        if node_spec.ll_max_bandwidth and (len(node_spec.ll_max_bandwidth) != 3 or min(
                node_spec.ll_max_bandwidth) <= 0):
            raise ValueError("node.ll_max_bandwidth must be [one node, two nodes, three or "
                             "more] in bytes/s")
        if not 1 <= node_spec.compute_slots <= node_spec.devices_per_node:
            raise ValueError("node.compute_slots must lie in 1..devices_per_node")
        if node_spec.host_cores < 1 or node_spec.host_memory_bandwidth <= 0:
            raise ValueError("node.host_cores and node.host_memory_bandwidth must be positive")
        if not 0.0 <= device.allocator_fragmentation < 1.0:
            raise ValueError("device.allocator_fragmentation must lie in [0, 1)")
    except (TypeError, ValueError, AttributeError) as exc:
        raise PlanError(f"{where}: bad value ({exc}); numbers must be plain floats like "
                        f"312e12") from None
    if "fp32" not in device.peak_flops:
        raise PlanError(f"{where}: peak_flops needs at least fp32")
    missing = [t for t in device.tensor_core_dtypes if t not in device.peak_flops]
    if missing:
        raise PlanError(f"{where}: tensor_core_dtypes lists {missing} without a peak_flops "
                        f"value for it")
    fits = []
    for kind, fit in sorted((data.get("collectives") or {}).items()):
        if isinstance(fit, dict) and fit.get("alpha") is not None and fit.get("beta"):
            fits.append((str(kind), float(fit["alpha"]), float(fit["beta"])))
            # fitted per group size (``autopar profile --from-run``): "all_reduce@4"
            for ranks, sized in sorted((fit.get("by_ranks") or {}).items()):
                fits.append((f"{kind}@{int(ranks)}", float(sized["alpha"]),
                             float(sized["beta"])))
    return Cluster(device=device, node=node_spec, collective_fits=tuple(fits))


def cluster_file(spec: str | Path) -> Path | None:
    """The YAML file of a catalog name (``"a100-80g"``) or a profile path; None if neither."""
    path = Path(spec)
    if not path.is_file():
        path = data_dir("cost_models") / f"{spec}.yaml"
    return path if path.is_file() else None


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A Cluster from a catalog name (``"a100-80g"``), a YAML path, or a Cluster (returned as is)."""
    if isinstance(spec, Cluster):
        return spec
    path = cluster_file(spec)
    if path is None:
        raise PlanError(f"unknown cluster '{spec}': use one of {', '.join(catalog_names())} "
                        f"or a profile YAML written by `autopar profile`")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        detail = " ".join(str(exc).split())  # YAML errors span several lines
        raise PlanError(f"cannot read cluster file {path}: {detail}") from None
    return parse_cluster(data, str(path))
