"""Capture Llama-3-70B from its shipped config on the meta device and look at its blocks.

Run: python examples/capture_llama.py [MODEL] [SEQ]
"""

import sys
import time

import autopar
from autopar.ir import OpKind
from autopar.models import build_model, token_inputs

name = sys.argv[1] if len(sys.argv) > 1 else "llama3-70b"
seq = int(sys.argv[2]) if len(sys.argv) > 2 else 4096

t0 = time.perf_counter()
model = build_model(name)  # meta device: no memory for the weights
graph = autopar.capture(model, token_inputs(1, seq))
print(f"{name}: {graph.num_params:,} parameters, {len(graph.ops)} ops, "
      f"captured in {time.perf_counter() - t0:.1f} s")
print(f"forward: {graph.flops_per_token / 1e9:.1f} GFLOP per token at sequence {seq}")

for type_id, blocks in graph.block_types().items():
    b = blocks[0]
    print(f"type {type_id}: {len(blocks):>3} x {b.kind:<11} {b.param_numel:>14,} params each "
          f"(e.g. {b.name})")

layer = graph.layer_blocks[0]
linears = [graph.op(n) for n in layer.nodes if graph.op(n).kind is OpKind.LINEAR]
print(f"{layer.name} has {len(linears)} linear ops:")
for op in linears:
    print(f"  {op.module_path:<40} {op.params[0]:<45} {op.flops / 1e9:8.1f} GFLOP")
