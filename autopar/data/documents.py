"""Documents packed into one row: where each starts, for a model that keeps them apart.

Text is packed into rows across document boundaries, each document ending with the
end-of-document token. A row's positions restart at 0 after each such token (Megatron-LM's
``reset_position_ids``); a Hugging Face model handed these ``position_ids`` (and no attention
mask) builds a block-diagonal causal mask from them (transformers' ``masking_utils``
``find_packed_sequence_indices``), so no token attends across a document boundary and each
document's rotary positions start at 0, as if it were alone in the row.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# the files a token dataset's metadata sits in: PREFIX.meta.json
META_SUFFIX = ".meta.json"


def document_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """``[rows, seq]`` positions of ``ids`` (``[rows, seq]``): counting from 0 at the row's
    start and again after every ``eos`` token (which ends the document it is in)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eos
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    # each position minus the index where its document began
    began = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - began


def write_meta(prefix: str | Path, meta: dict) -> None:
    """PREFIX.meta.json: what a token dataset's documents are (their end token, packing),
    written under a temporary name and renamed into place."""
    path = Path(f"{prefix}{META_SUFFIX}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta) + "\n")
    tmp.replace(path)
