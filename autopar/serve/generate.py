"""Cached autoregressive generation: the prompt runs once (prefill), then one token at a time,
each step reading every layer's keys and values from a static cache instead of recomputing
the prefix.

The cache is transformers' ``StaticCache``: per layer, keys and values pre-allocated as
[batch, kv_heads, max_len, head_dim] and written by position. Its layers size themselves from
the first keys they see, so under tensor parallelism (the attention split by heads) each rank
caches only its own kv heads: [batch, kv_heads / tp, max_len, head_dim]. Prompts of different
lengths are left-padded, their positions counted from their first real token, as Hugging
Face's ``generate`` does, so greedy tokens are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from autopar.artifact import load_artifact
from autopar.codegen.generate_program import decode_function
from autopar.errors import PlanError
from autopar.models.source import build_from_source, describe_source
from autopar.parallel.generate_stages import split_for_generation
from autopar.parallel.init import materialize
from autopar.parallel.mesh import build_mesh
from autopar.parallel.tensor_parallel import apply_tensor_parallel
from autopar.peft import apply_peft
from autopar.plan import Plan
from autopar.train.checkpoint import artifact_checkpoint, latest_checkpoint, read_tensors
from autopar.train.parallelize import parallelize


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of prompts of different lengths, left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PlanError("every prompt needs at least one token; drop the empty ones")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """One token per row from the last position's logits [batch, vocab], with Hugging Face's
    warpers in its order: temperature, then top-k, then top-p (the smallest set of tokens
    whose probability reaches ``top_p``, at least one)."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1)  # ascending, as HF's TopPLogitsWarper
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None) -> None:
    """Refuse generation settings that cannot run, in one line each."""
    if max_new_tokens < 1:
        raise PlanError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise PlanError(f"temperature must be positive, got {temperature}; use "
                        f"do_sample=False for greedy decoding")
    if top_k is not None and top_k < 1:
        raise PlanError(f"top_k must be at least 1, got {top_k}; leave it out to keep every "
                        f"token")
    if top_p is not None and not 0 < top_p <= 1:
        raise PlanError(f"top_p must be in (0, 1], got {top_p}")


def new_cache(config, max_len: int, stage=None):
    """An empty static KV cache for ``max_len`` positions: transformers' ``StaticCache``, each
    layer allocated [batch, kv_heads, max_len, head_dim] from the first keys it sees (so under
    tensor parallelism only this rank's kv heads); under pipeline stages only this rank's
    layers fill, and the mask sizes come from its first one (``stage.cache``)."""
    if stage is not None:
        return stage.cache(config, max_len)
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_len)


def new_tokens(out: torch.Tensor, prompts: Sequence[Sequence[int]],
               eos_token_id: int | None = None) -> list[list[int]]:
    """Each prompt's new token ids from ``generate``'s [batch, prompt + new] output, cut after
    the stop token (what follows it is padding)."""
    width = out.shape[1] - max(len(p) for p in prompts)
    rows = []
    for row in out[:, out.shape[1] - width:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[:row.index(eos_token_id) + 1]
        rows.append(row)
    return rows


class Generator:
    """Generate with a model's KV cache, in one process or under a plan on several.

    ``model`` is a Hugging Face causal LM (an ``nn.Module``), a shipped name or config path
    (the seed-0 weights ``autopar run`` starts from, :func:`initial_model`), a Hugging Face
    folder with weights, or an artifact directory (its latest checkpoint, adapters included).
    With ``plan``, the model is laid out as the plan says in the current process group: tensor
    parallelism splits the attention by heads and with it the cache; pipeline stages each run
    and cache their own layers (:mod:`autopar.parallel.generate_stages`). Every rank must call
    :meth:`generate` with the same arguments and gets the same tokens.
    """

    def __init__(self, model: nn.Module | str | Path, plan: Plan | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        model = load_model(model, self.device)
        if getattr(model, "config", None) is None or not hasattr(model, "get_output_embeddings"):
            raise PlanError(f"generation needs a Hugging Face causal LM (its config and cache); "
                            f"{type(model).__name__} is not one")
        self.stage = None  # this rank's pipeline stage (GenerationStage), if any
        if plan is not None and plan.devices > 1:
            import dataclasses

            # a decode step has one token: nothing to split over the sequence, so the same
            # weights run as plain tensor parallelism
            plan = dataclasses.replace(plan, sequence_parallel=False)
            if plan.mesh["pp"] > 1:
                model = self._stages(model, plan)
            else:
                model = parallelize(model, plan, str(self.device.type))
                if isinstance(model, nn.parallel.DistributedDataParallel):
                    # replicas of a decode step share no gradient: the whole model, as is
                    model = model.module
        self.model = model.eval()
        self.config = model.config

    def _stages(self, model: nn.Module, plan: Plan) -> nn.Module:
        """This rank's generation stage (:mod:`autopar.parallel.generate_stages`), its layers
        split over tp as the plan says; each rank keeps whole copies of what it runs."""
        if plan.mesh["ep"] > 1:
            raise PlanError("generation under pipeline stages with expert parallelism is not "
                            "in autopar yet; re-plan with constraints ep=1 or pp=1")
        mesh = build_mesh(plan, self.device.type)
        self.stage = split_for_generation(model, plan, mesh["pp"].get_group())
        if plan.mesh["tp"] > 1:
            apply_tensor_parallel(model, plan, mesh["tp"], whole_logits=True)
        return model

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | Sequence[Sequence[int]],
                 attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 32,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, seed: int = 0) -> torch.Tensor:
        """The prompts followed by their new tokens, as Hugging Face's ``generate`` returns
        them: [batch, prompt + new]. ``input_ids`` is a tensor (left-padded, with its
        ``attention_mask``) or a list of token-id lists of any lengths (left-padded here).
        A row that emits ``eos_token_id`` is finished: it continues with ``pad_token_id``
        (default: the eos id), and generation stops when every row is finished. Sampling
        draws from a generator seeded with ``seed`` (the same draws on every rank)."""
        check_sampling(max_new_tokens, do_sample, temperature, top_k, top_p)
        if pad_token_id is None:
            pad_token_id = eos_token_id if eos_token_id is not None else 0
        if not isinstance(input_ids, torch.Tensor):
            input_ids, attention_mask = left_pad(input_ids, pad_token_id)
        vocab = getattr(self.config, "vocab_size", None)
        if isinstance(vocab, int) and input_ids.numel() and (
                int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise PlanError(f"prompt token ids must lie in [0, {vocab}) for this model's "
                            f"vocabulary; found {int(input_ids.min())}..{int(input_ids.max())}")
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else \
            attention_mask.to(self.device, torch.long)
        # the loop a generated generate.py shows, run on this model (and stage) as it is
        decode = decode_function(self.stage is not None)
        return decode(self.model, self.stage, input_ids, mask, max_new_tokens=max_new_tokens,
                      do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed)


def load_model(model: nn.Module | str | Path, device: torch.device) -> nn.Module:
    """The model a :class:`Generator` runs, from what the user passed (see there)."""
    if isinstance(model, nn.Module):
        return model.to(device)
    path = Path(str(model))
    if (path / "manifest.json").is_file():
        return _from_artifact(path, device)
    if path.is_dir() and any(path.glob("*.safetensors")):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    local_files_only=True).to(device)

    # the weights autopar run starts from (seed 0): the same on every rank and every call
    return initial_model(describe_source(str(model)), None, device)


def _from_artifact(directory: Path, device: torch.device) -> nn.Module:
    """An artifact's model with the weights of its latest checkpoint (whole, one process)."""
    import torch.distributed.checkpoint as dcp

    manifest, plan = load_artifact(directory)
    ckpt = artifact_checkpoint(directory)
    model = build_from_source(manifest["model"], 0, device)
    if plan.peft:
        apply_peft(model, plan.peft)
    stored = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    names = [n for n, _ in model.named_parameters()]
    state = read_tensors(ckpt, stored, names)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[f"model.{name}"])
    return model


