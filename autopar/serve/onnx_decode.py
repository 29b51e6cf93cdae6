"""ONNX export of cached generation: the prefill and the decode step of one process's model,
with the KV cache as explicit inputs and outputs.

Two programs, of static shapes fixed at export (gpt-fast style: batch, prompt length and cache
length ``max_len``):

- ``prefill.onnx``: ``input_ids`` [batch, prompt_len] (left-padded), ``attention_mask``
  [batch, prompt_len] and the empty cache -> ``logits`` [batch, vocab] of the last position
  and the cache with the prompt's keys and values in slots 0..prompt_len-1.
- ``decode.onnx``: ``input_ids`` [batch, 1], ``attention_mask`` [batch, max_len] (1 where a
  slot holds a real token, this step's slot included), ``position_ids`` [batch, 1] and
  ``cache_position`` [1] (the slot this step writes) and the cache -> ``logits`` and the cache.

The cache is ``past_key_values.{i}.key`` / ``.value`` in and ``present.{i}.key`` / ``.value``
out, each [batch, kv_heads, max_len, head_dim]. It is never a module buffer or hidden state:
the dynamo exporter loses buffers that a forward mutates, and a runtime can only carry state
it sees as I/O. The Hugging Face model runs unchanged over a :class:`TensorCache` whose layers
start from the input tensors and, at every ``update``, ``index_copy`` the new keys into a new
tensor, which is what the program returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from autopar.artifact import load_artifact
from autopar.errors import PlanError
from autopar.serve.generate import load_model
from autopar.serve.hf_export import _atomic_folder

MANIFEST = "generation.json"
FORMAT = "autopar-onnx-decode/1"
# one .onnx file holds at most 2 GiB; past that the weights go to a .data file beside it
_EXTERNAL_BYTES = 1_800_000_000


def cache_names(layers: int, prefix: str) -> list[str]:
    """``{prefix}.{i}.key``, ``{prefix}.{i}.value`` for every layer, in I/O order."""
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


class TensorLayer(CacheLayerMixin):
    """One layer's cache over given tensors: ``update`` writes the new keys and values at
    ``slots`` into new tensors (no in-place write, so the exporter sees them as outputs)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slots = keys, values, slots
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the tensors are the program's inputs."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = self.keys.index_copy(2, self.slots, key_states.to(self.keys.dtype))
        self.values = self.values.index_copy(2, self.slots, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # never asked: the programs pass positions and a ready 4D mask

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class TensorCache(Cache):
    """transformers' Cache over the cache tensors [k0, v0, k1, v1, ...] a program takes."""

    def __init__(self, tensors: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
        super().__init__(layers=[TensorLayer(tensors[i], tensors[i + 1], slots)
                                 for i in range(0, len(tensors), 2)])

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.keys, layer.values)]


def _step(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
          slots: torch.Tensor, key_ok: torch.Tensor, cache: Sequence[torch.Tensor]
          ) -> tuple[torch.Tensor, ...]:
    """The model over ``input_ids`` written at cache ``slots``: the last position's logits and
    the new cache. ``key_ok`` [batch, max_len] says which slots hold real tokens."""
    kv = TensorCache(cache, slots)
    slot = torch.arange(key_ok.shape[1], device=input_ids.device)
    causal = slot[None, :] <= slots[:, None]
    # a padding query sees itself only: a row with no key at all would be NaN in ONNX's
    # softmax, and the NaN would reach real rows through the pad slots' cached values
    mask = (causal[None] & key_ok[:, None, :].bool()) | (slot[None, :] == slots[:, None])[None]
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=cache[0].dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(cache[0].dtype).min)
    out = model(input_ids=input_ids, attention_mask=mask[:, None], position_ids=positions,
                cache=kv, use_cache=True)
    return (out.logits[:, -1], *kv.tensors())


