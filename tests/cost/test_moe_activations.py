"""What a routed MoE layer keeps for its backward: the token copies that pass through the
experts, never the stacked expert weights (the grouped matmul reads them through a transpose)
nor the tokens an index op gathered (its backward needs only the indices)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autopar
from autopar.cost.activations import (
    _floating,
    block_activation_bytes,
    parameter_view,
    requires_grad,
    saved_tensors,
)
from autopar.cost.block_cost import captured_batch
from autopar.ir.graph import OpKind

CONFIGS = Path(autopar.__file__).parent / "models" / "configs"
SEQ = 64
HIDDEN, INTERMEDIATE, TOP_K = 64, 128, 2  # autopar/models/configs/tiny-mixtral.json


@pytest.fixture(scope="module")
def mixtral():
    return autopar.capture("tiny-mixtral", seq=SEQ)


def _layer(graph):
    return next(b for b in graph.blocks if b.role == "layer")


def test_experts_keep_their_token_copies_and_nothing_else(mixtral) -> None:
    block = _layer(mixtral)
    grad_ops = requires_grad(mixtral)
    kept: dict[str, int] = {}
    for name in block.nodes:
        op = mixtral.op(name)
        if op.kind is OpKind.MOE_EXPERT:
            for t in saved_tensors(mixtral, op, grad_ops):
                assert not parameter_view(mixtral, t.root), (name, t.root)
                if _floating(mixtral, t.root) and \
                        mixtral.op(t.root).kind is OpKind.MOE_EXPERT:
                    kept[t.root] = t.nbytes
    copies = SEQ * captured_batch(mixtral) * TOP_K
    # the gathered copies (first matmul's input), the gate-and-up output, the activation's
    # output, the product (second matmul's input), the second matmul's output and its
    # routing probability (their product is the combine): fp32, as captured
    per_copy = HIDDEN + 2 * INTERMEDIATE + INTERMEDIATE + INTERMEDIATE + HIDDEN + 1
    assert sum(kept.values()) == copies * per_copy * 4


def test_an_index_op_keeps_its_indices_only(mixtral) -> None:
    block = _layer(mixtral)
    grad_ops = requires_grad(mixtral)
    gathers = [n for n in block.nodes if mixtral.op(n).target.startswith("aten.index.Tensor")
               and n in grad_ops]
    assert gathers
    for name in gathers:
        for t in saved_tensors(mixtral, mixtral.op(name), grad_ops):
            assert not _floating(mixtral, t.root), (name, t.root)


def test_expert_weights_do_not_grow_the_layer_activations(mixtral, tmp_path) -> None:
    """Four times the experts at the same top-k: the weights grow 4x, the activations only by
    the router's wider scores."""
    config = json.loads((CONFIGS / "tiny-mixtral.json").read_text())
    config["num_local_experts"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    small, wide = mixtral, autopar.capture(tmp_path, seq=SEQ)
    a = block_activation_bytes(small, _layer(small)).stored_bytes
    b = block_activation_bytes(wide, _layer(wide)).stored_bytes
    router_growth = SEQ * captured_batch(small) * 12 * 4 * 3  # logits, softmax, probabilities
    assert a < b <= a + router_growth
