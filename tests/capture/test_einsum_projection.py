"""Einsum projections (``torch.einsum("bsh,oh->bso", x, w)``) are linear ops for FLOPs and the
solver, and the plan says which dim of the weight is split; einsums the graph pass cannot
follow stay whole, and a hand-edited split of one is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture.einsum_projection import Projection, einsum_flops, projection
from autopar.capture.layer_graph import check_layer_split
from autopar.cost import load_cluster
from autopar.ir import OpKind
from autopar.plan import Plan
from autopar.search.sharding import node_options
from autopar.train.parallelize import check_tp_entries
from tests.fixtures.plain_models import (
    EinsumMlp,
    FusedEinsumAttention,
    make_einsum_gpt,
    make_fused_einsum_gpt,
)


@pytest.mark.parametrize("equation,expected", [
    ("bsh,oh->bso", Projection(out_dim=0, contracted_dim=1)),  # nn.Linear's (out, in)
    ("bso,ho->bsh", Projection(out_dim=0, contracted_dim=1)),
    ("bso,oh->bsh", Projection(out_dim=1, contracted_dim=0)),  # stored (in, out)
    ("...h,oh->...o", Projection(out_dim=0, contracted_dim=1)),
    (" bsh , oh -> bso ", Projection(out_dim=0, contracted_dim=1)),
    ("abc,dc", Projection(out_dim=0, contracted_dim=1)),  # implicit output: "abd"
])
def test_projections_are_recognised_with_their_weight_orientation(equation, expected) -> None:
    assert projection(equation) == expected


@pytest.mark.parametrize("equation,weight_ndim", [
    ("bsh,eho->bso", 3),  # a batched weight
    ("bsh,hk,ko->bso", 2),  # three operands
    ("oh,bsh->bso", 2),  # the weight first
    ("bsh,oh->bos", 2),  # the output reordered
    ("bsh,oh->bo", 2),  # a batch dimension summed away
    ("bsh,hh->bsh", 2),  # one index twice in the weight
    ("bsh,sh->bs", 2),  # the weight's other index is the input's
    ("bsh,oh", 2),  # implicit output, alphabetical: "bos"
])
def test_other_einsums_are_not_projections(equation, weight_ndim) -> None:
    assert projection(equation, weight_ndim) is None


def test_einsum_flops_count_every_index_once() -> None:
    assert einsum_flops("bsh,oh->bso", [(2, 8, 16), (32, 16)]) == 2 * 2 * 8 * 16 * 32
    assert einsum_flops("bhqd,bhkd->bhqk", [(2, 4, 8, 16), (2, 4, 8, 16)]) == \
        2 * 2 * 4 * 8 * 8 * 16


def test_einsum_projections_are_captured_as_linears_priced_exactly() -> None:
    model, example = make_einsum_gpt()
    graph = autopar.capture(model, example)
    einsums = [op for op in graph.ops if "einsum" in op.target and op.block >= 0
               and op.module_path.startswith("h.0.")]
    assert [op.params for op in einsums] == [
        ["h.0.attn.w_q"], ["h.0.attn.w_k"], ["h.0.attn.w_v"], ["h.0.attn.w_o"],
        ["h.0.mlp.w_up"], ["h.0.mlp.w_down"]]
    assert all(op.kind is OpKind.LINEAR for op in einsums)
    assert [op.weight_out_dim for op in einsums] == [0, 0, 0, 0, 0, 1]
    tokens = example[0].numel()
    for op in einsums:  # 2 x tokens x in x out, as nn.Linear without bias
        assert op.flops == 2 * tokens * op.input_meta[0].shape[-1] * op.output_meta[0].shape[-1]


class _OddEinsums(nn.Module):
    """Einsums with parameters that are not projections the graph pass follows."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w_batched = nn.Parameter(torch.randn(2, d, d))
        self.w_a, self.w_b = nn.Parameter(torch.randn(d, d)), nn.Parameter(torch.randn(d, d))
        self.w_shared = nn.Parameter(torch.randn(4 * d, d))
        self.w_first = nn.Parameter(torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.einsum("bsh,eho->bso", x, self.w_batched)
        x = torch.einsum("bsh,hk,ko->bso", x, self.w_a, self.w_b)
        h = torch.relu(torch.einsum("bsh,oh->bso", x, self.w_shared))  # the weight read twice
        x = torch.einsum("bso,oh->bsh", h, self.w_shared)
        return torch.einsum("oh,bsh->bso", self.w_first, x)


def test_einsums_the_pass_cannot_follow_are_never_split() -> None:
    model, example = _OddEinsums(), (torch.randn(2, 8, 16),)
    graph = autopar.capture(model, example)
    einsums = [op for op in graph.ops if "einsum" in op.target]
    assert len(einsums) == 5
    assert all(op.kind is not OpKind.LINEAR and op.weight_out_dim is None for op in einsums)
    cluster = load_cluster("cpu")
    options = {}
    for block in graph.blocks:  # the solver's only option for each: replicated
        options.update(node_options(graph, block, 2, cluster))
    assert {op.name: set(options[op.name]) for op in einsums} == \
        {op.name: {"replicate"} for op in einsums}

def test_a_hand_edited_split_of_an_einsum_weight_along_the_wrong_dim_is_refused() -> None:
    """The up projection's weight (out, in) split along its contracted dim, with no split input
    to meet it: the pass refuses in one line."""
    layer, x = EinsumMlp(16), torch.randn(2, 8, 16)
    check_layer_split(layer, {"w_up": 0, "w_down": 0}, {}, 2, (x,), {})  # as the plan splits
    with pytest.raises(autopar.PlanError) as err:
        check_layer_split(layer, {"w_up": 1}, {}, 2, (x,), {})
    assert "\n" not in str(err.value) and "tp=1" in str(err.value)


def test_a_fused_einsum_weight_is_recorded_and_checked_under_its_own_name() -> None:
    """w_qkv shares its module with w_o: its parts are keyed by the parameter itself, checked
    at load (parts tp splits whole) and against the model (parts add up to one of its dims)."""
    model, example = make_fused_einsum_gpt()
    plan = autopar.plan(model, example, devices=2, global_batch=4,
                        constraints=dict(tp=2, precision="fp32"))
    assert plan.placements["fused"]["h.0.attn.w_qkv"] == [64, 64, 64]
    check_tp_entries(model, plan)  # as planned: accepted
    edited = plan.to_dict()
    edited["placements"]["fused"]["h.0.attn.w_qkv"] = [63, 64, 65]
    with pytest.raises(autopar.PlanError, match="63 that tp=2 does not split whole"):
        Plan.from_dict(edited)
    edited["placements"]["fused"]["h.0.attn.w_qkv"] = [64, 64, 32]
    with pytest.raises(autopar.PlanError, match=r"w_qkv is \[64, 192\]"):
        check_tp_entries(model, Plan.from_dict(edited))


def test_fused_parts_on_a_row_split_are_refused_before_any_run() -> None:
    layer, x = FusedEinsumAttention(16, 2), torch.randn(2, 8, 16)
    check_layer_split(layer, {"w_qkv": 1, "w_o": 1}, {"w_qkv": [16, 16, 16]}, 2, (x,), {})
    with pytest.raises(autopar.PlanError, match="fused parts .* input features"):
        check_layer_split(layer, {"w_qkv": 0}, {"w_qkv": [16, 16, 16]}, 2, (x,), {})
