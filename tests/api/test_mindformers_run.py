"""MindFormers run YAMLs as run configs (autopar.api.mindformers_run): MindFormers' Llama-2-70B
pre-training file maps its model, parallel sections, optimizer and batch, and lists what it
does not use in one line; a tiny Llama in MindFormers' words trains two steps on the CPU."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.api.mindformers_run import is_mindformers_run, translate_mindformers
from autopar.api.run_config import load_run_config, validate_run_config
from autopar.cli.train_cmd import STARTER
from autopar.errors import PlanError
from autopar.models.hf import build_model
from autopar.search.constraints import load_constraints
from tests.cli.test_inspect import cli_here

ROOT = Path(__file__).resolve().parents[2]
LLAMA2_70B = ROOT / "tests" / "fixtures" / "mindformers" / "pretrain_llama2_70b_bf16_64p.yaml"
TINY_TOKENIZER = ROOT / "autopar" / "models" / "tokenizers" / "tiny" / "tokenizer.json"

# a tiny Llama as MindFormers states one (hidden 64, 2 layers, vocab 256), its data a local
# JSON-lines file read by TrainingDataLoader, its tokenizer a Hugging Face tokenizer folder
TINY = f"""\
seed: 3
output_dir: './output'
run_mode: 'train'
load_checkpoint: ''
trainer: {{type: CausalLanguageModelingTrainer, model_name: 'llama_tiny'}}
runner_config: {{epochs: 1, batch_size: 2, sink_mode: True, sink_size: 1}}
runner_wrapper: {{type: MFTrainOneStepCell, scale_sense: 1.0, use_clip_grad: True,
                 max_grad_norm: 0.5}}
optimizer: {{type: AdamW, beta1: 0.9, beta2: 0.95, eps: 1.e-8, weight_decay: 0.1}}
lr_schedule: {{type: CosineWithWarmUpLR, learning_rate: 3.e-3, lr_end: 3.e-4,
              warmup_ratio: 0.0, warmup_lr_init: 0.0, total_steps: 2}}
train_dataset:
  data_loader: {{type: TrainingDataLoader, dataset_dir: corpus.jsonl, text_col: text,
                shuffle: False}}
  input_columns: ["input_ids"]
  batch_size: 2
processor:
  tokenizer: {{type: LlamaTokenizer, vocab_file: {TINY_TOKENIZER}}}
parallel_config: {{data_parallel: 1, model_parallel: 1, pipeline_stage: 1, micro_batch_num: 1}}
parallel: {{parallel_mode: 1, enable_parallel_optimizer: False}}
context: {{mode: 0, device_target: "CPU"}}
model:
  model_config:
    type: LlamaConfig
    batch_size: 2
    seq_length: 32
    hidden_size: 64
    num_layers: 2
    num_heads: 4
    n_kv_heads: 2
    vocab_size: 256
    multiple_of: 16
    rms_norm_eps: 1.0e-5
    theta: 500000.0
    compute_dtype: "float32"
    param_init_type: "float32"
  arch: {{type: LlamaForCausalLM}}
