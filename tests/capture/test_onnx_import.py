"""The ONNX front door: an exported model captures like the nn.Module it came from."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import autopar
from autopar.errors import CaptureError
from autopar.ir import OpKind
from autopar.ir.graph import Graph
from autopar.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Graph, Graph]:
    """(torch capture, ONNX capture) of one tiny GPT with a tied embedding and head."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=32, d_model=128, n_layers=2, n_heads=4)).eval()
    # weights as after training: the exporter folds equal-valued constants (freshly initialised
    # zero biases, unit norm scales) into one initializer, which a trained model never has
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    ids = torch.randint(0, 256, (2, 32))
    path = tmp_path_factory.mktemp("onnx") / "gpt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), path, dynamo=True, verbose=False)
    return autopar.capture(model, (ids,)), autopar.capture(str(path))


def test_params_and_flops_match_torch_capture(both: tuple[Graph, Graph]) -> None:
    torch_graph, onnx_graph = both
    assert onnx_graph.source == "onnx"
    # The export stores the tied weight once, merges the equal-valued LayerNorm weights and
    # bakes the causal mask in; the importer undoes all three, so the counts agree exactly.
    assert onnx_graph.num_params == torch_graph.num_params
    # Decomposed SDPA adds the scale, mask add and softmax (~0.2%) that fused SDPA does not count.
    assert onnx_graph.flops == pytest.approx(torch_graph.flops, rel=0.01)
    assert onnx_graph.tokens == torch_graph.tokens == 64


def test_parameters_keep_their_torch_names(both: tuple[Graph, Graph]) -> None:
    _, graph = both
    # val_N transposed copies and merged LayerNorm weights get the FQNs torch gave them.
    for fqn in ("layers.0.attn.qkv.weight", "layers.1.ln2.weight", "ln_f.bias", "head.weight"):
        assert fqn in graph.params
    assert not graph.buffers


def test_layers_become_blocks_of_one_type(both: tuple[Graph, Graph]) -> None:
    torch_graph, graph = both
    assert [b.role for b in graph.blocks] == ["head", "layer", "layer", "tail"]
    assert len({b.type_id for b in graph.layer_blocks}) == 1
    assert [b.name for b in graph.layer_blocks] == [b.name for b in torch_graph.layer_blocks]
    assert graph.blocks[0].kind == "embedding" and graph.layer_blocks[0].kind == "transformer"
    assert sorted(n for b in graph.blocks for n in b.nodes) == sorted(op.name for op in graph.ops)


def test_linear_ops_read_parameters(both: tuple[Graph, Graph]) -> None:
    torch_graph, graph = both
    linears = graph.ops_of_kind(OpKind.LINEAR)
    assert len(linears) == len(torch_graph.ops_of_kind(OpKind.LINEAR)) == 9
    assert all(op.params and op.module_path for op in linears)
    assert "layers.0.attn.qkv" in {op.module_path for op in linears}
    # The tied head reads the embedding table through a Transpose.
    assert graph.ops_of_kind(OpKind.EMBEDDING)[0].params == linears[-1].params == ["head.weight"]
    assert graph.ops_of_kind(OpKind.ATTENTION)  # the two SDPA matmuls in an attention scope


def test_gemm_counts_bias_and_transposed_weight(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])
    w = helper.make_tensor("fc.weight", TensorProto.FLOAT, [16, 8], [0.1] * 128)
    b = helper.make_tensor("fc.bias", TensorProto.FLOAT, [16], [0.0] * 16)
    gemm = helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1)
    model = helper.make_model(helper.make_graph([gemm], "g", [x], [y], [w, b]))
    path = tmp_path / "gemm.onnx"
    onnx.save(model, path)
    graph = autopar.capture(str(path))
    (op,) = graph.ops
    assert op.kind is OpKind.LINEAR and op.params == ["fc.weight", "fc.bias"]
    assert op.flops == 2 * 4 * 16 * 8 + 4 * 16
    assert op.module_path == "fc"  # from the parameter names: no exporter metadata here
    assert graph.num_params == 16 * 8 + 16


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.onnx"
    with pytest.raises(CaptureError, match="nowhere.onnx: no such file"):
        autopar.capture(str(path))


def test_corrupt_bytes(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CaptureError, match="corrupt.onnx: not an ONNX"):
        autopar.capture(str(path))


def test_text_file_renamed(tmp_path: Path) -> None:
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a model\n")
    with pytest.raises(CaptureError, match="notes.onnx: not an ONNX") as info:
        autopar.capture(str(path))
    assert "\n" not in str(info.value)


def test_dynamic_dimension_asks_for_static_shapes(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                                [x], [y]))
    path = tmp_path / "dynamic.onnx"
    onnx.save(model, path)
    with pytest.raises(CaptureError, match="dynamic.onnx: input 'x' has the dynamic dimension"):
        autopar.capture(str(path))
