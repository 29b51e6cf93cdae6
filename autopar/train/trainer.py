"""The training loop: one optimizer step per global batch, under the plan's parallelism."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from autopar.calibrate.trace_summary import BACKWARD, FORWARD, OPTIMIZER, STEP, mark_forward
from autopar.data.dataset import open_source
from autopar.data.documents import document_positions
from autopar.errors import PlanError
from autopar.models.source import build_from_source
from autopar.parallel.context_parallel import CP_ATTR, context_parallel_of
from autopar.parallel.cp_stage import trace_positions
from autopar.parallel.expert_parallel import (
    ExpertParallelExperts,
    data_rank,
    replica_group,
    sync_expert_grads,
)
from autopar.parallel.init import InitReport, materialize
from autopar.parallel.mesh import axis, replica_axis
from autopar.parallel.pipeline import (
    average_replica_grads,
    build_pipeline,
    materialize_stages,
    replicated_stages,
    sync_tied_grads,
    tied_copies,
)
from autopar.parallel.tensor_parallel import reduce_partial_grads
from autopar.peft.rdrop import RDROP_ATTR
from autopar.plan import Plan
from autopar.plan.support import refuse_unsupported
from autopar.train.autocast_ops import register_grouped_mm_autocast
from autopar.train.checkpoint import load_checkpoint, save_checkpoint
from autopar.train.document_mask import document_mask_choice
from autopar.train.expert_capacity import (
    CapacityCounter,
    install_capacity,
    refuse_split_sequences,
)
from autopar.train.loss import (
    IGNORE_INDEX,
    classification_loss,
    context_parallel_lm_loss,
    full,
    lm_loss,
    logits_of,
)
from autopar.train.loss_scale import LossScaler
from autopar.train.optim import Hyperparameters, decay_groups, lr_at, set_lr
from autopar.train.parallelize import check_module_paths, check_tp_entries
from autopar.train.program_calls import pipeline_spec, replicate
from autopar.train.router_loss import (
    RouterTerms,
    load_summary,
    router_logits_of,
    router_loss_of,
    router_terms,
    routing_shape,
    traced_moe_output,
)
from autopar.train.run_log import RunLog
from autopar.train.task import open_samples, training_task
from autopar.weights.hf_weights import HFCheckpoint


def _vocab(model: nn.Module, plan: Plan) -> int:
    """The output size of the language-model head: the model's config when it has one, else
    the last dimension of the captured output (a plain nn.Module factory)."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    if getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    shapes = list(plan.model.get("outputs", {}).values())
    if not shapes or not shapes[0]:
        raise PlanError("the plan does not record the model's output shape and the model has "
                        "no config.vocab_size; re-plan it with this autopar version")
    return int(shapes[0][-1])


def _constructor(source: dict, seed: int) -> Callable[[], nn.Module]:
    """A function that builds the model of ``source`` on CPU with ``seed`` once (later calls
    return the same build), leaving the caller's random state as it was."""
    built: list[nn.Module] = []

    def build() -> nn.Module:
        if not built:
            with torch.random.fork_rng(devices=[]):
                built.append(build_from_source(source, seed, "cpu"))
        return built[0]

    return build


