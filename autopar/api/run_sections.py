"""The sections of a run config file (autopar.api.run_config) as pydantic models: each field
typed, each section refusing a field it does not know, and what a field names checked where
it can be (files exist, constraints and peft settings parse, clusters load, the shipped sets
are known). Relative paths are resolved against the validation context's ``base`` (the
config file's folder); a field's check raises ValueError, which the reader turns into one
line naming the field (:func:`autopar.api.run_config.one_line`).
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from autopar.api.arguments import REFUSED, TrainingArguments
from autopar.cost.hardware import load_cluster
from autopar.data.sets import TEXT_SETS
from autopar.errors import AutoparError, PlanError
from autopar.metrics import SETS
from autopar.models.hf import list_models
from autopar.peft.config import parse_peft
from autopar.search.constraints import load_constraints

# datasets' packaged builder for each kind of file a data source may name
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text"}
PROMPT_FILES = (".txt", ".jsonl")
# TrainingArguments' names that a run config states in another section
ELSEWHERE = {"constraints": "plan.constraints", "cluster": "plan.cluster",
             "memory_limit_gb": "plan.memory_limit_gb", "dataset_text_field": "data.text_field"}


# --- paths, relative to the config file's folder (the validation context's "base") ---------
def _local(value: str, info: ValidationInfo) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else Path((info.context or {}).get("base", ".")) / path


def _existing(value: object, info: ValidationInfo, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"give the {what} as a path")
    path = _local(value, info)
    if not path.exists():
        raise ValueError(f"no {what} {path}; check the path (relative paths are read from the "
                         f"config file's folder)")
    return str(path.resolve())


def _path_if_there(value: str, info: ValidationInfo) -> str:
    """``value`` as a path when one exists there, else as given (a name)."""
    path = _local(value, info)
    return str(path.resolve()) if path.exists() else value


class Section(BaseModel):
    """A config section: unknown fields refused."""

    model_config = ConfigDict(extra="forbid")


class DataSource(Section):
    """One dataset: a local file (``path``, read by ``datasets.load_dataset``), a token
    dataset from ``autopar data prepare`` (``prepared``: its PREFIX), a shipped text set
    (``set``), or a ``blend`` of those, each with a ``weight``. ``split``: a datasets split
    expression over a file or set (``"train[:90%]"``)."""

    path: str | None = None
    prepared: str | None = None
    set: str | None = None
    split: str | None = None
    weight: PositiveFloat | None = None
    blend: list[DataSource] | None = None

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, value: object) -> object:
        if not isinstance(value, dict):
            raise ValueError("a data source is a mapping: {path: FILE}, {prepared: PREFIX}, "
                             "{set: tiny-text} or {blend: [{path: FILE, weight: 0.7}, ...]}")
        return value

    @field_validator("path")
    @classmethod
    def _file(cls, value: str, info: ValidationInfo) -> str:
        path = _existing(value, info, "data file")
        if Path(path).suffix.lower() not in BUILDERS:
            raise ValueError(f"{Path(path).name}: autopar reads {', '.join(BUILDERS)} files; "
                             f"convert it, or prepare it with `autopar data prepare`")
        return path

    @field_validator("prepared")
    @classmethod
    def _prefix(cls, value: str, info: ValidationInfo) -> str:
        prefix = _local(value.removesuffix(".bin").removesuffix(".idx"), info)
        if not Path(f"{prefix}.idx").is_file():
            raise ValueError(f"no token dataset {prefix} ({prefix}.idx is missing); make it "
                             f"with `autopar data prepare FILE --out {value}`")
        return str(prefix.resolve())

    @field_validator("set")
    @classmethod
    def _shipped(cls, value: str) -> str:
        if value not in TEXT_SETS:
            raise ValueError(f"no shipped text set {value!r}; use {', '.join(TEXT_SETS)}")
        return value

    @model_validator(mode="after")
    def _one(self) -> DataSource:
        given = [k for k in ("path", "prepared", "set", "blend") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of path, prepared, set or blend (got "
                             f"{', '.join(given) or 'none'})")
        if self.split and not (self.path or self.set):
            raise ValueError("split selects rows of a path or set source; a prepared dataset "
                             "or a blend has none")
        for part in self.blend or []:
            if part.blend or part.weight is None:
                raise ValueError("each part of a blend is a path, prepared or set source with "
                                 "a weight, e.g. {set: tiny-text, weight: 0.3}")
        return self


class DataSection(Section):
    """``train`` and ``eval`` sources; ``streaming``: read path sources as datasets'
    streams (training then needs max_steps); ``text_field``: the text column."""

    train: DataSource | None = None
    eval: DataSource | None = None
    streaming: bool = False
    text_field: str = "text"

    @model_validator(mode="after")
    def _whole(self) -> DataSection:
        for name in ("train", "eval"):
            source = getattr(self, name)
            if source is not None and source.weight is not None:
                raise ValueError(f"data.{name}: a weight belongs to a part of a blend; write "
                                 f"{{blend: [{{..., weight: W}}, ...]}} or drop it")
            if source is not None and self.streaming and source.split:
                raise ValueError(f"data.{name}: a split cannot slice a streamed file; drop "
                                 f"split or set streaming: false")
        return self


class PlanSection(Section):
    """The plan's pins: ``constraints`` as ``autopar.plan`` takes them (a mapping, ``k=v``
    text, a preset, or a DeepSpeed / Megatron-LM / MindFormers file), the ``cluster``
    profile it is priced on, and ``memory_limit_gb`` per device."""

    constraints: Any = None
    cluster: str | None = None
    memory_limit_gb: PositiveFloat | None = None

    @field_validator("constraints")
    @classmethod
    def _pins(cls, value: object, info: ValidationInfo) -> object:
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (dict, str)) for v in items):
            raise ValueError("give a mapping ({tp: 2, dp: 2}), k=v text, a preset or a file")
        items = [_path_if_there(v, info) if isinstance(v, str) else v for v in items]
        try:
            load_constraints(items)  # checked now, read again by the planner
        except (AutoparError, ValueError) as exc:
            raise ValueError(str(exc)) from None
        return items if isinstance(value, list) else items[0]

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        value = _path_if_there(value, info)
        try:
            load_cluster(value)
        except AutoparError as exc:
            raise ValueError(str(exc)) from None
        return value


class _TrainingChecks(Section):
    @model_validator(mode="before")
    @classmethod
    def _names(cls, values: object) -> object:
        for name in values if isinstance(values, dict) else ():
            if name in ELSEWHERE:
                raise ValueError(f"{name} goes under {ELSEWHERE[name]}, not training")
            if name in REFUSED:
                raise ValueError(f"{name} is not read by autopar: {REFUSED[name]}")
        return values

    @model_validator(mode="after")
    def _ranges(self) -> _TrainingChecks:
        try:
            TrainingArguments(**self.model_dump())
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        return self


_HINTS = typing.get_type_hints(TrainingArguments)
# TrainingArguments' own names, types and defaults (typed here so that YAML's "3e-3", a
# string to YAML 1.1, still reads as a number)
TrainingSection = create_model(
    "TrainingSection", __base__=_TrainingChecks,
    **{f.name: (_HINTS[f.name], f.default) for f in fields(TrainingArguments)
       if f.name not in ELSEWHERE})


class EvaluationSection(Section):
    """Scored sets evaluated after the loss and perplexity: shipped names (tiny-choice,
    tiny-qa) or local files of question/choices/answer or question/answer rows."""

    sets: list[str] = Field(default_factory=list)

    @field_validator("sets")
    @classmethod
    def _sets(cls, value: list[str], info: ValidationInfo) -> list[str]:
        out = []
        for name in value:
            path = _local(name, info)
            if name not in SETS and not path.is_file():
                raise ValueError(f"no evaluation set {name!r}; use {', '.join(SETS)} or a "
                                 f".jsonl file of question/choices/answer rows")
            out.append(name if name in SETS else str(path.resolve()))
        return out


class PredictSection(Section):
    """Prompts (a list, or a .txt file of one per line, or a .jsonl file with a "prompt"
    field) and Hugging Face's generation settings."""

    prompts: Any
    max_new_tokens: PositiveInt = 32
    do_sample: bool = False
    temperature: PositiveFloat | None = None
    top_k: PositiveInt | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return value
        if isinstance(value, str):
            path = _existing(value, info, "prompts file")
            if Path(path).suffix.lower() in PROMPT_FILES:
                return path
        raise ValueError("give a list of prompts ([\"the cat\"]) or a .txt (one per line) or "
                         ".jsonl (a \"prompt\" field) file")

    def generation(self) -> dict:
        """The generation keywords for :meth:`autopar.Trainer.predict`."""
        return self.model_dump(exclude={"prompts"}, exclude_none=True)


