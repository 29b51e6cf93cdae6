"""``Plan.model``: the facts a plan records about its model, as a typed record.

The plan file holds them as a mapping (``model:`` in plan.yaml: source, parameter count, the
captured inputs and outputs, the blocks, the model's shape); :class:`ModelFacts` is that
mapping read once, so that readers ask it (``plan.model.layers``, ``plan.model.seq``) rather
than each re-deriving the same facts from nested dicts. Fields a plan file may lack (older
plans, a hand-written one) are None and are left out when written back, so that a file loads
and saves byte-identically.

The records also answer ``facts["inputs"]`` and ``facts.get("shape")`` as the mapping did:
plans, notebooks and tests written against the mapping keep working.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir.blocks import LAYERLESS_BLOCKS


class _ReadsAsMapping:
    """``record["field"]``, ``record.get("field", default)`` and ``dict(record)`` read the plan
    file's form (:meth:`to_dict`): absent optional fields are missing keys, blocks are
    mappings. Attribute access is the typed record."""

    def to_dict(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key: str) -> object:
        return self.to_dict()[key]

    def get(self, key: str, default: object = None) -> object:
        return self.to_dict().get(key, default)

    def keys(self):  # noqa: ANN201 - dict's keys view
        return self.to_dict().keys()

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()


@dataclass(frozen=True)
class BlockFacts(_ReadsAsMapping):
    """One block of the captured model: a repeated layer (its module path, ``model.layers.3``)
    or one of the parts around them (``head``, ``tail``, ``root``)."""

    name: str
    type: int  # the structural type: blocks of one type share a tensor-parallel solution
    kind: str | None = None  # transformer, moe, embedding, output, other

    @property
    def is_layer(self) -> bool:
        """Whether this block is one of the model's repeated layers (it has a module of its
        own), not the ops before, after or outside them."""
        return self.name not in LAYERLESS_BLOCKS

    def to_dict(self) -> dict:
        """The plan file's form: ``{name, type, kind}``, ``kind`` only when known."""
        out: dict = {"name": self.name, "type": self.type}
        if self.kind is not None:
            out["kind"] = self.kind
        return out


@dataclass(frozen=True)
class ModelFacts(_ReadsAsMapping):
    """What the plan knows about its model, in the plan file's field order."""

    inputs: dict[str, list[int]]  # input name -> captured shape (batch first)
    blocks: tuple[BlockFacts, ...]
    source: str | None = None  # how it was captured: torch.export, onnx, ...
    params: int | None = None
    input_dtypes: dict[str, str] | None = None  # the runtime reads the training task from these
    outputs: dict[str, list[int]] | None = None  # the runtime sizes its loss from these
    model_type: str | None = None
    shape: dict | None = None  # hidden size, layers, heads, ...: what other engines' files state
    vocab_parallel: bool | None = None
    # facts this autopar does not know (a newer or hand-edited file): kept, written back after
    # the known ones, so that loading and saving loses nothing
    extra: dict = field(default_factory=dict)

    # the plan file's order (older files wrote it so; the order keeps saves byte-identical)
    _FILE_ORDER = ("source", "params", "inputs", "input_dtypes", "outputs", "blocks",
                   "model_type", "shape", "vocab_parallel")

    @classmethod
    def from_dict(cls, data: dict) -> ModelFacts:
        """The record of a plan file's ``model`` mapping (already checked by the schema)."""
        given = {k: v for k, v in data.items() if k in cls._FILE_ORDER}
        extra = {k: v for k, v in data.items() if k not in cls._FILE_ORDER}
        blocks = tuple(BlockFacts(str(b["name"]), int(b["type"]), b.get("kind"))
                       for b in data.get("blocks", ()))
        return cls(**{**given, "blocks": blocks, "inputs": dict(data.get("inputs") or {}),
                      "extra": extra})

    def to_dict(self) -> dict:
        """The plan file's ``model`` mapping: the fields it has, in the file's order."""
        out: dict = {}
        for name in self._FILE_ORDER:
            value = getattr(self, name)
            if name == "blocks":
                out[name] = [b.to_dict() for b in value]
            elif value is not None:
                out[name] = value
        return {**out, **self.extra}

    # -- what readers derive ---------------------------------------------------------------
    @property
    def block_names(self) -> list[str]:
        """Every block's name, in model order (layers and the parts around them)."""
        return [b.name for b in self.blocks]

    @property
    def layers(self) -> list[str]:
        """Module paths of the repeated layers, in model order."""
        return [b.name for b in self.blocks if b.is_layer]

    @property
    def seq(self) -> int:
        """Tokens per sequence: the last dimension of the first captured input."""
        return next(iter(self.inputs.values()))[-1]
