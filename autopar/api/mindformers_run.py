"""A MindFormers run YAML (``run_mindformer.py --config X --run_mode train``) as an autopar run
config: the same model, parallel layout, optimizer, schedule and data, and one line naming
every field that is not used.

What is read, in MindFormers' names:

* ``model.model_config`` (LlamaConfig: hidden_size, num_layers, num_heads, n_kv_heads,
  vocab_size, seq_length, intermediate_size or multiple_of with ffn_dim_multiplier,
  rms_norm_eps, theta, param_init_type, token ids) -> an inline Hugging Face Llama config;
  ``model.arch.type`` must be LlamaForCausalLM. ``load_checkpoint`` naming a Hugging Face
  folder (config.json and safetensors) is the model instead, with its weights.
* ``parallel_config``, ``parallel.enable_parallel_optimizer`` / ``pipeline_config``,
  ``recompute_config``, ``compute_dtype``, ``offload`` -> plan constraints, by
  :func:`autopar.plan.mindformers.constraints_from_mindformers`.
* ``runner_config``: ``batch_size`` is the per-card micro-batch (the plan's microbatch_size),
  and the global batch is data_parallel x micro_batch_num x batch_size, as MindFormers trains
  it; ``epochs`` -> num_train_epochs.
* ``optimizer`` (an AdamW type: beta1, beta2, eps, weight_decay), ``lr_schedule``
  (CosineWithWarmUpLR, LinearWithWarmUpLR, ConstantWarmUpLR; learning_rate, lr_end,
  warmup_steps or warmup_ratio, total_steps), ``runner_wrapper`` (use_clip_grad,
  max_grad_norm), ``seed``, ``output_dir``, ``do_eval`` with ``eval_step_interval``.
* ``train_dataset`` / ``eval_dataset``: a data loader's ``dataset_dir`` (or ``data_files``)
  naming one local .jsonl/.json/.csv/.parquet/.txt file, with ``text_col``; MindRecord
  files are not read (convert with ``autopar data prepare``).
* ``processor.tokenizer.vocab_file``: a file in a Hugging Face tokenizer folder -> tokenizer.
* ``model.model_config.pet_config`` with pet_type lora -> ``peft`` (MindFormers' wq/wk/wv/wo/
  w1/w2/w3 as Hugging Face's projection names).
* ``run_mode``: recorded; the autopar command run decides, as ``--run_mode`` does.
"""

from __future__ import annotations

import re
from pathlib import Path

from autopar.errors import PlanError
from autopar.plan.mindformers import constraints_from_mindformers

# read by constraints_from_mindformers (the plan's pins)
CONSTRAINT_FIELDS = (
    *(f"parallel_config.{k}" for k in (
        "data_parallel", "model_parallel", "pipeline_stage", "expert_parallel",
        "micro_batch_num", "use_seq_parallel", "context_parallel", "context_parallel_algo",
        "vocab_emb_dp")),
    "parallel.pipeline_config.pipeline_interleave", "parallel.pipeline_config.pp_interleave_num",
    "parallel.enable_parallel_optimizer", "optimizer_shard", "runner_config.batch_size",
    *(f"model.model_config.{k}" for k in (
        "hidden_size", "num_layers", "num_heads", "n_kv_heads", "vocab_size", "seq_length",
        "intermediate_size", "multiple_of", "ffn_dim_multiplier", "compute_dtype")),
    *(f"recompute_config.{k}" for k in (
        "recompute", "select_recompute", "recompute_layers_per_stage",
        "select_recompute_layers_per_stage")),
    "offload")
ADAMW = ("AdamW", "AdamWeightDecay", "FP32StateAdamWeightDecay", "FusedAdamWeightDecay")
SCHEDULES = {"CosineWithWarmUpLR": "cosine", "LinearWithWarmUpLR": "linear",
             "ConstantWarmUpLR": "constant_with_warmup"}
DATA_FILES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
RUN_MODES = ("train", "finetune", "eval", "predict")
# MindFormers' Llama linear names -> Hugging Face's
LINEARS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj",
           "w2": "down_proj", "w3": "up_proj"}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def is_mindformers_run(data: dict) -> bool:
    """Whether a loaded YAML is a MindFormers run config (by its content)."""
    model = data.get("model")
    return any(k in data for k in ("run_mode", "runner_config", "parallel_config")) or \
        (isinstance(model, dict) and "model_config" in model)


class _Reader:
    """Reads dotted fields of the YAML and remembers which were read."""

    def __init__(self, data: dict) -> None:
        self.data, self.used = data, set()

    def get(self, path: str, default: object = None) -> object:
        node: object = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        self.used.add(path)
        return default if node is None else node

    def unused(self) -> list[str]:
        """Every leaf field of the YAML that holds a value and was not read, in the file's
        order (an empty field says nothing to use)."""
        return [p for p, value in _leaves(self.data, "") if value not in (None, "", [], {})
                and not any(p == u or p.startswith(u + ".") for u in self.used)]


