"""Plan records: what the passes decide and the runtime applies, as frozen typed values.

Passes run before (and without) a process group. What needs one is recorded on `program.plan`
and realised later by `retarget.execution.apply_plan` (DDP, FSDP2, comm hooks), the Runtime (loss
scaler, ZeroRedundancyOptimizer) and the optimizer guard; the report prints the same records.

    field         record          written by               read by
    ddp           DdpPlan         shard_ddp                apply_plan, report
    zero1         Zero1Plan       shard_optimizer_state    Runtime.prepare, optimizer guard
    fsdp          FsdpPlan        shard_fsdp               apply_plan, memory estimate, report
    comm_hook     CommHookPlan    comm_hook                apply_plan (execution.comm_hooks)
    loss_scaler   LossScalerPlan  insert_autocast (fp16)   Runtime (runtime.scaler)
    fp8           Fp8Plan         swap_fp8 (msamp)         the user (MS-AMP's optimizer)
    stream        StreamPlan      plan_stream              apply_stream (execution.stream), report
    tp            TpPlan          shard_tp                 apply_plan (execution.apply_tp), report
    applied       AppliedPlan     apply_plan               Runtime, optimizer guard, report

Each record is frozen: a pass replaces a field, nobody edits a record in place. `to_dict()`
gives the JSON form the report's `to_dict()["plan"]` carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from retarget.core.world import World


def _json(value: Any) -> Any:
    if isinstance(value, World):
        return {"size": value.size, "local_size": value.local_size, "source": value.source}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


@dataclass(frozen=True, kw_only=True)
class DdpBucket:
    """One gradient bucket DDP all-reduces, in launch order."""

    parameters: tuple[str, ...]
    numel: int
    mib: float


@dataclass(frozen=True, kw_only=True)
class DdpPlan:
    """Replicate with torch's DistributedDataParallel."""

    strategy: str
    """ddp or zero1 (the target's strategy)."""
    world: World
    """The world the plan was made for; apply_plan refuses a run of another size."""
    options: Mapping[str, Any]
    """DistributedDataParallel's keyword arguments."""
    parameters: int
    """Trainable elements every rank holds and all-reduces."""
    buckets: tuple[DdpBucket, ...]
    """The buckets DDP builds (reverse definition order, 1 MiB first bucket)."""


@dataclass(frozen=True, kw_only=True)
class Zero1Plan:
    """Shard optimizer state over the DDP ranks (ZeroRedundancyOptimizer)."""

    optimizer: str
    """The class runtime.prepare wraps the user's optimizer in."""
    world: World
    per_rank: tuple[int, ...]
    """Elements of optimizer state each rank holds (ZeroRedundancyOptimizer's greedy split)."""


@dataclass(frozen=True, kw_only=True)
class FsdpUnit:
    """One fully_shard call."""

    path: str
    """The module's path ("" is the root, always the last unit)."""
    block: str
    parameters: int
    per_rank: tuple[int, ...]
    """Elements each rank holds, in rank order."""
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class FsdpPlan:
    """Shard with FSDP2: units, mesh, mixed precision and offload policies."""

    strategy: str
    """fsdp, zero3, zero2 or hsdp."""
    world: World
    mesh_shape: tuple[int, ...]
    """(world,) or, for hsdp, (replicate, shard)."""
    mesh_dims: tuple[str, ...]
    reshard_after_forward: bool
    sync_module_states: bool
    load_from_rank0: bool = False
    """cpu_ram_efficient_loading: after sharding, every rank takes its shards of rank 0's values
    (the other ranks' own weights, placeholders or not, are never read)."""
    state_dict: str
    """sharded (DTensor shards) or full (whole tensors, gathered on every rank)."""
    param_dtype: str | None
    """MixedPrecisionPolicy.param_dtype (None: no policy, everything in float32)."""
    reduce_dtype: str | None
    offload: bool
    pin_memory: bool
    units: tuple[FsdpUnit, ...]

    @property
    def shard_size(self) -> int:
        """Processes one parameter is sharded over (the mesh's last dimension)."""
        return self.mesh_shape[-1]