class Prefill(nn.Module):
    """prefill.onnx: (input_ids, attention_mask, *cache) -> (logits, *cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, prompt = input_ids.shape
        rest = attention_mask.new_zeros(batch, cache[0].shape[2] - prompt)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # from the first real token
        slots = torch.arange(prompt, device=input_ids.device)
        return _step(self.model, input_ids, positions, slots,
                     torch.cat([attention_mask, rest], dim=1), cache)


class Decode(nn.Module):
    """decode.onnx: (input_ids, attention_mask, position_ids, cache_position, *cache) ->
    (logits, *cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, cache_position: torch.Tensor,
                *cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _step(self.model, input_ids, position_ids, cache_position, attention_mask, cache)


@dataclass
class OnnxExportReport:
    """What :func:`export_onnx` wrote."""

    path: Path
    batch: int
    prompt_len: int
    max_len: int
    layers: int
    cache_shape: tuple[int, ...]  # of each key and value tensor
    bytes: int  # of the files written
    seconds: float


def _refuse_plan(directory: Path) -> None:
    """An artifact whose ranks each hold part of every token's work has no one-rank program
    that generates alone."""
    _, plan = load_artifact(directory)
    mesh = plan.mesh
    whole = (f"export the whole model instead: autopar export {directory} --to hf HF_OUT, then "
             f"autopar export HF_OUT --to onnx OUT")
    if mesh.get("tp", 1) > 1:
        raise PlanError(f"{directory}'s plan has tp={mesh['tp']}: tensor-parallel ranks "
                        f"all-reduce inside every layer, which one rank's ONNX program cannot "
                        f"do; {whole} (or re-plan with constraints tp=1)")
    if mesh.get("ep", 1) > 1:
        raise PlanError(f"{directory}'s plan has ep={mesh['ep']}: expert-parallel ranks "
                        f"exchange tokens inside every MoE layer; {whole}")
    if mesh.get("pp", 1) > 1:
        raise PlanError(f"{directory}'s plan has pp={mesh['pp']}: a pipeline rank's stage "
                        f"takes and hands on hidden states at every token, and exporting one "
                        f"stage is not in autopar yet; {whole}")


def _probe(model: nn.Module, batch: int, max_len: int) -> list[tuple[torch.Size, torch.dtype]]:
    """Each cache tensor's shape and dtype, from one token through transformers' own static
    cache (so kv heads, head dims and layer count come from the model, whatever its config
    calls them)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device), cache=cache,
              use_cache=True)
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) and layer.max_cache_len < max_len:
            raise PlanError(f"layer {i} attends within a sliding window of "
                            f"{layer.max_cache_len} tokens, which the exported cache does not "
                            f"roll; pass --max-len {layer.max_cache_len} or less")
        if not getattr(layer, "is_initialized", False) or not hasattr(layer, "keys"):
            raise PlanError(f"layer {i} of {type(model).__name__} keeps no key/value cache "
                            f"(linear attention or cross-attention); only attention decoders "
                            f"export with their cache")
    return [(t.shape, t.dtype) for layer in cache.layers for t in (layer.keys, layer.values)]


def _need_onnx_extra(package: str) -> None:
    """A one-line PlanError naming the extra to install when ``package`` is missing (the ONNX
    pieces are optional: a plain install plans and trains without them)."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise PlanError(f"ONNX export and generation need {package}, which is not installed; "
                        f"pip install 'autopar[onnx]'")


