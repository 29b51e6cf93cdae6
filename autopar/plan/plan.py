"""The Plan: the only thing that crosses from search to codegen. Versioned, YAML, hand-editable."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from autopar.cost.offload import STATE_OFFLOADS
from autopar.cost.precision import FP32, Precision
from autopar.cost.recompute_policy import RECOMPUTE_MODES
from autopar.errors import PlanError
from autopar.peft import parse_peft
from autopar.plan.launch import plan_launch
from autopar.plan.model_facts import ModelFacts
from autopar.plan.parallelisms import check_value
from autopar.plan.placement import Placement, parse_placements
from autopar.plan.schema import check_plan_file
from autopar.plan.tp_entries import validate_tp_entries

PLAN_VERSION = 3
# version 1 lacks what the report needs beyond the summary (time breakdown, per-stage idle, the
# runner-ups' breakdowns, bounds, explain); version 2 lacks the precision, the engine and the
# robustness checks. Both still load, and the report says what is missing
READABLE_VERSIONS = (1, 2, 3)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# Plan.report's renderer. The report package reads plans (report -> plan), so plan/ must not
# import it; instead autopar.report registers its ``render`` here when it is imported (autopar's
# __init__ imports it, so ``import autopar`` is enough), and Plan.report delegates to it.
_report_renderer: Callable[..., str] | None = None


def register_report_renderer(render: Callable[..., str]) -> None:
    """Make ``render(plan, fmt, run)`` what :meth:`Plan.report` calls (autopar.report's)."""
    global _report_renderer
    _report_renderer = render


def round6(x: float) -> float:
    """Six significant digits: readable, and stable across runs for byte-identical files."""
    return float(f"{x:.6g}")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers never see a
    partial file, and a failure leaves none behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".",
                               prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would give, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass
class Predicted:
    """What the cost model predicts for the plan (on the most loaded device for memory)."""

    step_time_s: float
    memory: dict[str, float]  # params, grads, optimizer, activations, kv_cache, buffers, total
    mfu: float
    tokens_per_s: float
    bubble_s: float = 0.0
    host_bytes_per_node: float = 0.0
    stages: list[dict] = field(default_factory=list)  # per stage: blocks, times, memory
    # the step time as terms that add up to it (compute, recompute, comm, bubble, dp_comm,
    # optimizer, offload), along the bottleneck stage
    breakdown: dict[str, float] = field(default_factory=dict)
    pipeline_s: float = 0.0  # the pipelined forward/backward of one step
    p2p_s: float = 0.0  # one send across the slowest stage boundary
    # what each steady-state send costs its stage (the part not hidden, and the compute it
    # slows where hidden)
    p2p_steady_s: float = 0.0
    optimizer_s: float = 0.0
    offload_s: float = 0.0
    model_flops: float = 0.0  # per step, without recompute: the MFU numerator
    # the step if every collective were 1.5x slower, and if overlap were halved
    sensitivity: dict[str, float] = field(default_factory=dict)
    # task="infer": step_time_s is one decoding step of every concurrent sequence
    prefill_s: float = 0.0  # the prompts' forward, all concurrent sequences
    decode_s_per_token: float = 0.0  # each decoding step at the planned concurrency
    context: int = 0  # positions each sequence's cache holds (the decoding step's worst case)
    kv_cache_bytes: float = 0.0  # on the most loaded device
    max_concurrency: int = 0  # the most sequences this plan's layout holds in memory

    def __getitem__(self, key: str) -> object:  # plan.predicted["mfu"] works too
        return getattr(self, key)


@dataclass
class Plan:
    """A parallel execution plan for one model on one cluster.

    ``mesh`` maps ``pp``/``dp``/``cp``/``ep``/``tp`` to degrees whose product is ``devices``
    (``cp``: context-parallel ranks, each holding ``seq / cp`` tokens; ``cp_mode`` how they
    exchange attention's keys and values: ring, alltoall or hybrid);
    ``recompute`` has one mode per block; ``stages`` are ``[start, end)`` block ranges.
    """

    # source, parameter count, blocks, captured input shapes (a dict is read into the record)
    model: ModelFacts
    devices: int
    cluster: str
    task: str
    global_batch: int
    mesh: dict[str, int]
    microbatch_size: int
    num_microbatches: int
    zero_stage: int
    schedule: str
    virtual_stages: int
    sequence_parallel: bool
    recompute: list[str]
    offload: list[str]
    stages: list[list[int]]
    placements: dict  # params: FQN -> placement; nodes: per block type, node -> strategy
    predicted: Predicted
    alternatives: list[dict] = field(default_factory=list)
    solver: dict = field(default_factory=dict)
    memory_limit_bytes: float = 0.0
    # per block type: the alternatives (tp degrees, recompute modes, each op's strategies) and
    # their costs, for `autopar explain`
    explain: dict = field(default_factory=dict)
    # parameter / compute / reduce dtypes and loss scaling (empty in plans before version 3)
    precision: dict = field(default_factory=dict)
    # whose collectives the prediction prices: autopar's runtime, or megatron / deepspeed
    engine: str = "autopar"
    cp_mode: str = "ring"
    # GShard expert capacity the plan was priced with and the runtime drops at (None: dropless)
    capacity_factor: float | None = None
    # task="finetune": the parameter-efficient method (autopar.peft.PeftConfig as a dict) and
    # the parameters it trains (the rest are frozen)
    peft: dict = field(default_factory=dict)
    trainable_params: int = 0
    # registered parallelisms (autopar.plan.parallelisms) and the values the search chose
    parallelisms: dict[str, bool | int | str] = field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):  # the plan file's mapping, or a caller's
            self.model = ModelFacts.from_dict(self.model)

    # -- persistence ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain data (what the YAML file holds), ``version`` first."""
        d = asdict(self)
        d["model"] = self.model.to_dict()
        d = {"version": d.pop("version"), **d}
        if not d["parallelisms"]:
            del d["parallelisms"]  # plans without them read as before
        if d["capacity_factor"] is None:
            del d["capacity_factor"]  # dropless: the files of dropless plans stay as they were
        return d

    def save(self, path: str | Path) -> Path:
        """Write the plan as YAML atomically (a failure leaves no partial file)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None,
                              width=100)
        return write_text_atomic(path, f"# autopar plan (format version {PLAN_VERSION}); edit "
                                       f"and re-run as you like: codegen reads only this "
                                       f"file\n{text}")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file; a file of another version or an inconsistent edit is a PlanError."""
        path = Path(path)
        try:
            # libyaml's safe loader where installed: the same data, and a plan with its explain
            # tables parses in milliseconds instead of a second
            data = yaml.load(path.read_text(), Loader=_SAFE_LOADER)  # noqa: S506 - safe
        except OSError as exc:
            raise PlanError(f"cannot read plan {path}: {exc.strerror}; check the path") from None
        except yaml.YAMLError as exc:
            line = " ".join(str(exc).split())
            raise PlanError(f"plan {path} is not valid YAML ({line}); fix the file or "
                            f"re-plan") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, where: str = "plan") -> Plan:
        """A validated Plan from plain data; ``where`` names the source in error messages."""
        if not isinstance(data, dict):
            raise PlanError(f"{where} is not an autopar plan (not a mapping)")
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise PlanError(f"{where} has plan format version {version!r}, this autopar reads "
                            f"versions {', '.join(map(str, READABLE_VERSIONS))}; re-run "
                            f"`autopar compile` to re-plan")
        data = dict(data)
        if isinstance(data.get("mesh"), dict) and "cp" not in data["mesh"]:
            data["mesh"] = {**data["mesh"], "cp": 1}  # plans from before context parallelism
        check_plan_file(data, where)  # every field's type and range, before anything reads it
        for fields, given, inside in ((cls.__dataclass_fields__, data, ""),
                                      (Predicted.__dataclass_fields__, data["predicted"],
                                       "predicted.")):
            unknown = sorted(set(given) - set(fields), key=repr)
            if unknown:  # repr: a key may hold quotes or line breaks, the message stays one line
                raise PlanError(f"{where}: missing or unknown field ({inside}{unknown[0]!r} is "
                                f"not a plan field); remove it, or re-plan")
        predicted = Predicted(**data.pop("predicted"))
        plan = cls(predicted=predicted, **data)
        plan.validate(where)
        plan.version = PLAN_VERSION  # upgraded in memory: saving writes the current format
        return plan

    def validate(self, where: str = "plan") -> None:
        """Internal consistency: what a hand edit can break."""
        mesh = self.mesh
        if set(mesh) != {"pp", "dp", "cp", "tp", "ep"} or any(int(v) < 1 for v in mesh.values()):
            raise PlanError(f"{where}: mesh must give pp, dp, cp, ep, tp >= 1, got {mesh}")
        product = mesh["pp"] * mesh["dp"] * mesh["cp"] * mesh["tp"] * mesh["ep"]
        if product != self.devices:
            raise PlanError(f"{where}: mesh {mesh} covers {product} devices but devices is "
                            f"{self.devices}; make pp*dp*cp*ep*tp equal devices")
        if self.capacity_factor is not None and not (
                isinstance(self.capacity_factor, (int, float))
                and not isinstance(self.capacity_factor, bool) and self.capacity_factor > 0):
            raise PlanError(f"{where}: capacity_factor must be a positive number or null "
                            f"(dropless), got {self.capacity_factor!r}")
        if self.cp_mode not in ("ring", "alltoall", "hybrid", "allgather"):
            raise PlanError(f"{where}: cp_mode must be ring, alltoall, hybrid or allgather, "
                            f"got {self.cp_mode!r}")
        replicas = mesh["dp"] * mesh["ep"]
        if self.microbatch_size * self.num_microbatches * replicas != self.global_batch:
            raise PlanError(
                f"{where}: microbatch_size {self.microbatch_size} x num_microbatches "
                f"{self.num_microbatches} x dp*ep {replicas} != global_batch {self.global_batch}")
        nblocks = len(self.model.blocks)
        if len(self.recompute) != nblocks:
            raise PlanError(f"{where}: recompute lists {len(self.recompute)} modes for "
                            f"{nblocks} blocks; give one mode per block")
        bad = sorted(set(self.recompute) - set(RECOMPUTE_MODES))
        if bad:
            raise PlanError(f"{where}: unknown recompute mode(s) {bad}; use "
                            f"{', '.join(RECOMPUTE_MODES)}")
        if len(self.stages) != mesh["pp"]:
            raise PlanError(f"{where}: {len(self.stages)} stages for pp={mesh['pp']}")
        expect = 0
        for start, end in self.stages:
            if start != expect or end <= start:
                raise PlanError(f"{where}: stages {self.stages} must be contiguous, non-empty "
                                f"[start, end) ranges from 0")
            expect = end
        if expect != nblocks:
            raise PlanError(f"{where}: stages end at block {expect} but the model has {nblocks}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"{where}: zero_stage must be 0-3, got {self.zero_stage}")
        for name, value in self.parallelisms.items():
            check_value(name, value, f"{where}: parallelisms")
        if self.parallelisms and self.task == "infer":
            raise PlanError(f"{where}: parallelisms are for training plans; remove them from "
                            f"this serving plan")
        if self.peft:
            parse_peft(dict(self.peft))  # one line naming the bad setting
        if self.precision:
            try:
                Precision.from_dict(self.precision)
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanError(f"{where}: precision {self.precision} is not valid ({exc}); "
                                f"give param, compute and reduce as fp32, bf16 or fp16") from None
        if not isinstance(self.placements, dict) or \
                not isinstance(self.placements.get("params", {}), dict):
            raise PlanError(f"{where}: placements must map params to placements; re-plan with "
                            f"autopar compile")
        # a fused projection's parts and an attention's heads, as the runtime splits them
        validate_tp_entries(self.placements, mesh["tp"], where)

    # -- reading ----------------------------------------------------------------------------
    def recompute_counts(self) -> dict[str, int]:
        """Blocks per recompute mode, in the order none, selective, op, full: ``{"none": 30,
        "full": 4}``."""
        return {m: self.recompute.count(m) for m in RECOMPUTE_MODES
                if self.recompute.count(m)}

    @property
    def layers(self) -> list[str]:
        """Module paths of the model's repeated layers, in model order (not the head, tail or
        root blocks around them)."""
        return self.model.layers

    @property
    def seq(self) -> int:
        """Tokens per sequence the plan was made for (the first captured input's last
        dimension)."""
        return self.model.seq

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """Block ranges of the pipeline chunks: the stages, each cut in ``virtual_stages``
        parts for the interleaved schedule (chunk c runs on rank c % pp), in model order."""
        v = self.virtual_stages if self.schedule == "interleaved" else 1
        out = []
        for start, end in self.stages:
            n = end - start
            if n < v:
                raise PlanError(f"stage {start}-{end} has fewer blocks than virtual_stages={v}")
            cuts = [start + (n * k) // v for k in range(v + 1)]
            out.extend((cuts[k], cuts[k + 1]) for k in range(v))
        if v > 1:  # chunk order: rank r holds chunks r, r + pp, ... of the model's sequence
            pp = len(self.stages)
            out = [out[r * v + k] for k in range(v) for r in range(pp)]
            out.sort()
        return out

    @property
    def offloads_state(self) -> bool:
        """Whether model state (optimizer states or parameters) is offloaded to the host."""
        return bool(STATE_OFFLOADS & set(self.offload))

    @property
    def state_offloads(self) -> list[str]:
        """Which model state is offloaded: ``["optimizer"]``, ``["optimizer", "params"]``..."""
        return sorted(STATE_OFFLOADS & set(self.offload))

    @property
    def data_parallel_wrapper(self) -> str:
        """"fully_shard", "ddp" or "none": which wrapper the data parallelism uses. DDP for
        ZeRO-0/1 (1 adds ZeroRedundancyOptimizer: :attr:`shards_optimizer`), fully_shard for
        ZeRO-2 (parameters kept gathered from the forward to the end of the backward) and
        ZeRO-3, and for state offload (with one device too)."""
        if self.offloads_state:
            return "fully_shard"
        if self.mesh["dp"] * self.mesh.get("cp", 1) == 1:  # cp ranks replicate parameters too
            return "none"
        return "ddp" if self.zero_stage <= 1 else "fully_shard"

    @property
    def shards_optimizer(self) -> bool:
        """Whether DDP's optimizer is a ZeroRedundancyOptimizer (ZeRO-1)."""
        return self.data_parallel_wrapper == "ddp" and self.zero_stage == 1

    @property
    def training_precision(self) -> Precision:
        """The precision record (fp32 where the plan records none: plans before version 3)."""
        return Precision.from_dict(self.precision) if self.precision else FP32

    def param_placements(self) -> dict[str, Placement]:
        """Each parameter's placement as a record (the file holds the string form)."""
        return parse_placements(self.placements.get("params") or {})

    def check_world_size(self, world: int) -> None:
        """Refuse, in one line with the launch that fits, a run of ``world`` processes for a
        plan of another size."""
        if world == self.devices:
            return
        launch = plan_launch(self.devices, self.cluster) if self.devices > 1 else \
            "one process, without torchrun"
        raise PlanError(f"the plan is for {self.devices} devices but {world} processes are "
                        f"running; launch with {launch} (or re-plan for {world})")

    def report(self, fmt: str = "text", run: dict | None = None) -> str:
        """The strategy report: ``"text"``, ``"markdown"``, ``"html"`` (one self-contained
        file with plots) or ``"json"``; ``run`` (:func:`autopar.report.run.load_run` of an
        artifact directory) adds what a run measured next to what was predicted. Delegates to
        :func:`autopar.report.render` (registered by that package: see above)."""
        if _report_renderer is None:
            raise PlanError("no report renderer is registered: import autopar.report (or "
                            "autopar) before calling Plan.report")
        return _report_renderer(self, fmt, run)

    def __repr__(self) -> str:
        return (f"Plan(mesh={self.mesh}, mb={self.microbatch_size}x{self.num_microbatches}, "
                f"zero={self.zero_stage}, schedule={self.schedule}, "
                f"step={self.predicted.step_time_s:.3g}s)")
