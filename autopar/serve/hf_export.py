"""``autopar export DIR --to hf OUT``: a Hugging Face folder from a run's latest checkpoint.

The distributed checkpoint (:mod:`autopar.train.checkpoint`) stores every plan's weights
under the model's own names and layout, so the export needs no process group and no plan:
it reads a few tensors at a time with ``torch.distributed.checkpoint`` (no_dist), writes
them under the names ``save_pretrained`` uses (:func:`autopar.weights.hf_layout.save_pieces`:
per-expert tensors, original names), in safetensors shards of at most ``max_shard_bytes``
with their index, plus ``config.json``. The folder appears whole or not at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autopar.artifact import load_artifact
from autopar.errors import PlanError
from autopar.files import fsync_dir, fsync_file
from autopar.models.hf import is_conv1d
from autopar.models.source import build_from_source
from autopar.peft import apply_peft, parse_peft
from autopar.peft.lora import merged
from autopar.peft.saved import adapter_files, save_adapter
from autopar.train.checkpoint import artifact_checkpoint, read_tensors
from autopar.weights.base_files import copy_tokenizer_files, recorded_init_from
from autopar.weights.hf_layout import Piece, model_tensors, save_pieces
from autopar.weights.hf_weights import INDEX_FILE, SINGLE_FILE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ExportReport:
    """What :func:`export_hf` wrote."""

    path: Path
    step: int  # the training step of the checkpoint exported
    tensors: int  # checkpoint tensors written
    files: int  # safetensors shards
    bytes: int  # tensor bytes written
    base: str | None = None  # the run's --init-from folder, as recorded in its checkpoint
    tokenizer_files: list[str] = field(default_factory=list)  # copied from ``base``


def export_hf(directory: str | Path, out: str | Path, *, dtype: str = "fp32",
              max_shard_bytes: int = 5 * 2**30, merge: bool = False) -> ExportReport:
    """Write the latest checkpoint of the artifact ``directory`` as a Hugging Face folder
    ``out`` that ``AutoModelForCausalLM.from_pretrained(out)`` loads, in ``dtype``.

    A fine-tuning run is written as an adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``, only the trained weights; peft's layout for LoRA and
    Prefix Tuning, see :mod:`autopar.peft.saved`); a LoRA run with ``merge`` as the base
    model with ``W + scaling * B @ A`` folded in; an R-Drop run (every weight trained) as
    the whole model. The folder the run's weights started from (``--init-from``, recorded
    in the checkpoint) is the adapter's ``base_model_name_or_path``, and its tokenizer files
    are copied into ``out`` (:mod:`autopar.weights.base_files`)."""
    import torch.distributed.checkpoint as dcp

    if dtype not in DTYPES:
        raise PlanError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PlanError(f"{out} already exists; pass a new folder (nothing is overwritten)")
    manifest, plan = load_artifact(directory)
    source = manifest["model"]
    if source.get("kind") != "hf_config":
        raise PlanError(f"{directory} trains a {source.get('kind')} model, not a Hugging Face "
                        f"one; only models built from a transformers config export to --to hf")
    ckpt = artifact_checkpoint(directory)
    model = build_from_source(source, 0, "meta")  # the base model: what is written
    peft = None
    if plan.peft:
        peft = parse_peft(plan.peft)
        if merge and peft.method != "lora":
            raise PlanError(f"--merge folds LoRA into the base weights; a {peft.method} run "
                            f"has no LoRA to fold; drop --merge to write its adapter folder")
        adapted = build_from_source(source, 0, "meta")
        apply_peft(adapted, peft)
        if peft.method == "rdrop":  # every weight trained: the whole model is the export
            peft = None
    if merge and not peft:
        raise PlanError(f"--merge folds LoRA adapters into the base weights, but {directory} "
                        f"trains no adapters; drop --merge")
    shapes, _, _ = model_tensors(adapted if plan.peft else model)
    stored = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    for name, shape in shapes.items():
        meta = stored.get(f"model.{name}")
        if meta is None or tuple(getattr(meta, "size", ())) != shape:
            raise PlanError(f"checkpoint {ckpt} is not of this artifact's model ({name} is "
                            f"{'missing' if meta is None else list(meta.size)}); export the "
                            f"directory it was trained in")
    base = recorded_init_from(ckpt)
    if peft and not merge:
        return _export_adapter(adapted, peft, ckpt, stored, out, dtype, base)
    lora = {n: m for n, m in adapted.named_modules() if hasattr(m, "lora_A")} if peft else {}
    shapes, _, _ = model_tensors(model)
    pieces = save_pieces(model)
    target = DTYPES[dtype]
    shards = _shards(shapes, target.itemsize, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))] \
        if len(shards) > 1 else [SINGLE_FILE]
    with _atomic_folder(out) as partial:
        weight_map, written, total = {}, 0, 0
        for group, file in zip(shards, names, strict=True):
            wanted = list(group)
            for n in group:  # --merge: each adapted weight with its two factors
                module = n.rpartition(".")[0]
                if n.endswith(".weight") and module in lora:
                    wanted += [f"{module}.lora_A", f"{module}.lora_B"]
            state = read_tensors(ckpt, stored, wanted)
            tensors = {}
            for n in group:
                whole = state.pop(f"model.{n}")
                module = n.rpartition(".")[0]
                if n.endswith(".weight") and module in lora:
                    whole = merged(whole, state.pop(f"model.{module}.lora_A"),
                                   state.pop(f"model.{module}.lora_B"), lora[module].scaling,
                                   is_conv1d(lora[module]))
                whole = whole.to(target)
                for piece in pieces[n]:
                    tensors[piece.key] = _box(whole, piece)
            _save(tensors, partial / file)
            weight_map.update(dict.fromkeys(tensors, file))
            written += len(tensors)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if len(names) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(
                weight_map.items()))}
            (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _config(model, source["config"], dtype).save_pretrained(str(partial))
        tokenizer = copy_tokenizer_files(base, partial)
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    return ExportReport(out, step, written, len(names), total, base, tokenizer)


@contextlib.contextmanager
def _atomic_folder(out: Path) -> Iterator[Path]:
    """A folder to fill that becomes ``out`` only when the block finishes (an empty ``out``
    the user made is replaced); on any error nothing is left."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        for path in partial.iterdir():  # on disk before the name says it is whole
            fsync_file(path)
        fsync_dir(partial)
        if out.exists():
            out.rmdir()
        os.replace(partial, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _export_adapter(adapted, peft, ckpt: Path, stored: dict, out: Path, dtype: str,
                    base: str | None) -> ExportReport:
    """The run's adapter folder (:mod:`autopar.peft.saved`): only the trained weights, its
    config naming ``base`` (the --init-from folder) as the model it adapts."""
    names = [n for n, p in adapted.named_parameters() if p.requires_grad]
    state = read_tensors(ckpt, stored, names)
    trained = {n: state[f"model.{n}"].to(DTYPES[dtype]) for n in names}
    tensors, config = adapter_files(adapted, peft, trained)
    if base is not None:  # else what the model's config knows (nothing, for a config build)
        config["base_model_name_or_path"] = base
    with _atomic_folder(out) as partial:
        save_adapter(partial, tensors, config)
        tokenizer = copy_tokenizer_files(base, partial)
    step = json.loads((ckpt / "meta.json").read_text())["step"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportReport(out, step, len(tensors), 1, nbytes, base, tokenizer)


def _shards(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int) -> list[list[str]]:
    """Model tensors grouped, in state_dict order, into files of at most ``limit`` bytes (a
    bigger tensor gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _box(whole: torch.Tensor, piece: Piece) -> torch.Tensor:
    out = whole
    for d, (start, n) in enumerate(zip(piece.start, piece.shape, strict=True)):
        if start or n != whole.shape[d]:
            out = out.narrow(d, start, n)
    return (out.squeeze(0) if piece.stacked else out).contiguous()


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _config(model, recorded: dict, dtype: str):
    """The model's transformers config as config.json should hold it: the recorded config,
    the architecture class and the dtype of the written weights."""
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = str(DTYPES[dtype]).removeprefix("torch.")
    config.use_cache = recorded.get("use_cache", True)
    return config
