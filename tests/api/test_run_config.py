"""The run config file (autopar.api.run_config): what `autopar init` writes and the shipped
example validate, every mistake is one line naming the field and the fix, overrides and
relative paths, and the TrainingArguments and data the Trainer is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from autopar.api.run_config import (
    RunConfig,
    apply_overrides,
    load_run_config,
    load_source,
    model_source,
    read_prompts,
    training_arguments,
    validate_run_config,
)
from autopar.cli.train_cmd import STARTER
from autopar.errors import PlanError
from tests.cli.test_inspect import cli_here

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "run_config.yaml"


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _refused(data: dict, *words: str, base: Path = Path(".")) -> str:
    """validate_run_config's one-line message for ``data``, which must name ``words``."""
    with pytest.raises(PlanError) as err:
        validate_run_config(data, base, "run.yaml")
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    return message


def test_what_init_writes_and_the_example_load_and_validate(tmp_path) -> None:
    made = cli_here("init", str(tmp_path / "autopar.yaml"))
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "autopar.yaml").read_text() == STARTER
    for path in (tmp_path / "autopar.yaml", EXAMPLE):
        config = load_run_config(path)
        assert config.model == "tiny-llama" and config.data.train.set == "tiny-text"
        assert config.plan.cluster == "cpu" and config.training.use_cpu
        assert config.evaluation.sets == ["tiny-choice", "tiny-qa"]
        assert config.predict.prompts and config.unused == []
        args = training_arguments(config)  # what the Trainer is given, its own checks passed
        assert args.cluster == "cpu" and args.dataset_text_field == "text"
    example = load_run_config(EXAMPLE)
    assert example.training.learning_rate == 3e-3 and example.training.adam_beta2 == 0.95
    assert example.predict.generation() == {"max_new_tokens": 12, "do_sample": False}


def test_every_mistake_is_one_line_naming_the_field_and_the_fix(tmp_path) -> None:
    base = {"model": "tiny-llama", "data": {"train": {"set": "tiny-text"}}}
    _refused({**base, "trainig": {}}, "trainig: unknown field", "did you mean training?")
    _refused({**base, "training": {"max_step": 5}}, "training.max_step: unknown field",
             "did you mean max_steps?", "learning_rate")
    _refused({**base, "training": {"max_steps": "five"}}, "training.max_steps",
             "valid integer", "\"five\"", "give a whole number")
    _refused({**base, "training": {"learning_rate": [1]}}, "training.learning_rate",
             "give a number")
    _refused({**base, "training": {"fsdp": "full_shard"}}, "training: fsdp is not read by "
             "autopar", "zero")
    _refused({**base, "training": {"optim": "sgd"}}, "optim is not read", "AdamW")
    _refused({**base, "training": {"constraints": {"tp": 2}}}, "plan.constraints")
    _refused({**base, "training": {"dataset_text_field": "body"}}, "data.text_field")
    _refused({**base, "training": {"warmup_steps": 5, "warmup_ratio": 0.1}},
             "training:", "not both")
    _refused({**base, "plan": {"constraints": {"tp": 0}}}, "plan.constraints",
             "positive integer")
    _refused({**base, "plan": {"constraints": {"tq": 2}}}, "unknown constraint 'tq'")
    _refused({**base, "plan": {"cluster": "a100"}}, "plan.cluster", "a100-80g")
    _refused({**base, "plan": {"memory_limit_gb": -1}}, "plan.memory_limit_gb",
             "greater than 0")
    _refused({"data": {}}, "model: field required; add it")
    _refused({"model": "tiny-lama"}, "did you mean tiny-llama?")
    _refused({**base, "peft": {"method": "lora", "use_dora": True}}, "peft:", "use_dora")
    _refused({"model": "tiny-llama", "data": {"train": "corpus.jsonl"}}, "data.train",
             "{path: FILE}")
    _refused({"model": "tiny-llama", "data": {"train": {"set": "tiny-text", "path": "x"}}},
             "data.train.path", "no data file")
    _refused({"model": "tiny-llama", "data": {"train": {}}}, "exactly one of path, prepared, "
             "set or blend (got none)")
    _refused({"model": "tiny-llama", "data": {"train": {"set": "tiny-texts"}}},
             "data.train.set", "tiny-text")
    _refused({"model": "tiny-llama", "data": {"train": {"prepared": "missing/tok"}}},
             "data.train.prepared", "autopar data prepare")
    _refused({"model": "tiny-llama", "data": {"train": {"set": "tiny-text", "weight": 2}}},
             "data.train: a weight belongs to a part of a blend")
    _refused({"model": "tiny-llama", "data": {"train": {"blend": [{"set": "tiny-text"}]}}},
             "data.train", "with a weight")
    _refused({**base, "evaluation": {"sets": ["mmlu"]}}, "evaluation.sets", "tiny-choice")
    _refused({**base, "predict": {"prompts": 3}}, "predict.prompts", ".txt")
    _refused({**base, "predict": {"prompts": ["a"], "beams": 4}}, "predict.beams",
             "max_new_tokens")
    # several mistakes: the first, and how many more
    assert "(and 1 more)" in _refused({**base, "training": {"max_steps": "x", "seed": "y"}})


