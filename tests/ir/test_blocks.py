"""Block detection and structural typing."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar.ir.blocks import find_layer_container


def test_container_with_most_indices_wins() -> None:
    paths = ["model.embed", "model.layers.0.attn", "model.layers.1.attn", "model.layers.2.mlp",
             "model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1", "lm_head"]
    assert find_layer_container(paths) == "model.layers"
    assert find_layer_container(["a", "b.c"]) is None


class _Stack(nn.Module):
    """Three layers, the middle one wider: two types among the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                                                      nn.Linear(64, 32)),
                                     nn.Linear(32, 32)])
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def test_layers_differing_in_structure_get_different_types() -> None:
    graph = autopar.capture(_Stack(), (torch.zeros(4, 16),))
    layers = graph.layer_blocks
    assert [b.name for b in layers] == ["layers.0", "layers.1", "layers.2"]
    assert layers[0].type_id == layers[2].type_id != layers[1].type_id
    assert graph.blocks[0].role == "head" and graph.blocks[-1].role == "tail"
    assert layers[1].param_numel == 32 * 64 + 64 + 64 * 32 + 32


def test_sequential_without_container_groups_top_level_children() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    graph = autopar.capture(model, (torch.zeros(2, 8),))
    # Sequential children are named "0", "1", "2": an indexed container at the root
    assert [b.role for b in graph.blocks] == ["layer", "layer", "layer"]
    assert graph.blocks[0].type_id == graph.blocks[2].type_id


def test_block_outputs_are_the_activation_sent_downstream(tiny_gpt, token_ids) -> None:
    graph = autopar.capture(tiny_gpt, (token_ids,))
    b, s = token_ids.shape
    hidden_bytes = b * s * tiny_gpt.cfg.d_model * 4
    for block in graph.layer_blocks:
        assert block.output_bytes == hidden_bytes


def test_graph_is_a_dag_with_edges_from_producers(tiny_gpt, token_ids) -> None:
    import networkx as nx

    graph = autopar.capture(tiny_gpt, (token_ids,))
    assert nx.is_directed_acyclic_graph(graph.dag)
    for op in graph.ops:
        for src in op.inputs:
            assert graph.dag.has_edge(src, op.name)