class Trainer:
    """Train ``source`` (an artifact manifest's model source) under ``plan``, laid out by
    ``program``: the generated training program (autopar.codegen.program), loaded as a module.

    Runs in the current process group (torchrun, or a test's spawned ranks); with one device
    it needs none. ``device`` overrides the plan cluster's device type (e.g. ``"cpu"``).

    No rank builds the full model: it is built on meta, parallelised there, and then each rank
    allocates and initialises only its shards (:func:`autopar.parallel.init.materialize`,
    seeded per module, so every plan and one process start from the same weights);
    ``init_report`` says what this rank allocated. ``init_from`` (a Hugging Face safetensors
    folder) supplies the weights instead, each rank reading only its slices.
    """

    init_report: InitReport  # this rank's materialisation: units, peak, local bytes

    def __init__(self, source: dict, plan: Plan, *, program: ModuleType, device: str = "cpu",
                 seed: int = 0, hyper: Hyperparameters | None = None, lr: float | None = None,
                 log: RunLog | None = None, data: str = "synthetic",
                 init_from: str | Path | None = None, document_mask: bool = True) -> None:
        refuse_unsupported(plan)  # the table the search reads too
        world = dist.get_world_size() if dist.is_initialized() else 1
        plan.check_world_size(world)
        hyper = hyper or Hyperparameters()
        if lr is not None:  # a shorthand for the most common setting
            hyper = replace(hyper, lr=lr)
        self.plan, self.seed, self.hyper = plan, seed, hyper
        self.grad_clip = hyper.grad_clip
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = run_device(device)
        # the program's precision: autocast's compute dtype, and dynamic loss scaling (fp16)
        self.autocast = getattr(program, "AUTOCAST", None) if program is not None else None
        if self.autocast is not None:  # MoE experts' grouped GEMMs in the compute dtype too
            register_grouped_mm_autocast(self.device.type)
        self.scaler = LossScaler(self.device) \
            if program is not None and getattr(program, "LOSS_SCALING", False) else None
        model = build_from_source(source, seed, "meta")
        base_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # a mixture of experts' router losses (load balancing, z-loss), when asked for
        self.router = router_loss_of(model, hyper.router_aux_coef, hyper.router_z_coef)
        self.router_step: list[RouterTerms] = []  # this step's micro-batches' terms
        self.forward_kwargs = {"output_router_logits": True} if self.router is not None else {}
        self.routing = routing_shape(model)
        adapt = getattr(program, "adapt", None) if program is not None else None
        if adapt is not None:  # fine-tuning: freeze the base, add what trains
            adapt(model)
        elif plan.peft:
            raise PlanError("the plan fine-tunes with a method but the program has no adapt(); "
                            "delete train.py to regenerate it from plan.yaml")
        # R-Drop's model runs each batch twice; its loss reads both passes
        self.rdrop_alpha = getattr(model, RDROP_ATTR, None)
        self.evaluating = False  # autopar.train.evaluate runs forward-only passes
        check_module_paths(model, plan)
        check_tp_entries(model, plan)
        # a language model or a classifier, from the plan's captured inputs and output
        self.task = training_task(plan)
        if self.task.classifies:
            if self.rdrop_alpha is not None:
                raise PlanError("R-Drop's loss compares two passes' token distributions; "
                                "this model is a classifier: plan it without R-Drop")
            self.vocab: int | None = None  # no tokens: no vocabulary, no sequence
            self.seq: int | None = None
            self.data = open_samples(data, self.task)
        else:
            self.vocab = _vocab(model, plan)
            self.seq = plan.seq

            # bad data fails before any parallel setup
            self.data = open_source(data, self.vocab)
        # packed documents: kept apart by their positions when the model and plan allow
        self.document_eos, self.document_choice = document_mask_choice(
            model, plan, getattr(self, "data", None), document_mask)
        # the unparallelised meta model: materialize reads each module's class and init rule
        # from it (parallelism replaces both); a meta copy costs no memory
        reference = copy.deepcopy(model)
        # a checkpoint of another model is refused here, from its headers, before any rank
        # allocates; each rank later reads only its slices
        added = {n for n, _ in reference.named_parameters(remove_duplicate=False)} - base_names
        self.weights = HFCheckpoint(init_from, reference, optional=added) if init_from \
            else None
        # where the weights started, recorded in every checkpoint (a resumed run takes it
        # from the one it loads) so that an export can name its base model and tokenizer
        self.init_from = str(Path(init_from).resolve()) if init_from else None
        # what a checkpoint holds: traced pipeline stages also list non-persistent buffers
        self.state_keys = frozenset(reference.state_dict())
        # what the model's constructor wrote, for the tensors no init rule writes (a plain
        # model's bare parameters): the model built whole on CPU, only if one needs it
        self.constructed = _constructor(source, seed)
        self.pipe = None
        self.replicated = False  # a pipeline's ZeRO-0/1 replicas (gradients all-reduced)
        # the generated program lays the model out: its mesh, then its parallelize functions
        mesh = program.build_mesh(device)
        dp_mesh = axis(mesh, "dp").mesh  # None: the program's mesh has no dp axis
        # this rank's place on each mesh axis (the profile's stages are pp coordinates)
        self.coords = {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names} \
            if mesh is not None else {}
        self.dp_rank = axis(mesh, "dp").local_rank
        if plan.mesh["ep"] > 1:
            self.dp_rank = data_rank(mesh)  # ep ranks read different rows too
        if plan.mesh["pp"] > 1:
            model = self._pipeline(model, reference, plan, mesh, device, dp_mesh, program)
        else:
            program.parallelize(model, mesh, plan)
            self.init_report = materialize(model, seed, reference=reference,
                                           device=self.device, weights=self.weights,
                                           constructed=self.constructed)
            # DDP broadcasts and buckets real tensors: only after materialize
            model = replicate(program, model, mesh, plan)
        del self.constructed  # frees the CPU build, if one was made
        # context parallelism: each cp rank feeds its share of every sequence, loss summed

        self.cp = context_parallel_of(model)
        # the run's --capacity-factor, else the one the plan was priced with
        self.capacity = self._install_capacity(
            model, plan, hyper.capacity_factor if hyper.capacity_factor is not None
            else plan.capacity_factor)
        self.experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
        self.model = model
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None and plan.mesh["dp"] > 1 \
            else None
        # the ranks whose losses make up the global mean: dp, or dp x ep under expert parallelism
        self.replica_group = replica_group(plan, mesh, self.dp_group)
        self.optimizer = program.build_optimizer(decay_groups(self.model, hyper.weight_decay),
                                                 mesh, hyper)
        self.log = log if self.rank == 0 else None
        self.step_index = 0
        self.horizon: int | None = None  # the schedule's, once a run (or a checkpoint) sets it
        self.last_record: dict = {}

    def _pipeline(self, model: nn.Module, reference: nn.Module, plan: Plan, mesh, device: str,
                  dp_mesh, program: ModuleType) -> nn.Module:
        """Split the meta model at the program's chunks into this rank's stage modules, lay
        each out with the program's ``parallelize_stage``, materialize them; returns them as
        one ModuleList."""
        self.tied = tied_copies(model)
        # a classifier's example meets its first layer's weights, on meta: it is on meta too
        cp = plan.mesh["cp"]  # each cp rank traces (and runs) its share of the sequence
        example = torch.zeros(plan.microbatch_size, *self.task.sample_shape, device="meta") \
            if self.task.classifies else \
            torch.zeros(plan.microbatch_size, self.seq // cp, dtype=torch.long)
        inputs = trace_positions(model, plan.microbatch_size, self.seq // cp) if cp > 1 \
            else None
        if self.router is not None:  # every layer's router logits reach the last stage
            inputs = {**(inputs or {}), **self.forward_kwargs}
        spec = pipeline_spec(program, plan)
        loss_fn = self.loss if self.scaler is None and self.router is None else \
            self._pipeline_loss
        original = model

        def lay_out(stage: nn.Module) -> None:
            program.parallelize_stage(stage, mesh, plan, original)

        stages, self.pipe, modules = build_pipeline(
            model, plan, axis(mesh, "pp").mesh, device, example, loss_fn, lay_out,
            chunks=[tuple(c) for c in spec["chunks"]], schedule=spec["schedule"],
            microbatches=spec["microbatches"], inputs=inputs)
        self.pp_group = axis(mesh, "pp").group
        self.init_report = materialize_stages(modules, self.seed, reference, device,
                                              self.weights, self.constructed)
        for module in modules:  # the profiler sees each stage's forward as one phase
            mark_forward(module)
        # the stages' replicas: dp, or dp x cp under context parallelism
        replicas = replica_axis(mesh, plan)
        self.replicated = replicated_stages(plan, replicas.mesh)
        self.stage_replica_group = replicas.group
        stages = nn.ModuleList(modules)
        cp_of_stages = {id(c): c for c in map(context_parallel_of, modules) if c is not None}
        if cp_of_stages:  # the loss (last stage) is the cp loss, each rank's share
            setattr(stages, CP_ATTR, next(iter(cp_of_stages.values())))
        return stages

    def loss(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss (:func:`autopar.train.loss.lm_loss`, R-Drop's when the
        fine-tuning method is R-Drop); while evaluating, the plain cross-entropy. A
        classifier's: :func:`autopar.train.loss.classification_loss` of its labels."""
        if self.task.classifies:
            return classification_loss(output, targets)
        if getattr(self, "cp", None) is not None and not self.evaluating:
            return context_parallel_lm_loss(self.cp, output, targets)  # summed over the whole sequence's tokens
        if self.evaluating:
            logits = logits_of(output)
            if logits.shape[0] == 2 * targets.shape[0]:  # a pipeline traced R-Drop's 2 passes
                output = logits[: targets.shape[0]]
            return lm_loss(output, targets)
        return lm_loss(output, targets, self.rdrop_alpha)

    def _install_capacity(self, model: nn.Module, plan: Plan,
                          capacity_factor: float | None) -> CapacityCounter | None:
        """Expert capacity on the parallelized model (None: dropless routing)."""
        if capacity_factor is None:
            return None
        refuse_split_sequences(plan.mesh, "drop --capacity-factor")
        return install_capacity(model, capacity_factor, *self.routing)

    def _capacity_record(self) -> dict:
        """The share of token copies dropped past the experts' capacity this step (the
        global batch's); empty when routing is dropless."""
        if self.capacity is None:
            return {}
        counts = torch.tensor(self.capacity.take(), dtype=torch.float64)
        if self.replica_group is not None:
            dist.all_reduce(counts, group=self.replica_group)
        routed, dropped = counts.tolist()
        return {"expert_dropped_share": dropped / routed if routed else 0.0}

    def _pipeline_loss(self, output: object, targets: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss: with router losses, the traced model returns every
        MoE layer's router logits, relayed from the stages that computed them (their
        gradients go back the same way), so the terms are the whole model's, as in one
        process; scaled under dynamic loss scaling (not while evaluating)."""
        if self.router is not None:
            output = traced_moe_output(output, self.router.experts)
        loss = self.loss(output, targets)
        if self.evaluating:
            return loss
        if self.router is not None:
            loss = loss + self._router_loss(output)
        return loss if self.scaler is None else self.scaler.scale(loss)

    def _router_loss(self, output: object) -> torch.Tensor:
        """The router terms a micro-batch adds to its loss: this rank's share under cp,
        times cp, as the cp language-model loss (the gradient sync averages over cp)."""
        group = self.cp.group if self.cp is not None else None
        terms = router_terms(router_logits_of(output), self.router, group)
        self.router_step.append(terms)
        return terms.weighted(self.router) * (self.cp.size if self.cp is not None else 1)

    def _router_record(self) -> dict:
        """The step's router losses (means over its micro-batches, whole sequences) and
        expert load, for the run log; empty without router losses."""
        if self.router is None:
            return {}
        if self.router_step:
            values = torch.stack([torch.stack([t.aux.detach(), t.z.detach()])
                                  for t in self.router_step]).sum(0) / len(self.router_step)
            load = torch.stack([t.load for t in self.router_step]).sum(0)
        else:  # a pipeline stage before the last: the last stage computed the terms
            values = torch.zeros(2, device=self.device)
            load = torch.zeros(self.router.experts, device=self.device)
        self.router_step = []
        if self.pipe is not None:
            both = torch.cat([values, load.to(values.device)])
            dist.all_reduce(both, group=self.pp_group)
            values, load = both[:2], both[2:]
        if self.cp is not None:  # each cp rank holds a share of the sequences' terms
            dist.all_reduce(values, group=self.cp.group)
        if self.replica_group is not None:  # the global batch's, as the loss
            both = torch.cat([values, load])
            dist.all_reduce(both, group=self.replica_group)
            values = both[:2] / (self.plan.mesh["dp"] * self.plan.mesh["ep"])
            load = both[2:]
        record = {"router_aux_loss": float(values[0]), "router_z_loss": float(values[1])}
        return {**record, **load_summary(load)}

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with self._compute():
            self.pipe.step(inputs, target=targets, losses=losses, return_outputs=False)
        if self.replicated:  # ZeRO-0/1 replicas: average the gradients over dp (x ep)

            average_replica_grads(list(self.model), self.plan, self.stage_replica_group,
                                  self.replica_group, self.experts)
        total = torch.stack([loss.detach().float() for loss in losses]).mean() if losses \
            else torch.zeros((), device=self.device)
        if self.scaler is not None and losses:
            total = total / self.scaler.value
        if self.cp is not None:  # each cp rank's loss is its share of the sequence's
            total = self.cp.mean(total)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds the losses
        if self.tied:
            sync_tied_grads(list(self.model), self.tied, self.pp_group)
        return total

    def train_step(self) -> float:
        """One optimizer step on the next global batch; returns the global mean loss.

        Its phases are marked for the profiler (autopar.calibrate.trace_summary reads them)."""
        start = time.perf_counter()
        with record_function(STEP):
            total, lr = self._step()
        value = float(total)
        elapsed = time.perf_counter() - start
        plan = self.plan
        # a classifier's throughput is in samples (it reads no tokens)
        speed = {"samples_per_s": plan.global_batch / elapsed} if self.task.classifies else \
            {"tokens_per_s": plan.global_batch * self.seq / elapsed}
        self.last_record = {
            "step": self.step_index, "loss": value, "lr": lr, "step_time_s": elapsed, **speed,
            "mfu": measured_mfu(plan, elapsed), "peak_memory_bytes": _peak_memory(),
            **self._router_record(), **self._capacity_record()}
        self.step_index += 1
        if not math.isfinite(value):
            raise FloatingPointError(f"loss became {value} at step {self.step_index}")
        return value

    def _step(self) -> tuple[torch.Tensor, float]:
        plan = self.plan
        per_replica = plan.global_batch // (plan.mesh["dp"] * plan.mesh["ep"])
        inputs, targets = self._batch(self.dp_rank * per_replica, per_replica)
        if self.cp is not None:  # this cp rank's chunks of each sequence
            inputs, targets = self.cp.shard(inputs), self.cp.shard(targets)
        m, b = plan.num_microbatches, plan.microbatch_size
        if self.pipe is not None:
            total = self._pipeline_step(inputs, targets)
        else:
            total = torch.zeros((), device=self.device)
            for i in range(m):
                chunk = inputs[i * b:(i + 1) * b]
                with self._loss_context(), self._activation_offload():
                    with record_function(FORWARD), self._compute():
                        output = self.model(chunk, **self.forward_kwargs,
                                            **self.position_kwargs(chunk))
                        loss = self.loss(output, targets[i * b:(i + 1) * b])
                        if self.router is not None:
                            loss = loss + self._router_loss(output)
                    del output  # the logits: the loss's backward needs only its fp32 softmax
                    scaled = loss / m
                    with record_function(BACKWARD):
                        (self.scaler.scale(scaled) if self.scaler is not None
                         else scaled).backward()
                total += full(loss.detach()) / m
            sync_expert_grads(self.experts, plan, self.dp_group)
            if self.cp is not None:  # each cp rank's loss is its share of the sequence's
                total = self.cp.mean(total)
        reduce_partial_grads(self.model.parameters())  # sequence-parallel norms' weights
        lr = lr_at(self.hyper, self.step_index)
        with record_function(OPTIMIZER):
            overflow = False
            if self.scaler is not None:  # clip and step on true gradients; skip on overflow
                overflow = self.scaler.unscale_(self.model.parameters())
                self.scaler.update(overflow)
            if self.grad_clip and not overflow:
                self._clip()
            if not overflow:
                set_lr(self.optimizer, self.hyper, lr)
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.replica_group is not None:
            dist.all_reduce(total, group=self.replica_group)
            total /= plan.mesh["dp"] * plan.mesh["ep"]
        return total, lr

    def _batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(model inputs, targets) of rows ``[start, start + count)`` of this step's global
        batch: each data-parallel rank reads only its rows. A language model reads token ids
        and predicts each next one; a classifier reads samples and their labels."""
        plan = self.plan
        if self.task.classifies:
            inputs, labels = self.data.rows(self.step_index, plan.global_batch, self.seed,
                                            start, count)
            return inputs.to(self.device), labels.to(self.device)
        window = (self.step_index, plan.global_batch, self.seq, self.seed, start, count)
        mine = self.data.rows(*window).to(self.device)
        targets = mine[:, 1:]
        mask = getattr(self.data, "loss_mask", lambda *_: None)(*window)
        if mask is not None:  # instruction data: only response tokens are trained targets
            targets = targets.masked_fill(~mask[:, 1:].to(self.device), IGNORE_INDEX)
        return mine[:, :-1], targets

    def position_kwargs(self, ids: torch.Tensor) -> dict:
        """``{"position_ids": ...}`` restarting after each end-of-document token when this
        run keeps packed documents apart (:mod:`autopar.train.document_mask`), else {}."""
        if self.document_eos is None:
            return {}
        return {"position_ids": document_positions(ids, self.document_eos)}

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``ids`` (every rank passes the same ids), whole and on
        every rank: forward only, under the plan's parallelism. A pipeline takes the shape
        it was traced for: ``num_microbatches * microbatch_size`` rows of ``seq`` tokens."""
        if self.task.classifies:
            raise PlanError("logits() reads a language model's token ids; this model is a "
                            "classifier: call trainer.model on its inputs instead")
        ids = ids.to(self.device)
        if self.pipe is None:
            mode = self.model.training
            self.model.eval()  # no dropout (nor R-Drop's second pass)
            try:
                with self._compute():
                    return full(logits_of(self.model(ids))).float()
            finally:
                self.model.train(mode)
        m, b = self.plan.num_microbatches, self.plan.microbatch_size
        if tuple(ids.shape) != (m * b, self.seq):
            raise PlanError(f"a pipeline computes logits for [{m * b}, {self.seq}] token ids "
                            f"(its micro-batches), not {list(ids.shape)}")
        with self._compute():
            # runtime schedules compute the last stage's loss whenever they have a loss_fn:
            # give it a target (the loss is dropped; eval runs no backward)
            out = self.pipe.eval(ids, target=torch.zeros_like(ids), losses=[])
        shape = (m * b, self.seq, self.vocab)
        last = self.plan.mesh["pp"] - 1
        if out is not None and logits_of(out).shape[0] == 2 * m * b:  # R-Drop traced twice
            out = logits_of(out)[: m * b]
        mine = logits_of(out).float() if out is not None and \
            self.pp_group.rank() == last else torch.empty(shape, device=self.device)
        group_rank = dist.get_global_rank(self.pp_group, last)
        dist.broadcast(mine, group_rank, group=self.pp_group)
        return mine

    @property
    def checkpointable(self) -> bool:
        """Whether this run's state can be saved: every plan the runtime trains, pipelines and
        ZeRO-1 included (autopar.train.checkpoint writes one format for all of them)."""
        return True

    def _loss_context(self):
        """loss_parallel when the LM head may leave the logits split over tp (the forward,
        the loss and its backward run inside it); otherwise nothing."""
        import contextlib

        if self.plan.mesh["tp"] > 1 and self.pipe is None:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def _compute(self):
        """autocast to the program's compute dtype (bf16, fp16), or nothing (fp32)."""
        import contextlib

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _activation_offload(self):
        """save_on_cpu keeps saved activations in host memory when the plan offloads them."""
        import contextlib

        if "activations" in self.plan.offload:
            return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        return contextlib.nullcontext()

    def _clip(self) -> None:
        if self.pipe is None:
            clip_grad_norm(self.model.parameters(), self.grad_clip)
            return
        # one copy of each tied parameter counts, and the norm spans every stage
        params = [p for n, p in self.model.named_parameters()
                  if n.split(".", 1)[1] not in self.tied]
        clip_grad_norm(params, self.grad_clip, self.pp_group, scale=list(self.model.parameters()))

    def train(self, steps: int, checkpoint_dir: str | Path | None = None,
              checkpoint_every: int = 0, evaluate=None, eval_every: int = 0,
              profiler=None, keep_last: int = 0, final_save: bool = True) -> list[float]:
        """Run ``steps`` steps; save a checkpoint every ``checkpoint_every`` steps and at the
        end (unless ``final_save`` is False) when ``checkpoint_dir`` is given, keeping the
        newest ``keep_last`` (0: all); call ``evaluate(trainer)`` every ``eval_every``
        steps and at the end when given; ``profiler`` (an
        :class:`autopar.calibrate.profiling.StepProfiler`) records its window of steps. Each
        step's record goes to the run log."""
        # the schedule's horizon: the settings', else the one a resumed run was given, else
        # this run's last step
        self.hyper = self.hyper.with_horizon(self.horizon or self.step_index + steps)
        self.horizon = self.hyper.decay_steps
        losses = []
        if self.log is not None:
            self.log.start(steps, first_step=self.step_index)
        if profiler is not None:
            profiler.start(self)
        try:
            for i in range(steps):
                losses.append(self.train_step())
                if profiler is not None:
                    profiler.step()
                if self.log is not None:
                    self.log.step(self.last_record, i + 1)
                last = i == steps - 1
                if checkpoint_dir and ((last and final_save) or (
                        checkpoint_every and self.step_index % checkpoint_every == 0)):
                    save_checkpoint(self, checkpoint_dir, keep_last)
                if evaluate is not None and (last or (eval_every and
                                                      self.step_index % eval_every == 0)):
                    evaluate(self)
            if profiler is not None:
                self.profile_summary = profiler.finish(self.coords)
        finally:  # writers and the profiler end with the run, whether it finished or failed
            if profiler is not None:
                profiler.close()
            if self.log is not None:
                self.log.close()
        return losses

    def resume(self, checkpoint_dir: str | Path) -> int:
        """Continue from the latest complete checkpoint (saved under any plan)."""
        return load_checkpoint(self, checkpoint_dir)


def clip_grad_norm(params, max_norm: float, group=None, scale=None) -> torch.Tensor:
    """Clip by the norm over the whole mesh, with one all-reduce per (mesh, sharded dims).

    Works when some gradients are DTensors (tensor-parallel or fully-sharded) and others plain
    tensors, which torch's clip_grad_norm_ refuses. A sharded DTensor contributes its local
    shard's squares, summed over the mesh dimensions it is split on; a replicated one counts
    once. ``group`` sums the squares over pipeline stages; ``scale`` lists the parameters to
    rescale when they differ from those measured.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    # on the gradients' device: the collectives below need it there (NCCL takes no CPU tensors)
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    buckets: dict[tuple, list] = {}
    for g in grads:
        if not hasattr(g, "device_mesh"):
            squares = squares + g.detach().float().pow(2).sum().to(device)
            continue
        if any(pl.is_partial() for pl in g.placements):
            squares = squares + g.full_tensor().float().pow(2).sum().to(device)
            continue
        # every split mesh dimension (FSDP's _StridedShard under tp is not is_shard())
        dims = tuple(i for i, pl in enumerate(g.placements)
                     if not pl.is_replicate() and not pl.is_partial())
        entry = buckets.setdefault((id(g.device_mesh), dims),
                                   [torch.zeros((), dtype=torch.float32, device=device),
                                    g.device_mesh, dims])
        entry[0] = entry[0] + g.to_local().detach().float().pow(2).sum().to(device)
    for local, mesh, dims in buckets.values():
        for dim in dims:
            dist.all_reduce(local, group=mesh.get_group(dim))
        squares = squares + local
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if scale is not None:
        grads = [p.grad for p in scale if p.grad is not None]
    if float(factor) < 1.0:
        for g in grads:
            (g.to_local() if hasattr(g, "to_local") else g).mul_(float(factor))
    return total


def run_device(device_type: str) -> torch.device:
    """This process's device: the CPU, or the accelerator LOCAL_RANK names (set as current
    here, so that every tensor a collective meets is on it)."""
    if device_type == "cpu":
        return torch.device("cpu")
    import os

    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def measured_mfu(plan: Plan, step_time_s: float) -> float | None:
    """The step's model-FLOP utilisation against the peak the plan was predicted with:
    the predicted MFU scaled by predicted / measured step time (None when the plan predicts
    none)."""
    predicted = plan.predicted
    if not (predicted.mfu and predicted.step_time_s and step_time_s > 0):
        return None
    return predicted.mfu * predicted.step_time_s / step_time_s


def _peak_memory() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
