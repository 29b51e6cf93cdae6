"""Applying a plan with PyTorch's distributed engine: the mesh, tensor and sequence parallelism
(DTensor styles or the layer's rewritten graph), pipeline stages, expert parallelism, sharded
initialisation, recompute and data-parallel policies, and the helpers the generated program
calls by name (``program_steps``)."""
