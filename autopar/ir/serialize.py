"""The IR as plain JSON data: a captured graph written once and read back equal.

Only JSON types go in and come out (never pickle): a file read back is data, and a file that
is not a graph this format wrote raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from autopar.ir.graph import Block, Graph, GraphInput, OpKind, OpNode, ParamInfo, TensorMeta

FORMAT = 1


def _meta(m: TensorMeta) -> list:
    return [list(m.shape), m.dtype]


def _read_meta(data: list) -> TensorMeta:
    shape, dtype = data
    return TensorMeta(tuple(int(d) for d in shape), str(dtype))


def _param(p: ParamInfo) -> dict:
    return {"fqn": p.fqn, "shape": list(p.shape), "dtype": p.dtype, "trainable": p.trainable,
            "aliases": list(p.aliases)}


def _read_param(data: dict) -> ParamInfo:
    return ParamInfo(data["fqn"], tuple(data["shape"]), data["dtype"], bool(data["trainable"]),
                     tuple(data["aliases"]))


_OP_FIELDS = [f.name for f in fields(OpNode)]


def _op(op: OpNode) -> dict:
    out = {name: getattr(op, name) for name in _OP_FIELDS}
    out["kind"] = op.kind.value
    out["input_meta"] = [_meta(m) for m in op.input_meta]
    out["output_meta"] = [_meta(m) for m in op.output_meta]
    return out


def _read_op(data: dict) -> OpNode:
    values = {name: data[name] for name in _OP_FIELDS}
    values["kind"] = OpKind(data["kind"])
    values["input_meta"] = [_read_meta(m) for m in data["input_meta"]]
    values["output_meta"] = [_read_meta(m) for m in data["output_meta"]]
    return OpNode(**values)


def graph_to_dict(graph: Graph) -> dict:
    """``graph`` as JSON-ready data (the dag is rebuilt from the ops on reading)."""
    return {
        "format": FORMAT,
        "ops": [_op(op) for op in graph.ops],
        "inputs": [[i.name, _meta(i.meta)] for i in graph.inputs],
        "params": [_param(p) for p in graph.params.values()],
        "buffers": [_param(p) for p in graph.buffers.values()],
        "outputs": list(graph.outputs),
        "source": graph.source,
        "model_config": graph.model_config,
        "peft": graph.peft,
        "context_parallel_refusal": graph.context_parallel_refusal,
        "blocks": [asdict(b) for b in graph.blocks],
    }


def graph_from_dict(data: dict) -> Graph:
    """The graph :func:`graph_to_dict` wrote."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not an autopar graph of format {FORMAT}")
    graph = Graph(
        ops=[_read_op(op) for op in data["ops"]],
        inputs=[GraphInput(name, _read_meta(meta)) for name, meta in data["inputs"]],
        params={p["fqn"]: _read_param(p) for p in data["params"]},
        buffers={p["fqn"]: _read_param(p) for p in data["buffers"]},
        outputs=list(data["outputs"]),
        source=data["source"],
        model_config=data["model_config"],
    )
    graph.peft = data["peft"]
    graph.context_parallel_refusal = data["context_parallel_refusal"]
    graph.blocks = [Block(**b) for b in data["blocks"]]
    return graph


def same_graph(a: Graph, b: Graph) -> bool:
    """Whether two graphs hold the same ops, tensors, parameters, blocks and facts."""
    return (a.ops == b.ops and a.inputs == b.inputs and a.params == b.params
            and a.buffers == b.buffers and a.outputs == b.outputs and a.source == b.source
            and a.model_config == b.model_config and a.peft == b.peft
            and a.context_parallel_refusal == b.context_parallel_refusal
            and a.blocks == b.blocks and set(vars(a)) - {"_by_name"} ==
            set(vars(b)) - {"_by_name"})
