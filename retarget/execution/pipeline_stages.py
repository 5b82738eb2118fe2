"""Pipeline parallelism applied: this rank's stages of the model and torch's schedule over them.

apply_plan calls `apply_pipeline` with `plan.pp` (passes/shard/split_stages.py). The stages are
torch.distributed.pipelining's own: `pipeline()` exports the user's model (its logits for
`input_ids`) on one microbatch of the example and splits it before the block each later stage
begins with (`SplitPoint.BEGINNING`); `Pipe.build_stage` gives this rank its `PipelineStage`s
(one, or K under interleaved-1f1b: stage i runs on rank i mod size, torch's looped order),
whose parameters are the model's own Parameter objects (the compiled model shares them), so an
optimizer built on `compiled.parameters()` steps this rank's weights and skips the others
(they get no gradient here). The schedule (GPipe, 1F1B or interleaved 1F1B) cuts each batch
into the planned microbatches, runs forward and backward, computes transformers' loss from the
last stage's logits and averages the microbatches' gradients. Under pp+bf16 and pp+ac each of
this rank's stages runs under autocast and recomputes its blocks (stage_forward.py).

torch 2.13's stages treat every floating-point value a stage sends as an activation that needs
a gradient, and refuse one read by two later stages ("backward of skip connections not
supported yet"); a transformers decoder computes its rotary cos/sin and causal mask once,
before the first block, and hands them to every block, so with three stages or more the first
would send them to several. `pipeline_split.prepare_split` rewrites the split so that every
value goes to the next stage only, and contiguous (gloo receives no strided buffer).

torch's split gives a weight used by two stages (an LM head tied to the embedding) a copy in
each stage after the first, which no optimizer on `compiled.parameters()` would step;
`pipeline_split.use_original_parameters` puts the model's own Parameter back in every stage
module, so each rank's gradient lands on it; after the schedule's step the gradients of such a
weight are summed over the ranks whose stages use it (`PipelineRun.tied`), the same sum one
process makes, so the copies on those ranks take the same steps and stay equal. Its norm is
counted once, on the first of them, when `clip_grad_norm_` combines the stages' norms.

A rank keeps its stages' weights only: once the stages are built, the other stages'
parameters are emptied (`core.modules.release`, as fsdp empties the user's copies: same
Parameter objects, shapes and dtypes, one element of storage), so memory per rank is its
stages', not the model's. `PipelineRun.held` says which tensors are this rank's to save (its
stages' parameters and buffers; the first stage also any that no stage reads), and
`held_keys` names them in a state dict: save_state writes each stage's part from its own rank,
save_model gathers the parts on rank 0, and `unwrap()` gives every rank every stage's weights
(`share_weights`, a broadcast from each tensor's first owner, `PipelineRun.owners`, into fresh
storage for an emptied one).

`PipelineRun.forward_backward(batch)` is the training call (`compiled.runtime.forward_backward`):
every rank calls it with the same batch; it returns the batch's mean loss on every rank (the
last stage's, broadcast). A plain call of the compiled model would run one stage: it is
refused, naming forward_backward and unwrap().
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from retarget.core.modules import release, release_replaced, released
from retarget.core.parallel_dims import Meshes
from retarget.core.plans import PpPlan, TpPlan
from retarget.core.slots import OUTER_FORWARD
from retarget.execution.pipeline_split import (
    prepare_split,
    run_generated_code,
    use_original_parameters,
)
from retarget.execution.pipeline_tp import settle_gradients, split_stage_blocks
from retarget.execution.stage_forward import TRACED_PREFIX, run_stage_forward


class _Logits(nn.Module):
    """What the stages split: the model's logits for `input_ids` (the loss is the schedule's)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@dataclass(frozen=True)
class TiedWeight:
    """A weight several stages use: the ranks running them and a process group of those ranks."""

    param: nn.Parameter
    ranks: tuple[int, ...]
    group: Any


