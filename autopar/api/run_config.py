"""One run in one YAML file: the model, its data, the plan's pins, the training settings,
what to evaluate and what to generate, validated, and the :class:`autopar.Trainer` it makes.

    model: tiny-llama
    data: {train: {set: tiny-text}, eval: {set: tiny-text, split: "train[90%:]"}}
    plan: {constraints: {tp: 2, dp: 2}, cluster: cpu}
    training: {output_dir: run, max_steps: 20, global_batch_size: 8, max_seq_length: 64}

Each section refuses a field it does not know (naming the nearest known one); a mistake is
one line naming the field's path and the fix (:func:`load_run_config`; the sections are in
:mod:`autopar.api.run_sections`). Paths the config reads
(model and tokenizer folders, data files, prepared prefixes, constraints, cluster and prompt
files) are relative to the config file's folder, so a config means the same from any working
directory; ``training.output_dir``, where the run writes, is relative to the working
directory, as Hugging Face's and MindFormers' are. A MindFormers run YAML is read too
(:mod:`autopar.api.mindformers_run`). What a file holds reaches the planner and the trainer
as values, never as code.
"""

from __future__ import annotations

import difflib
import json
import typing
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from autopar.api.arguments import TrainingArguments
from autopar.api.mindformers_run import is_mindformers_run, translate_mindformers
from autopar.api.model_input import resolve_model
from autopar.api.run_sections import BUILDERS, DataSource, RunConfig
from autopar.api.trainer import Trainer
from autopar.data.hf_datasets import dataset_kind
from autopar.data.sets import TEXT_SETS
from autopar.errors import PlanError
from autopar.metrics import SETS, load_set
from autopar.plan.plan import write_text_atomic
from autopar.serve.prompts import prompt_entries
from autopar.train.checkpoint import latest_checkpoint

__all__ = ["RunConfig", "apply_overrides", "build_trainer", "has_weights", "load_eval_set",
           "load_run_config", "load_source", "model_source", "one_line", "read_prompts",
           "read_yaml", "resume_weights", "training_arguments", "unused_line",
           "validate_run_config"]


# --- reading ---------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> dict:
    """A YAML file's top-level mapping; a PlanError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"no run config {path}; write one with `autopar init {path}`")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path} is not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a run config is a mapping of sections (model:, data:, ...)")
    return data


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``data`` with each ``dotted.path=value`` set (the value read as YAML:
    ``training.max_steps=5``, ``data.train={set: tiny-text}``)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise PlanError(f"--set {item!r}: write SECTION.FIELD=VALUE, e.g. "
                            f"training.max_steps=5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"--set {item!r}: the value is not YAML "
                            f"({' '.join(str(exc).split())})") from None
        node = data
        for depth, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise PlanError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is not a "
                                f"section; set it whole")
        node[parts[-1]] = value
    return data


def validate_run_config(data: dict, base: str | Path = ".", where: str = "run config"
                        ) -> RunConfig:
    """``data`` as a :class:`RunConfig`, relative paths read from ``base``; a PlanError of
    one line (``where: field.path: cause; fix``) otherwise."""
    try:
        return RunConfig.model_validate(data, context={"base": str(base)})
    except ValidationError as exc:
        raise PlanError(one_line(exc, where)) from None


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = (), *,
                    warn: bool = True) -> RunConfig:
    """The run config in ``path`` (autopar's, or a MindFormers run YAML, recognised by its
    content) with ``overrides`` applied (:func:`apply_overrides`, in autopar's names). A
    MindFormers file's unused fields are in ``config.unused`` and, with ``warn``, one
    warning line."""
    path = Path(path)
    data, unused = read_yaml(path), []
    if is_mindformers_run(data):
        data, unused = translate_mindformers(data, path.parent)
    config = validate_run_config(apply_overrides(data, overrides), path.parent, str(path))
    config._unused = list(unused)
    if unused and warn:
        warnings.warn(unused_line(unused), stacklevel=2)
    return config


def unused_line(unused: list[str]) -> str:
    """The one line that lists a MindFormers file's fields autopar does not use."""
    return f"MindFormers fields not used: {', '.join(unused)}"


_FIXES = {"int": "give a whole number", "float": "give a number such as 3.0e-3",
          "bool": "give true or false", "string": "give text", "missing": "add it",
          "list": "give a list such as [a, b]", "dict": "give a mapping (key: value)",
          "model": "give a mapping (key: value)", "greater": "give a larger value",
          "less": "give a smaller value"}


def one_line(exc: ValidationError, where: str) -> str:
    """pydantic's first error as ``where: field.path: cause; fix`` (and how many more)."""
    errors = exc.errors()
    err = errors[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        known = _fields_at(err["loc"][:-1])
        near = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        section = ".".join(str(p) for p in err["loc"][:-1]) or "a run config"
        cause = f"unknown field; {hint}{section} takes {', '.join(known)}"
    elif err["type"] == "value_error":
        cause = str(err["ctx"]["error"])
        last = str(err["loc"][-1]) if err["loc"] else ""
        if last and cause.startswith(f"{last}: "):  # the field named twice
            cause = cause[len(last) + 2:]
        elif cause.startswith(f"{loc}."):  # a message that names its own field
            loc, _, cause = cause.partition(": ")
    else:
        got = json.dumps(err.get("input"), default=str)
        fix = next((f for k, f in _FIXES.items() if err["type"].startswith(k)), "fix the value")
        got = "" if err["type"] == "missing" else f" (got {got[:60]})"
        cause = f"{err['msg'][0].lower()}{err['msg'][1:]}{got}; {fix}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return " ".join(f"{where}: {loc}: {cause}{more}".split())


def _fields_at(loc: tuple) -> list[str]:
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if isinstance(part, str) and model is not None:
            field = model.model_fields.get(part)
            model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_model_in, typing.get_args(annotation))), None)