@dataclass(frozen=True, kw_only=True)
class CommHookPlan:
    """A DDP communication hook: a 16-bit cast all-reduce, or PowerSGD."""

    part: str
    """fp16-comm, bf16-comm or powersgd (the target part)."""
    kind: str
    """cast or powersgd."""
    dtype: str | None = None
    """cast: the dtype buckets are all-reduced in."""
    powersgd: Mapping[str, Any] = field(default_factory=dict)
    """powersgd: its options (rank, start_iter, min_compression_rate, error_feedback,
    warm_start, wrapper)."""

    def describe(self) -> str:
        """One line for the report: which hook, and what it sends."""
        if self.kind == "cast":
            return (
                f"{self.part}: buckets all-reduced in {self.dtype} (half the bytes of "
                "float32), divided by the world size before the sum"
            )
        o = self.powersgd
        wrapped = "" if o["wrapper"] == "none" else f", sent in {o['wrapper']} (comm wrapper)"
        return (
            f"powersgd: rank-{o['rank']} approximation after {o['start_iter']} plain all-reduce "
            f"steps, for matrices compressed at least {o['min_compression_rate']}x; "
            f"error_feedback={o['error_feedback']}, warm_start={o['warm_start']}{wrapped}"
        )


@dataclass(frozen=True, kw_only=True)
class LossScalerPlan:
    """fp16's dynamic loss scaling (torch.amp.GradScaler's options)."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    def options(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Fp8Plan:
    """What an FP8 backend hands the training loop (MS-AMP's own optimizer)."""

    backend: str
    optimizer: Any = None


@dataclass(frozen=True, kw_only=True)
class StreamPlan:
    """Inference with weights off the execution device (`stream[...]`).

    The pass sizes the blocks against the budget and records the `device_map` (module path ->
    execution device or `source`), the execution device and the blocks that are never split;
    applying it fills in where the tensors went (`folder`, `units`, `offloaded_bytes`).
    """

    source: str
    """"disk" or "cpu": where the weights that do not fit the budget live."""
    prefetch: int
    max_memory: int | float | None
    """Bytes of resident weights, a share of the model's, or None (free memory)."""
    device_map: Mapping[str, str] = field(default_factory=dict)
    main_device: str = "cpu"
    """The device every block runs on."""
    blocks: tuple[str, ...] = ()
    """Module paths whose weights come in together (find_blocks' repeats)."""
    folder: str = ""
    offloaded_bytes: int = 0
    units: int = 0

    def describe(self) -> str:
        where = f"{self.units} blocks from {self.source}" if self.units else "nothing offloaded"
        return f"stream: {where}, prefetch {self.prefetch}" + (
            f", folder {self.folder}" if self.folder else ""
        )


@dataclass(frozen=True, kw_only=True)
class XlaPlan:
    """The model on an XLA device (`xla[...]`), and under SPMD how each parameter is laid out.

    `shards` maps each parameter sharded over the mesh to its spec (dim 0 on the "fsdp" axis);
    every other parameter is replicated. `devices` is the mesh size (1 without SPMD).
    """

    spmd: bool
    sharding: str
    """"fsdp" (dim 0 of the repeated blocks' parameters over the mesh) or "replicate"."""
    devices: int
    platform: str
    shards: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)
    replicated: tuple[str, ...] = ()
    sharded_numel: int = 0
    total_numel: int = 0

    def per_device_numel(self) -> int:
        """Parameter elements one device holds."""
        return self.total_numel - self.sharded_numel + self.sharded_numel // max(1, self.devices)

    def describe(self) -> str:
        how = (
            f"SPMD over {self.devices} {self.platform} devices, {len(self.shards)} parameters "
            f"sharded on dim 0, {len(self.replicated)} replicated; "
            f"{self.per_device_numel():,} of {self.total_numel:,} elements per device"
            if self.spmd
            else f"one {self.platform} device"
        )
        return f"xla: {how}"