def _leaves(node: object, prefix: str) -> list[tuple[str, object]]:
    if not isinstance(node, dict) or not node:
        return [(prefix, node)] if prefix else []
    return [leaf for k, v in node.items()
            for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]


def translate_mindformers(data: dict, base: str | Path = ".") -> tuple[dict, list[str]]:
    """``(run config mapping, fields not used)`` of a MindFormers run YAML whose relative
    paths are read from ``base`` (see the module); the mapping is validated as any run config
    is (autopar.api.run_config)."""
    r, base = _Reader(data), Path(base)
    for path in CONSTRAINT_FIELDS:
        r.get(path)
    mode = r.get("run_mode", "train")
    if mode not in RUN_MODES:
        raise PlanError(f"run_mode {mode!r} is not one autopar runs; use one of "
                        f"{', '.join(RUN_MODES)}")
    constraints = _constraints(data)
    training = {"output_dir": str(r.get("output_dir", "./output")),
                "seed": r.get("seed", 0), "max_seq_length": constraints["model"]["seq_length"],
                **_batch(r, constraints), **_optimizer(r), **_schedule(r), **_evaluation(r)}
    if r.get("runner_wrapper.use_clip_grad") is False:
        training["max_grad_norm"] = 0.0
    elif r.get("runner_wrapper.max_grad_norm") is not None:
        training["max_grad_norm"] = r.get("runner_wrapper.max_grad_norm")
    run = {"model": _model(r, constraints, base), "plan": {"constraints": constraints},
           "training": training, "data": _data(r)}
    tokenizer = _tokenizer(r, base)
    if tokenizer:
        run["tokenizer"] = tokenizer
    peft = _peft(r)
    if peft:
        run["peft"] = peft
    return run, r.unused()


def _constraints(data: dict) -> dict:
    data = {**data, "model": dict(data.get("model") or {})}
    config = dict(data["model"].get("model_config") or {})
    config.setdefault("multiple_of", 256)  # LlamaConfig's default feed-forward rounding
    data["model"]["model_config"] = config
    try:
        pins = constraints_from_mindformers(data)
    except ValueError as exc:
        raise PlanError(f"MindFormers YAML: {exc}") from None
    shape = pins.get("model") or {}
    missing = [k for k in ("hidden_size", "num_layers", "num_heads", "vocab_size",
                           "seq_length") if k not in shape]
    if missing:
        raise PlanError(f"MindFormers YAML: model.model_config has no {', '.join(missing)}; "
                        f"state the model's sizes there")
    return pins


def _batch(r: _Reader, pins: dict) -> dict:
    per_card, micro = pins["microbatch_size"], pins["num_microbatches"]
    replicas = r.get("parallel_config.data_parallel", 1)  # MindFormers' dp includes ep
    out: dict = {"per_device_train_batch_size": per_card}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (per_card, micro, replicas)):
        out["global_batch_size"] = replicas * micro * per_card  # else the pins are refused
    if r.get("runner_config.epochs") is not None:
        out["num_train_epochs"] = float(r.get("runner_config.epochs"))
    return out


def _optimizer(r: _Reader) -> dict:
    if r.data.get("optimizer") is None:
        return {}
    kind = (r.data["optimizer"] or {}).get("type")
    if kind is not None and kind not in ADAMW:
        return {}  # autopar trains with AdamW: the whole section is listed as not used
    r.get("optimizer.type")
    out = {}
    for src, dst in (("beta1", "adam_beta1"), ("beta2", "adam_beta2"), ("eps", "adam_epsilon"),
                     ("weight_decay", "weight_decay")):
        if r.get(f"optimizer.{src}") is not None:
            out[dst] = float(r.get(f"optimizer.{src}"))
    if r.get("optimizer.learning_rate") is not None:
        out["learning_rate"] = float(r.get("optimizer.learning_rate"))
    return out


def _schedule(r: _Reader) -> dict:
    kind = (r.data.get("lr_schedule") or {}).get("type")
    if kind is not None and kind not in SCHEDULES:
        return {}  # listed as not used
    out = {}
    if r.get("lr_schedule.learning_rate") is not None:
        out["learning_rate"] = float(r.get("lr_schedule.learning_rate"))
    if r.get("lr_schedule.lr_end") is not None:
        out["min_lr"] = float(r.get("lr_schedule.lr_end"))
    steps, ratio = r.get("lr_schedule.warmup_steps", 0), r.get("lr_schedule.warmup_ratio", 0)
    if steps:
        out["warmup_steps"] = int(steps)
    elif ratio:
        out["warmup_ratio"] = float(ratio)
    if kind is not None:
        r.get("lr_schedule.type")
        name = SCHEDULES[kind]
        out["lr_scheduler_type"] = "constant" if name == "constant_with_warmup" and not (
            steps or ratio) else name
    total = r.get("lr_schedule.total_steps")
    if isinstance(total, int) and total > 0:
        out["max_steps"] = total
    for name, off in (("warmup_lr_init", 0), ("num_cycles", 0.5)):  # read when autopar's
        if (r.data.get("lr_schedule") or {}).get(name) == off:
            r.get(f"lr_schedule.{name}")
    return out


