"""Sharded weight initialisation: no rank ever holds the full model.

A model is built on the meta device (``build_from_source(..., device="meta")``), parallelised
there (DTensor tensor parallelism, expert splitting, checkpoint wrappers, fully_shard), and then
:func:`materialize` allocates only this rank's shards and fills them.

The values do not depend on the plan. Each module that directly owns parameters or buffers is a
*unit*; its tensors are generated whole, on CPU, one unit at a time, from a seed derived from
(seed, the unit's canonical FQN), by the model's own rule: the module's ``reset_parameters``
(what its constructor does), then the init rule of the nearest ancestor that has one (autopar's
``init_module(module)``, or a transformers model's ``_init_weights(module)``) on the module and
on each of its ancestors, children before parents as transformers does (a parent's rule may
re-initialise a child's weight, GPT-2's scaled projections). Each rank then keeps its slice.
One process, any tensor-parallel, ZeRO or expert split, and any pipeline stage therefore start
from identical weights, and the transient peak is one module's tensors, never the model.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import PlanError
from autopar.parallel.tp_styles import FUSED_ATTR

if TYPE_CHECKING:
    from autopar.weights.hf_weights import HFCheckpoint

# path segments that wrappers insert between a module and its parent; the module's canonical
# FQN (the one the unwrapped model has) is what its seed and its checkpoint key derive from
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def canonical_fqn(name: str) -> str:
    """``name`` as the unwrapped model spells it: without checkpoint_wrapper's, FSDP1's or
    torch.compile's inserted segments. fully_shard (FSDP2), DTensor tensor parallelism and
    pipeline stage modules keep the original FQNs, so they pass through unchanged."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


