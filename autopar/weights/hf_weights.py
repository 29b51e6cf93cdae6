"""Load a Hugging Face safetensors checkpoint into any plan, each rank reading only its slices.

:class:`HFCheckpoint` opens a folder (one ``model.safetensors``, or shards with their
``model.safetensors.index.json``), reads only the headers, and matches them against the
unparallelised meta model (:mod:`autopar.weights.hf_layout`): a checkpoint of another model is
refused in one line before any rank allocates. :func:`autopar.parallel.init.materialize` then
asks it for each local shard: the shard's global indices per dimension (DTensor placements,
FSDP's strided shards, a fused projection's per-part row order) are intersected with the
checkpoint's boxes, and only those rows and columns are read, with safetensors slices, then
cast to the model's dtype. A file is opened for one tensor at a time, so its mapped pages
never add up to the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autopar.errors import PlanError
from autopar.weights.hf_layout import Piece, load_pieces, model_tensors

INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 32 * 2**20  # the most one read copies (and maps) at a time
SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a checkpoint folder or file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return _keys_of(p)
    if not p.is_dir():
        raise PlanError(f"no checkpoint at {path}: pass a Hugging Face folder (config.json + "
                        f"*.safetensors) or a .safetensors file")
    index = p / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"cannot read {index} ({exc}); re-save the checkpoint with "
                            f"save_pretrained") from None
        missing = sorted({f for f in weight_map.values() if not (p / f).is_file()})
        if missing:
            raise PlanError(f"{index} names {missing[0]}, which is not in {p}; copy the whole "
                            f"checkpoint folder")
        return {k: p / f for k, f in weight_map.items()}
    if (p / SINGLE_FILE).is_file():
        return _keys_of(p / SINGLE_FILE)
    shards = sorted(p.glob("*.safetensors"))
    if len(shards) == 1:
        return _keys_of(shards[0])
    if list(p.glob("*.bin")) or list(p.glob("*.pt")) or list(p.glob("*.pth")):
        raise PlanError(f"{p} holds a torch .bin checkpoint, which cannot be read by slices; "
                        f"convert it to safetensors first: AutoModelForCausalLM."
                        f"from_pretrained(P).save_pretrained(P_OUT, safe_serialization=True)")
    what = f"{len(shards)} .safetensors files but no {INDEX_FILE}" if shards else \
        "no .safetensors file"
    raise PlanError(f"{p} has {what}; pass a folder written by save_pretrained")


def _keys_of(file: Path) -> dict[str, Path]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return dict.fromkeys(f.keys(), file)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise PlanError(f"cannot read {file} as safetensors ({exc}); re-save it with "
                        f"save_pretrained") from None


def _headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype), from the files' headers only."""
    from safetensors import safe_open

    out = {}
    by_file: dict[Path, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise PlanError(f"the checkpoint index puts {key} in {file.name}, which "
                                    f"does not hold it; re-save the checkpoint")
                s = f.get_slice(key)
                out[key] = (tuple(s.get_shape()), s.get_dtype())
    return out


class HFCheckpoint:
    """A Hugging Face checkpoint matched to a model, ready for sliced reads.

    ``model`` is the unparallelised model, normally on meta. Every tensor of the model must
    come from the checkpoint, except buffers (built by the model's own rule, like rotary
    frequencies), tied copies (read from their first owner) and the ``optional`` ones (what a
    fine-tuning method added: initialised by its own rule).
    """

    def __init__(self, path: str | Path, model: nn.Module,
                 optional: set[str] | frozenset[str] = frozenset()) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(path)
        headers = _headers(self.files)
        self.dtypes = {k: d for k, (_, d) in headers.items()}
        where = f"checkpoint {self.path}"
        self.pieces: dict[str, list[Piece]] = load_pieces(
            model, {k: s for k, (s, _) in headers.items()}, where)
        shapes, _, buffers = model_tensors(model)
        missing = sorted(n for n in shapes if n not in self.pieces and n not in buffers
                         and n not in optional)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise PlanError(f"{where} does not match the model: it lacks {missing[0]}{more}; "
                            f"pass the checkpoint of this model's config")
        self.bytes_read = 0  # what this rank read from the files

    def covers(self, fqn: str) -> bool:
        """Whether the model tensor ``fqn`` (canonical, first owner) comes from the file."""
        return fqn in self.pieces

    def fill(self, target: torch.Tensor, fqn: str,
             rows: tuple[int, torch.Tensor] | None = None) -> None:
        """Copy this rank's part of the model tensor ``fqn`` into ``target`` (a DTensor or a
        plain tensor, allocated); ``rows`` = (dim, order): the target holds the model
        tensor's ``index_select(dim, order)`` (a fused projection split per part)."""
        local = target.to_local() if isinstance(target, DTensor) else target
        index = global_indices(target)
        if rows is not None:
            dim, order = rows
            index[dim] = order[index[dim]]
        with torch.no_grad():
            for piece in self.pieces[fqn]:
                self._read_piece(piece, index, local)

    def _read_piece(self, piece: Piece, index: list[torch.Tensor],
                    local: torch.Tensor) -> None:
        where, inside = [], []
        for d, idx in enumerate(index):
            hit = (idx >= piece.start[d]) & (idx < piece.start[d] + piece.shape[d])
            positions = hit.nonzero().flatten()
            if positions.numel() == 0:
                return  # nothing of this box lives in this shard
            where.append(positions)
            inside.append(idx[positions] - piece.start[d])
        # the file's first dimension is read in chunks of at most CHUNK_BYTES, each from a
        # freshly opened file: the transient copy and the mapped pages stay bounded by the
        # chunk, not by the largest tensor
        first = 1 if piece.stacked else 0
        row_bytes = local.element_size() * max(1, int(torch.Size(
            [w.numel() for w in where]).numel() // where[first].numel()))
        step = max(1, CHUNK_BYTES // row_bytes)
        for lo in range(0, where[first].numel(), step):
            part_where, part_inside = list(where), list(inside)
            part_where[first] = where[first][lo:lo + step]
            part_inside[first] = inside[first][lo:lo + step]
            self._copy_box(piece, part_where, part_inside, local)

    def _copy_box(self, piece: Piece, where: list[torch.Tensor], inside: list[torch.Tensor],
                  local: torch.Tensor) -> None:
        file_dims = inside[1:] if piece.stacked else inside
        block = self._read_box(piece.key, file_dims)
        if piece.stacked:
            block = block.unsqueeze(0)
        block = block.to(local.dtype)
        if all(int(w[-1] - w[0]) + 1 == w.numel() for w in where):
            # the usual case: one box of the shard; broadcast index tensors would cost 8
            # bytes per element
            local[tuple(slice(int(w[0]), int(w[-1]) + 1) for w in where)].copy_(block)
            return
        view = [w.view([-1 if i == d else 1 for i in range(len(where))])
                for d, w in enumerate(where)]
        local.index_put_(tuple(view), block)

    def _read_box(self, key: str, dims: list[torch.Tensor]) -> torch.Tensor:
        """The checkpoint tensor ``key`` at the given indices per dimension, read as few
        contiguous slices as the indices allow (one per run of consecutive indices)."""
        from safetensors import safe_open

        runs = [_runs(d) for d in dims]
        with safe_open(str(self.files[key]), framework="pt") as f:
            out = _gather(f.get_slice(key), runs, []) if dims else f.get_tensor(key)
        self.bytes_read += out.numel() * out.element_size()
        # the runs came in index order: reorder to the order asked for
        order = [torch.argsort(torch.argsort(d)) for d in dims]
        for d, o in enumerate(order):
            if not torch.equal(o, torch.arange(o.numel())):
                out = out.index_select(d, o)
        return out


def _runs(idx: torch.Tensor) -> list[slice]:
    """Sorted ``idx`` as slices of consecutive values."""
    values = torch.sort(idx).values.tolist()
    out, start = [], values[0]
    for prev, cur in zip(values, values[1:], strict=False):
        if cur != prev + 1:
            out.append(slice(start, prev + 1))
            start = cur
    out.append(slice(start, values[-1] + 1))
    return out


def _gather(view, runs: list[list[slice]], chosen: list[slice]) -> torch.Tensor:
    """The cartesian product of ``runs`` read from a safetensors slice view, concatenated."""
    d = len(chosen)
    if d == len(runs):
        return view[tuple(chosen)]
    return torch.cat([_gather(view, runs, [*chosen, s]) for s in runs[d]], dim=d)


def global_indices(t: torch.Tensor) -> list[torch.Tensor]:
    """For each dimension, the global indices of the elements this rank holds of ``t`` (a
    DTensor, in any placements FSDP and tensor parallelism use, or a plain tensor: all)."""
    if not isinstance(t, DTensor):
        return [torch.arange(n) for n in t.shape]
    mesh, placements = t.device_mesh, t.placements
    out = []
    for d, n in enumerate(t.shape):
        # what a dimension's sharding keeps does not depend on the others: shard a 1-D arange
        # the same way along this dimension only (no communication: every rank has it)
        along = [type(p)(0, **_extra(p)) if getattr(p, "dim", None) == d and not
                 p.is_replicate() else Replicate() for p in placements]
        arange = torch.arange(n, device=mesh.device_type)
        local = distribute_tensor(arange, mesh, along, src_data_rank=None).to_local()
        out.append(local.cpu())
    return out


def _extra(placement) -> dict:
    split = getattr(placement, "split_factor", None)
    return {"split_factor": split} if split is not None else {}