def export_onnx(model: nn.Module | str | Path, out: str | Path, *, batch: int = 1,
                max_len: int = 128, prompt_len: int = 32, optimize: bool = True
                ) -> OnnxExportReport:
    """Write ``prefill.onnx``, ``decode.onnx`` and ``generation.json`` (shapes and I/O names)
    into the new folder ``out``, for ``model`` as :class:`autopar.Generator` takes it (a
    Hugging Face causal LM, a shipped name, a Hugging Face folder, an artifact directory).

    Shapes are fixed: ``batch`` rows, prompts left-padded to ``prompt_len`` and a cache of
    ``max_len`` positions, so a prompt generates at most ``max_len - prompt_len + 1`` tokens.
    An artifact trained under tensor, expert or pipeline parallelism is refused (its ranks
    exchange activations inside every token). ``optimize`` runs the exporter's graph
    optimizer (constant folding, fusions; seconds per program). The folder appears whole or
    not at all."""
    out = Path(out)
    if batch < 1 or prompt_len < 1 or max_len <= prompt_len:
        raise PlanError(f"need batch >= 1, prompt_len >= 1 and max_len > prompt_len (room for "
                        f"a decode step); got batch={batch}, prompt_len={prompt_len}, "
                        f"max_len={max_len}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PlanError(f"{out} already exists; pass a new folder (nothing is overwritten)")
    _need_onnx_extra("onnxscript")  # torch's ONNX exporter runs on it
    if isinstance(model, (str, Path)) and (Path(model) / "manifest.json").is_file():
        _refuse_plan(Path(model))
    start = time.perf_counter()
    # a module exports where it lives; the rest loads on the CPU, as the exporter traces it
    model = load_model(model, next(model.parameters()).device if isinstance(model, nn.Module)
                       else torch.device("cpu"))
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise PlanError(f"ONNX export of cached generation needs a Hugging Face causal LM (its "
                        f"config and cache); {type(model).__name__} is not one")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                          None)
    if isinstance(limit, int) and max_len > limit:
        raise PlanError(f"max_len {max_len} exceeds the model's {limit} positions; pass "
                        f"--max-len {limit} or less")
    model.eval()
    specs = _probe(model, batch, max_len)
    device = next(model.parameters()).device
    cache = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    layers = len(cache) // 2
    past, present = cache_names(layers, "past_key_values"), cache_names(layers, "present")
    ids = torch.zeros(batch, prompt_len, dtype=torch.long, device=device)
    programs = {
        "prefill.onnx": (Prefill(model), (ids, torch.ones_like(ids), *cache),
                         ["input_ids", "attention_mask", *past]),
        "decode.onnx": (Decode(model), (ids[:, :1], torch.ones(batch, max_len, dtype=torch.long),
                                        ids[:, :1] + prompt_len,
                                        torch.tensor([prompt_len]), *cache),
                        ["input_ids", "attention_mask", "position_ids", "cache_position",
                         *past]),
    }
    external = sum(p.numel() * p.element_size() for p in model.parameters()) > _EXTERNAL_BYTES
    with _atomic_folder(out) as partial, _quiet_exporter(), _exportable_experts(model), \
            torch.no_grad():
        for name, (program, args, inputs) in programs.items():
            torch.onnx.export(program, args, str(partial / name), dynamo=True,
                              input_names=inputs, output_names=["logits", *present],
                              external_data=external, optimize=optimize, verbose=False)
        (partial / MANIFEST).write_text(json.dumps({
            "format": FORMAT, "batch": batch, "prompt_len": prompt_len, "max_len": max_len,
            "layers": layers, "cache_shapes": [list(s) for s, _ in specs],
            "cache_dtype": str(specs[0][1]).removeprefix("torch."),
            "vocab": int(model.get_output_embeddings().weight.shape[0]),
            "prefill": {"inputs": programs["prefill.onnx"][2], "outputs": ["logits", *present]},
            "decode": {"inputs": programs["decode.onnx"][2], "outputs": ["logits", *present]},
        }, indent=2) + "\n")
        written = sum(f.stat().st_size for f in partial.iterdir())
    return OnnxExportReport(out, batch, prompt_len, max_len, layers, tuple(specs[0][0]),
                            written, time.perf_counter() - start)


@contextlib.contextmanager
def _exportable_experts(model: nn.Module) -> Iterator[None]:
    """MoE experts as transformers' batched matmuls while exporting: its default grouped_mm
    is a custom op with no ONNX translation; batched_mm gathers each token's experts with
    static shapes."""
    settable = getattr(model, "_can_set_experts_implementation", None)
    before = model.get_experts_implementation() if settable is not None and settable() \
        else None
    if before is not None:
        model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        if before is not None:
            model.set_experts_implementation(before)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter's progress lines, warnings and notices of optional ops (torchvision's)
    are not the user's business; its errors still raise."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


