"""Where each tensor of a model lives in a Hugging Face checkpoint, and back.

A checkpoint names tensors as the model's ``state_dict`` does, except where transformers
converts them on load: per-expert MoE matrices stacked into one 3-D tensor per layer (and
gate/up concatenated), Mixtral's ``block_sparse_moe`` renamed ``mlp``, a base-model prefix
added or dropped. transformers states those conversions as data (its conversion mapping);
this module reads that mapping and turns it into *pieces*: each model tensor is a union of
boxes, each box one checkpoint tensor. A rank then reads only the parts of the boxes its
shard overlaps (:mod:`autopar.weights.hf_weights`), and an export writes every box back
under the name ``save_pretrained`` gives it (:mod:`autopar.serve.hf_export`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from autopar.errors import PlanError


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's box inside a model tensor."""

    key: str  # the checkpoint tensor's name
    start: tuple[int, ...]  # its corner in the model tensor
    shape: tuple[int, ...]  # its extent in the model tensor
    stacked: bool = False  # one expert of a stacked tensor: the file lacks the leading dim


def model_tensors(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str],
                                              set[str]]:
    """(persistent tensors a checkpoint holds: FQN -> shape, tied alias -> first FQN,
    buffer FQNs) of an unparallelised (meta) model."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        if id(t) in first:
            alias[name] = first[id(t)]
        else:
            first[id(t)] = name
            shapes[name] = tuple(t.shape)
    buffers = {n for n, _ in model.named_buffers()}
    return shapes, alias, buffers


def _transforms(model: nn.Module, *, saving: bool) -> tuple[list, list]:
    """transformers' (renamings, converters) for ``model``; none for other models. Saving
    leaves out the legacy renamings, as save_pretrained does."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=not saving)
    renamings = [t for t in transforms if type(t) is WeightRenaming]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _ops(converter) -> str:
    """'stack' (per-expert tensors stacked on dim 0), 'stack+cat' (then parts concatenated
    on dim 1), or the names of a layout autopar does not read."""
    names = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if names == [("MergeModulelist", 0)]:
        return "stack"
    if names == [("MergeModulelist", 0), ("Concatenate", 1)]:
        return "stack+cat"
    return "+".join(n for n, _ in names)


def _expert_regex(pattern: str) -> re.Pattern:
    # transformers' patterns are regex text with '*' standing for the expert index
    return re.compile(pattern.replace("*.", r"(\d+)\.") + r"(?!\w)")


def load_pieces(model: nn.Module, checkpoint: dict[str, tuple[int, ...]], where: str
                ) -> dict[str, list[Piece]]:
    """Model FQN -> the checkpoint boxes it is made of, for every tensor ``checkpoint`` (name
    -> shape) supplies. Refuses, in one line, checkpoint tensors the model has no place for
    and boxes whose shapes do not fit; missing tensors are the caller's to judge."""
    from transformers.core_model_loading import apply_renamings, rename_source_key

    shapes, alias, buffers = model_tensors(model)
    renamings, converters = _transforms(model, saving=False)
    prefix = getattr(model, "base_model_prefix", None) or None
    known = dict.fromkeys([*shapes, *alias], True)  # transformers reads .get(...) is not None
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                             None) or ()]
    transient = {n.rsplit(".", 1)[-1] for n, _ in model.named_buffers()} - \
        {n.rsplit(".", 1)[-1] for n in model.state_dict()}
    pieces: dict[str, list[Piece]] = {}
    parts: dict[str, dict[tuple[int, int], tuple[str, tuple[int, ...]]]] = {}
    how: dict[str, object] = {}
    unexpected = []
    for key, shape in checkpoint.items():
        target, pattern = rename_source_key(key, renamings, converters, prefix, known) \
            if (renamings or converters or prefix) else (key, None)
        if pattern is None:
            if target in alias:
                continue  # a tied copy: the model reads its first owner
            if target not in shapes:
                if any(p.search(key) for p in ignored) or key.rsplit(".", 1)[-1] in transient:
                    continue  # what transformers itself skips (rotary inv_freq, masks)
                unexpected.append(key)
                continue
            if tuple(shape) != shapes[target]:
                raise PlanError(f"{where}: {key} is {list(shape)} there but "
                                f"{list(shapes[target])} in the model; pass the checkpoint of "
                                f"this model's config")
            pieces[target] = [Piece(key, (0,) * len(shape), tuple(shape))]
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        if target not in shapes:
            unexpected.append(key)
            continue
        renamed = apply_renamings(key, renamings)
        found = _expert_regex(pattern).search(renamed)
        if found is None or not found.groups():
            raise PlanError(f"{where}: cannot tell which expert {key} holds; autopar reads "
                            f"per-expert tensors named like '{pattern}'")
        how[target] = converter
        part = converter.source_patterns.index(pattern)
        parts.setdefault(target, {})[(int(found.group(1)), part)] = (key, tuple(shape))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise PlanError(f"{where} does not match the model: it holds {unexpected[0]}{more}, "
                        f"which the model does not have; pass the checkpoint of this model's "
                        f"config")
    for target, boxes in parts.items():
        pieces[target] = _stacked_pieces(target, shapes[target], boxes, how[target], where)
    return pieces