class PipelineRun:
    """This rank's stages and the schedule that drives them."""

    def __init__(
        self,
        plan: PpPlan,
        schedule: Any,
        rank: int,
        group: Any,
        storage: list[frozenset[int]],
        tied: list[TiedWeight],
        owners: dict[str, int],
        device: torch.device,
        frozen: list[nn.Parameter],
    ):
        self.plan = plan
        self.schedule = schedule
        self.rank = rank
        self.group = group
        #: Per rank, the storage (data_ptr) of the tensors its stages own (module docstring),
        #: as it was when the stages were built.
        self.storage = storage
        #: The weights several stages use, with the ranks that use them.
        self.tied = tied
        #: Per state dict key, the first rank whose stages own its tensor.
        self.owners = owners
        self.device = device
        #: The other stages' parameters, emptied here and not requiring grad until unwrap().
        self.frozen = frozen
        #: tp+pp: this rank's tp-split parameters, whose gradients are settled to their
        #: placements after each step (pipeline_tp.settle_gradients).
        self.split: list[nn.Parameter] = []
        #: This rank's stage modules (torch's split of the traced model), in stage order.
        self.stage_modules: list[nn.Module] = []

    @property
    def held(self) -> frozenset[int]:
        """The storage of the tensors this rank's stages own."""
        return self.storage[self.rank]

    def counted(self, params: list[Tensor]) -> list[Tensor]:
        """`params` without the tied weights whose norm another rank counts (the first rank
        using one counts it)."""
        elsewhere = {id(t.param) for t in self.tied if t.ranks[0] != self.rank}
        return [p for p in params if id(p) not in elsewhere]

    def sum_tied_gradients(self) -> None:
        """Sum the gradient of each tied weight over the ranks whose stages use it."""
        for tied in self.tied:
            if self.rank not in tied.ranks:
                continue
            if tied.param.grad is None:
                tied.param.grad = torch.zeros_like(tied.param)
            grad = tied.param.grad  # under fsdp+pp a DTensor: the same shard on every holder
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=tied.group)

    def held_keys(self, module: nn.Module) -> set[str]:
        """The keys of `module`'s state dict whose tensors this rank's stage owns."""
        return {
            key
            for key, tensor in module.state_dict(keep_vars=True).items()
            if isinstance(tensor, Tensor) and local_pointer(tensor) in self.held
        }

    def share_weights(self, module: nn.Module) -> None:
        """Give every rank the trained weights of every stage, in `module` (the user's model,
        its own stage's weights already synced into it): each tensor of its state dict is
        broadcast from the first rank whose stages own it (a collective); an emptied one gets
        fresh storage first (the same Parameter object)."""
        with torch.no_grad():
            for key, tensor in module.state_dict(keep_vars=True).items():
                owner = self.owners.get(key)
                if owner is None or not isinstance(tensor, Tensor):
                    continue
                empty = released(tensor)
                if empty and owner != self.rank:
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
                else:
                    buffer = tensor.data
                source = dist.get_global_rank(self.group, owner)
                dist.broadcast(buffer, src=source, group=self.group)
                if empty:
                    tensor.data = buffer
        for param in self.frozen:
            param.requires_grad_(True)
        self.frozen = []

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.plan.size - 1

    def forward_backward(self, batch: dict[str, Tensor]) -> Tensor:
        """Forward and backward of the whole batch through the pipeline; its mean loss."""
        ids, labels = batch["input_ids"], batch.get("labels")
        if labels is None:
            raise ValueError(
                "pp: forward_backward needs labels in the batch (the loss is the last stage's)"
            )
        expected = self.plan.microbatch_rows * self.plan.microbatches
        if ids.shape[0] != expected:
            raise ValueError(
                f"pp[microbatches={self.plan.microbatches}]: a batch of {ids.shape[0]} rows; "
                f"the stages were traced for {expected} rows ({self.plan.microbatch_rows} per "
                "microbatch): every batch needs that many"
            )
        losses: list[Tensor] = []
        if self.first:
            self.schedule.step(ids)
        elif self.last:
            self.schedule.step(target=labels, losses=losses)
        else:
            self.schedule.step()
        settle_gradients(self.split)
        self.sum_tied_gradients()
        loss = torch.stack(losses).mean().detach() if self.last else torch.zeros(())
        loss = loss.to(torch.float32)
        dist.broadcast(
            loss, src=dist.get_global_rank(self.group, self.plan.size - 1), group=self.group
        )
        return loss


