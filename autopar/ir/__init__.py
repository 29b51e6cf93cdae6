"""autopar's IR: a networkx DAG of ops grouped into blocks."""

from autopar.ir.blocks import assign_blocks
from autopar.ir.graph import (
           Block,
           Graph,
           GraphInput,
           OpKind,
           OpNode,
           ParamInfo,
           TensorMeta,
           dtype_bytes,
)

__all__ = ["Block", "Graph", "GraphInput", "OpKind", "OpNode", "ParamInfo", "TensorMeta",
           "assign_blocks", "dtype_bytes"]
