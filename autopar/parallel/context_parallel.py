"""Context parallelism applied to a model: each of the ``cp`` ranks holds a load-balanced
share of every sequence (:mod:`autopar.parallel.cp_layout`), runs everything token-wise on it
as usual, and attention over the whole sequence by ring (:mod:`autopar.parallel.ring_attention`),
all-to-all (:mod:`autopar.parallel.alltoall_attention`), both (all-to-all inside groups of
cp ranks, a ring across them: :mod:`autopar.parallel.hybrid_attention`) or an all-gather of
the keys and values (:mod:`autopar.parallel.allgather_attention`) over the cp process group.

Hugging Face decoders (Llama, Qwen2, Mistral, ...) get the cp attention through transformers'
attention interface (registered under :data:`CP_ATTENTION`, selected with
``set_attn_implementation``), and the global position ids of the rank's tokens as their
``position_ids`` when the caller gives none, so rotary tables match one process. The loss is a
sum over tokens: :meth:`ContextParallel.lm_loss` divides each rank's sum by the token count of
the whole sequence, and gradients of replicated parameters are reduced over dp x cp (the
program's ``dp_cp`` mesh), so the step equals one process's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError
from autopar.models.gpt import GPT, Attention
from autopar.parallel.allgather_attention import allgather_attention
from autopar.parallel.alltoall_attention import alltoall_attention, alltoall_heads_refusal
from autopar.parallel.cp_layout import global_positions, shard_sequence
from autopar.parallel.cp_sdpa import hook_sdpa
from autopar.parallel.hybrid_attention import hybrid_attention, hybrid_groups
from autopar.parallel.ring_attention import ring_attention

# the name the cp attention is registered under in transformers' AttentionInterface
CP_ATTENTION = "autopar_context_parallel"
# the attribute of each attention module (and of the model) holding its ContextParallel
CP_ATTR = "_autopar_context_parallel"
RUNS_MODES = ("ring", "alltoall", "hybrid", "allgather")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in context parallelism: the cp process group, its rank in it, the
    degree and the mode (ring | alltoall | hybrid | allgather; for hybrid, this rank's all-to-all and ring
    groups)."""

    group: object
    rank: int
    size: int
    mode: str
    inner: object = None
    outer: object = None

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of ``tensor`` (input ids, labels, ...) along the sequence."""
        return shard_sequence(tensor, self.rank, self.size, dim)

    def positions(self, local_tokens: int, device: torch.device | str) -> torch.Tensor:
        """The global position ids (1, local_tokens) of this rank's tokens."""
        return global_positions(local_tokens * self.size, self.rank, self.size, device)

    @property
    def head_split(self) -> int:
        """Over how many ranks each rank's heads are split (all-to-all: every cp rank;
        hybrid: its all-to-all group's), or 1 (ring)."""
        return {"alltoall": self.size,
                "hybrid": dist.get_world_size(self.inner) if self.inner else 1}.get(self.mode, 1)

    def check_heads(self, query_heads: int, kv_heads: int) -> None:
        """One-line PlanError unless these heads (a tp rank's) split whole over the ranks
        the mode re-shards them to."""
        reason = alltoall_heads_refusal(query_heads, kv_heads, self.head_split)
        if reason is not None:
            raise PlanError(reason)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float | None = None, causal: bool = True) -> torch.Tensor:
        """Attention over the whole sequence for this rank's queries (B, H, S/cp, D)."""
        if self.mode == "hybrid":
            return hybrid_attention(q, k, v, self.inner, self.outer, scale=scale, causal=causal)
        attend = {"ring": ring_attention, "alltoall": alltoall_attention,
                  "allgather": allgather_attention}[self.mode]
        return attend(q, k, v, self.group, scale=scale, causal=causal)

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's mean loss from each rank's loss
        (:func:`autopar.train.loss.context_parallel_lm_loss`, detached)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.size


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The ContextParallel a model (or the DDP wrapper around it) was laid out with, or None."""
    inner = getattr(model, "module", model)
    return getattr(model, CP_ATTR, None) or getattr(inner, CP_ATTR, None)


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (q, k, v as (B, H, S, D); output
    (B, S, H, D)) running the module's context-parallel attention."""
    cp = getattr(module, CP_ATTR, None)
    if cp is None:
        raise PlanError(f"{type(module).__name__} runs context-parallel attention but was not "
                        f"laid out for it; apply the plan with autopar.parallelize")
    if attention_mask is not None and not bool(attention_mask.all()):  # all ones: no padding
        raise PlanError("context parallelism runs causal attention over whole sequences; a "
                        "padding attention_mask is not supported: pass none (pack sequences "
                        "instead of padding them)")
    if dropout and module.training:
        raise PlanError(f"context parallelism does not run attention dropout ({dropout}); set "
                        f"the model's attention_dropout to 0")
    window = kwargs.get("sliding_window")
    if window is not None:
        check_sliding_window(module, query.shape[2] * cp.size, window)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = cp.attend(query, key, value, scale=scaling, causal=causal)
    return out.transpose(1, 2).contiguous(), None


