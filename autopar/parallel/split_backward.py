"""The zero-bubble schedule's split backward on fully_shard stages that reshard after the
forward (ZeRO-3).

torch's split backward finds a stage's weights by ``stage.submod.parameters()``: the input
step (I) records which autograd nodes lead to them, and the weight step (W) maps those nodes
back to the parameters whose ``.grad`` it sets (``torch/distributed/pipelining/_backward.py``:
``stage_backward_input`` / ``stage_backward_weight``). The forward ran on fully_shard's
gathered (unsharded) parameters, but after a resharding forward the module holds the sharded
ones again; fully_shard gathers each layer only once autograd reaches it, after I has listed
the weights. I then finds no weight of a resharded layer, W computes nothing for them, and
every stage but the first (whose W is a plain full backward) ends the step without those
gradients.

The fix: gather the stage's parameters right before its I and W steps (``FSDPModule.unshard``),
so both list the tensors the forward used. That is the gather the backward makes anyway, only
for the whole stage at once instead of layer by layer; under the pipeline schedules the
backward keeps them gathered until the next forward (``set_reshard_after_backward(False)``
in ``stage.backward_maybe_with_nosync``), so the peak is the one the cost model prices for
fully_shard under a pipeline (:func:`autopar.cost.engines.fsdp_under_pipeline`: the whole
stage's compute copy). In torch's ZB1P order a W follows its stage's I or W, never a forward,
so the gather before W finds them gathered and sends nothing: one gather per micro-batch's
backward, as priced.
"""

from __future__ import annotations

from torch import nn


def _gather(module: nn.Module) -> None:
    """Gather every fully_shard unit of ``module`` (a no-op for a gathered one)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()


def gather_for_split_backward(stage) -> bool:
    """Make ``stage`` (a torch PipelineStage) gather its fully_shard parameters before each
    input-gradient step of a split backward and before each weight-gradient step; returns
    whether the stage has fully_shard units (otherwise it is left as it is)."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in stage.submod.modules()):
        return False
    backward = stage.backward_one_chunk
    backward_weight = stage.backward_weight_one_chunk

    def backward_one_chunk(bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        if not full_backward:  # the input step: it lists the weights the W step fills
            _gather(stage.submod)
        return backward(bwd_chunk_id, loss=loss, full_backward=full_backward,
                        last_backward=last_backward)

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False):
        _gather(stage.submod)
        return backward_weight(bwd_chunk_id, last_backward=last_backward)

    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    return True