"""


def test_mindformers_run_yamls_are_recognised_by_content() -> None:
    assert is_mindformers_run(yaml.safe_load(LLAMA2_70B.read_text()))
    assert is_mindformers_run(yaml.safe_load(TINY))
    assert is_mindformers_run({"model": {"model_config": {"hidden_size": 64}}})
    assert not is_mindformers_run(yaml.safe_load(STARTER))
    assert not is_mindformers_run({"model": {"model_type": "llama"}})


def test_the_llama2_70b_file_maps_its_model_layout_and_optimizer() -> None:
    config = load_run_config(LLAMA2_70B, warn=False)
    model = config.model
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    assert (model["hidden_size"], model["num_hidden_layers"], model["num_attention_heads"],
            model["num_key_value_heads"], model["vocab_size"],
            model["max_position_embeddings"]) == (8192, 80, 64, 8, 32000, 4096)
    # Llama's feed-forward width from multiple_of 256 and ffn_dim_multiplier 1.3
    assert model["intermediate_size"] == 28672
    assert model["rms_norm_eps"] == 1e-5 and model["dtype"] == "bfloat16"
    pins = config.plan.constraints
    assert {k: pins[k] for k in ("dp", "tp", "pp", "num_microbatches", "microbatch_size",
                                 "sequence_parallel", "schedule", "vocab_parallel",
                                 "precision")} == {
        "dp": 2, "tp": 4, "pp": 8, "num_microbatches": 256, "microbatch_size": 1,
        "sequence_parallel": True, "schedule": "1f1b", "vocab_parallel": True,
        "precision": "bf16"}
    assert pins["zero_stage"] == 2  # the optimizer shard under model parallelism (plan docs)
    recompute = pins["recompute"]  # select_recompute [10, 8, ...] per stage of 10 layers
    assert recompute[1:11].count("selective") == 10 and recompute[11:21].count(
        "selective") == 8 and set(recompute[51:81]) == {"none"}
    training = config.training
    assert training.global_batch_size == 2 * 256 * 1  # data_parallel x micro_batch_num x batch
    assert training.per_device_train_batch_size == 1 and training.num_train_epochs == 3
    assert (training.adam_beta1, training.adam_beta2, training.adam_epsilon) == (0.9, 0.95,
                                                                                  1e-8)
    assert training.seed == 0 and training.output_dir == "./output"
    assert training.max_seq_length == 4096
    # the planner reads the same pins from the file itself
    assert load_constraints(str(LLAMA2_70B)) == load_constraints(pins)


def test_the_llama2_70b_file_lists_what_it_does_not_use_in_one_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_run_config(LLAMA2_70B)
    lines = [str(w.message) for w in caught if "MindFormers fields" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("MindFormers fields not used: trainer.type, ")
    unused = config.unused
    for name in ("context.mode", "context.device_target", "context.max_device_memory",
                 "parallel.parallel_mode", "parallel.gradients_mean", "parallel.full_batch",
                 "parallel.search_mode", "parallel.enable_alltoall",
                 "parallel.parallel_optimizer_config.parallel_optimizer_threshold",
                 "parallel_config.gradient_aggregation_group", "use_parallel",
                 "micro_batch_interleave_num", "recompute_config.mp_comm_recompute",
                 "runner_config.sink_mode", "model.model_config.use_flash_attention",
                 "model.model_config.softmax_compute_type"):
        assert name in unused, name
    for name in ("parallel_config.data_parallel", "parallel_config.micro_batch_num",
                 "parallel.enable_parallel_optimizer", "recompute_config.select_recompute",
                 "model.model_config.hidden_size", "model.model_config.ffn_dim_multiplier",
                 "model.model_config.rms_norm_eps", "model.arch.type", "optimizer.type",
                 "optimizer.beta2", "runner_config.epochs", "runner_config.batch_size",
                 "seed", "run_mode"):
        assert name not in unused, name


def test_schedules_checkpoints_data_and_lora_map_or_are_listed(tmp_path, hf_folder) -> None:
    data = yaml.safe_load(TINY)
    run, unused = translate_mindformers(data, tmp_path)
    training = run["training"]
    assert (training["lr_scheduler_type"], training["learning_rate"], training["min_lr"],
            training["max_steps"], training["max_grad_norm"]) == ("cosine", 3e-3, 3e-4, 2, 0.5)
    assert "warmup_ratio" not in training and "lr_schedule.warmup_lr_init" not in unused
    assert run["data"] == {"train": {"path": "corpus.jsonl"}, "text_field": "text"}
    assert run["tokenizer"] == str(TINY_TOKENIZER.parent)
    assert run["model"]["rope_theta"] == 500000.0 and run["model"]["intermediate_size"] == 176
    assert "load_checkpoint" not in unused  # empty: nothing to use
    # a MindRecord file, another optimizer, another schedule: listed, not guessed
    other = {**data, "optimizer": {"type": "Lamb", "beta1": 0.8},
             "lr_schedule": {"type": "PolynomialWithWarmUpLR", "learning_rate": 1e-4},
             "train_dataset": {"data_loader": {"type": "MindDataset",
                                               "dataset_dir": "wiki.mindrecord"}}}
    run, unused = translate_mindformers(other, tmp_path)
    assert {"optimizer.type", "optimizer.beta1", "lr_schedule.type",
            "lr_schedule.learning_rate", "train_dataset.data_loader.dataset_dir"} <= set(unused)
    assert "train" not in run["data"] and "adam_beta1" not in run["training"]
    # a Hugging Face folder as load_checkpoint is the model, with its weights
    folder = hf_folder("tiny-llama")
    run, unused = translate_mindformers({**data, "load_checkpoint": str(folder)}, tmp_path)
    assert run["model"] == str(folder) and "load_checkpoint" not in unused
    # MindFormers' LoRA (pet_config) in Hugging Face's names
    lora = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.05,
            "target_modules": ".*wq|.*wv"}
    data["model"]["model_config"]["pet_config"] = lora
    run, unused = translate_mindformers(data, tmp_path)
    assert run["peft"] == {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
                           "target_modules": ["q_proj", "v_proj"]}


def test_what_autopar_cannot_read_is_one_line() -> None:
    data = yaml.safe_load(TINY)
    data["model"]["arch"]["type"] = "GLM2ForCausalLM"
    with pytest.raises(PlanError, match="MindFormers Llama models"):
        translate_mindformers(data)
    data = yaml.safe_load(TINY)
    del data["model"]["model_config"]["hidden_size"]
    with pytest.raises(PlanError, match="model.model_config has no hidden_size"):
        translate_mindformers(data)
    with pytest.raises(PlanError, match="run_mode 'serve'"):
        translate_mindformers({**yaml.safe_load(TINY), "run_mode": "serve"})


def test_a_tiny_llama_in_mindformers_words_trains_two_steps(tmp_path) -> None:
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": f"the red cat number {i} sat on the mat."}) + "\n"
        for i in range(64)))
    (tmp_path / "tiny.yaml").write_text(TINY)
    ran = cli_here("train", "tiny.yaml", cwd=str(tmp_path))
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = [ln for ln in ran.stderr.splitlines() if ln.startswith("MindFormers fields")]
    assert said == ["MindFormers fields not used: trainer.type, trainer.model_name, "
                    "runner_config.sink_mode, runner_config.sink_size, runner_wrapper.type, "
                    "runner_wrapper.scale_sense, train_dataset.data_loader.shuffle, "
                    "train_dataset.input_columns, train_dataset.batch_size, "
                    "processor.tokenizer.type, parallel.parallel_mode, context.mode, "
                    "context.device_target, model.model_config.batch_size"]
    out = tmp_path / "output"
    records = [json.loads(line) for line in (out / "logs" / "train.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["lr"] == pytest.approx(3e-3)  # cosine, no warm-up
    plan = autopar.Plan.load(out / "plan.yaml")
    assert plan.global_batch == 2 and plan.microbatch_size == 2 and plan.seq == 32
    hf = json.loads((tmp_path / "output.model" / "config.json").read_text())
    model = build_model(hf, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 2 * 64 * 256 + 64 + 2 * (
        64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64)
    # the seed reached the run config (and so the weights and the data order)
    config = validate_run_config(translate_mindformers(yaml.safe_load(TINY), tmp_path)[0],
                                 tmp_path)
    assert config.training.seed == 3
