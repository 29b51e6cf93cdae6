"""The parallel choice the cost model evaluates (the search's decision variables)."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.precision import Precision

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
OFFLOADS = ("optimizer", "params", "activations")
# whose collectives the estimate prices: autopar's runtime (FSDP2 / DDP / DTensor / pipelining)
# or, for comparison with published runs and for exporting plans, Megatron-LM's (2021, no
# overlap), Megatron-Core's (its overlap options on), DeepSpeed's, Llama 3's 4D setup (FSDP
# that keeps parameters gathered through the step, TP, PP), or llm-foundry's (Composer on
# PyTorch FSDP1, MPT's fused cross-entropy); what each issues, overlaps and keeps for its loss
# is autopar.cost.engines.ENGINE_FEATURES
ENGINES = ("autopar", "megatron", "megatron-core", "deepspeed", "llama3-4d", "llm-foundry")
# how context parallelism exchanges attention's keys and values across the cp ranks (see
# autopar.cost.context_parallel): ring passes K/V around the ring, alltoall (DeepSpeed-Ulysses)
# re-shards q, k, v and the output from sequence to heads, hybrid is all-to-all inside a node
# and a ring across nodes (Megatron-Core's hierarchical "a2a+p2p"), allgather gathers the
# whole sequence's K/V before attention (Llama 3's, Megatron-Core's "all_gather")
CP_MODES = ("ring", "alltoall", "hybrid", "allgather")


@dataclass(frozen=True)
class BlockLayout:
    """One block type's tensor-parallel layout: op positions within the block."""

    column: tuple[int, ...] = ()  # column-parallel linears (output features split)
    row: tuple[int, ...] = ()  # row-parallel linears (input split; output reduced)
    sharded: tuple[int, ...] = ()  # ops whose outputs are split over tp
    # key/value projections of an attention with fewer kv heads than tp: each rank computes
    # the one kv head its query heads read (replicated over tp / kv ranks): (op, kv heads)
    kv: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class TPLayouts:
    """The per-op layouts chosen for each block type at one tensor-parallel degree. A block
    type without an entry uses the Megatron layout read off the dataflow."""

    tp: int
    by_type: tuple[tuple[int, BlockLayout], ...] = ()

    def get(self, type_id: int) -> BlockLayout | None:
        for tid, layout in self.by_type:
            if tid == type_id:
                return layout
        return None


@dataclass(frozen=True)
class ParallelConfig:
    """One point of the search space.

    Mesh axes: ``pp x dp x cp x ep x tp`` devices, ``tp`` innermost (consecutive ranks, so it
    stays inside a node), then ``ep``, ``cp``, ``dp``, ``pp`` outermost. Expert parallelism
    borrows data-parallel devices: dense parameters are replicated over ``dp x cp x ep`` ranks
    (their data parallel degree), expert parameters are split over ``ep`` and replicated over
    ``dp x cp``; the batch is split over ``dp x ep``. Context parallelism splits each sequence
    over ``cp`` ranks (each holds ``seq / cp`` tokens): its ranks hold the same parameters and
    reduce gradients with the data-parallel ranks (torchtitan's ``dp_shard_cp`` mesh).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    sequence_parallel: bool = False
    zero_stage: int = 0
    microbatch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per device
    recompute: tuple[str, ...] | str = "none"  # one mode for all blocks, or one per block
    offload: frozenset[str] = field(default_factory=frozenset)
    stages: tuple[tuple[int, int], ...] | None = None  # [start, end) block ranges; None = balanced
    precision: Precision | None = None  # None: the device's default (see cost.precision)
    engine: str = "autopar"
    tp_layouts: TPLayouts | None = None  # None: the Megatron layout of every block type
    vocab_parallel: bool = True  # False: embedding tables stay whole on every tp rank
    # GShard expert capacity: each expert takes at most this many even shares of a sequence's
    # token copies, the rest dropped (None: dropless routing)
    capacity_factor: float | None = None

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def data_parallel(self) -> int:
        """Ways the batch is split (dense data-parallel degree)."""
        return self.dp * self.ep

    @property
    def dense_replicas(self) -> int:
        """Ranks holding the same dense parameters, over which their gradients are reduced
        and ZeRO shards them: ``dp x cp x ep``."""
        return self.dp * self.cp * self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same expert parameters: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.data_parallel * self.microbatch_size * self.num_microbatches

    def recompute_of(self, block_index: int) -> str:
        if isinstance(self.recompute, str):
            return self.recompute
        return self.recompute[block_index]

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep", "cp", "microbatch_size", "num_microbatches",
                     "virtual_stages"):
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError("zero_stage must be 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}")
        bad = set(self.offload) - set(OFFLOADS)
        if bad:
            raise ValueError(f"unknown offload {sorted(bad)}; use {OFFLOADS}")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError("capacity_factor must be positive (or None: dropless)")
        if self.tp_layouts is not None and self.tp_layouts.tp != self.tp:
            raise ValueError(f"tp_layouts are for tp={self.tp_layouts.tp}, the config has "
                             f"tp={self.tp}")