def unit_seed(seed: int, fqn: str) -> int:
    """The seed of one module's tensors: a stable hash (not Python's salted ``hash``) of the
    run's seed and the module's canonical FQN, the same in every process."""
    digest = hashlib.sha256(f"{seed}:{canonical_fqn(fqn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class InitReport:
    """What :func:`materialize` did on this rank."""

    units: int  # modules whose tensors this rank generated
    peak_unit_bytes: int  # the largest one module's whole tensors: the transient peak
    local_bytes: int  # bytes of the parameters and buffers this rank now holds


def materialize(model: nn.Module, seed: int, *, reference: nn.Module | None = None,
                device: str | torch.device = "cpu",
                weights: HFCheckpoint | None = None,
                constructed: Callable[[], nn.Module] | None = None) -> InitReport:
    """Allocate ``model``'s parameters and buffers on ``device`` (local shards only) and
    initialise them as the unsharded model built from ``seed`` would be, in place.

    ``model`` is on meta, plain or parallelised (DTensors from tensor parallelism, fully_shard
    or expert splitting; checkpoint wrappers; a pipeline stage module). ``reference`` is the
    same model unparallelised and still on meta (``copy.deepcopy`` of the meta build taken
    before parallelising, or another meta build); it supplies each module's class and the
    init rules, which parallelism may have replaced. Without it, a model holding no
    DTensors and no fully_shard modules is its own reference. Tied parameters are
    initialised once, from their first owner. Call it before DDP and before the optimizer.

    ``weights`` (a checkpoint matched to ``reference``) supplies every tensor it holds instead:
    each rank reads only its slices; the rest (buffers such as rotary frequencies) are
    generated as above.

    ``constructed`` returns the model built whole on CPU by its source, with the run's seed
    (what its constructor wrote); it is called at most once, and only when a tensor is written
    by no ``reset_parameters`` and no init rule (a plain model's bare ``nn.Parameter``, such
    as a ViT's class token, or ``nn.MultiheadAttention``'s packed projection): such a tensor
    takes the constructor's value. Without it, such a tensor is a PlanError.
    """
    for name, t in _named_tensors(model):
        if not t.is_meta:
            raise PlanError(f"materialize expects a model built on meta, but {name} is on "
                            f"{t.device}; build with build_from_source(..., device='meta')")
    reference = _reference(model, reference)
    units, owner, alias = _index(reference)
    keys = {}
    for name, _ in _named_tensors(model):  # checked before anything is allocated
        fqn = canonical_fqn(name)
        keys[name] = owner.get(alias.get(fqn, fqn))
        if keys[name] is None:
            raise PlanError(f"{name} has no counterpart in the reference model; pass "
                            f"reference= an unparallelised meta build of the same model")
    _to_empty(model, device)
    wanted: dict[str, dict[str, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    rows: dict[int, tuple[int, torch.Tensor]] = {}  # fused projections split per part
    for name, t in _named_tensors(model):
        if id(t) not in seen:
            seen.add(id(t))
            path, attr = keys[name]
            wanted.setdefault(path, {}).setdefault(attr, []).append(t)
            owner, _, leaf = name.rpartition(".")
            order = getattr(model.get_submodule(owner), FUSED_ATTR, {}).get(leaf)
            if order is not None:
                rows[id(t)] = order
    peak = 0
    built: list[dict[str, torch.Tensor]] = []  # the constructed model's tensors, once needed
    for path, (module, chain) in units.items():
        if path not in wanted:
            continue  # nothing of it lives here (another pipeline stage)
        todo = wanted[path]
        if weights is not None:
            for attr in list(todo):
                fqn = f"{path}.{attr}" if path else attr
                if weights.covers(fqn):
                    for target in todo.pop(attr):
                        weights.fill(target, fqn, rows.get(id(target)))
            if not todo:
                continue
        full = _generate(module, chain, path, seed)
        peak = max(peak, sum(t.numel() * t.element_size() for t in full.values()))
        with torch.no_grad():
            for attr, targets in todo.items():
                fqn = f"{path}.{attr}" if path else attr
                value = full[attr]
                if constructed is not None and _unwritten(value):
                    if not built:
                        built.append(dict(_named_tensors(constructed())))
                    value = built[0].get(fqn, value).detach()  # an adapter's: not built
                _check_written(value, fqn, module)
                for target in targets:
                    whole = value
                    if id(target) in rows:  # the order the fused split expects
                        whole = whole.index_select(*rows[id(target)])
                    _fill(target, whole)
        del full
    local = sum(_local(t).numel() * t.element_size() for t in _unique_tensors(model))
    return InitReport(units=len(wanted), peak_unit_bytes=peak, local_bytes=local)


def _reference(model: nn.Module, reference: nn.Module | None) -> nn.Module:
    if reference is None:
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(t, DTensor) for _, t in _named_tensors(model)) or \
                any(isinstance(m, FSDPModule) for m in model.modules()):
            raise PlanError("materialize needs reference= an unparallelised meta build of the "
                            "model when the model is already parallelised; deepcopy the meta "
                            "model before parallelising it")
        # a meta deepcopy costs no memory; generating from it leaves the model's own
        # materialised siblings untouched when an ancestor's rule runs
        reference = copy.deepcopy(model)
    for name, t in _named_tensors(reference):
        if not t.is_meta or isinstance(t, DTensor):
            raise PlanError(f"the reference model must be unparallelised and on meta, but "
                            f"{name} is a {type(t).__name__} on {t.device}; pass a fresh meta "
                            f"build")
    return reference


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _unique_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for _, t in _named_tensors(model)}.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


Chain = list[tuple[nn.Module, str]]  # (ancestor, attribute of the next module), root first


def _index(reference: nn.Module) -> tuple[dict[str, tuple[nn.Module, Chain]],
                                           dict[str, tuple[str, str]], dict[str, str]]:
    """(units: canonical path -> (module, its ancestors), owner: tensor FQN -> (unit path,
    attribute), alias: tied tensor FQN -> its first owner's FQN)."""
    units: dict[str, tuple[nn.Module, Chain]] = {}
    owner: dict[str, tuple[str, str]] = {}
    alias: dict[str, str] = {}
    first: dict[int, str] = {}
    for path, module, chain in _walk(reference):
        own = {**module._parameters, **module._buffers}
        own = {n: t for n, t in own.items() if t is not None}
        if not own:
            continue
        units.setdefault(path, (module, chain))
        for attr, t in own.items():
            fqn = f"{path}.{attr}" if path else attr
            if id(t) in first:
                alias[fqn] = first[id(t)]
            else:
                first[id(t)] = fqn
                owner[fqn] = (path, attr)
    return units, owner, alias


def _walk(root: nn.Module) -> Iterator[tuple[str, nn.Module, Chain]]:
    """(canonical path, module, ancestors) for every module, each once (first path wins)."""
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module, Chain]] = [("", root, [])]
    while stack:
        path, module, chain = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        yield canonical_fqn(path), module, chain
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        for name, child in reversed(children):
            stack.append((f"{path}.{name}" if path else name, child, [*chain, (module, name)]))