def check_sliding_window(model: nn.Module, tokens: int, window: int | None = None) -> None:
    """One-line PlanError when attention over ``tokens`` is limited to a sliding window
    shorter than them (``window``, else the model's config's when it uses one): the cp
    attention sees the whole causal past."""
    if window is None:
        config = getattr(model, "config", None)
        window = getattr(config, "sliding_window", None) \
            if getattr(config, "use_sliding_window", True) else None
    if window is not None and int(window) < tokens:
        raise PlanError(f"context parallelism attends over the whole causal past; this model "
                        f"limits attention to a sliding window of {window} tokens, shorter than "
                        f"the {tokens}-token sequence: train at seq <= {window} or re-plan "
                        f"with constraints cp=1")


def _give_positions(model: nn.Module, cp: ContextParallel, name: str = "position_ids") -> None:
    """The model's forward gets the global position ids of this rank's tokens as keyword
    ``name`` when the caller passes none (the model would number the local tokens from 0)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get(name) is None:
            ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
            kwargs[name] = cp.positions(ids.shape[1], ids.device)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def context_parallel_for(model: nn.Module, group, mode: str, tp: int = 1,
                         all_to_all_ranks: int = 0) -> ContextParallel:
    """This rank's ContextParallel over ``group`` in ``mode`` for ``model`` (a Hugging Face
    decoder or autopar's GPT), after checking that each tp rank's heads split over the ranks
    the mode re-shards them to (one-line PlanError)."""
    if mode not in RUNS_MODES:
        raise PlanError(f"context parallelism cp_mode={mode}: the runtime runs "
                        f"{', '.join(RUNS_MODES)}; re-plan with one of them")
    cp = _context_parallel(group, mode, all_to_all_ranks)
    if isinstance(model, GPT):
        heads = kv_heads = model.cfg.n_heads // tp
    else:
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", 0) // tp
        kv_heads = (getattr(config, "num_key_value_heads", None) or heads * tp) // tp
    cp.check_heads(heads, kv_heads)
    return cp


def _context_parallel(group, mode: str, all_to_all_ranks: int) -> ContextParallel:
    inner = outer = None
    size = dist.get_world_size(group)
    if mode == "hybrid" and all_to_all_ranks in (0, 1, size):
        # an all-to-all of one rank is the ring, of every cp rank the all-to-all (as priced)
        mode = "alltoall" if all_to_all_ranks == size else "ring"
    if mode == "hybrid":
        inner, outer = hybrid_groups(group, all_to_all_ranks)
    return ContextParallel(group, dist.get_rank(group), size, mode, inner, outer)


def apply_context_parallel(model: nn.Module, group, mode: str, tp: int = 1,
                           all_to_all_ranks: int = 0) -> ContextParallel:
    """Lay ``model`` (a Hugging Face decoder, or autopar's GPT) out for context parallelism
    over the process ``group`` in ``mode``: its attention becomes the cp attention, its
    forward gets global position ids. Returns (and records on the model) this rank's
    :class:`ContextParallel`. ``tp``: the tensor-parallel degree (all-to-all splits each tp
    rank's heads over cp); ``all_to_all_ranks``: hybrid's all-to-all group size."""
    if mode not in RUNS_MODES:
        raise PlanError(f"context parallelism cp_mode={mode}: the runtime runs "
                        f"{', '.join(RUNS_MODES)}; re-plan with one of them")
    if isinstance(model, GPT):
        return _apply_to_gpt(model, group, mode, tp, all_to_all_ranks)
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise PlanError(f"context parallelism hooks Hugging Face decoders' and autopar's GPT's "
                        f"attention; {type(model).__name__} is neither: re-plan with "
                        f"constraints cp=1")
    cp = context_parallel_for(model, group, mode, tp, all_to_all_ranks)
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _hf_attention)
    model.set_attn_implementation(CP_ATTENTION)
    tagged = 0
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and hasattr(module, "config"):
            setattr(module, CP_ATTR, cp)
            own = module.config
            if own is not model.config and own._attn_implementation != CP_ATTENTION:
                # tensor parallelism gave the module a private config with its local head
                # counts; the module picks its attention function from that copy
                own._attn_implementation = CP_ATTENTION
            tagged += 1
    if not tagged:
        raise PlanError(f"context parallelism found no attention module in "
                        f"{type(model).__name__}; re-plan with constraints cp=1")
    setattr(model, CP_ATTR, cp)
    _give_positions(model, cp)
    return cp


def _apply_to_gpt(model: nn.Module, group, mode: str, tp: int,
                  all_to_all_ranks: int) -> ContextParallel:
    """autopar's GPT: its attention's causal SDPA call runs the cp attention
    (:mod:`autopar.parallel.cp_sdpa`); its learned positions read the global positions."""

    if not model.cfg.fused_attention:
        raise PlanError("context parallelism replaces the GPT's scaled_dot_product_attention "
                        "call; this one computes attention by hand (fused_attention=False): "
                        "set fused_attention=True or re-plan with constraints cp=1")
    cp = context_parallel_for(model, group, mode, tp, all_to_all_ranks)
    for module in model.modules():
        if isinstance(module, Attention):
            hook_sdpa(module, cp)
    setattr(model, CP_ATTR, cp)
    _give_positions(model, cp, "positions")
    return cp
