"""`prepare_pippy` (Accelerate's `accelerate.inference.prepare_pippy`): pipeline-parallel
inference of a model over the launched processes, one stage per process.

Accelerate cuts where its big-model device map would put the next GPU (memory, not work);
here `split_points="auto"` asks the compiler's pp planner (passes/shard/stage_cuts.py
`stage_starts`): the repeated blocks find_blocks found, balanced by the FLOPs annotate_shapes
counts on the example (planned in this process, `compile_for(model, "single")`), stages
beginning inside a block only when whole blocks balance poorly and no_split_module_classes
is not given. A list of module paths is used as given. torch.distributed.pipelining runs it,
as in Accelerate: `pipeline()` exports the model on one microbatch and splits it,
`build_stage` gives this process its stage, `ScheduleGPipe` (forward only: no loss) drives the
microbatches; values a stage would send past the next one are forwarded stage by stage
(execution/pipeline_split.py), each sent value contiguous.

A transformers model's `config.use_cache` is turned off, with a warning (its KV cache object
cannot travel between stages; Accelerate's export fails on it). The model is returned with its
`forward` replaced (as Accelerate does): every process calls it
with the same inputs; the last process gets the output (the others None), or every process
with `gather_output=True`. Differences from Accelerate, each an error naming the value rather
than a silent change: the example is the batch a call passes (every call passes that many
rows, which `num_chunks` must divide: Accelerate traces on the whole example and pads calls);
a split point that is no module of the model; more or fewer split points than processes - 1.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from retarget.driver.compile import compile_for
from retarget.execution.pipeline_split import prepare_split, run_generated_code
from retarget.execution.process import ProcessState
from retarget.passes.shard.stage_cuts import stage_starts


def prepare_pippy(
    model: nn.Module,
    split_points: str | list[str] | None = "auto",
    no_split_module_classes: list[str] | None = None,
    example_args: tuple[Any, ...] | None = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool | None = False,
) -> nn.Module:
    """Wrap `model` for pipeline-parallel inference over the launched processes (see the
    module docstring)."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    state = ProcessState.current()
    processes = state.world_size
    chunks = num_chunks or processes
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    rows = _rows(args, kwargs)
    if rows % chunks:
        raise ValueError(
            f"prepare_pippy: num_chunks={chunks} does not divide the example's {rows} rows; every "
            "call is cut into num_chunks equal microbatches: pass an example batch of a multiple "
            "of num_chunks rows (the batch each call will pass)"
        )
    points = _split_points(model, split_points, no_split_module_classes, args, kwargs, processes)
    model.hf_split_points = points
    if processes == 1:
        return model
    micro = rows // chunks
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) and "use_cache" not in kwargs:
        # transformers' KV cache is no tensor torch's export can return through the stages
        config.use_cache = False
        warnings.warn(
            f"prepare_pippy: {type(model).__name__}.config.use_cache set to False: a KV cache "
            "cannot be returned through pipeline stages (calls return no past_key_values)",
            stacklevel=2,
        )

    def first_rows(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[:micro]
        return value

    pipe = pipeline(
        model,
        mb_args=tree_map(first_rows, args),
        mb_kwargs=tree_map(first_rows, kwargs),
        split_spec={point: SplitPoint.BEGINNING for point in points},
    )
    prepare_split(pipe)
    run_generated_code(pipe.get_stage_module(state.rank))
    stage = pipe.build_stage(state.rank, device=state.device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks)
    model.pippy_stage = schedule
    model._original_forward = model.forward

    def forward(*call_args: Any, **call_kwargs: Any) -> Any:
        got = _rows(call_args, call_kwargs)
        if got != rows:
            raise ValueError(
                f"prepare_pippy: a call with {got} rows; the stages were traced for the "
                f"example's {rows} ({chunks} microbatches of {micro}): every call passes that "
                "many"
            )
        if state.rank == 0:
            output = schedule.step(*call_args, **call_kwargs)
        else:
            output = schedule.step()
        last = processes - 1
        if not gather_output:
            return output if state.rank == last else None
        box = [output if state.rank == last else None]
        dist.broadcast_object_list(box, src=last)
        return box[0]

    model.forward = forward
    return model


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The batch size: dim 0 of the first tensor among the arguments."""
    for value in tree_flatten((args, kwargs))[0]:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    raise ValueError(
        "prepare_pippy: no tensor in example_args / example_kwargs to take the batch size from; "
        "pass the inputs of one call"
    )


def _split_points(
    model: nn.Module,
    split_points: str | list[str] | None,
    no_split: list[str] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    processes: int,
) -> list[str]:
    """The module paths the stages after the first begin at: the planner's ("auto"), or the
    list given, checked."""
    if split_points in ("auto", None):
        if processes == 1:
            return []
        example: Any = kwargs if kwargs and not args else args
        program = compile_for(model, "single", example_inputs=example, world_size=1).program
        # no_split_module_classes: stages begin at block boundaries only
        return stage_starts(program, processes, "blocks" if no_split else "auto")
    if isinstance(split_points, str):
        split_points = [split_points]
    points = list(split_points)
    modules = dict(model.named_modules())
    missing = [p for p in points if p not in modules]
    if missing:
        raise ValueError(
            f"prepare_pippy: split_points {missing} are not modules of "
            f"{type(model).__name__} (e.g. {next(iter(n for n in modules if n), '')!r})"
        )
    if processes > 1 and len(points) != processes - 1:
        raise ValueError(
            f"prepare_pippy: {len(points)} split_points make {len(points) + 1} stages, but "
            f"{processes} processes run one each: give {processes - 1}"
        )
    return points
