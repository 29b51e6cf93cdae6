"""``autopar.pipeline("text-generation", model=...)``: text in, text out, in the shape of Hugging
Face's ``pipeline`` (and MindFormers' ``pipeline(task="text_generation")``), on autopar's
:class:`~autopar.serve.generate.Generator` (its KV cache, and a plan's layout).

Text is tokenized by the model's own tokenizer (its Hugging Face folder, or ``tokenizer=``);
a conversation (a list of ``{"role", "content"}`` messages) goes through the tokenizer's chat
template with the generation prompt added. Outputs follow Hugging Face's text-generation
pipeline (transformers 5): ``[{"generated_text": ...}]`` per input, the prompt's text followed by
the new tokens' text (``return_full_text=False``: the new text alone); for a conversation, the
messages followed by ``{"role": "assistant", "content": new text}``. The call takes Hugging
Face's generation names (:mod:`autopar.serve.generation_options`).

Launched with several processes (``torchrun --nproc-per-node N script.py``), the pipeline joins
the job's process group and, without ``plan=``, plans serving for N devices itself: rank 0
runs the planner and every rank receives its plan, so all lay the model out the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import capture
from autopar.cost.hardware import catalog_names
from autopar.data.instruction import load_hf_tokenizer, tokenizer_beside
from autopar.errors import PlanError
from autopar.ir.graph import Graph
from autopar.models.hf import build_model, max_positions, token_inputs
from autopar.models.source import describe_source
from autopar.parallel.rank_zero import on_rank_zero
from autopar.peft import applied_method
from autopar.plan import Plan
from autopar.search.api import plan as make_plan
from autopar.search.constraints import load_constraints
from autopar.serve.generate import Generator, load_model
from autopar.serve.generation_options import Decoding, folder_defaults, resolve, split_call
from autopar.train.launch import init_process_group
from autopar.train.run_flags import BACKENDS

TASKS = ("text-generation",)

# catalog entries by what CUDA calls the device (A100s are told apart by their memory)
GPU_CATALOG = (("h200", "h200"), ("b200", "b200"), ("h100", "h100-80g"), ("v100", "v100-16g"))


class TextGenerationPipeline:
    """Generates text for a string, a conversation, or a list of either (see the module).

    ``plan``: the layout the pipeline runs under (None in one process). ``replicas``: how many
    processes each hold the whole model and serve their share of the prompts (a plan that
    only replicates). ``defaults``: the model folder's ``generation_config.json`` settings and
    its path (:func:`~autopar.serve.generation_options.folder_defaults`)."""

    def __init__(self, generator: Generator, tokenizer: Any, *, plan: Plan | None = None,
                 replicas: int = 1, defaults: tuple[dict, str] = ({}, "")) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.plan = plan
        self.replicas = replicas
        self.defaults = defaults

    def __call__(self, inputs: str | list, **options: Any) -> list:
        """``[{"generated_text": ...}]`` for one prompt; a list of those for a list of
        prompts. Every process of a job calls it with the same inputs and gets the same
        outputs.

        Keywords (Hugging Face's names and meanings): ``max_new_tokens`` (default 32) or
        ``max_length`` (each prompt's tokens plus its new ones), ``do_sample`` (default
        False: greedy), ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` (an id or a
        list), ``pad_token_id``, ``generation_config`` (a ``transformers.GenerationConfig``
        or a dict; the call's keywords win over it, it wins over the model folder's
        generation_config.json), ``return_full_text``, ``return_tensors`` (the token ids,
        prompt first, as ``{"generated_token_ids": [...]}``), and autopar's ``seed`` (the
        sampling draws). Other generation settings are refused in one line."""
        generation, output = split_call(options)
        prompts, single = _prompt_list(inputs)
        decoding = resolve(generation, self.defaults, self.tokenizer)
        full_text, tensors, seed = _output_options(output)
        ids = [self._prompt_ids(p) for p in prompts]
        news = self._new_ids(ids, decoding, seed)
        outputs = [[self._record(prompt, prompt_ids, new, full_text, tensors)]
                   for prompt, prompt_ids, new in zip(prompts, ids, news, strict=True)]
        return outputs[0] if single else outputs

    def _prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            if not getattr(self.tokenizer, "chat_template", None):
                raise PlanError("this tokenizer has no chat template; pass the prompt as a "
                                "string instead of a list of messages")
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                     tokenize=True)
            # transformers 5 returns a BatchEncoding, 4 a list of ids
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        raise PlanError(f"a prompt is a string or a list of {{'role', 'content'}} messages; got "
                        f"{type(prompt).__name__}")

    def _new_ids(self, ids: list[list[int]], decoding: Decoding, seed: int) -> list[list[int]]:
        """Each prompt's new token ids. Replicas each generate every ``replicas``-th prompt
        and exchange their rows, as a generated program's data-parallel replicas do."""
        limits = decoding.new_token_limits([len(p) for p in ids])
        if self.replicas == 1:
            return self._generate(ids, limits, decoding, seed)
        replica = dist.get_rank()
        share = list(range(replica, len(ids), self.replicas))
        rows = self._generate([ids[i] for i in share], [limits[i] for i in share], decoding,
                              seed) if share else []
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(zip(share, rows, strict=True)))
        merged: list[list[int]] = [[] for _ in ids]
        for pairs in everyone:
            for index, row in pairs:
                merged[index] = row
        return merged

    def _generate(self, ids: list[list[int]], limits: list[int], decoding: Decoding,
                  seed: int) -> list[list[int]]:
        rows = self.generator.generate(ids, **decoding.generator_kwargs(max(limits), seed))
        width = max(len(p) for p in ids)  # left padding: every row's prompt ends here
        return [decoding.cut(row[width:], limit)
                for row, limit in zip(rows.tolist(), limits, strict=True)]

    def _record(self, prompt: str | list[dict], prompt_ids: list[int], new: list[int],
                full_text: bool, tensors: bool) -> dict:
        if tensors:
            return {"generated_token_ids": [*prompt_ids, *new]}
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if not full_text:
            return {"generated_text": text}
        if isinstance(prompt, str):
            return {"generated_text": prompt + text}
        return {"generated_text": [*prompt, {"role": "assistant", "content": text}]}


def _prompt_list(inputs: object) -> tuple[list, bool]:
    """(the prompts, whether one prompt was given alone)."""
    if not isinstance(inputs, (str, list, tuple)):
        raise PlanError(f"a prompt is a string or a list of {{'role', 'content'}} messages; got "
                        f"{type(inputs).__name__}")
    single = isinstance(inputs, str) or (
        isinstance(inputs, list) and bool(inputs) and all(isinstance(m, dict) for m in inputs))
    prompts = [inputs] if single else list(inputs)
    if not prompts:
        raise PlanError("no prompt given; pass a string or a list of strings")
    return prompts, single


def _output_options(output: dict) -> tuple[bool, bool, int]:
    """(return_full_text, return_tensors, seed) of a call."""
    tensors = bool(output.get("return_tensors") or False)
    if tensors and output.get("return_full_text") is not None:
        raise PlanError("return_tensors returns the token ids, prompt first; drop "
                        "return_full_text (Hugging Face refuses the two together too)")
    seed = output.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PlanError(f"seed is an integer (the sampling draws), got {seed!r}")
    return bool(output.get("return_full_text", True)), tensors, seed


def pipeline(task: str, model: nn.Module | str | Path, *, tokenizer: Any = None,
             plan: Plan | None = None, device: str | torch.device | None = None,
             constraints: dict | str | None = None, cluster: str | Path | None = None
             ) -> TextGenerationPipeline:
    """A text-generation pipeline over ``model`` (what :class:`Generator` takes: a module, a
    Hugging Face folder, a shipped name or an artifact).

    ``tokenizer``: a loaded tokenizer or its folder (default: the model's folder, when it
    holds one). ``device``: default ``cuda:LOCAL_RANK`` where CUDA is available, else the
    CPU. Launched with several processes (torchrun's WORLD_SIZE > 1), the pipeline joins the
    job's process group unless one is initialized (gloo on CPU, nccl on CUDA) and generates
    under ``plan``, or, without one, under a serving plan (``task="infer"``) for that many
    devices made on rank 0 and sent to every rank; ``constraints`` (e.g. ``{"tp": 2}``) and
    ``cluster`` (default: the catalog entry of this device) go to that planner. The plan used
    is the pipeline's ``plan`` (None in one process). Every rank calls the pipeline with the
    same inputs."""
    if task not in TASKS:
        raise PlanError(f"unknown pipeline task {task!r}; autopar runs {', '.join(TASKS)}")
    planner_inputs = [k for k, v in (("constraints", constraints), ("cluster", cluster))
                      if v is not None]
    if plan is not None and planner_inputs:
        raise PlanError(f"{planner_inputs[0]} shapes the plan autopar makes when none is "
                        f"given; pass plan= or {planner_inputs[0]}=, not both")
    tokenizer = _tokenizer(model, tokenizer)
    defaults = folder_defaults(model)  # a bad generation_config.json fails before any work
    device = resolve_device(device)
    world = join_launched_group(device)
    if world == 1 and planner_inputs:
        raise PlanError(f"{planner_inputs[0]} shapes the layout over several processes, and "
                        f"this is one; launch with torchrun --nproc-per-node N, or drop "
                        f"{planner_inputs[0]}")
    loaded = load_model(model, device)
    if plan is None and world > 1:
        plan = shared_plan(model, loaded, world, cluster or default_cluster(device),
                           constraints, device)
    if plan is not None and plan.devices > 1:
        plan.check_world_size(world)
    replicas = replicas_of(plan)
    generator = Generator(loaded, plan=plan if replicas == 1 else None, device=device)
    return TextGenerationPipeline(generator, tokenizer, plan=plan, replicas=replicas,
                                  defaults=defaults)


def _tokenizer(model: object, tokenizer: Any) -> Any:
    if tokenizer is None:
        tokenizer = tokenizer_beside(model)
        if tokenizer is None:
            raise PlanError("no tokenizer: the model is not a folder holding one; pass "
                            "tokenizer=FOLDER")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_hf_tokenizer(tokenizer)
    return tokenizer


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device``, or for None this process's GPU (``cuda:LOCAL_RANK``) where CUDA is
    available, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def join_launched_group(device: torch.device) -> int:
    """The job's world size; joins torchrun's process group (its environment: WORLD_SIZE > 1)
    when none is initialized, with the device type's backend."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if device.type not in BACKENDS:
            raise PlanError(f"no collective backend for {device.type} processes; pass "
                            f"device= one of {', '.join(sorted(BACKENDS))}")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before nccl: each rank on its own GPU
        init_process_group(BACKENDS[device.type])
    return world


def default_cluster(device: torch.device) -> str:
    """The hardware catalog entry the planner prices this device with."""
    if device.type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    lowered = name.lower()
    for key, entry in GPU_CATALOG:
        if key in lowered:
            return entry
    if "a100" in lowered:
        memory = torch.cuda.get_device_properties(device).total_memory
        return "a100-80g" if memory > 50e9 else "a100-40g"
    raise PlanError(f"no hardware catalog entry for {name}; pass cluster= one of "
                    f"{', '.join(catalog_names())} or a profile YAML (autopar profile)")


def shared_plan(model: object, loaded: nn.Module, world: int, cluster: str | Path,
                constraints: dict | str | None, device: torch.device) -> Plan:
    """The serving plan for ``world`` devices, made on rank 0 and broadcast, so that every
    rank lays the model out the same way even where the solver could choose differently
    from run to run. A failure on rank 0 is raised on every rank."""
    where = device if device.type != "cpu" else None
    return Plan.from_dict(on_rank_zero(
        lambda: serving_plan(model, loaded, world, cluster, constraints).to_dict(), where))


def serving_plan(model: object, loaded: nn.Module, world: int, cluster: str | Path,
                 constraints: dict | str | None) -> Plan:
    """The planner's serving plan (``task="infer"``) for ``world`` devices of ``cluster``,
    one the Generator runs: no expert parallelism, and either the whole model on every
    process (dp = world) or split over all of them (dp = 1)."""
    pins = load_constraints(constraints)
    if pins.get("ep", 1) > 1:
        raise PlanError("generation with expert parallelism is not in autopar yet; drop ep "
                        "from constraints")
    pins["ep"] = 1
    target = planning_target(model, loaded)
    plan = make_plan(target, devices=world, cluster=cluster, task="infer", constraints=pins)
    if 1 < plan.mesh["dp"] < world and "dp" not in pins:
        plan = make_plan(target, devices=world, cluster=cluster, task="infer",
                         constraints={**pins, "dp": 1})
    return plan


def planning_target(model: object, loaded: nn.Module) -> str | Graph:
    """What the planner captures: a shipped name or a folder as given (its graph is cached),
    else a meta-device twin of the loaded model built from its config."""
    if isinstance(model, (str, Path)) and not (Path(model) / "manifest.json").is_file():
        return str(model)
    if applied_method(loaded) is not None:
        raise PlanError("autopar.pipeline does not plan a model with fine-tuning adapters; "
                        "pass plan= (autopar compile --task infer), or serve the merged model "
                        "(autopar export DIR --to hf OUT --merge)")
    source = describe_source(loaded)
    if source["kind"] != "hf_config":
        raise PlanError(f"generation needs a Hugging Face causal LM (its config and cache); "
                        f"{type(loaded).__name__} is not one")
    config = source["config"]
    twin = build_model(config, device="meta")
    return capture(twin, token_inputs(1, min(max_positions(config), 4096)))


def replicas_of(plan: Plan | None) -> int:
    """How many processes each hold the whole model under ``plan`` (each serves a share of
    the prompts): all of them for a plan that only replicates, else 1. A plan that mixes
    replicas with a split model is refused: the Generator lays out one or the other."""
    if plan is None or plan.devices == 1:
        return 1
    dp = plan.mesh["dp"]
    if dp == plan.devices:
        return dp
    if dp == 1:
        return 1
    raise PlanError(f"the plan holds {dp} replicas of a model split over "
                    f"{plan.devices // dp} processes; autopar.pipeline serves a model split "
                    f"over every process (dp=1) or whole on each (dp={plan.devices}): re-plan "
                    f"with constraints dp=1")