def _stacked_pieces(target: str, shape: tuple[int, ...],
                    boxes: dict[tuple[int, int], tuple[str, tuple[int, ...]]], converter,
                    where: str) -> list[Piece]:
    """The boxes of a stacked expert tensor: expert e at index e of dim 0, its parts one
    after another along dim 1 (gate then up, as transformers concatenates them)."""
    ops = _ops(converter)
    if ops not in ("stack", "stack+cat"):
        raise PlanError(f"{where}: {target} is stored in a layout autopar does not read yet "
                        f"(transformers converts it with {ops}); convert the checkpoint with "
                        f"from_pretrained + save_pretrained into this transformers version's "
                        f"layout")
    n_parts = len(converter.source_patterns) if ops == "stack+cat" else 1
    out = []
    for e in range(shape[0]):
        offset = 0
        for p in range(n_parts):
            if (e, p) not in boxes:
                raise PlanError(f"{where} does not match the model: expert {e} of {target} "
                                f"({converter.source_patterns[p]}) is missing; pass the "
                                f"checkpoint of this model's config")
            key, part_shape = boxes[(e, p)]
            box = (1, *part_shape)
            if len(box) != len(shape) or any(
                    b != s for i, (b, s) in enumerate(zip(box, shape, strict=True))
                    if i not in (0, 1)):
                raise PlanError(f"{where}: {key} is {list(part_shape)} there, which does not "
                                f"fit {target} {list(shape)} in the model; pass the "
                                f"checkpoint of this model's config")
            out.append(Piece(key, (e, offset, *([0] * (len(shape) - 2))), box, stacked=True))
            offset += part_shape[0]
        if offset != shape[1]:
            raise PlanError(f"{where}: the parts of expert {e} of {target} add up to {offset} "
                            f"rows, but the model has {shape[1]}; pass the checkpoint of this "
                            f"model's config")
    extra = {e for e, _ in boxes} - set(range(shape[0]))
    if extra:
        raise PlanError(f"{where} holds expert {min(extra)} of {target}, but the model has "
                        f"{shape[0]} experts; pass the checkpoint of this model's config")
    return out


def save_pieces(model: nn.Module) -> dict[str, list[Piece]]:
    """Model FQN -> the boxes it is written as: the names and layout ``save_pretrained``
    writes (per-expert tensors for stacked experts, the original names of renamed ones).
    Tied copies are left out, as save_pretrained leaves them out. Each mapping is checked by
    loading it back (:func:`load_pieces`); a tensor whose reverse is unclear keeps the
    model's own name, which this transformers version loads as it is."""
    from transformers.core_model_loading import apply_renamings

    shapes, _, _ = model_tensors(model)
    renamings, converters = _transforms(model, saving=True)
    reverse = [r.reverse_transform() for r in reversed(renamings)]
    out: dict[str, list[Piece]] = {}
    for name, shape in shapes.items():
        out[name] = [Piece(name, (0,) * len(shape), shape)]
        converter = next((c for c in converters if _ops(c) in ("stack", "stack+cat") and any(
            re.search(re.escape(t) + r"(?!\w)", name) for t in c.target_patterns)), None)
        if converter is not None:
            target = next(t for t in converter.target_patterns
                          if re.search(re.escape(t) + r"(?!\w)", name))
            n_parts = len(converter.source_patterns) if _ops(converter) == "stack+cat" else 1
            if len(shape) < 2 or shape[1] % n_parts:
                continue
            rows = shape[1] // n_parts
            boxes = []
            for e in range(shape[0]):
                for p, pattern in enumerate(converter.source_patterns[:n_parts]):
                    literal = pattern.replace("*", str(e)).replace("\\", "")
                    key = apply_renamings(name.replace(target, literal, 1), reverse)
                    boxes.append(Piece(key, (e, p * rows, *([0] * (len(shape) - 2))),
                                       (1, rows, *shape[2:]), stacked=True))
            candidate = boxes
        else:
            key = apply_renamings(name, reverse) if reverse else name
            if key == name:
                continue
            candidate = [Piece(key, (0,) * len(shape), shape)]
        try:  # the reverse must load back to this very tensor
            back = load_pieces(model, {p.key: p.shape[1:] if p.stacked else p.shape
                                       for p in candidate}, "export")
        except PlanError:
            continue
        if back.get(name) == candidate:
            out[name] = candidate
    return out
