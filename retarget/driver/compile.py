"""compile_for: capture -> Program -> pass pipeline -> CompiledModule."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import IO, Any

from torch import nn

from retarget.core.errors import EagerRegionWarning, TargetNotSupportedError
from retarget.core.modules import released, structural_copy, with_mixin
from retarget.core.slots import OFFLOAD, PROGRAM
from retarget.core.world import World, launch_environment, launched_target
from retarget.driver.compiled import CompiledModule
from retarget.execution.rank0_loading import asks_rank0_loading, give_placeholders
from retarget.ir.hooks import users_hooks_set_aside
from retarget.ir.program import ExampleInputs, Program
from retarget.passes.base import Pass
from retarget.passes.manager import PassManager
from retarget.passes.pipeline import build_pipeline, place_extra, settle_capture
from retarget.targets.grammar import Target, TargetError, parse_target
from retarget.targets.strategies import STRATEGIES


def compile_for(
    model: nn.Module,
    target: str | Target | None = None,
    *,
    example_inputs: Any = None,
    capture: str = "regions",
    verify: bool = False,
    disable: Iterable[str] = (),
    frontends: tuple[str, ...] | None = None,
    print_before: Iterable[str] = (),
    print_after: Iterable[str] = (),
    stream: IO[str] | None = None,
    world_size: int | None = None,
    extra_passes: Iterable[Pass] = (),
) -> CompiledModule:
    """Rewrite `model` for `target` and return it as a CompiledModule.

    `target` defaults to the one `retarget launch` exported (RETARGET_TARGET), else "single";
    in a run of several processes a target without a strategy (ddp, fsdp, ...) is refused.
    `example_inputs` follows how the model is called: a tuple is positional arguments, a dict is
    keyword arguments (the Hugging Face way), anything else is the one argument. Without it,
    regions are captured lazily at their first call. `capture` is "regions" (one graph per
    distinct repeated block, glue eager), "whole", "eager", or "auto": "regions" when a pass of
    the target reads or rewrites a graph, else nothing is captured (the blocks run their own
    forward, which their graphs would compute bit for bit; retarget.Accelerator's choice, as
    Accelerate captures nothing).
    `verify=True` checks after every pass that the model still computes what eager computes on
    the example inputs. `disable` names passes to skip; `print_before`/`print_after` name
    passes around which the region graphs are printed to `stream` (stderr by default).
    `world_size` is the number of processes a ddp/fsdp plan is made for (default: the run's
    own, from torchrun's environment, else 1);
    `extra_passes` are your own Pass instances, each placed by its contract right after the
    passes it requires or follows (else after the analyses), before the appliers;
    under a process group of more than one process the plan is applied (DDP or FSDP2),
    in a world of one it is recorded and the report says it was not applied.

        >>> compiled = retarget.compile_for(model, "single", example_inputs={"input_ids": ids})
        >>> print(compiled.report)

    The user's `model` object is never edited: the result is a structural copy that shares every
    parameter tensor with it; `compiled.unwrap()` gives `model` back with the current weights.
    One exception: once FSDP2 has sharded the compiled model, the parameters of `model` it
    replaced are emptied (same objects, no storage), so that a rank holds 1/N of the weights,
    not a full copy beside its shards; `unwrap()` gathers them back (every rank calls it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_for takes an nn.Module, got {type(model).__name__}")
    target = _resolve_target(target, world_size)
    if asks_rank0_loading(target) and _rank() not in (None, 0):
        give_placeholders(model)  # rank 0's values replace them after sharding
    _refuse_weightless(model)
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    passes = place_extra(
        build_pipeline(target, capture=capture, frontends=frontends), list(extra_passes)
    )
    print_before, print_after = tuple(print_before), tuple(print_after)
    passes = settle_capture(passes, graphs_wanted=bool(verify or print_before or print_after))
    manager = PassManager(
        passes,
        verify=verify,
        disable=disable,
        print_before=print_before,
        print_after=print_after,
        stream=stream,
    )
    program = new_program(model, target, example_inputs, capture, world_size)
    root = program.module
    # compile_for's probes are not the user's calls
    with users_hooks_set_aside(model, root) as program.parked_hooks:
        manager.run(program)  # the whole pipeline: analyses, rewrites and plans, appliers
    warn_eager_regions(program)
    note_lonely_processes(program)
    return root


def new_program(
    model: nn.Module, target: Target, example_inputs: Any, capture: str, world_size: int | None
) -> Program:
    """The Program of a structural copy of `model` (a CompiledModule), before any pass."""
    example = ExampleInputs.of(example_inputs)
    check_example_call(model, example)
    root = with_mixin(structural_copy(model), CompiledModule)
    program = Program(
        module=root,
        original=model,
        target=target,
        example=example,
        capture=capture,
        world=World.resolve(world_size),
    )
    PROGRAM.set(root, program)
    return program


def _rank() -> int | None:
    """This process's rank in a run of several processes, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    env = launch_environment()
    return env.rank if env.world_size > 1 else None


def check_example_call(model: nn.Module, example: ExampleInputs | None) -> None:
    """example_inputs must fit `model.forward` the way compile_for calls it (a tuple is the
    positional arguments, a dict the keyword arguments, anything else the one argument);
    refused before anything runs, naming the call, when it does not."""
    if example is None:
        return
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: the call itself will tell
        return
    try:
        signature.bind(*example.args, **example.kwargs)
    except TypeError as error:
        name = type(model).__name__
        if example.kwargs and not example.args:
            keys = ", ".join(f"{k}=..." for k in example.kwargs)
            how = f"a dict is passed as keyword arguments: {name}.forward({keys})"
            fix = (
                "if forward takes the dict itself, pass it as the one positional argument: "
                f"example_inputs=({{{', '.join(repr(k) + ': ...' for k in example.kwargs)}}},)"
            )
        elif example.args and not example.kwargs:
            how = f"a tuple is passed as positional arguments: {name}.forward(*example_inputs)"
            fix = "if forward takes the tuple itself, wrap it: example_inputs=(your_tuple,)"
        else:
            how, fix = f"{name}.forward(*args, **kwargs)", "match forward's signature"
        raise ValueError(
            f"example_inputs does not fit {name}.forward{signature}: {how} fails ({error}); {fix}"
        ) from None


def _refuse_weightless(model: nn.Module) -> None:
    """compile_for runs the model to capture it: its weights must be there (or mapped), except
    on the ranks other than 0 under cpu_ram_efficient_loading (given placeholders before)."""
    dispatched = OFFLOAD.get(model) is not None
    emptied = next((n for n, p in model.named_parameters() if released(p)), None)
    if emptied:
        raise TargetNotSupportedError(
            f"compile_for: the model's weights ({emptied}, ...) were emptied when an earlier "
            "compile_for sharded them with FSDP; call unwrap() on that compiled model (every "
            "rank) to gather them back first, or keep training the compiled model"
        )
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if dispatched or meta:
        what = (
            "is dispatched (its offloaded weights live outside it)"
            if dispatched
            else (f"has weights on the meta device ({meta})")
        )
        raise TargetNotSupportedError(
            f"compile_for: the model {what}; capture runs the model, so it needs its weights. "
            "Load the checkpoint memory-mapped (load_checkpoint_in_model(model, path, "
            "mmap=True): no memory is taken) and add the stream part to the target "
            "(e.g. 'bf16+stream[from=disk,max_memory=2GB]') to run it within a budget. "
            "To train sharded, only rank 0 needs the weights: "
            "'fsdp[cpu_ram_efficient_loading=true]' takes a meta model on the other ranks"
        )


def warn_eager_regions(program: Program) -> None:
    """One warning naming every region left eager, and the passes that fell back with it."""
    eager = [r for r in program.regions if r.eager_only]
    if not eager:
        return
    parts = []
    for region in eager:
        passes = sorted({name for name, _ in region.eager_forms})
        fallback = f"; passes in their eager form: {', '.join(passes)}" if passes else ""
        parts.append(f"{region.name} ({region.reason}{fallback})")
    warnings.warn(
        f"retarget: {len(eager)} region(s) run eagerly, not as captured graphs: "
        + "; ".join(parts)
        + ". Graph rewrites apply there in their module-level form; compiled.report has the "
        "detail",
        EagerRegionWarning,
        stacklevel=3,
    )


def note_lonely_processes(program: Program) -> None:
    """A target with nothing to distribute in a run of several processes (world_size given, so
    not refused): the report says each process trains alone."""
    world = launch_environment().world_size
    plan = program.plan
    if world > 1 and plan.distribution is None and plan.tp is None:
        program.notes.append(
            f"target '{program.target}' has no distribution part but this run has {world} "
            "processes: each one trains its own copy, gradients are not synchronised (add ddp "
            "or fsdp to the target)"
        )


def _resolve_target(target: str | Target | None, world_size: int | None) -> Target:
    """The target given; else the one `retarget launch` exported; else "single".

    A target without a distribution strategy (or "single") in a run of several processes is
    refused: every rank would train on its own, silently (Accelerate's failure mode under
    torchrun without a distributed config).
    """
    if target is None:
        target = launched_target() or "single"
    target = parse_target(target)
    env = launch_environment()
    processes = env.world_size if env.rank is not None else 1
    # tp and pp distribute by themselves (alone, each fills the world with one group).
    strategies = [
        n for n in target.names if (n in STRATEGIES and n != "single") or n in ("tp", "pp")
    ]
    if world_size is None and processes > 1 and not strategies:
        raise TargetError(
            f"target '{target}' trains on one process, but this run has {processes} processes "
            f"(WORLD_SIZE={processes}): each would train alone on its own data. Add a strategy "
            f"(ddp, fsdp, zero1, zero2, hsdp), e.g. 'ddp+{target}', or launch one process",
            part=str(target),
        )
    return target