def test_a_bad_file_is_one_line(tmp_path) -> None:
    with pytest.raises(PlanError, match="autopar init"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_run_config(_config(tmp_path, "model: [tiny\n"))
    with pytest.raises(PlanError, match="mapping of sections"):
        load_run_config(_config(tmp_path, "- tiny-llama\n"))


def test_yaml_numbers_without_a_dot_are_numbers(tmp_path) -> None:
    # YAML 1.1 reads 3e-3 as text; the training section is typed, so it is a number here
    config = load_run_config(_config(tmp_path, "model: tiny-llama\ntraining: {learning_rate: "
                                               "3e-3, max_steps: '5', bf16: 'false'}\n"))
    assert config.training.learning_rate == 0.003 and config.training.max_steps == 5
    assert config.training.bf16 is False


def test_overrides_set_dotted_fields_as_yaml(tmp_path) -> None:
    data = {"model": "tiny-llama", "training": {"max_steps": 3}}
    apply_overrides(data, ["training.max_steps=7", "data.train={set: tiny-text}",
                           "plan.constraints=tp=2", "predict.prompts=[a, b]", "peft="])
    assert data == {"model": "tiny-llama", "training": {"max_steps": 7},
                    "data": {"train": {"set": "tiny-text"}}, "plan": {"constraints": "tp=2"},
                    "predict": {"prompts": ["a", "b"]}, "peft": None}
    for bad, words in (("training.max_steps", "SECTION.FIELD=VALUE"),
                       ("training..x=1", "SECTION.FIELD=VALUE"),
                       ("model.name=x", "model is not a section"),
                       ("training.seed=[1", "not YAML")):
        with pytest.raises(PlanError, match=words):
            apply_overrides({"model": "tiny-llama"}, [bad])
    config = load_run_config(_config(tmp_path, "model: tiny-llama\n"),
                             ["training.max_steps=9", "training.seed=1"])
    assert config.training.max_steps == 9 and config.training.seed == 1


def test_paths_are_read_from_the_config_files_folder(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "cfg"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "corpus.jsonl").write_text('{"text": "the cat sat"}\n' * 40)
    (folder / "prompts.txt").write_text("the cat\n\nthe dog\n")
    (folder / "prompts.jsonl").write_text('{"prompt": "a red"}\n{"prompt": "a blue"}\n')
    (folder / "pins.yaml").write_text("tp: 2\n")
    path = folder / "run.yaml"
    path.write_text("model: tiny-llama\ndata: {train: {path: data/corpus.jsonl}}\n"
                    "plan: {constraints: pins.yaml}\npredict: {prompts: prompts.txt}\n"
                    "training: {output_dir: out}\n")
    monkeypatch.chdir(tmp_path)  # elsewhere: the config still finds its files
    config = load_run_config(path)
    assert config.data.train.path == str(folder / "data" / "corpus.jsonl")
    assert config.plan.constraints == str(folder / "pins.yaml")
    assert read_prompts(config.predict.prompts) == ["the cat", "the dog"]
    assert read_prompts(str(folder / "prompts.jsonl")) == ["a red", "a blue"]
    assert config.training.output_dir == "out"  # where the run writes: the working directory
    loaded = load_source(config.data.train, config.data)
    assert loaded.num_rows == 40 and loaded.column_names == ["text"]
    (folder / "bad.jsonl").write_text('{"prompt": "a"}\n{"body": "b"}\n')
    with pytest.raises(PlanError, match="bad.jsonl:2: expected \"ids\""):
        read_prompts(str(folder / "bad.jsonl"))
    (folder / "ids.jsonl").write_text('{"ids": [1, 2]}\n')
    with pytest.raises(PlanError, match="predict generates from text"):
        read_prompts(str(folder / "ids.jsonl"))


def test_a_source_with_the_wrong_columns_is_refused_before_anything_is_written(tmp_path
                                                                               ) -> None:
    (tmp_path / "rows.jsonl").write_text('{"body": "the cat"}\n')
    config = validate_run_config({"model": "tiny-llama", "data": {
        "train": {"path": "rows.jsonl"}}}, tmp_path)
    with pytest.raises(PlanError, match="columns are \\['body'\\]"):
        load_source(config.data.train, config.data)
    split = validate_run_config({"model": "tiny-llama", "data": {
        "train": {"set": "tiny-text", "split": "train[:10%]"},
        "eval": {"blend": [{"set": "tiny-text", "weight": 1},
                           {"set": "tiny-text", "split": "train[:5]", "weight": 2}]}}})
    assert load_source(split.data.train, split.data).num_rows == 40
    parts = load_source(split.data.eval, split.data)
    assert [(p.num_rows, w) for p, w in parts] == [(400, 1.0), (5, 2.0)]


def test_an_inline_model_config_is_written_beside_the_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = validate_run_config({"model": {"model_type": "llama", "hidden_size": 64},
                                  "training": {"output_dir": "run"}})
    written = Path(model_source(config))
    assert written == tmp_path / "run.model" / "config.json"
    assert json.loads(written.read_text()) == {"model_type": "llama", "hidden_size": 64}
    assert not (tmp_path / "run").exists()  # the Trainer's to make
    _refused({"model": {"hidden_size": 64}}, "model: an inline model", "model_type")


def test_the_schema_matches_the_training_arguments() -> None:
    """Every TrainingArguments name is a training field, but those another section holds."""
    from dataclasses import fields

    from autopar.api.arguments import TrainingArguments
    from autopar.api.run_sections import ELSEWHERE

    names = {f.name for f in fields(TrainingArguments)} - set(ELSEWHERE)
    assert set(RunConfig.model_fields["training"].annotation.model_fields) == names
    assert yaml.safe_load(STARTER)["training"].keys() <= names
