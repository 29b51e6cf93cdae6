"""Context-parallel attention for plain models that call ``F.scaled_dot_product_attention``
(autopar's own GPT, nanoGPT-style layers): while a tagged attention module runs its forward,
its causal SDPA call runs the cp attention instead. Every other SDPA call in the process is
untouched (the wrapper passes it straight through)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch.nn.functional as F
from torch import nn

from autopar.errors import PlanError

# the ContextParallel of the attention module whose forward is running, if any
_ACTIVE: ContextVar = ContextVar("autopar_cp_sdpa", default=None)
_ORIGINAL = F.scaled_dot_product_attention


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """``F.scaled_dot_product_attention``, or the cp attention inside a tagged module."""
    cp = _ACTIVE.get()
    if cp is None:
        return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None or not is_causal:
        raise PlanError("context parallelism runs causal attention over whole sequences; this "
                        "model's SDPA call passes a mask or is not causal: re-plan with "
                        "constraints cp=1")
    if dropout_p:
        raise PlanError(f"context parallelism does not run attention dropout ({dropout_p}); "
                        f"set the model's dropout to 0")
    with outside_context_parallel():
        return cp.attend(query, key, value, scale=scale, causal=True)


def active_context_parallel():
    """The ContextParallel of the tagged module whose forward is running, or None."""
    return _ACTIVE.get()


@contextmanager
def outside_context_parallel() -> Iterator[None]:
    """No module is tagged inside: the cp attention's own SDPA calls (all-to-all's) are plain
    ones."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def hook_sdpa(module: nn.Module, cp) -> None:
    """Run ``module``'s causal SDPA calls as ``cp``'s attention (``cp``: a ContextParallel)."""
    F.scaled_dot_product_attention = _sdpa  # the wrapper; a no-op outside tagged modules
    hook_module(module, cp)


def hook_module(module: nn.Module, cp) -> None:
    """Tag ``module`` with ``cp`` while its forward runs (:func:`active_context_parallel`)."""
    tokens: list = []

    def enter(*_) -> None:
        tokens.append(_ACTIVE.set(cp))

    def leave(*_) -> None:
        if tokens:
            _ACTIVE.reset(tokens.pop())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