class OnnxGenerator:
    """Greedy generation with onnxruntime from a folder :func:`export_onnx` wrote: the
    prefill once, then the decode step, each step's cache outputs fed back as its inputs."""

    def __init__(self, folder: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",)
                 ) -> None:
        _need_onnx_extra("onnxruntime")
        import onnxruntime as ort

        folder = Path(folder)
        if not (folder / MANIFEST).is_file():
            raise PlanError(f"{folder} holds no {MANIFEST}; export one with autopar export "
                            f"MODEL --to onnx {folder}")
        self.spec = json.loads((folder / MANIFEST).read_text())
        if self.spec.get("format") != FORMAT:
            raise PlanError(f"{folder / MANIFEST} is of format {self.spec.get('format')!r}, "
                            f"this autopar reads {FORMAT}; export it again")
        self.batch, self.prompt_len = self.spec["batch"], self.spec["prompt_len"]
        self.max_len = self.spec["max_len"]
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: not its notes on what it could not fold
        self.sessions = {name: ort.InferenceSession(str(folder / f"{name}.onnx"), options,
                                                    providers=list(providers))
                         for name in ("prefill", "decode")}

    def empty_cache(self) -> list:
        """Zeros in every cache slot, as the prefill takes them."""
        import numpy as np

        dtype = np.dtype(self.spec["cache_dtype"])
        return [np.zeros(shape, dtype=dtype) for shape in self.spec["cache_shapes"]]

    def _run(self, name: str, feeds: list) -> tuple:
        inputs = self.spec[name]["inputs"]
        outputs = self.sessions[name].run(None, dict(zip(inputs, feeds, strict=True)))
        return outputs[0], outputs[1:]

    def prefill(self, input_ids, attention_mask, cache: list | None = None) -> tuple:
        """(logits [batch, vocab], cache) of left-padded prompts [batch, prompt_len]."""
        return self._run("prefill", [input_ids, attention_mask,
                                     *(cache if cache is not None else self.empty_cache())])

    def decode(self, input_ids, attention_mask, position_ids, cache_position, cache: list
               ) -> tuple:
        """(logits [batch, vocab], cache) of one token per row written at ``cache_position``."""
        return self._run("decode", [input_ids, attention_mask, position_ids, cache_position,
                                    *cache])

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None
                 ) -> torch.Tensor:
        """Greedy tokens as :meth:`autopar.Generator.generate` returns them: the prompts,
        left-padded to the longest, followed by the new tokens. At most ``batch`` prompts of
        at most ``prompt_len`` tokens; rows finished by ``eos_token_id`` continue with
        ``pad_token_id`` (default: the eos id)."""
        import numpy as np

        room = self.max_len - self.prompt_len + 1
        new = room if max_new_tokens is None else max_new_tokens
        if not 1 <= new <= room:
            raise PlanError(f"max_new_tokens must be 1..{room} (the export's max_len "
                            f"{self.max_len} minus prompt_len {self.prompt_len}, plus one); "
                            f"got {new}")
        if not 1 <= len(prompts) <= self.batch or \
                not all(1 <= len(p) <= self.prompt_len for p in prompts):
            raise PlanError(f"this export takes 1..{self.batch} prompts of 1..{self.prompt_len} "
                            f"tokens; export again with a larger --batch or --prompt-len")
        if pad_token_id is None:
            pad_token_id = eos_token_id if eos_token_id is not None else 0
        rows = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((self.batch, self.prompt_len), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        # unused rows run a one-token dummy prompt: the export's shapes are fixed
        for row, prompt in enumerate(list(prompts) + [[pad_token_id]] * (self.batch - rows)):
            ids[row, self.prompt_len - len(prompt):] = torch.as_tensor(list(prompt))
            mask[row, self.prompt_len - len(prompt):] = 1
        logits, cache = self.prefill(ids.numpy(), mask.numpy())
        keys = np.zeros((self.batch, self.max_len), dtype=np.int64)
        keys[:, :self.prompt_len] = mask.numpy()
        position = mask.sum(-1, keepdim=True).numpy() - 1
        finished = np.zeros(self.batch, dtype=bool)
        out = [ids[:rows, self.prompt_len - width:]]
        for step in range(new):
            token = logits.argmax(-1)
            if eos_token_id is not None:
                token = np.where(finished, pad_token_id, token)
                finished |= token == eos_token_id
            out.append(torch.from_numpy(token[:rows, None].astype(np.int64)))
            if step == new - 1 or bool(finished[:rows].all()):
                break
            slot = self.prompt_len + step
            keys[:, slot] = 1
            position = position + 1
            logits, cache = self.decode(token[:, None].astype(np.int64), keys, position,
                                        np.array([slot], dtype=np.int64), cache)
        return torch.cat(out, dim=1)