class RunConfig(Section):
    """A whole run (see the module docstring). ``model``: a shipped name, a Hugging Face
    folder, an artifact, or a Hugging Face config inline (a mapping with ``model_type``);
    ``tokenizer``: a folder (default: the model's); ``peft``: a fine-tuning method as
    ``autopar.Trainer`` takes it."""

    model: Any
    tokenizer: str | None = None
    peft: Any = None
    data: DataSection = Field(default_factory=DataSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    training: TrainingSection = Field(default_factory=TrainingSection)  # type: ignore[valid-type]
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    predict: PredictSection | None = None
    _unused: list[str] = PrivateAttr(default_factory=list)

    @property
    def unused(self) -> list[str]:
        """A MindFormers file's fields that the translation did not use (else empty)."""
        return self._unused

    @field_validator("model")
    @classmethod
    def _model(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, dict):
            if "model_type" not in value:
                raise ValueError("an inline model is a Hugging Face config: add model_type "
                                 "(e.g. llama) and its sizes")
            return value
        if not isinstance(value, str) or not value:
            raise ValueError("give a shipped name (tiny-llama), a Hugging Face folder or an "
                             "artifact folder")
        if not _local(value, info).exists() and value not in list_models():
            near = difflib.get_close_matches(value, list_models(), n=1)
            raise ValueError(f"{value!r} is neither a folder nor a shipped model"
                             + (f"; did you mean {near[0]}?" if near else
                                "; `autopar inspect --list` lists the shipped ones"))
        return _path_if_there(value, info)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _existing(value, info, "tokenizer folder")

    @field_validator("peft")
    @classmethod
    def _peft(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            value = _path_if_there(value, info)
        try:
            parse_peft(value)
        except AutoparError as exc:
            raise ValueError(str(exc)) from None
        return value
