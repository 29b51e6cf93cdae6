"""Tensor parallelism for models written the way people write them (no Hugging Face or autopar
class): a GPT whose attention is one fused qkv linear cut by ``split`` before SDPA, and a ViT
of ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``'s packed ``in_proj_weight``).
Their layers run from their own graph (GraphParallel). Plans are drawn from ``autopar.plan``;
each trains in the user's own loop through ``autopar.parallelize`` and through the generated
program (the Trainer: the GPT as a language model, the ViT as a classifier) and must equal one
process: losses over steps and every parameter's gradient at the first step, with the split
weights really split.
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from tests.fixtures.harness import run_in_group, run_ranks, spawn_ranks
from tests.fixtures.plain_models import (
    make_convnet,
    make_einsum_gpt,
    make_fused_einsum_gpt,
    make_gpt,
    make_vit,
)

pytestmark = pytest.mark.dist
STEPS, BATCH = 4, 4
FACTORIES = {"gpt": make_gpt, "vit": make_vit, "convnet": make_convnet,
             "einsum_gpt": make_einsum_gpt, "fused_einsum_gpt": make_fused_einsum_gpt}


def _batches(name: str):
    import torch

    g = torch.Generator().manual_seed(5)
    if name.endswith("gpt"):
        return [(ids[:, :-1], ids[:, 1:]) for ids in
                (torch.randint(0, 128, (BATCH, 33), generator=g) for _ in range(STEPS))]
    return [(torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,),
                                                                         generator=g))
            for _ in range(STEPS)]


def _loss(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def _plain_name(name: str) -> str:
    parts = [p for p in name.removeprefix("module.").split(".")
             if p not in ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")]
    if parts and parts[0].isdigit() and len(parts) > 1 and not parts[1].isdigit():
        parts = parts[1:]  # a pipeline's ModuleList of stages
    return ".".join(parts)


def _gradients(model) -> dict:
    import torch

    from autopar.parallel.tp_styles import FUSED_ATTR

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        owner, _, leaf = name.rpartition(".")
        fused = getattr(model.get_submodule(owner), FUSED_ATTR, {}).get(leaf)
        if fused is not None:  # a fused projection's rows, back in the model's order
            g = g.index_select(fused[0], torch.argsort(fused[1]))
        out[_plain_name(name)] = g.detach().float().numpy().copy()
    return out


def _own_loop(rank: int, port: int, out, world: int, name: str, plan_dict: dict | None
              ) -> None:
    run_in_group(rank, port, out, world, _train, name, plan_dict)


def _train(name: str, plan_dict: dict | None) -> tuple:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from autopar.plan import Plan
    from autopar.train.parallelize import PROGRAM_ATTR, optimizer

    torch.manual_seed(0)
    model, _ = FACTORIES[name]()  # every rank builds the same weights
    dp, mine, pipe, program = 1, 0, None, ""
    if plan_dict is not None:
        plan = Plan.from_dict(plan_dict)
        dp = plan.mesh["dp"]
        # the mesh is (pp, dp, tp), tp innermost
        mine = dist.get_rank() % (dp * plan.mesh["tp"]) // plan.mesh["tp"]
        example = _batches(name)[0][0][:plan.microbatch_size]
        model = autopar.parallelize(model, plan, example=example, loss_fn=_loss)
        pipe = model if plan.mesh["pp"] > 1 else None
        program = getattr(model, PROGRAM_ATTR)  # the training program it ran
        opt = optimizer(model, plan, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    share = BATCH // dp
    losses, grads = [], None
    for step, (inputs, target) in enumerate(_batches(name)):
        rows = slice(mine * share, (mine + 1) * share)
        if pipe is not None:
            loss = pipe.step(inputs[rows], target=target[rows])  # forward and backward
        else:
            loss = _loss(model(inputs[rows]), target[rows])
            loss.backward()
        if step == 0:
            grads = _gradients(pipe.modules if pipe is not None else model)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total)
            total /= dist.get_world_size()  # every rank of a dp group holds the same loss
        losses.append(float(total))
    if pipe is not None:  # every stage's gradients, by the plain model's names
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grads)
        grads = {k: v for d in everyone for k, v in d.items()}
        model = pipe.modules
    split = {}  # parameter -> its placement over the tensor-parallel ranks
    for n, p in model.named_parameters():
        names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if "tp" in names:
            split[_plain_name(n)] = str(p.placements[names.index("tp")])
    return losses, grads, split, program


def _plan(name: str, devices: int, pins: dict):
    model, example = FACTORIES[name]()  # the model itself: the search checks its split runs
    return autopar.plan(model, example, devices=devices, global_batch=BATCH,
                        constraints=dict(pins, precision="fp32"))


def _assert_equal(expected: tuple, got: tuple) -> None:
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-5)
    assert set(got[1]) == set(expected[1])
    for key, value in expected[1].items():
        np.testing.assert_allclose(got[1][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.fixture(scope="module")
def single() -> dict:
    return {name: spawn_ranks(_own_loop, 1, (1, name, None))[0] for name in FACTORIES
            if "einsum" not in name}


# the einsum GPTs' projections: (weight, stored dim its split runs along). Up and q/k/v are
# column-parallel, split on their output index; o and down row-parallel, on their contracted
# index; w_o is stored (out, in), w_down and the fused w_qkv (in, out), so the plan must say
# which dim
_EINSUM_SPLITS = {"attn.w_q": 0, "attn.w_k": 0, "attn.w_v": 0, "attn.w_o": 1,
                  "mlp.w_up": 0, "mlp.w_down": 0}
_FUSED_EINSUM_SPLITS = {"attn.w_qkv": 1, "attn.w_o": 1, "mlp.w_up": 0, "mlp.w_down": 0}


@pytest.mark.parametrize("name,splits", [("einsum_gpt", _EINSUM_SPLITS),
                                         ("fused_einsum_gpt", _FUSED_EINSUM_SPLITS)],
                         ids=["einsum", "fused-einsum"])
@pytest.mark.parametrize("devices,pins", [(2, dict(tp=2)), (4, dict(tp=2, dp=2))],
                         ids=["tp2", "tp2xdp2"])
def test_einsum_projections_split_by_tensor_parallelism_equal_one_process(
        name, splits, devices, pins) -> None:
    """Projections written ``torch.einsum("bsh,oh->bso", x, w)`` with bare parameters are
    split as the solver priced them: the plan records the split dim of each weight (a fused
    one's parts under its own name), the layers run from their graph on the shards, and
    training equals one process."""
    plan = _plan(name, devices, pins)
    assert plan.mesh["tp"] == 2
    for i in range(4):
        for weight, dim in splits.items():
            assert plan.placements["params"][f"h.{i}.{weight}"] == f"Shard({dim})@tp"
    fused = {f"h.{i}.attn.w_qkv": [64, 64, 64] for i in range(4)} if "attn.w_qkv" in splits \
        else {}
    assert plan.placements["fused"] == fused
    want = spawn_ranks(_own_loop, 1, (1, name, None))[0]
    got = spawn_ranks(_own_loop, devices, (devices, name, plan.to_dict()))[0]
    _assert_equal(want, got)
    held = {n: p for n, p in got[2].items() if n.startswith("h.") and p != "R"}
    assert held == {f"h.{i}.{w}": f"S({d})" for i in range(4) for w, d in splits.items()}, held


# tp x dp of these models runs in the generated program's test below
@pytest.mark.parametrize("name", ["gpt", "vit"])
@pytest.mark.parametrize("devices,pins", [(2, dict(tp=2)),
                                          (2, dict(tp=2, recompute="full")),
                                          (4, dict(pp=2, tp=2, schedule="1f1b"))],
                         ids=["tp2", "tp2-recompute", "pp2xtp2"])
def test_plain_models_split_by_tensor_parallelism_equal_one_process(single, name, devices,
                                                                    pins) -> None:
    plan = _plan(name, devices, pins)
    assert plan.mesh["tp"] == 2
    got = spawn_ranks(_own_loop, devices, (devices, name, plan.to_dict()))[0]
    _assert_equal(single[name], got)
    split = got[2]
    attention = "attn.c_attn.weight" if name == "gpt" else "self_attn.in_proj_weight"
    held = {n: placement for n, placement in split.items() if n.endswith(attention)}
    # rank 0 holds every layer, or its pipeline stage's
    assert held and set(held.values()) == {"S(0)"}, f"fused projections not split: {split}"
    assert plan.mesh["pp"] > 1 or len(held) == 4


@pytest.mark.parametrize("devices,pins", [(2, dict(dp=2, zero_stage=3)),
                                          (4, dict(tp=2, dp=2))], ids=["zero3", "tp2xdp2"])
def test_a_convnet_planned_by_the_search_equals_one_process(single, devices, pins) -> None:
    plan = _plan("convnet", devices, pins)
    got = spawn_ranks(_own_loop, devices, (devices, "convnet", plan.to_dict()))[0]
    _assert_equal(single["convnet"], got)
    assert not plan.sequence_parallel  # a ConvNet has no sequence to split


# tp2 alone and pp2 x tp2 of the GPT and the ViT run in your own loop above
@pytest.mark.parametrize("name,devices,pins", [
    ("gpt", 4, dict(tp=2, dp=2)), ("vit", 4, dict(tp=2, dp=2)),
    ("einsum_gpt", 4, dict(tp=2, dp=2)), ("einsum_gpt", 4, dict(pp=2, tp=2, schedule="gpipe"))],
    ids=["tp2xdp2-gpt", "tp2xdp2-vit", "tp2xdp2-einsum_gpt", "pp2xtp2-einsum_gpt"])
def test_plain_models_through_the_generated_program_equal_one_process(name, devices,
                                                                      pins) -> None:
    """The Trainer reads the task from the plan: the GPT trains as a language model on
    synthetic tokens, the ViT as a classifier on synthetic images and labels."""
    source = {"kind": "factory", "spec": f"tests.fixtures.plain_models:make_{name}"}
    model, example = FACTORIES[name]()
    graph = autopar.capture(model, example)
    constraints = dict(precision="fp32")
    plan = autopar.plan(model, example, devices=devices, global_batch=BATCH,
                        constraints=dict(constraints, **pins))
    single = autopar.plan(graph, devices=1, global_batch=BATCH,
                          constraints=dict(constraints, microbatch_size=plan.microbatch_size))
    want = run_ranks(source, single, steps=STEPS, first_grads=True)
    got = run_ranks(source, plan, steps=STEPS, first_grads=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1] > 0  # weights really are split
    assert set(got[2]) == set(want[2])  # every gradient, from every rank
    for key, value in want[2].items():
        np.testing.assert_allclose(got[2][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_parallelize_runs_the_program_autopar_run_runs(single, tmp_path) -> None:
    """One path from plan to PyTorch calls: ``autopar.parallelize`` runs the artifact's
    train.py for the same plan, but for the stated option that the LM head's output comes
    back whole for the user's own loss (the Trainer's loss is vocabulary-parallel); on two
    processes (tp2, drawn from the search) it equals one process."""
    import difflib

    plan = _plan("gpt", 2, dict(tp=2))
    got = spawn_ranks(_own_loop, 2, (2, "gpt", plan.to_dict()))[0]
    _assert_equal(single["gpt"], got)
    assert got[2].get("lm_head.weight") == "S(0)"  # the head really is split
    out = autopar.compile("tests.fixtures.plain_models:make_gpt", None, plan, tmp_path / "art")
    artifact = (out / "train.py").read_text().splitlines()
    ran = got[3].splitlines()
    changed = [(a, b) for tag, i1, i2, j1, j2 in
               difflib.SequenceMatcher(None, artifact, ran).get_opcodes() if tag != "equal"
               for a, b in zip(artifact[i1:i2], ran[j1:j2], strict=True)]
    assert changed == [
        ('    "lm_head": ColumnParallel(use_local_output=False),',
         '    "lm_head": ColumnParallel(output_layouts=Replicate()),'),
        ("# the LM head's output: split over the vocabulary, for autopar's vocabulary-parallel "
         "loss",
         "# the LM head's output: gathered whole on every rank, for your own loss "
         "(autopar.parallelize)"),
    ]
