"""Whether a run keeps packed documents apart, and why not when it does not.

Rows of text are packed across document boundaries. When the data records the token that
ends each document (PREFIX.meta.json ``eos_id``) and the model is a Hugging Face causal LM
run without pipeline stages or context parallelism, each micro-batch is given positions
that restart after every such token (:func:`autopar.data.documents.document_positions`):
transformers then masks attention block-diagonally, so a document never attends to the one
before it. Otherwise documents in one row attend to each other, as Megatron-LM and
torchtitan pre-train by default; the run says which, and why, on its first line.
"""

from __future__ import annotations

import inspect

from torch import nn

from autopar.plan import Plan


def document_mask_choice(model: nn.Module, plan: Plan, data: object, wanted: bool = True
                         ) -> tuple[int | None, str]:
    """(the end-of-document token to restart positions after, or None; the choice in words)."""
    eos = getattr(data, "eos_id", None)
    apart = "packed documents attend to each other"
    if not wanted:
        return None, f"{apart} (document mask turned off)"
    if eos is None:
        return None, f"{apart} (the data records no end-of-document token)"
    if plan.mesh["pp"] > 1:
        return None, f"{apart} (pipeline stages are traced with the token ids alone)"
    if plan.mesh["cp"] > 1:
        return None, f"{apart} (context parallelism splits each row's sequence)"
    forward = getattr(model, "forward", None)
    takes = forward is not None and "position_ids" in inspect.signature(forward).parameters
    if getattr(model, "config", None) is None or not takes:
        return None, f"{apart} (the model takes no position_ids to mask them by)"
    return int(eos), (f"packed documents are kept apart: positions restart after token "
                      f"{eos}, attention is block-diagonal")