#: The layouts a TpRule may name; each is one of torch.distributed.tensor.parallel's styles.
TP_STYLES = {
    "colwise": "ColwiseParallel(): weight (and bias) sharded on the output features",
    "rowwise": "RowwiseParallel(): weight sharded on the input features, output all-reduced",
    "colwise_rep": "ColwiseParallel(output_layouts=Replicate()): outputs gathered (LM head)",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate()): vocab-parallel embedding",
    "sequence_parallel": "SequenceParallel(): norm/dropout sharded on the sequence dim",
    "replicate": "kept whole on every rank",
    "replicate_grad_allreduce": "kept whole, but read on one rank's heads (a per-head norm): "
    "its gradient is partial on each rank and is all-reduced over the tp ranks",
}


@dataclass(frozen=True, kw_only=True)
class TpRule:
    """How one module is split: a style of TP_STYLES and why."""

    style: str
    reason: str
    sequence: str = ""
    """With sequence parallelism, where the module meets the residual stream that is split on
    the sequence dim (dim 1) between blocks: "gather" (its input is split on the sequence and
    all-gathered first: a block's colwise Linears, a replicated LM head), "scatter" (its output
    is reduce-scattered onto the sequence: a block's rowwise Linears, the input embedding),
    "scatter_input" (a replicated first block whose whole input, made by glue that computes on
    the stream, is cut to this rank's slice: no communication), "gather_output" (a replicated
    last block whose output is all-gathered whole for glue or a head that needs it), or ""
    (neither)."""
    vocab_output: bool = False
    """loss_parallel's LM head: the logits stay a DTensor split over the vocabulary (the last
    dim), which cross entropy reads under torch's `loss_parallel()`."""