def apply_pipeline(
    module: nn.Module,
    original: nn.Module,
    plan: PpPlan,
    example_ids: Tensor,
    state: Any,
    meshes: Meshes,
    shard: dict[str, Any] | None = None,
    tp: TpPlan | None = None,
) -> PipelineRun:
    """Trace and split `original`, build this rank's stages and schedule; wrap `module`'s
    calls. `meshes` has a "pp" dimension; under fsdp+pp a "dp" one too, and `shard` is
    fully_shard's arguments for each of this rank's stage modules; under tp+pp (fsdp+tp+pp) a
    "tp" dimension last, and each stage's blocks compute on DTensors over it (pipeline_tp.py)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        SplitPoint,
        pipeline,
    )

    group, rank = meshes["pp"].get_group(), meshes["pp"].get_local_rank()
    traced = pipeline(
        _Logits(original),
        (example_ids[: plan.microbatch_rows],),
        split_spec={f"model.{path}": SplitPoint.BEGINNING for path in plan.split_points},
    )
    prepare_split(traced)
    ranks = [stage.rank for stage in plan.stages]  # stage i runs on rank i mod size
    used = use_original_parameters(traced, original, len(ranks))
    mine = [stage.index for stage in plan.stages_of(rank)]
    split: dict[int, nn.Parameter] = {}
    if tp is not None:  # each block of this rank's stages on DTensors over "tp"
        blocks = list(dict.fromkeys(b for stage in plan.stages for b in stage.blocks))
        for index in mine:
            stage_module = traced.get_stage_module(index)
            split_stage_blocks(
                stage_module, blocks, TRACED_PREFIX, tp, original, meshes["tp"], split
            )
        swap_parameters(module, split)
        used = [{k: split.get(id(p), p) for k, p in stage.items()} for stage in used]
    tied = _tied_weights(used, ranks, meshes)
    stage_modules = [traced.get_stage_module(index) for index in mine]
    for stage_module in stage_modules:  # bf16 / ac inside the stage (stage_forward.py)
        run_generated_code(stage_module)  # every graph edit is made
        run_stage_forward(stage_module, plan, state.device.type)
    if shard is not None:
        replaced = _shard_stages(traced, mine, used, shard)
        # In the compiled model, and in the other ranks' stage modules too (never run here,
        # but then every rank finds each tensor in the same stages: `storage`). The user's
        # model keeps its own Parameters (emptied below, refilled by unwrap), as under fsdp.
        for tree in (module, traced.split_gm):
            swap_parameters(tree, replaced)
        tied = [dataclasses.replace(t, param=replaced.get(id(t.param), t.param)) for t in tied]
    storage = _rank_storage(traced, ranks, plan.size, module)
    owners = _owners(module, storage)
    stages = [traced.build_stage(index, state.device, group) for index in mine]
    # Only this rank's stages' weights stay: the others' are emptied (in both models: they
    # share them) and stop requiring grad meanwhile (torch's DCP fills a fresh optimizer's
    # state with a step over every parameter that requires grad, which would write into
    # them); unwrap() gives both back.
    release_replaced(original, module)
    frozen = []
    for param in {id(p): p for p in module.parameters()}.values():
        if local_pointer(param) not in storage[rank] and release(param) and param.requires_grad:
            param.requires_grad_(False)
            frozen.append(param)
    vocab = original.config.vocab_size

    def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
        return original.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    schedule_class = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved-1f1b": ScheduleInterleaved1F1B,
        "zero-bubble": ScheduleInterleavedZeroBubble,
    }[plan.schedule]
    # The looped schedules take this rank's list of stages, the others its one stage.
    driven = stages if plan.stages_per_rank > 1 else stages[0]
    schedule = schedule_class(driven, n_microbatches=plan.microbatches, loss_fn=loss_fn)
    OUTER_FORWARD.set(module, functools.partial(_refuse, plan))
    run = PipelineRun(plan, schedule, rank, group, storage, tied, owners, state.device, frozen)
    run.stage_modules = stage_modules  # fully_shard changed their classes, not the objects
    if tp is not None and shard is None:  # FSDP2 settles its own gradients
        run.split = list(split.values())
    return run


def _shard_stages(
    traced: Any, mine: list[int], used: list[dict[int, Any]], shard: dict[str, Any]
) -> dict[int, nn.Parameter]:
    """fully_shard each of this rank's stage modules over the dp ranks (one unit per stage:
    its graph reads every parameter itself); the sharded Parameter that replaced each original
    one, by the original's id. Refused: a weight two of this rank's stages use (each stage's
    fully_shard would make its own copy of it)."""
    from torch.distributed.fsdp import fully_shard

    seen: dict[int, int] = {}
    for index in mine:
        for key in used[index]:
            if key in seen:
                raise NotImplementedError(
                    f"fsdp+pp: a weight is used by stages {seen[key]} and {index}, which both "
                    "run on this rank; sharding them one by one would give each its own copy. "
                    "Use another pp[stages_per_rank=...] or pp without fsdp"
                )
            seen[key] = index
    replaced: dict[int, nn.Parameter] = {}
    for index in mine:
        stage_module = traced.get_stage_module(index)
        before = dict(stage_module.named_parameters(remove_duplicate=False))
        fully_shard(stage_module, **shard)
        for name, param in stage_module.named_parameters(remove_duplicate=False):
            if param is not before[name]:
                replaced[id(before[name])] = param
    return replaced


def swap_parameters(module: nn.Module, replaced: dict[int, nn.Parameter]) -> None:
    """Register `replaced[id(p)]` wherever `module`'s tree holds a parameter p in it."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in replaced:
                sub._parameters[name] = replaced[id(param)]


