"""Apply the distribution plan the passes recorded: DDP or FSDP2 on the compiled model.

The apply_plan stage (passes/apply/apply_plan.py) calls `apply_plan(program)` after every pass. With
a `DdpPlan` or an `FsdpPlan` on `program.plan` it takes this process's `ProcessState` (initialising
the process group from torchrun's environment), takes the program's `ParallelDims` (the degrees
the planners read) and every mesh and process group from its `Meshes` (core/parallel_dims.py,
the only maker of them), and:

- world of one: applies nothing and says so in the plan (`plan.applied`) and the report;
- DDP: torch's DistributedDataParallel wraps a small module that owns the compiled model and
  runs its forward. The DDP object is kept in the compiled model's `__dict__`, outside
  `_modules`, and the compiled model's forward calls through it (the OUTER_FORWARD slot), so
  state_dict keys, parameter names and `isinstance` stay the user's while every DDP feature
  (buckets, no_sync, comm hooks, buffer broadcast, static graph) is torch's own. The comm hook
  from `plan.comm_hook` is registered on it.
- FSDP2: `fully_shard` on each planned unit (repeated blocks, then the root) over a 1-D mesh, or
  a (replicate, shard) mesh for hsdp, with the MixedPrecisionPolicy and CPUOffloadPolicy of the
  plan. fully_shard re-classes modules as dynamic subclasses, as we do, so keys and `isinstance`
  hold; parameters become DTensor shards. With `load_from_rank0` (cpu_ram_efficient_loading)
  the shards then take rank 0's values (execution.rank0_loading) instead of a broadcast of the
  whole model before sharding.
- tp: torch's parallel styles over the "tp" dim (execution.apply_tp); with fsdp/zero2/zero3
  beside it, then fully_shard per unit over "dp", with execution.tp_fsdp placing what FSDP2 cannot
  shard as is (fused parts on dim 0) and summing the gradients of the parameters tp keeps whole
  but reads on split heads.

Region graphs capture new call signatures while the model runs (a last, smaller batch); that
capture traces the module's own forward, so the hooks FSDP installed on the module (which
all-gather and free parameters) are made to stand aside while `region.capturing()` is true:
the outer call's hooks have already gathered the parameters the capture reads.

What was applied is kept as an `Applied` record in the compiled model's APPLIED slot,
which the Runtime reads for no_sync, gradient sync and hook statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from retarget.core.capturing import capturing
from retarget.core.modules import release_replaced
from retarget.core.parallel_dims import Meshes, ParallelDims
from retarget.core.plans import AppliedPlan, FsdpPlan
from retarget.core.slots import APPLIED, OUTER_FORWARD
from retarget.execution.context.apply import apply_context, refuse_unlaunched
from retarget.execution.module_call import own_forward
from retarget.execution.process import ProcessState
from retarget.execution.rank0_loading import collect_full, load_shards
from retarget.execution.step_guard import install_guard
from retarget.ir.program import Program


@dataclass
class Applied:
    """What apply_plan did to a compiled model: the meshes it took (core.parallel_dims), the
    objects it made (a DDP wrapper, FSDP2 units, tp's split modules, a pipeline run) and what
    wraps the model, as the report says it (`wrapped`)."""

    state: ProcessState
    meshes: Meshes
    wrapped: str = ""
    ddp: Any = None
    hook_state: Any = None
    fsdp_modules: list[nn.Module] = field(default_factory=list)
    mesh: Any = None
    """The mesh the report shows: fully_shard's under fsdp alone, the whole mesh under tp or pp."""
    tp_modules: list[str] = field(default_factory=list)
    """Paths of the modules tp split (fsdp+tp: FSDP2 units too, mesh the (dp, tp) mesh)."""
    context_mesh: Any = None
    """Under cp: the (dp, cp) mesh (DDP or FSDP2 span every rank; loaders divide over dp)."""
    pipeline: Any = None
    """Under pp: the PipelineRun (this rank's stages and the schedule)."""

    @property
    def dims(self) -> ParallelDims:
        return self.meshes.dims

    def data_state(self) -> ProcessState:
        """This process as data parallelism sees it: under tp, pp or cp, rank, world and
        process group of the dp ranks only (the ranks of a tp, pp or cp group share a batch:
        loaders divide and gather_for_metrics gathers over dp); otherwise the process itself."""
        data = self.meshes.data()
        if data is None:
            return self.state
        rank, size, group = data
        if group is None:
            return dataclasses.replace(self.state, rank=0, world_size=1)
        return dataclasses.replace(self.state, rank=rank, world_size=size, group=group)

    @property
    def fsdp_root(self) -> nn.Module | None:
        return self.fsdp_modules[-1] if self.fsdp_modules else None

    @property
    def syncs_data_parallel(self) -> bool:
        """Whether a data-parallel wrapper (DDP, or FSDP2 outside a pipeline) syncs gradients
        at backward, which accumulation holds back (the pipeline schedule syncs its stages')."""
        return self.pipeline is None and (self.ddp is not None or self.fsdp_root is not None)


def applied_of(module: nn.Module) -> Applied | None:
    """The Applied record of a compiled model, or None when compile_for applied no plan."""
    return APPLIED.get(module)


def apply_plan(program: Program) -> None:
    """Realise program.plan's DDP or FSDP record on program.module (see the module docstring).

    Then install the optimizer step guard where a plain optimizer would step wrongly
    (step_guard.install_guard: FSDP-replaced parameters, zero1, fp16).
    """

    _apply(program)
    install_guard(program)


def _apply(program: Program) -> None:
    plan = program.plan
    record = plan.distribution
    if record is None and plan.tp is None and plan.pp is None:
        return
    state = ProcessState.current()
    planned = program.world.size
    describe = program.world.describe()
    if state.world_size == 1:
        if plan.cp is not None:
            refuse_unlaunched(program.module, plan.cp.size)
        plan.applied = AppliedPlan(applied=False, reason="world size is 1")
        planned_for = "" if planned == 1 else f" (the plan shown is for {describe})"
        program.notes.append(
            f"plan not applied: world size is 1, the model trains in this one process"
            f"{planned_for}. Launch N processes (retarget launch --num_processes N, or torchrun) "
            "to distribute it"
        )
        return
    if planned != state.world_size:
        raise ValueError(
            f"compile_for planned '{program.target}' for {describe}, but this run "
            f"has {state.world_size} processes: drop world_size= (the run's own size is used) "
            f"or launch {planned} processes"
        )
    module = program.module
    if state.device.type != "cpu":
        module.to(state.device)
    dims = program.parallel_dims()
    unplanned = dims.unplanned(plan)
    if unplanned:
        raise ValueError(
            f"'{program.target}' lays out a mesh with {', '.join(unplanned)} dimension(s) but "
            "their planning pass made no record (disabled?): enable it, or drop the part from "
            "the target"
        )
    meshes = Meshes(dims, state.device.type)
    if plan.pp is not None:
        applied = _apply_pp(program, state, meshes)
    elif plan.tp is not None:
        applied = _apply_tp(program, state, meshes)
    elif plan.ddp is not None:
        applied = _apply_ddp(program, state, meshes)
    else:
        applied = _apply_fsdp(program, plan.fsdp, state, meshes)
    if plan.cp is not None:
        applied.context_mesh = apply_context(module, plan.cp.layout_key, meshes)
    APPLIED.set(module, applied)
    plan.applied = AppliedPlan(
        applied=True,
        world_size=state.world_size,
        backend=state.backend,
        device=str(state.device),
        wrapped=_wrapped(applied),
    )


def _wrapped(applied: Applied) -> str:
    text = applied.wrapped
    if applied.context_mesh is not None:
        text += f" + context parallel (mesh dp x cp {tuple(applied.context_mesh.shape)})"
    return text


# -- DDP -------------------------------------------------------------------------------------


class DdpModule(nn.Module):
    """What DistributedDataParallel wraps: owns the compiled model, runs its recorded call
    (`own_forward`: below the compiled model's own forward, which would call DDP again)."""

    def __init__(self, compiled: nn.Module):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return own_forward(self.compiled, *args, **kwargs)


def _apply_ddp(program: Program, state: ProcessState, meshes: Meshes) -> Applied:
    from torch.nn.parallel import DistributedDataParallel

    from retarget.execution.comm_hooks import build_hook

    module = program.module
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    ddp = DistributedDataParallel(
        DdpModule(module), device_ids=device_ids, **program.plan.ddp.options
    )
    applied = Applied(state, meshes, wrapped="DistributedDataParallel", ddp=ddp)
    hook_plan = program.plan.comm_hook
    if hook_plan is not None:
        applied.hook_state, hook = build_hook(hook_plan)
        ddp.register_comm_hook(applied.hook_state, hook)
        if applied.hook_state:
            applied.wrapped += f" + {type(applied.hook_state).__name__}"
    OUTER_FORWARD.set(module, functools.partial(_through_ddp, ddp, module))
    return applied


def _through_ddp(ddp: nn.Module, compiled: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call the model through DDP, in the train/eval mode the user set on the model."""
    if ddp.training != compiled.training:
        ddp.train(compiled.training)
    return ddp(*args, **kwargs)


# -- FSDP2 -----------------------------------------------------------------------------------


# -- pipeline parallel -----------------------------------------------------------------------


def _apply_pp(program: Program, state: ProcessState, meshes: Meshes) -> Applied:
    """This rank's pipeline stages (execution.pipeline_stages); under fsdp+pp on a (pp, dp)
    mesh, each stage module sharded with fully_shard over "dp"; under tp+pp a "tp" dimension
    last ((pp, tp), or (pp, dp, tp) for fsdp+tp+pp: torchtitan's order), each stage's blocks
    split over it."""
    from retarget.execution.pipeline_stages import apply_pipeline

    example = program.example
    ids = example.kwargs.get("input_ids", example.args[0] if example.args else None)
    broadcast_module_states(program.module)  # every stage starts from rank 0's weights
    pp, fsdp, tp = program.plan.pp, program.plan.fsdp, program.plan.tp
    shard = fully_shard_arguments(fsdp, meshes.fsdp()) if fsdp is not None else None
    run = apply_pipeline(program.module, program.original, pp, ids, state, meshes, shard, tp)
    mesh = meshes.mesh if len(meshes.dims.used) > 1 else None
    text = f"pipeline stage {run.rank} of {run.plan.size} ({run.plan.schedule})"
    if meshes.has("dp"):
        text += " + fully_shard per stage"
    if meshes.has("tp"):
        text += " + tp over each stage's blocks"
    if mesh is not None:
        text += f" ({meshes.dims.describe()})"
    return Applied(state, meshes, wrapped=text, pipeline=run, mesh=mesh)


# -- tensor parallel (+ FSDP2 over dp) -------------------------------------------------------


def _apply_tp(program: Program, state: ProcessState, meshes: Meshes) -> Applied:
    """torch's parallel styles over the "tp" dim, then fully_shard over "dp" for fsdp+tp."""
    from retarget.execution.apply_tp import apply_tp
    from retarget.execution.tp_fsdp import shard_placement, sum_partial_gradients_over_tp
    from retarget.execution.tp_regions import recapture_split_regions

    tp = program.plan.tp
    fsdp = program.plan.fsdp
    mesh = meshes.mesh
    if tp.async_tp:  # shard_tp admits it on CUDA, inductor and sequence parallelism only
        enable_async_tp(mesh["tp"])
    # Parameters tp leaves whole (norms, embeddings) must start equal on every rank, and
    # distribute_tensor scatters rank 0's copy of the split ones.
    broadcast_module_states(program.module)
    if fsdp is None:
        done = apply_tp(program.module, tp, mesh["tp"])
        recapture_split_regions(program, tp)
        release_replaced(program.original, program.module)
        text = f"tensor parallel x {len(done)} modules (mesh {tuple(mesh.shape)})"
        return Applied(state, meshes, wrapped=text, mesh=mesh, tp_modules=done)
    # Under FSDP2 the parameters tp keeps whole but reads on split heads are summed over tp
    # through Partial gradients (execution.tp_fsdp), not by apply_tp's hook on a parameter that
    # fully_shard replaces.
    partial = [p for p, r in tp.rules.items() if r.style == "replicate_grad_allreduce"]
    rules = {p: r for p, r in tp.rules.items() if p not in partial}
    done = apply_tp(program.module, dataclasses.replace(tp, rules=rules), mesh["tp"])
    recapture_split_regions(program, tp)
    for path in partial:
        sum_partial_gradients_over_tp(program.submodule(path), mesh["tp"])
    # tp's fused parts on dim 0 need a placement of their own (execution.tp_fsdp).
    applied = _apply_fsdp(program, fsdp, state, meshes, placement=shard_placement(meshes))
    applied.tp_modules = done
    return applied


def enable_async_tp(mesh: Any) -> None:
    """Symmetric memory for the tp group and inductor's micro-pipelining pass, which rewrites
    all-gather + matmul and matmul + reduce-scatter pairs into overlapped kernels."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh.get_group().group_name)
    inductor_config._micro_pipeline_tp = True


def _apply_fsdp(
    program: Program,
    plan: FsdpPlan,
    state: ProcessState,
    meshes: Meshes,
    placement: Callable[[nn.Parameter], Any] | None = None,
) -> Applied:
    """fully_shard per unit over `meshes.fsdp()`: a 1-D mesh of the dp (or dp x cp) ranks, the
    2-D (replicate, shard) one for hsdp, "dp" of the (dp, tp) mesh under tp, where `placement`
    is fully_shard's shard_placement_fn."""
    from torch.distributed.fsdp import fully_shard

    full: dict[str, torch.Tensor] = {}
    under_tp = meshes.has("tp")
    if not under_tp:  # under tp, _apply_tp broadcast every state before splitting
        if plan.load_from_rank0:  # rank 0's whole parameters, sent shard by shard below
            full = collect_full(program.module)
        elif plan.sync_module_states:
            broadcast_module_states(program.module)
    shard_over = meshes.fsdp()
    kwargs = fully_shard_arguments(plan, shard_over, placement)
    applied = Applied(state, meshes, mesh=meshes.mesh if under_tp else shard_over)
    for unit in plan.units:
        module = program.submodule(unit.path) if unit.path else program.module
        with hooks_skip_captures(module):
            fully_shard(module, **kwargs)
        applied.fsdp_modules.append(module)
        # The user's model (kept for unwrap) would pin a full copy of every replaced parameter:
        # freed unit by unit, so the whole model and all shards are never alive together.
        release_replaced(program.original, program.module)
    applied.wrapped = (
        f"fully_shard x {len(applied.fsdp_modules)} (mesh {tuple(applied.mesh.shape)})"
    )
    if plan.load_from_rank0:
        load_shards(program.module, full, state.device)
    if plan.state_dict == "full":
        program.module.register_state_dict_post_hook(_full_state_dict)
        program.module.register_load_state_dict_pre_hook(_shard_loaded_state)
    return applied


def fully_shard_arguments(
    plan: FsdpPlan, mesh: Any, placement: Callable[[nn.Parameter], Any] | None = None
) -> dict[str, Any]:
    """fully_shard's keyword arguments for the plan's units, sharding over `mesh`."""
    return {
        "mesh": mesh,
        "shard_placement_fn": placement,
        "reshard_after_forward": plan.reshard_after_forward,
        "mp_policy": mixed_precision_policy(plan),
        "offload_policy": offload_policy(plan),
    }


def mixed_precision_policy(plan: FsdpPlan) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if plan.param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, plan.param_dtype),
        reduce_dtype=getattr(torch, plan.reduce_dtype),
    )


def offload_policy(plan: FsdpPlan) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.offload else OffloadPolicy()


def tensor_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `tensor`'s values: itself, or a tensor subclass's inner tensors
    (torchao's quantized weights: their codes and scales), which collectives take."""
    if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [part for name in names for part in tensor_parts(getattr(tensor, name))]


def broadcast_module_states(module: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers (sync_module_states)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            for part in tensor_parts(tensor.data):
                dist.broadcast(part, src=0)


@contextlib.contextmanager
def hooks_skip_captures(module: nn.Module) -> Iterator[None]:
    """Forward hooks registered on `module` inside this block do nothing during a capture."""
    before = (set(module._forward_pre_hooks), set(module._forward_hooks))
    yield
    for hooks, old in zip((module._forward_pre_hooks, module._forward_hooks), before, strict=True):
        for key in set(hooks) - old:
            hooks[key] = _unless_capturing(hooks[key])


def _unless_capturing(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        return None if capturing() else hook(*args, **kwargs)

    return guarded


def _full_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict=full: DTensor shards become whole tensors (all ranks must call state_dict)."""
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[key] = value.full_tensor()


def _shard_loaded_state(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """state_dict=full: whole tensors loaded into DTensor parameters become this rank's shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = _sharded_state(module)
    for key, value in list(state_dict.items()):
        target = current.get(key[len(prefix) :] if key.startswith(prefix) else key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            state_dict[key] = distribute_tensor(
                value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )


def _sharded_state(module: nn.Module) -> dict[str, Any]:
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    return named