def _evaluation(r: _Reader) -> dict:
    if not r.get("do_eval", False):
        return {}
    every = r.get("eval_step_interval")
    return {"eval_strategy": "steps", **({"eval_steps": every} if isinstance(every, int)
                                         and every > 0 else {})}


def _model(r: _Reader, pins: dict, base: Path) -> object:
    arch = r.get("model.arch.type", "LlamaForCausalLM")
    kind = r.get("model.model_config.type", "LlamaConfig")
    if arch != "LlamaForCausalLM" or kind not in ("LlamaConfig", "LlamaForCausalLM"):
        raise PlanError(f"autopar reads MindFormers Llama models (LlamaForCausalLM, "
                        f"LlamaConfig); this one is {arch} with {kind}: give autopar the model "
                        f"as a Hugging Face folder instead")
    checkpoint = r.data.get("load_checkpoint")
    folder = base / checkpoint if isinstance(checkpoint, str) and checkpoint else None
    if folder is not None and (folder / "config.json").is_file() and \
            any(folder.glob("*.safetensors")):
        r.get("load_checkpoint")
        return str(folder.resolve())
    shape, get = pins["model"], lambda k, d=None: r.get(f"model.model_config.{k}", d)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "vocab_size": shape["vocab_size"], "hidden_size": shape["hidden_size"],
              "intermediate_size": shape["ffn_hidden_size"],
              "num_hidden_layers": shape["num_layers"],
              "num_attention_heads": shape["num_heads"],
              "num_key_value_heads": shape.get("num_kv_heads", shape["num_heads"]),
              "max_position_embeddings": get("max_position_embedding", shape["seq_length"]),
              "rms_norm_eps": float(get("rms_norm_eps", 1e-5)),
              "rope_theta": float(get("theta", 10000.0)), "hidden_act": "silu",
              "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
              "bos_token_id": get("bos_token_id", 1), "eos_token_id": get("eos_token_id", 2),
              "pad_token_id": get("pad_token_id", 0)}
    dtype = DTYPES.get(str((r.data["model"]["model_config"]).get("param_init_type")))
    if dtype:
        r.get("model.model_config.param_init_type")
        config["dtype"] = dtype
    return config


def _local_file(value: object) -> bool:
    return isinstance(value, str) and Path(value).suffix.lower() in DATA_FILES


def _data(r: _Reader) -> dict:
    out: dict = {}
    for section, name in (("train_dataset", "train"), ("eval_dataset", "eval")):
        loader = f"{section}.data_loader"
        for key in ("dataset_dir", "data_files"):
            if _local_file(((r.data.get(section) or {}).get("data_loader") or {}).get(key)):
                out[name] = {"path": r.get(f"{loader}.{key}")}
                r.get(f"{loader}.type")
                if r.get(f"{loader}.text_col") is not None:
                    out["text_field"] = r.get(f"{loader}.text_col")
                break
    return out


def _tokenizer(r: _Reader, base: Path) -> str | None:
    for key in ("vocab_file", "tokenizer_file"):
        value = ((r.data.get("processor") or {}).get("tokenizer") or {}).get(key)
        if isinstance(value, str) and value:
            path = base / value
            folder = path if path.is_dir() else path.parent
            if (folder / "tokenizer_config.json").is_file():
                r.get(f"processor.tokenizer.{key}")
                return str(folder.resolve())
    return None


def _peft(r: _Reader) -> dict | None:
    pet = ((r.data.get("model") or {}).get("model_config") or {}).get("pet_config")
    if not isinstance(pet, dict) or str(pet.get("pet_type", "")).lower() != "lora":
        return None
    base = "model.model_config.pet_config"
    out = {"method": "lora", "r": r.get(f"{base}.lora_rank", 8),
           "lora_alpha": r.get(f"{base}.lora_alpha", 16),
           "lora_dropout": r.get(f"{base}.lora_dropout", 0.0)}
    r.get(f"{base}.pet_type")
    targets = r.get(f"{base}.target_modules")
    if isinstance(targets, str):
        names = [hf for mf, hf in LINEARS.items() if re.search(rf"(?<![A-Za-z0-9]){mf}\b",
                                                                 targets)]
        if names:
            out["target_modules"] = names
    return out