def _rule(module: nn.Module) -> Callable[[nn.Module], None] | None:
    """A model's per-module init rule: autopar's ``init_module``, or the ``_init_weights`` of
    a transformers PreTrainedModel (which alone has ``_initialize_weights``)."""
    fn = getattr(module, "init_module", None)
    if callable(fn):
        return fn
    if callable(getattr(module, "_initialize_weights", None)):
        return module._init_weights
    return None


def _twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are whole, on CPU, and poisoned (NaN,
    or the lowest integer) so that a tensor no rule writes is caught."""
    twin = copy.copy(module)
    twin._parameters = {n: None if p is None else
                        nn.Parameter(_poisoned(p), requires_grad=p.requires_grad)
                        for n, p in module._parameters.items()}
    twin._buffers = {n: None if b is None else _poisoned(b) for n, b in module._buffers.items()}
    twin._modules = dict(module._modules)
    return twin


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(torch.iinfo(out.dtype).min)
    return out


def _generate(module: nn.Module, chain: Chain, path: str, seed: int) -> dict[str, torch.Tensor]:
    """The unit's own tensors, whole, as the model's init scheme makes them: constructors
    first (each level's ``reset_parameters``), then the model's rules, children before
    parents."""
    twin = _twin(module)
    # parents share the reference's meta tensors, so what they do lands for real only in the
    # twin (meta ops draw no random numbers either)
    levels = [twin]
    owners = [module]
    for ancestor, attr in reversed(chain):
        parent = copy.copy(ancestor)
        parent._modules = {**ancestor._modules, attr: levels[-1]}
        levels.append(parent)
        owners.append(ancestor)
    # transformers' init helpers skip tensors flagged _is_hf_initialized (loaded weights); the
    # twins' fresh tensors carry no flag, so its rule writes them all
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(unit_seed(seed, path))
        for level in levels:
            reset = getattr(level, "reset_parameters", None)
            if callable(reset):
                reset()
        for i, level in enumerate(levels):
            rule = next((r for m in owners[i:] if (r := _rule(m)) is not None), None)
            if rule is not None:
                rule(level)
    return {n: t.detach() for n, t in {**twin._parameters, **twin._buffers}.items()
            if t is not None}


def _unwritten(t: torch.Tensor) -> bool:
    """Whether ``t`` (from :func:`_generate`) still holds some of its poison."""
    if t.dtype == torch.bool:
        return False
    bad = t.isnan().any() if (t.is_floating_point() or t.is_complex()) else \
        (t == torch.iinfo(t.dtype).min).any()
    return bool(bad)


def _check_written(t: torch.Tensor, fqn: str, module: nn.Module) -> None:
    if _unwritten(t):
        raise PlanError(f"cannot initialise {fqn} from meta: neither "
                        f"{type(module).__name__}.reset_parameters nor the model's init rule "
                        f"(init_module, or transformers' _init_weights) writes it; give the "
                        f"model an init_module(module) method that does")


def _fill(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into ``target`` (a local shard or a plain tensor)."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank holds ``full`` already, so slice it without a scatter
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(shard)
    else:
        target.copy_(full)


def _to_empty(model: nn.Module, device: str | torch.device) -> None:
    """``model.to_empty`` keeping tied parameters tied: a plain meta parameter comes back as a
    new Parameter per owning module. (Swapping tensors would keep the object, but a traced
    pipeline stage holds weak references to its parameters, which forbid the swap.)
    fully_shard re-pads its shards in its own ``_apply``."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, attr))
    model.to_empty(device=device)
    for (module, attr), *rest in (s for s in slots.values() if len(s) > 1):
        first = module._parameters[attr]
        for other, name in rest:
            other._parameters[name] = first