@dataclass(frozen=True, kw_only=True)
class TpPlan:
    """Tensor parallelism (`tp[...]`): module path -> style, derived from the regions' graphs
    (plan=auto) or read from a hand plan, plus the module attributes that hold a full width and
    are divided by the degree (a head count)."""

    size: int
    """The tensor-parallel degree (the mesh's "tp" dimension)."""
    source: str
    """"auto" or the hand plan's PKG.MODULE:NAME (or "config.base_model_tp_plan")."""
    rules: Mapping[str, TpRule] = field(default_factory=dict)
    """Module path (as in the user's named_modules) -> rule, in module order."""
    attribute_fixes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Module path -> {attribute: value on each rank}, e.g. {"num_heads": 4} at size 2 of 8."""
    fused: Mapping[str, int] = field(default_factory=dict)
    """Module path -> parts fused along its sharded dim (3 for GPT-2's c_attn q|k|v): each part
    is split on its own, so every rank holds its slice of q, of k and of v."""
    fused_widths: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Module path -> the widths of fused parts of unequal sizes along its sharded dim (Phi3's
    q|k|v under GQA), each split on its own: rank r holds [q_r|k_r|v_r], stored as rank r's
    block of a parameter whose rows are in rank order (core.tp_split_dims.RowOrder)."""
    fused_whole: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Module path -> indices of its `fused_widths` parts every rank holds whole, beside the
    split ones (Falcon's one-head k and v): their gradients are summed over the tp ranks."""
    sequence_parallel: bool = False
    """The residual stream between blocks is split on the sequence dim (rules' `sequence`)."""
    loss_parallel: bool = False
    """The LM head's logits stay split over the vocabulary (its rule's `vocab_output`)."""
    async_tp: bool = False
    """Inductor micro-pipelines the sequence collectives with the matmuls (CUDA only)."""
    per_rank_numel: int = 0
    total_numel: int = 0
    blocks: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Repeated block path -> (parameter elements one rank holds, elements in all)."""

    def describe(self) -> str:
        styles: dict[str, int] = {}
        for rule in self.rules.values():
            styles[rule.style] = styles.get(rule.style, 0) + 1
        split = ", ".join(f"{n} {s}" for s, n in styles.items()) or "nothing split"
        text = (
            f"tp[size={self.size}] ({self.source}): {split}; "
            f"{self.per_rank_numel:,} of {self.total_numel:,} parameter elements per rank"
        )
        if self.sequence_parallel:
            bounds = [r.sequence for r in self.rules.values()]
            text += (
                f"; sequence_parallel: residual stream split on the sequence, "
                f"{bounds.count('gather')} modules all-gather it, "
                f"{bounds.count('scatter')} reduce-scatter onto it"
            )
            for path, rule in self.rules.items():
                if rule.sequence == "scatter_input":
                    text += f"; split at {path}'s input (after the glue)"
                if rule.sequence == "gather_output":
                    text += f"; gathered at {path}'s output"
        if self.loss_parallel:
            heads = [p for p, r in self.rules.items() if r.vocab_output]
            text += f"; loss_parallel: {', '.join(heads) or 'no'} logits split over the vocabulary"
        return text


@dataclass(frozen=True, kw_only=True)
class CpPlan:
    """Context parallelism (`cp[...]`): the sequence split over a group of `size` ranks (the
    mesh's innermost "cp" dim; the data-parallel ranks are the world over `size`)."""

    size: int
    attention: str
    """"ring", "allgather" or "ulysses" (execution/context/attention.py)."""
    balanced: bool
    """Zig-zag chunks: rank i holds chunks i and 2N-1-i of 2N."""
    layout_key: int
    """The key of the layout the attention op reads (the process group is bound at apply)."""
    implementation: str
    """The attention implementation name registered with transformers for this model."""
    attention_modules: tuple[str, ...] = ()
    """Paths of the attention modules whose calls are split."""
    sliding_windows: Mapping[str, int] = field(default_factory=dict)
    """Attention module path -> sliding window, where the model's config gives one."""
    sequence: int = 0
    """The example's sequence length (whole) and each rank's share of it."""
    per_rank_sequence: int = 0
    data_parallel: int = 1
    """world / size: the ranks that read different batches."""

    def describe(self) -> str:
        balance = "zig-zag chunks" if self.balanced else "contiguous chunks"
        share = (
            f"a sequence of {self.sequence} is {self.per_rank_sequence} positions per rank"
            if self.sequence
            else "each call's sequence is cut into 1/size per rank"
        )
        return (
            f"cp[size={self.size}] ({self.attention} attention, {balance}): "
            f"{len(self.attention_modules)} attention modules split; {share}; "
            f"{self.data_parallel} data-parallel group(s)"
        )


@dataclass(frozen=True, kw_only=True)
class PpStage:
    """One pipeline stage: the repeated blocks it runs (and the glue before or after them)."""

    index: int
    blocks: tuple[str, ...]
    """Paths of the repeated blocks it runs, whole or in part, in order; the first stage also
    runs the glue before the blocks (embeddings), the last the glue after them (final norm,
    head, loss)."""
    start: str = ""
    """The module it begins at: its first block, or a module inside it when the plan cuts
    inside blocks ("" for the first stage: the model's start)."""
    cost: int
    """Estimated forward FLOPs of the stage (its blocks', plus the head's on the last)."""
    rank: int = 0
    """The rank that runs it: stage i on rank i mod size (interleaved schedules loop)."""


def stage_imbalance(stages: tuple[PpStage, ...]) -> float:
    """Largest stage cost over the mean stage cost (1.0: perfectly balanced)."""
    costs = [s.cost for s in stages]
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean else 1.0


@dataclass(frozen=True, kw_only=True)
class PpPlan:
    """Pipeline parallelism (`pp[...]`): contiguous runs of the repeated blocks, K stages per
    rank (K > 1 for interleaved schedules), balanced by FLOPs; torch.distributed.pipelining
    runs the schedule."""

    size: int
    schedule: str
    microbatches: int
    stages: tuple[PpStage, ...]
    stages_per_rank: int = 1
    split_points: tuple[str, ...] = ()
    """The block each stage after the first begins with (torch's SplitPoint.BEGINNING)."""
    microbatch_rows: int = 0
    """Rows per microbatch of the example batch (every batch must have this many rows x M)."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Names of each weight shared by several modules (an LM head tied to the embedding):
    every stage using it holds it, and their gradients are summed after each step."""
    dp: int = 1
    """fsdp+pp: the ranks each stage runs on, FSDP2 sharding it (the mesh is (pp, dp))."""
    inside_blocks: bool = False
    """Whether some stage begins inside a block (cuts=auto, whole blocks balancing poorly)."""
    autocast: str | None = None
    """pp+bf16: the dtype each stage's forward runs under torch.autocast in ("bfloat16")."""
    checkpoint_every: int = 0
    """pp+ac: every n-th repeated block (the n-th, 2n-th, ...) is recomputed in backward;
    0: none."""
    compile: dict[str, Any] | None = None
    """pp+compile: torch.compile's keyword arguments for each repeated block of a stage."""

    @property
    def bubble(self) -> float:
        """The idle fraction of a step for the schedule: (p - 1) / (m + p - 1), and
        (p - 1) / (K m + p - 1) with K stages per rank (interleaving shortens the ramp); for
        zero-bubble an upper bound (it fills part of the ramp with weight-gradient work)."""
        work = self.stages_per_rank * self.microbatches
        return (self.size - 1) / (work + self.size - 1)

    def stages_of(self, rank: int) -> tuple[PpStage, ...]:
        """The stages rank `rank` runs, in order."""
        return tuple(stage for stage in self.stages if stage.rank == rank)

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean stage cost (1.0: perfectly balanced)."""
        return stage_imbalance(self.stages)

    def describe(self) -> str:
        return (
            f"pp[size={self.size}] ({self.schedule}, {self.microbatches} microbatches"
            + (f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else "")
            + f"): {len(self.stages)} stages of "
            f"{', '.join(str(len(s.blocks)) for s in self.stages)} "
            f"blocks; imbalance (max / mean stage FLOPs) {self.imbalance:.2f}; bubble "
            f"{self.bubble:.0%}"
            + "".join(f"; {' = '.join(names)} tied (gradients summed)" for names in self.tied)
            + (
                f"; each stage on {self.dp} ranks, fsdp over them (mesh pp x dp)"
                if self.dp > 1
                else ""
            )
            + (
                f"; cut inside blocks, at {', '.join(self.split_points)}"
                if self.inside_blocks
                else ""
            )
            + (f"; each stage under torch.autocast({self.autocast})" if self.autocast else "")
            + (
                "; every block recomputed in backward"
                if self.checkpoint_every == 1
                else f"; every {self.checkpoint_every}th block recomputed in backward"
                if self.checkpoint_every
                else ""
            )
            + (
                f"; each block compiled (torch.compile backend={self.compile['backend']})"
                if self.compile
                else ""
            )
        )


@dataclass(frozen=True, kw_only=True)
class AppliedPlan:
    """What apply_plan did in this process."""

    applied: bool
    reason: str = ""
    """Why nothing was applied (applied=False)."""
    world_size: int = 1
    backend: str = ""
    device: str = ""
    wrapped: str = ""
    """What wraps the model: DistributedDataParallel (+ hook state) or fully_shard x N."""


@dataclass
class Plan:
    """The records of one Program; a field is None until its pass (or apply_plan) sets it."""

    ddp: DdpPlan | None = None
    zero1: Zero1Plan | None = None
    fsdp: FsdpPlan | None = None
    comm_hook: CommHookPlan | None = None
    loss_scaler: LossScalerPlan | None = None
    fp8: Fp8Plan | None = None
    stream: StreamPlan | None = None
    xla: XlaPlan | None = None
    tp: TpPlan | None = None
    cp: CpPlan | None = None
    pp: PpPlan | None = None
    applied: AppliedPlan | None = None

    @property
    def distribution(self) -> DdpPlan | FsdpPlan | None:
        """The DDP or FSDP record, whichever the target asked for."""
        return self.ddp or self.fsdp

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the records that are set, by field name."""
        return {
            f.name: _json(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
