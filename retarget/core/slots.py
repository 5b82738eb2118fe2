"""Slots: the values retarget keeps in a module object's `__dict__`, each declared once here.

`nn.Module.__setattr__` registers a Module or Parameter value as a child or a parameter (which
would change `state_dict` keys and `named_modules`), and plain attributes show up in `repr` and
`vars`. A slot writes into `module.__dict__` directly under a `_retarget_` key, so the user's
model keeps its keys, children and hooks; and every such value is listed here with its writer:

    slot           holds                                            written by
    PROGRAM        the compiled model's Program                     driver.compile
    RUNTIME        its Runtime, made on first use                   driver.compiled
    OUTER_FORWARD  the call the compiled forward goes through (DDP) execution.apply_plan
                   (tp loss_parallel: torch's loss_parallel())     execution.apply_tp
    APPLIED        what apply_plan applied (an Applied record)      execution.apply_plan
    STEP_GUARD     the optimizer StepGuard                          execution.step_guard
    RECORD         how its calls run: one frozen ModuleRecord       capture_regions,
                   (region, path, autocast, checkpoint;             insert_autocast,
                   core.module_record)                              checkpoint_blocks
    BINDINGS       per graph, the graph-private values bound to it  ir.region
    BLOCK_WALK     a repeat's modules, for its call signature/hooks  ir.call_key
    LAST_CALL      a repeat's last call signature and its graph     ir.region (ir.call_key)
    AUTOCAST_EVAL  whether an FP8 module runs FP8 in eval mode      kernels.fp8.backends
    TE_RECIPE      a Transformer Engine module's recipe             kernels.fp8.backends
    DISK_WEIGHTS   per tensor name, the file/key it is mapped from  bigmodel.load_checkpoint
    LOAD_FAILED    why a checkpoint load left the model unusable    bigmodel.load_checkpoint
    OFFLOAD        the offload hooks of a dispatched model          bigmodel.dispatch
    XLA_STEPS      the step counter of a model on XLA devices      execution.xla_placement
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from torch import nn

T = TypeVar("T")


class Slot(Generic[T]):
    """One named value in a module's `__dict__`."""

    def __init__(self, name: str):
        self.key = f"_retarget_{name}"

    def get(self, module: nn.Module, default: Any = None) -> T | Any:
        return module.__dict__.get(self.key, default)

    def set(self, module: nn.Module, value: T) -> T:
        module.__dict__[self.key] = value
        return value

    def pop(self, module: nn.Module, default: Any = None) -> T | Any:
        return module.__dict__.pop(self.key, default)

    def setdefault(self, module: nn.Module, default: T) -> T:
        return module.__dict__.setdefault(self.key, default)

    def __repr__(self) -> str:
        return f"Slot({self.key!r})"


PROGRAM: Slot[Any] = Slot("program")
RUNTIME: Slot[Any] = Slot("runtime")
OUTER_FORWARD: Slot[Any] = Slot("outer_forward")
APPLIED: Slot[Any] = Slot("applied")
STEP_GUARD: Slot[Any] = Slot("step_guard")
RECORD: Slot[Any] = Slot("record")
BINDINGS: Slot[dict] = Slot("bindings")
BLOCK_WALK: Slot[Any] = Slot("block_walk")
LAST_CALL: Slot[tuple] = Slot("last_call")
AUTOCAST_EVAL: Slot[bool] = Slot("autocast_eval")
TE_RECIPE: Slot[Any] = Slot("te_recipe")
DISK_WEIGHTS: Slot[dict] = Slot("disk_weights")
LOAD_FAILED: Slot[str] = Slot("load_failed")
OFFLOAD: Slot[Any] = Slot("offload")
XLA_STEPS: Slot[Any] = Slot("xla_steps")
