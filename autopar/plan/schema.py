"""The plan file's schema: every field's type and range, checked when a plan is loaded.

A plan.yaml is data a person may edit (or receive), and its values reach a generated program
and the runtime. So before a Plan is built from a file, every field is checked here: numbers are
numbers in range (strictly: ``"2"`` is not 2, ``true`` is not 1), choices are one of the known
names, module paths and cluster names are plain names (no quotes, brackets or line breaks),
and placements follow their small grammar. The first violation is one line naming the field,
what it must be and what it was. Fields the runtime does not read (the solver's notes, the
explain tables, the runner-ups) are only checked for shape.

pydantic does the checking (strict mode); the Plan itself stays a plain dataclass.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, TypeAdapter, ValidationError
from typing_extensions import NotRequired, Required, TypedDict

from autopar.errors import PlanError

PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
NonNegative = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# module paths, parameter and input names: identifiers joined by dots (an ONNX file's
# initialisers also have ":", "/" and "-": "onnx::MatMul_12")
Path = Annotated[str, StringConstraints(pattern=r"^[\w.:/\-]+$", max_length=300)]
# a cluster's name (a catalog name or a profile's): printable, no quotes or line breaks
ClusterName = Annotated[str, StringConstraints(pattern=r"^[\w.+\-@:/ ]+$", max_length=200)]
Word = Annotated[str, StringConstraints(pattern=r"^[\w.+\-]*$", max_length=100)]
# "Replicate", "Shard(0)@tp", "Replicate@tp(kv-heads)", "Shard(0)@tp+Shard(0)@dp", ...
Placement = Annotated[str, StringConstraints(
    pattern=r"^(Replicate(@tp\(kv-heads\))?|Shard\(\d\)@(tp|dp|ep|cp))(\+Shard\(\d\)@(dp|ep|cp))*$")]
_SAYS = {  # what each pattern means, for the error line
    Path.__metadata__[0].pattern: "a module path (letters, digits and _.:/-)",
    ClusterName.__metadata__[0].pattern: "a cluster name (letters, digits, spaces and _.+-@:/)",
    Word.__metadata__[0].pattern: "a plain word (letters, digits and _.+-)",
    Placement.__metadata__[0].pattern: "a placement such as Replicate, Shard(0)@tp or "
                                       "Shard(0)@tp+Shard(0)@dp",
}
Range = Annotated[list[Count], Field(min_length=2, max_length=2)]


class Block(TypedDict):
    name: Path
    type: Count
    kind: NotRequired[Word]


class ModelFacts(TypedDict, total=False):
    source: Annotated[str, Field(max_length=200)]
    params: Count
    inputs: Required[dict[Path, list[PositiveInt]]]
    outputs: dict[Path, list[Count]]
    input_dtypes: dict[Path, Word]  # "int64", "float32": what the runtime's task is read from
    blocks: Required[list[Block]]
    model_type: Word
    shape: dict[Path, int | float | None]
    vocab_parallel: bool


class Placements(TypedDict, total=False):
    params: dict[Path, Placement]
    nodes_by_block_type: dict
    # checked by plan/tp_entries.py (lists of positive ints that add up and split whole)
    fused: dict[Path, object]
    heads: dict[Path, object]


class PredictedFile(TypedDict, total=False):
    step_time_s: Required[NonNegative]
    memory: Required[dict[Word, NonNegative]]
    mfu: Required[NonNegative]
    tokens_per_s: Required[NonNegative]
    bubble_s: NonNegative
    host_bytes_per_node: NonNegative
    stages: list[dict]
    breakdown: dict[Word, float]
    pipeline_s: NonNegative
    p2p_s: NonNegative
    p2p_steady_s: NonNegative
    optimizer_s: NonNegative
    offload_s: NonNegative
    model_flops: NonNegative
    sensitivity: dict[Word, float]
    prefill_s: NonNegative
    decode_s_per_token: NonNegative
    context: Count
    kv_cache_bytes: NonNegative
    max_concurrency: Count


Axis = Literal["pp", "dp", "cp", "ep", "tp"]


class PlanFile(TypedDict, total=False):
    version: Required[int]
    model: Required[ModelFacts]
    devices: Required[PositiveInt]
    cluster: Required[ClusterName]
    task: Required[Literal["train", "finetune", "infer"]]
    global_batch: Required[PositiveInt]
    mesh: Required[dict[Axis, PositiveInt]]
    microbatch_size: Required[PositiveInt]
    num_microbatches: Required[PositiveInt]
    zero_stage: Required[Literal[0, 1, 2, 3]]
    schedule: Required[Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]]
    virtual_stages: Required[PositiveInt]
    sequence_parallel: Required[bool]
    recompute: Required[list[Literal["none", "selective", "op", "full"]]]
    offload: Required[list[Literal["optimizer", "params", "activations"]]]
    stages: Required[list[Range]]
    placements: Required[Placements]
    predicted: Required[PredictedFile]
    alternatives: list[dict]
    solver: dict
    memory_limit_bytes: NonNegative
    explain: dict
    precision: dict[Literal["param", "compute", "reduce", "loss_scaling"], Word | bool]
    engine: Literal["autopar", "megatron", "megatron-core", "deepspeed", "llama3-4d",
                    "llm-foundry"]
    cp_mode: Literal["ring", "alltoall", "hybrid", "allgather"]
    capacity_factor: PositiveFloat | None
    peft: dict
    trainable_params: Count
    parallelisms: dict[Word, bool | int | Word]


_PLAN_FILE = TypeAdapter(PlanFile)


def check_plan_file(data: dict, where: str = "plan") -> None:
    """Raise a one-line PlanError at the first field of ``data`` (a plan file's mapping) whose
    type or range is wrong. Unknown top-level fields are refused by the Plan itself."""
    try:
        _PLAN_FILE.validate_python(data, strict=True)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        # a key is data too: one with quotes, spaces or line breaks is shown by repr
        field = ".".join(str(part) if re.fullmatch(r"[\w.\-\[\]]+", str(part)) else repr(part)
                         for part in first["loc"]) or "(top level)"
        got = first.get("input")
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        if first["type"] == "missing":
            raise PlanError(f"{where}: {field} is missing; restore it or re-plan with autopar "
                            f"compile") from None
        message = first["msg"][0].lower() + first["msg"][1:]
        if first["type"] == "string_pattern_mismatch":
            message = "must be " + _SAYS.get(first["ctx"]["pattern"], "a plain name")
        raise PlanError(f"{where}: {field}: {message}, got {shown}; fix the field or re-plan "
                        f"with autopar compile") from None
