"""Accelerate's Accelerator methods that the other mixins do not define.

A mixin of `Accelerator`: one-object prepare_* methods (they go through `prepare`, so the order
rules stay the runtime's), unscale_gradients, the save/load pre-hooks, set_trigger/check_trigger,
join_uneven_inputs and trigger_sync_in_backward. Each has Accelerate's signature; an argument
that cannot be honoured raises an error naming it.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from retarget.runtime.data.sharded_loader import ShardedDataLoader


class ParityMethods:
    """prepare_model, prepare_optimizer, prepare_data_loader, prepare_scheduler,
    unscale_gradients, register_save_state_pre_hook, register_load_state_pre_hook,
    set_trigger, check_trigger, join_uneven_inputs, trigger_sync_in_backward."""

    flag_tensor: torch.Tensor | None = None
    """set_trigger's flag (None until it is first set)."""

    # -- one object at a time ----------------------------------------------------------------

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """`prepare(model)`; with evaluation_mode=True the prepared model is put in eval mode
        (it is compiled for the target all the same: without backward nothing is synced)."""
        prepared = self.prepare(model, device_placement=_placement(device_placement))
        return prepared.eval() if evaluation_mode else prepared

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        """`prepare(optimizer)`: its model must have been prepared already."""
        return self.prepare(optimizer, device_placement=_placement(device_placement))

    def prepare_data_loader(
        self,
        data_loader: DataLoader,
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Callable | None = None,
    ) -> ShardedDataLoader:
        """`prepare(data_loader)`."""
        if slice_fn_for_dispatch is not None:
            raise ValueError(
                "prepare_data_loader(slice_fn_for_dispatch=...) cannot be honoured: in dispatch "
                "mode rank 0 collates each rank's own batch, so nothing is sliced"
            )
        return self.prepare(data_loader, device_placement=_placement(device_placement))

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """`prepare(scheduler)`: its optimizer must have been prepared already."""
        return self.prepare(scheduler)

    # -- the step ------------------------------------------------------------------------------

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """fp16: divide the gradients of `optimizer` (or of every prepared optimizer, a list
        also works) by the loss scale now, once per step, as Accelerate does before clipping by
        hand. Without a loss scaler it does nothing."""
        chosen = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        wanted = None if optimizer is None else {id(_inner(o)) for o in chosen}
        from retarget.runtime.optimizers import unscale_agreed

        for runtime in self._runtimes():
            if runtime.scaler is None:
                continue
            for held in runtime._optimizers:
                if wanted is None or id(_inner(held)) in wanted:
                    unscale_agreed(runtime.scaler, held, self.state)

    # -- save_state / load_state hooks -------------------------------------------------------

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, weights, output_dir)` runs before save_state writes. `weights` are
        the models' state dicts; changing that list (Accelerate's way of saving a model
        oneself) is refused: models are written through torch.distributed.checkpoint."""
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, input_dir)` runs before load_state reads; removing models from the
        list is refused (every prepared model is restored)."""
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    @property
    def _save_hooks(self) -> dict[int, Callable[..., None]]:
        return self.__dict__.setdefault("_save_state_hooks", OrderedDict())

    @property
    def _load_hooks(self) -> dict[int, Callable[..., None]]:
        return self.__dict__.setdefault("_load_state_hooks", OrderedDict())

    def _run_save_hooks(self, output_dir: str) -> None:
        models = list(self._models)
        weights = [model.state_dict() for model in models] if self._save_hooks else []
        before = [id(w) for w in weights]
        for hook in list(self._save_hooks.values()):
            hook(models, weights, output_dir)
        if [id(w) for w in weights] != before or len(models) != len(self._models):
            raise NotImplementedError(
                "register_save_state_pre_hook: the hook changed `models` or `weights`; models "
                "are saved through torch.distributed.checkpoint here, so a model cannot be left "
                "out or saved in another form: save it yourself after save_state"
            )

    def _run_load_hooks(self, input_dir: str) -> None:
        models = list(self._models)
        for hook in list(self._load_hooks.values()):
            hook(models, input_dir)
        if len(models) != len(self._models):
            raise NotImplementedError(
                "register_load_state_pre_hook: the hook removed models; every prepared model "
                "is restored by load_state here: load it yourself after load_state"
            )

    # -- breaking out of a loop together -------------------------------------------------------

    def set_trigger(self) -> None:
        """Raise this process's flag; `check_trigger()` is then True on every process."""
        self.__dict__["flag_tensor"] = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called set_trigger since the last check (all-reduced; every
        process must call it). Resets the flag when True."""
        flag = self.__dict__.get("flag_tensor")
        if flag is None:
            flag = torch.tensor(0, device=self.device)
        if self.reduce(flag, "sum").item() >= 1:
            self.__dict__["flag_tensor"] = torch.tensor(0, device=self.device)
            return True
        return False

    # -- uneven inputs, forced sync ------------------------------------------------------------

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None):
        """Train on processes with different numbers of batches (torch's Join), as Accelerate.

        `even_batches` overrides the prepared loaders' setting inside (dispatching loaders
        keep theirs). With uneven batches a process that runs out shadows the others'
        gradient all-reduces until all are done, and DDP then makes the weights agree. A
        prepared model stands for its DDP wrapper; sharded (FSDP) models cannot join.
        """
        if self.num_processes == 1:
            yield  # nothing to join, as in Accelerate (which warns)
            return
        from torch.distributed.algorithms.join import Join

        members = [_joinable(obj) for obj in joinables]
        overridden = [(loader, loader.options.even_batches) for loader in self._dataloaders]
        overridden = [(loader, even) for loader, even in overridden if not loader._dispatch]
        if even_batches is None:
            even_batches = self.even_batches
        try:
            for loader, _ in overridden:
                loader.set_even_batches(even_batches)
            with Join(members, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for loader, even in overridden:
                loader.set_even_batches(even)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """The next backward of `model` synchronises gradients: it does already outside
        `no_sync` and accumulation; inside a micro-step that does not sync it is refused."""
        if not model.runtime.sync_gradients:
            raise NotImplementedError(
                "trigger_sync_in_backward inside accumulate() on a micro-step that does not "
                "sync: the window holds these gradients back; use it outside accumulate()"
            )
        yield


def _joinable(obj: Any) -> Any:
    """What torch's Join takes for `obj`: a prepared model's DDP wrapper, or a Joinable."""
    from torch.distributed.algorithms.join import Joinable

    if isinstance(obj, Joinable):
        return obj
    applied = (
        obj.runtime.applied if isinstance(obj, nn.Module) and hasattr(obj, "runtime") else None
    )
    if applied is not None and applied.ddp is not None:
        return applied.ddp
    raise NotImplementedError(
        f"join_uneven_inputs cannot join {type(obj).__name__}: only a model prepared for ddp "
        "(its DDP wrapper) or a torch Joinable; sharded (fsdp) models have no join hook"
    )


def _placement(device_placement: bool | None) -> Any:
    return None if device_placement is None else [device_placement]


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)
