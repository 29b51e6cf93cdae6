"""Engines as they issue and overlap work: Megatron-Core's tensor-parallel overlap, FSDP2's
per-block collectives and copies, Llama 3's FSDP without resharding, and the engine pins."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.cost import ParallelConfig, estimate, load_cluster
from autopar.cost.block_cost import cached_block_cost, cached_block_traffic
from autopar.cost.comm import (
    AxisPlacement,
    bulk_wall,
    collective_time,
    pipelined_wall,
    ring_exchange_wall,
)
from autopar.cost.data_parallel import StepSync, step_sync, step_sync_exposed
from autopar.cost.engines import ENGINE_FEATURES, sm_share_slowdown
from autopar.cost.hardware import Overlap
from autopar.cost.precision import Precision
from autopar.plan.megatron import constraints_from_megatron, megatron_command
from autopar.plan.support import plan_unsupported
from autopar.search.constraints import load_constraints

from ..cli.test_inspect import _assert_one_line_error, cli_here

BF16 = Precision("bf16", "bf16", "fp32")
GRID = (0.1, 0.5, 1.0, 2.0, 8.0)


@pytest.mark.parametrize("slowdown", [0.0, 0.14])
def test_overlapped_tp_comm_hides_at_most_the_gemm_never_its_exposed_chunk(slowdown) -> None:
    for gemm in GRID:
        for comm in GRID:
            for ranks in (2, 4, 8):
                wall = ring_exchange_wall(gemm, comm / (ranks - 1), ranks, slowdown)
                hidden = gemm + comm - wall
                assert hidden <= min(comm, gemm) + 1e-12
                assert wall >= max(gemm, comm)  # neither finishes before itself
                # the last chunk's GEMM waits for the last exchange
                assert wall >= comm + gemm / ranks - 1e-12
            for splits in (1, 2, 4):
                chunk = comm / splits
                wall = pipelined_wall(gemm, chunk, splits, slowdown)
                assert gemm + comm - wall <= min(comm, gemm) + 1e-12
                assert wall >= gemm + chunk - 1e-12  # the last chunk's reduce-scatter exposed
            assert gemm + comm - bulk_wall(gemm, comm, slowdown) <= min(gemm, comm) + 1e-12
    # a GEMM far longer than its collective hides it, paying only the SMs it lends
    assert ring_exchange_wall(8.0, 0.01, 8, 0.0) == pytest.approx(8.0)
    assert pipelined_wall(8.0, 0.01, 4, 0.0) == pytest.approx(8.0 + 0.01)


def test_userbuffers_slow_the_gemm_by_the_sms_they_hold() -> None:
    h100 = load_cluster("h100-80g").device
    assert sm_share_slowdown(16, h100.compute_units) == pytest.approx(16 / (132 - 16))
    assert sm_share_slowdown(1, h100.compute_units) < 0.01
    assert sm_share_slowdown(16, 1) == 0.0  # no SMs to share (a CPU process)


@pytest.fixture(scope="module")
def llama8b():
    return autopar.capture("llama3-8b", seq=4096)


def test_megatron_core_hides_sequence_parallel_comm_behind_its_gemms(llama8b) -> None:
    cluster = load_cluster("h100-80g")
    base = ParallelConfig(dp=8, tp=8, sequence_parallel=True, zero_stage=1,
                          num_microbatches=4, precision=BF16, engine="megatron")
    core = replace(base, engine="megatron-core")
    plain, overlapped = estimate(llama8b, cluster, base), estimate(llama8b, cluster, core)
    c = cached_block_cost(llama8b, 1, base, cluster, "none")
    assert c.tp_comm_s > 0
    # the exposed remainder is less than the collectives and at least what the GEMMs cannot
    # hide: never below zero, never above the collectives themselves
    assert 0 < c.tp_overlap_fwd_s + c.tp_overlap_bwd_s < c.tp_comm_s
    assert overlapped.step_time_s < plain.step_time_s
    per_mb = sum(len(b) for b in llama8b.block_types().values()) * c.tp_comm_s
    assert plain.step_time_s - overlapped.step_time_s <= 4 * per_mb + \
        plain.stages[0].dp_comm_s
    # without sequence parallelism there is nothing userbuffers overlap: the all-reduces stay
    no_sp_plain = estimate(llama8b, cluster, replace(base, sequence_parallel=False, dp=1))
    no_sp_core = estimate(llama8b, cluster, replace(core, sequence_parallel=False, dp=1))
    assert no_sp_core.stages[0].comm_s == pytest.approx(no_sp_plain.stages[0].comm_s)


def test_the_first_fsdp_gather_is_exposed_and_fsdp2_copies_on_the_compute_stream(
        llama8b) -> None:
    cluster = load_cluster("a100-80g")
    config = ParallelConfig(dp=64, zero_stage=3, precision=BF16)
    traffic = cached_block_traffic(llama8b, 1, config, cluster)
    c = cached_block_cost(llama8b, 1, config, cluster, "none")
    device = cluster.device
    copy_bw = device.memory_bandwidth * device.efficiency.memory
    # copy-out reads and writes the gathered block; copy-in reads bf16 grads, writes fp32
    assert traffic.gather_copy_s == pytest.approx(2 * 2 * c.dense_params / copy_bw)
    assert traffic.reduce_copy_s == pytest.approx((2 + 4) * c.dense_params / copy_bw)
    est = estimate(llama8b, cluster, config)
    stage = est.stages[0]
    blocks = len(llama8b.blocks)
    # per micro-batch, ZeRO-3 adds at least one exposed gather per pass and every copy
    floor = 2 * traffic.gather_s + (blocks - 2) * (2 * traffic.gather_copy_s
                                                   + traffic.reduce_copy_s)
    assert stage.dp_microbatch_s >= floor
    # the engines that issue no FSDP2 copies do not pay them
    assert cached_block_traffic(llama8b, 1, replace(config, engine="deepspeed"),
                                cluster).gather_copy_s == 0.0


def test_gathers_at_512_ranks_pay_the_ring_latency() -> None:
    cluster = load_cluster("a100-80g")
    node = cluster.node
    small = 1e5  # a small FSDP unit: latency, not bandwidth, sets its time
    flat8 = collective_time("all_gather", small, AxisPlacement(8, 8, 1), cluster)
    wide = collective_time("all_gather", small, AxisPlacement(512, 8, 64), cluster)
    # each of the ring's 511 steps (63 across nodes) costs at least the lowest-latency
    # protocol's hop (NCCL's LL: 0.6 of Simple's 3.4 us on NVLink, 2.7 of 14 us on the network)
    hops = 448 * node.intra_latency * 0.6 / 3.4 + 63 * node.inter_latency * 2.7 / 14
    assert wide >= hops
    assert wide > 10 * flat8


def test_fsdp_under_a_pipeline_schedule_gathers_and_reduces_once_per_step(llama8b) -> None:
    """FSDP2 under PyTorch's pipeline schedules (Llama 3's 4D setup, and autopar's runtime)
    keeps ZeRO-2 parameters gathered and reduce-scatters once per step, after the last
    backward: its data-parallel traffic does not grow with the micro-batches and its gradients
    stay whole until then. Without stages FSDP2 reshards after every backward: ZeRO-2 gathers
    and reduce-scatters every micro-batch."""
    cluster = load_cluster("h100-80g")
    comm, grads = {}, {}
    for engine in ("autopar", "llama3-4d", "deepspeed"):
        for pp in (1, 2):
            for m in (2, 8):
                config = ParallelConfig(dp=16, tp=8, pp=pp, zero_stage=2, num_microbatches=m,
                                        precision=BF16, engine=engine)
                stage = estimate(llama8b, cluster, config).stages[0]
                comm[engine, pp, m], grads[engine, pp] = stage.dp_comm_s, stage.memory.grads
    for engine in ("autopar", "llama3-4d"):
        assert comm[engine, 2, 8] == pytest.approx(comm[engine, 2, 2])
        assert comm[engine, 1, 8] == pytest.approx(4 * comm[engine, 1, 2])
        # whole in the reduce dtype, where DeepSpeed's ZeRO-2 holds a 1/dp share
        assert grads[engine, 2] == pytest.approx(16 * grads["deepspeed", 2])
        assert grads[engine, 1] == pytest.approx(grads["deepspeed", 1])
    # one bucket per block: every reduce-scatter after the backward, the first block's gather
    # before the forward and the rest beside it
    stage_params = 16 * 2.18e8 / 8
    config = ParallelConfig(dp=16, tp=8, pp=2, zero_stage=2, precision=BF16, engine="llama3-4d")
    sync = step_sync(stage_params, 0.0, config, cluster, 2, 4, units=16)
    assert not sync.grad_overlaps and sync.param_overlaps
    assert sync.param_first_s == pytest.approx(sync.param_s / 16, rel=0.05)
    assert step_sync_exposed(sync, 1.0, cluster.device.overlap, first_forward_s=1.0) >= \
        sync.grad_s + sync.param_first_s


def test_megatron_core_gathers_parameters_beside_the_first_forward() -> None:
    gpu = Overlap(concurrent=1.0, compute_slowdown=0.2)
    after = StepSync(4.0, 0.5, True, 2.0)
    beside = StepSync(4.0, 0.5, True, 2.0, param_overlaps=True, param_first_s=0.25)
    exposed_after = step_sync_exposed(after, 10.0, gpu, first_forward_s=5.0)
    exposed_beside = step_sync_exposed(beside, 10.0, gpu, first_forward_s=5.0)
    assert exposed_after - exposed_beside == pytest.approx(2.0 - 0.25 - 0.2 * 1.75)
    # a forward too short to hide it leaves the rest exposed
    assert step_sync_exposed(beside, 10.0, gpu, first_forward_s=0.0) == \
        pytest.approx(exposed_after)
    assert not ENGINE_FEATURES["megatron"].grad_reduce_overlap
    assert ENGINE_FEATURES["megatron-core"].tp_comm_overlap


def test_a_megatron_core_command_pins_the_engine_and_round_trips(tmp_path) -> None:
    command = ("torchrun pretrain_gpt.py --tensor-model-parallel-size 4 --sequence-parallel "
               "--pipeline-model-parallel-size 2 --use-distributed-optimizer "
               "--tp-comm-overlap --overlap-grad-reduce --overlap-param-gather --bf16")
    pins = constraints_from_megatron(command, None)
    assert pins["engine"] == "megatron-core" and pins["zero_stage"] == 1
    assert "engine" not in constraints_from_megatron(command.replace(
        " --tp-comm-overlap --overlap-grad-reduce --overlap-param-gather", ""), None)
    path = tmp_path / "megatron.sh"
    path.write_text(command)
    assert load_constraints(str(path))["engine"] == "megatron-core"
    # another pin naming the engine wins
    assert load_constraints([str(path), "engine=megatron"])["engine"] == "megatron"
    graph = autopar.capture("tiny-llama", seq=64)
    plan = autopar.plan(graph, devices=16, global_batch=32, cluster="h100-80g",
                        constraints=str(path))
    assert plan.engine == "megatron-core" and plan.mesh["tp"] == 4
    emitted = megatron_command(plan)
    assert {"--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather"} <= \
        set(emitted.split())
    again = tmp_path / "again.sh"
    again.write_text(emitted)
    assert load_constraints(str(again))["engine"] == "megatron-core"


@pytest.mark.parametrize("engine", ["megatron-core", "llama3-4d"])
def test_compile_refuses_to_run_a_plan_priced_for_another_engine(engine, tmp_path) -> None:
    out = tmp_path / "art"
    made = cli_here("compile", "tiny-llama", "--devices", "8", "--seq", "32", "--global-batch",
                    "8", "--cluster", "h100-80g", "--constraints",
                    f"engine={engine},tp=2,pp=1", "--out", str(out), "-q")
    assert made.returncode == 0, made.stderr
    assert not (out / "train.py").exists()
    assert (out / "megatron.sh").exists() == (engine == "megatron-core")
    _assert_one_line_error(cli_here("run", str(out), "--steps", "1"), f"engine={engine}",
                           "engine=autopar")


def test_what_each_engine_does_not_offer_is_refused_and_megatron_fsdp_round_trips(
        tmp_path) -> None:
    graph = autopar.capture("tiny-llama", seq=32)
    plan = autopar.plan(graph, devices=8, global_batch=8, constraints="engine=megatron")
    plan.zero_stage = 3
    assert "ZeRO-2/3 on Megatron-LM" in plan_unsupported(plan)
    plan.offload = ["optimizer"]
    for engine, refused in (("megatron-core", "offload on Megatron-LM"),
                            ("llama3-4d", "offload in Llama 3's 4D setup")):
        plan.engine = engine
        assert refused in plan_unsupported(plan)
    # Megatron-Core's own FSDP shards parameters (ZeRO-3): priced per block, and its command
    # says so and reads back as the same stage
    fsdp = autopar.plan(graph, devices=8, global_batch=8,
                        constraints="engine=megatron-core,zero_stage=3,tp=1,pp=1")
    assert fsdp.zero_stage == 3 and fsdp.engine == "megatron-core"
    command = megatron_command(fsdp)
    assert "--use-megatron-fsdp" in command and "optim_grads_params" in command
    path = tmp_path / "fsdp.sh"
    path.write_text(command)
    pins = load_constraints(str(path))
    assert pins["engine"] == "megatron-core" and pins["zero_stage"] == 3


def test_pipeline_sends_are_priced_as_each_engine_sends_them_under_sequence_parallelism() -> None:
    """autopar's runtime gathers a stage's output before sending it (whole activations), so
    its send is priced whole; Megatron sends the sequence shard, 1 / tp of it."""
    graph = autopar.capture("tiny-llama", seq=32)
    cluster = load_cluster("h100-80g")
    config = ParallelConfig(pp=2, tp=2, sequence_parallel=True, num_microbatches=2,
                            precision=BF16)
    whole = cached_block_cost(graph, 1, replace(config, sequence_parallel=False), cluster,
                              "none").output_bytes
    ours = cached_block_cost(graph, 1, config, cluster, "none").output_bytes
    megatron = cached_block_cost(graph, 1, replace(config, engine="megatron"), cluster,
                                 "none").output_bytes
    assert whole > 0 and ours == whole and megatron == pytest.approx(whole / 2)