# --- building ------------------------------------------------------------------------------
def training_arguments(config: RunConfig) -> TrainingArguments:
    """The :class:`TrainingArguments`: the training section with the plan's pins and the
    data's text field folded in."""
    return TrainingArguments(**config.training.model_dump(),
                             dataset_text_field=config.data.text_field,
                             constraints=config.plan.constraints, cluster=config.plan.cluster,
                             memory_limit_gb=config.plan.memory_limit_gb)


def model_source(config: RunConfig) -> str:
    """What the Trainer reads as the model: the name or folder, or an inline config written
    (atomically) as ``OUTPUT_DIR.model/config.json`` beside the run's folder."""
    if not isinstance(config.model, dict):
        return config.model
    out = Path(config.training.output_dir).resolve()
    folder = out.with_name(out.name + ".model")
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / "config.json", json.dumps(config.model, indent=2) + "\n")
    return str(folder / "config.json")


def load_source(source: DataSource | None, data: Any) -> object:
    """What the Trainer takes for one data source: a ``datasets`` Dataset (or stream), a
    prepared PREFIX, or a list of (source, weight) pairs; its columns checked now."""
    if source is None:
        return None
    if source.blend:
        return [(load_source(part, data), part.weight) for part in source.blend]
    if source.prepared:
        return source.prepared
    # datasets takes seconds to import; only a run that reads a file pays for it
    import datasets

    file = str(TEXT_SETS[source.set]) if source.set else source.path
    builder = BUILDERS[Path(file).suffix.lower()]
    streaming = bool(data.streaming and source.path)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a local file: its bars would only clutter the console
    try:
        loaded = datasets.load_dataset(builder, data_files=file, split=source.split or "train",
                                       streaming=streaming)
        dataset_kind(loaded, data.text_field)  # its columns, before anything is written
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
        raise PlanError(f"cannot read {file} ({' '.join(str(exc).split())[:200]}); check the "
                        f"file and the split") from None
    except PlanError as exc:
        raise PlanError(f"{file}: {exc}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    return loaded


def has_weights(model: str) -> bool:
    """Whether ``model`` starts from trained weights: a folder with safetensors, or an
    artifact with a checkpoint (a shipped name starts from seeded ones)."""
    path = Path(model)
    return path.is_dir() and (any(path.glob("*.safetensors"))
                              or (path / "checkpoints" / "latest").is_file())


def _has_tokenizer(config: RunConfig) -> bool:
    """Whether the Trainer will find a tokenizer: given, in the model's folder, or shipped
    with a tiny config (an artifact or an inline config has none of its own)."""
    if config.tokenizer is not None:
        return True
    if isinstance(config.model, dict):
        return False
    folder = Path(config.model)
    if folder.is_dir():
        return (folder / "tokenizer_config.json").is_file()
    return resolve_model(config.model).tokenizer is not None  # a shipped name: its config


def _text_sources(loaded: object, text_field: str) -> bool:
    if isinstance(loaded, list):
        return any(_text_sources(part, text_field) for part, _ in loaded)
    return not isinstance(loaded, str) and loaded is not None and \
        dataset_kind(loaded, text_field) != "tokens"


def build_trainer(config: RunConfig) -> Trainer:
    """The :class:`autopar.Trainer` of ``config``: data read and checked first, then the
    Trainer plans and compiles into ``training.output_dir`` (see its docstring)."""
    args = training_arguments(config)
    train = load_source(config.data.train, config.data)
    held_out = load_source(config.data.eval, config.data)
    if any(_text_sources(d, config.data.text_field) for d in (train, held_out)) and \
            not _has_tokenizer(config):
        raise PlanError("the data is text, and the model brings no tokenizer: set tokenizer "
                        "to a Hugging Face tokenizer folder (the model's own)")
    return Trainer(model_source(config), args=args, train_dataset=train,
                   eval_dataset=held_out, tokenizer=config.tokenizer, peft=config.peft)


def load_eval_set(name: str) -> object:
    """An evaluation set: a shipped one by name, else a local file as a ``datasets``
    Dataset."""
    if name in SETS:
        return load_set(name)
    # datasets takes seconds to import; only a run that reads a file pays for it
    import datasets

    return datasets.load_dataset(BUILDERS.get(Path(name).suffix.lower(), "json"),
                                 data_files=name, split="train")


def read_prompts(prompts: list[str] | str) -> list[str]:
    """The prompts: a list as given, or a prompts file's text prompts (a .txt file's lines, a
    .jsonl file's "prompt" fields: :func:`autopar.serve.prompts.prompt_entries`)."""
    if isinstance(prompts, list):
        return prompts
    entries = prompt_entries(prompts)
    if not all(isinstance(e, str) for e in entries):
        raise PlanError(f"{prompts}: predict generates from text; write {{\"prompt\": ...}} "
                        f"lines, not token ids")
    return entries


def resume_weights(trainer: Trainer) -> str:
    """Load the latest checkpoint in the run's output_dir into ``trainer`` (the weights a
    finished ``autopar train`` left); returns it, or "initial" when there is none."""
    checkpoints = trainer.output_dir / "checkpoints"
    last = latest_checkpoint(checkpoints)
    if last is None:
        return "initial"
    runtime = trainer._ensure_runtime()  # noqa: SLF001 - the api package's own Trainer
    with warnings.catch_warnings():  # torch's note that one process reads the checkpoint
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        runtime.resume(checkpoints)
    trainer.state["global_step"] = runtime.step_index
    return str(last)