def initial_model(source: dict, plan: Plan | None = None,
                  device: str | torch.device = "cpu") -> nn.Module:
    """The whole model with the weights ``autopar run`` starts training from (seed 0, each
    module from its own seed, :func:`autopar.parallel.init.materialize`), with the plan's
    fine-tuning method when it has one."""
    model = build_from_source(source, 0, "meta")
    if plan is not None and plan.peft:
        apply_peft(model, plan.peft)
    materialize(model, 0, device=device)
    return model


def serving_model(directory: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The whole model artifact ``directory`` serves: the weights of its latest checkpoint,
    or, before any training, the seed-0 weights ``autopar run`` starts from."""
    device = torch.device(device)
    if latest_checkpoint(Path(directory) / "checkpoints") is not None:
        return _from_artifact(Path(directory), device)
    manifest, plan = load_artifact(directory)
    return initial_model(manifest["model"], plan, device)


def check_servable(plan: Plan, source: dict) -> None:
    """Refuse, before any work, what a generation program cannot serve."""
    if plan.mesh["ep"] > 1:
        raise PlanError("generation with expert parallelism is not in autopar yet; re-compile "
                        "with --task infer --constraints ep=1")
    if source.get("kind") != "hf_config":
        raise PlanError("generation needs a Hugging Face causal LM (its config and KV cache); "
                        "this artifact's model is a plain module: compile a Hugging Face model")


def serve(program, model: nn.Module, prompts: Sequence[Sequence[int]], *,
          device: str = "cpu", eos_token_id: int | None = None,
          **options) -> tuple[list[list[int]], float]:
    """Serve ``prompts`` with a generation program (an artifact's ``generate.py``, loaded):
    its mesh, its layout of ``model`` (whole, with its weights, on every rank), then its
    ``generate`` on this data-parallel replica's share of the prompts (every dp-th one).
    Returns, on every rank, each prompt's new token ids in order (cut after
    ``eos_token_id``) and the seconds generation took (the slowest replica's). ``options``
    go to ``generate`` (max_new_tokens, do_sample, temperature, top_k, top_p, seed)."""
    import time

    import torch.distributed as dist

    mesh = program.build_mesh(device)
    model, stage = program.parallelize(model, mesh)
    replicas = mesh["dp"].size() if mesh is not None else 1
    replica = mesh["dp"].get_local_rank() if mesh is not None else 0
    mine = list(prompts)[replica::replicas]
    start = time.perf_counter()
    rows = new_tokens(program.generate(model, stage, mine, eos_token_id=eos_token_id,
                                       **options), mine, eos_token_id) if mine else []
    seconds = time.perf_counter() - start
    if replicas == 1:
        return rows, seconds
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (replica, rows, seconds))
    merged: list[list[int]] = [[] for _ in prompts]
    for index, theirs, _ in everyone:
        for i, row in enumerate(theirs):
            merged[index + i * replicas] = row
    return merged, max(s for _, _, s in everyone)
