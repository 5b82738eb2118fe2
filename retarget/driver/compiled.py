"""CompiledModule: what compile_for returns.

The rewritten root is re-classed as `Compiled<YourModel>(CompiledModule, YourModel)`: it *is* an
instance of the user's class (HF methods, `config`, `generate` keep working), its state_dict keys
and parameter names are the original's, and it adds `report`, `history`, `program` and
`unwrap()`. When the whole model is one captured region, its forward runs the graph; otherwise
the original forward runs and the region modules inside it run theirs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from torch import nn

from retarget.core.capturing import capturing
from retarget.core.modules import sync_weights_into
from retarget.core.slots import OUTER_FORWARD, PROGRAM, RUNTIME
from retarget.execution import xla_device as xla
from retarget.execution.apply_plan import applied_of
from retarget.execution.module_call import RetargetedModule

if TYPE_CHECKING:
    from retarget.ir.program import PassRecord, Program
    from retarget.report.summary import Report
    from retarget.runtime.runtime import Runtime


class CompiledModule(RetargetedModule):
    """Mixin of the module returned by `retarget.compile_for`."""

    _retarget_mixin = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A wrapper apply_plan installed (DDP, tp's loss_parallel) runs the call; it reaches the
        # model's recorded call through module_call.own_forward, not through here again. A
        # capture traces the model's own code.
        outer = OUTER_FORWARD.get(self)
        if outer is not None and not capturing():
            return outer(*args, **kwargs)
        return super().forward(*args, **kwargs)

    @property
    def runtime(self) -> Runtime:
        """The training loop's helpers for this model: shard, prepare, backward, accumulate, ..."""
        from retarget.runtime.runtime import Runtime

        runtime = RUNTIME.get(self)
        if runtime is None:
            runtime = RUNTIME.set(self, Runtime(self))
        return runtime

    @property
    def program(self) -> Program:
        return PROGRAM.get(self)

    @property
    def report(self) -> Report:
        """What was captured and what each pass did; prints as a table, `.to_dict()` for JSON."""
        from retarget.report.summary import Report

        return Report(self.program)

    @property
    def history(self) -> list[PassRecord]:
        """Per pass: name, seconds, changed, stats, notes and region graph text after it."""
        return self.program.history

    def graphs(self, pass_name: str | None = None, when: str = "after") -> dict[str, str]:
        """Region graph code now, or right before/after the named pass."""
        if pass_name is None:
            return self.program.graph_text()
        return self.program.graphs_at(pass_name, when)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's `model.no_sync()`: forward and backward inside keep gradients local."""
        return self.runtime.no_sync()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # DDP's `.module`: scripts reach the model's attributes there
                return self
            raise

    def unwrap(self) -> nn.Module:
        """The original model object, carrying the current weights.

        Under fsdp/zero2/zero3/hsdp the original's parameters are emptied once FSDP2 shards the
        compiled model (`core.modules.release_replaced`: a rank holds its shards, not a full copy
        beside them). unwrap() gathers the full weights into those same Parameter objects: a
        collective that every rank must call, after which this rank holds a full copy again.

        Under pp each rank holds its own stages' weights only (the others are emptied):
        unwrap() broadcasts each stage's weights from its rank, also a collective.

            >>> model = compiled.unwrap()     # every rank, e.g. before generate() or export
        """
        original = self.program.original
        xla.settle([self])  # one sync, not a graph per tensor read out
        sync_weights_into(self, original)
        applied = applied_of(self)
        if applied is not None and applied.pipeline is not None:
            # Under pp each rank holds its stages only: the others' weights come from them.
            applied.pipeline.share_weights(original)
        return original