def local_pointer(tensor: Tensor) -> int:
    """Where a tensor's elements on this rank live: its own storage, or a DTensor's shard's."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).data_ptr()


def _tied_weights(used: list[dict[int, Any]], ranks: list[int], meshes: Meshes) -> list[TiedWeight]:
    """The weights used by stages on more than one rank (`ranks[i]`: stage i's pp rank), each
    with the process group of those ranks at this rank's position in the other dimensions
    (dp, tp: `Meshes.holders_group`, made on every rank in the same order)."""
    users: dict[int, list[int]] = {}
    params: dict[int, Any] = {}
    for stage, mine in enumerate(used):
        for key, param in mine.items():
            if ranks[stage] not in users.setdefault(key, []):
                users[key].append(ranks[stage])
            params[key] = param
    tied = []
    for key, holders in users.items():
        if len(holders) > 1:
            holders.sort()
            group = meshes.holders_group(tuple(holders))
            tied.append(TiedWeight(params[key], tuple(holders), group))
    return tied


def _rank_storage(
    traced: Any, ranks: list[int], size: int, model: nn.Module
) -> list[frozenset[int]]:
    """Per rank, the storage of the tensors it saves: its stages' parameters and buffers;
    rank 0's also those of `model` (the compiled model) that no stage holds (an unused one).
    Read before build_stage, and before the other stages' weights are emptied."""

    def storage(module: nn.Module) -> set[int]:
        tensors = [*module.parameters(), *module.buffers()]
        return {local_pointer(t) for t in tensors if t.numel()}

    parts: list[set[int]] = [set() for _ in range(size)]
    for index, rank in enumerate(ranks):
        parts[rank] |= storage(traced.get_stage_module(index))
    parts[0] |= storage(model) - set().union(*parts)
    return [frozenset(part) for part in parts]


def _owners(module: nn.Module, storage: list[frozenset[int]]) -> dict[str, int]:
    """Per state dict key of `module`, the first rank whose stages own its tensor (read before
    the other stages' weights are emptied: then only the key says whose a tensor is)."""
    owners = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, Tensor) and tensor.numel():
            pointer = local_pointer(tensor)
            owner = next((k for k, part in enumerate(storage) if pointer in part), None)
            if owner is not None:
                owners[key] = owner
    return owners


def _refuse(plan: PpPlan, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        f"this model runs as pp[size={plan.size}]: a call would run this rank's stage only. "
        "Train with loss = compiled.runtime.forward_backward(batch) (forward, backward and the "
        "mean loss on every rank); for generate() or evaluation, unwrap() the model (every "
        "rank calls it: it gives each rank every stage's trained weights)"
    )
