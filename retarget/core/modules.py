"""Module-tree helpers: structural copies and dynamic subclasses.

`compile_for` never edits the user's module objects. It works on a *structural copy*: every
nn.Module in the tree is copied shallowly (own `_modules`, `_parameters`, `_buffers` and hook
dicts) while parameters and buffers stay the very same tensors. Passes may then re-class, swap or
re-parent modules freely, optimizers built on either tree update the same weights, and tied
weights stay tied because a tensor shared in the original is shared in the copy.

Behaviour is added with dynamic subclasses (as FSDP2's `fully_shard` does): an instance of
`LlamaDecoderLayer` becomes a `RetargetedLlamaDecoderLayer(RetargetedModule, LlamaDecoderLayer)`,
so `isinstance` checks, attributes and state_dict keys are exactly the original's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

_SUBCLASSES: dict[tuple[type, type], type] = {}
#: A subclass with_mixin made -> the class it was made from.
_BASES: dict[type, type] = {}


def structural_copy(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """Copy the module tree without copying tensors; a module used twice is copied once."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    for name, child in module._modules.items():
        if child is not None:
            clone._modules[name] = structural_copy(child, memo)
    return clone


def with_mixin(module: nn.Module, mixin: type) -> nn.Module:
    """Re-class `module` in place as a subclass of (mixin, its class); idempotent."""
    cls = type(module)
    if isinstance(module, mixin):
        return module
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        name = f"{mixin.__name__.removesuffix('Module')}{cls.__name__}"
        _SUBCLASSES[key] = type(name, (mixin, cls), {"__module__": cls.__module__})
        _BASES[_SUBCLASSES[key]] = cls
    module.__class__ = _SUBCLASSES[key]
    return module


def base_class(module: nn.Module) -> type:
    """The class `module` had before with_mixin re-classed it (its own class if it never was).

    Unlike `original_class`, a class that only marks itself a mixin (an FP8 Linear, which
    reports show as the user's Linear) is kept: it is what runs."""
    cls = type(module)
    while cls in _BASES:
        cls = _BASES[cls]
    return cls


def original_class(module: nn.Module) -> type:
    """The user's class of a module that may carry retarget mixins."""
    for cls in type(module).__mro__:
        # Own attribute only: FSDP2's FSDPModule (and other classes built on our mixins by
        # inheritance elsewhere) must not count as the user's class.
        own_mixin = cls.__dict__.get("_retarget_mixin", False)
        if not own_mixin and cls not in _SUBCLASSES.values() and not _is_wrapper(cls):
            return cls
    return type(module)


def _is_wrapper(cls: type) -> bool:
    """Classes torch's composable APIs mix in (fully_shard's FSDP<Class>, FSDPModule)."""
    return cls.__module__.startswith("torch.distributed")


def sync_weights_into(source: nn.Module, target: nn.Module) -> int:
    """Make `target`'s state equal `source`'s where they are not already the same tensors.

    A DTensor in `source` is gathered whole (a collective: every rank must call this). A
    parameter of `target` that `release_replaced` emptied gets fresh storage holding the
    gathered tensor, in place (the same Parameter object, so references to it see the weights).
    A module of `source` that stands in for one of the user's (a quantized Linear) and says
    what the user's module held (`original_state()`) gives that instead of its own tensors.
    A 1-D buffer stored in another dtype with the same bytes (a quantized weight re-stored in
    FSDP's gather dtype) is copied as bytes, never converted as numbers.
    Returns how many tensors were copied (0 when the trees share every tensor).
    """
    target_state = target.state_dict(keep_vars=True)
    copied = 0
    with torch.no_grad():
        for key, value in original_form_state(source, target).items():
            dest = target_state[key]
            if dest is value or not isinstance(value, torch.Tensor):
                continue
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            same_bytes = full.numel() * full.element_size() == dest.numel() * dest.element_size()
            if full.dtype != dest.dtype and full.dim() == dest.dim() == 1 and same_bytes:
                full = full.contiguous().view(dest.dtype)
            if released(dest):
                dest.data = full.detach().to(dest.dtype, copy=full is value)
            else:
                dest.copy_(full.detach().to(dest.device))
            copied += 1
    return copied


def original_form_state(module: nn.Module, target: nn.Module) -> dict[str, Any]:
    """`module.state_dict(keep_vars=True)`, where each submodule with an `original_state()`
    method that stands in for a module of another class in `target` (the user's Linear a
    quantized one replaced) shows what that method returns under its path instead of its own
    parameters and buffers."""
    state = module.state_dict(keep_vars=True)
    for path, sub in module.named_modules():
        original = getattr(type(sub), "original_state", None)
        if not callable(original) or type(target.get_submodule(path)) is type(sub):
            continue
        prefix = f"{path}." if path else ""
        own = [name for name, _ in sub.named_parameters(recurse=False)]
        own += [name for name, _ in sub.named_buffers(recurse=False)]
        for name in own:
            state.pop(prefix + name, None)
        state.update({prefix + k: v for k, v in sub.original_state().items()})
    return state


def release_replaced(original: nn.Module, current: nn.Module) -> int:
    """Free the storage of `original`'s parameters that `current` no longer uses.

    FSDP2's fully_shard replaces each parameter of the compiled model by a DTensor shard; the
    user's model, kept for `unwrap()`, would otherwise hold the full tensors on every rank
    beside the shards. Each such Parameter object keeps its identity, shape, dtype, device and
    requires_grad, but its data becomes one element broadcast to the shape (NaN for floating
    dtypes, so a forward of the emptied model shows it; an in-place write raises), and every
    holder of the object (the user's model, an optimizer built on it, a captured graph) stops
    pinning the memory. `sync_weights_into` fills it again. Returns how many were released.
    """
    kept = {id(p) for p in current.parameters()}
    params = {id(p): p for p in original.parameters()}.values()
    return sum(release(param) for param in params if id(param) not in kept)


def release(param: torch.Tensor) -> bool:
    """Empty one parameter as `release_replaced` does (identity, shape, dtype, device and
    requires_grad kept; one NaN element broadcast to the shape); False if there was nothing
    to free."""
    if released(param) or param.numel() <= 1 or param.is_meta:
        return False
    fill = math.nan if param.is_floating_point() else 0
    one = torch.full((), fill, dtype=param.dtype, device=param.device)
    param.data = one.expand(param.shape)
    param.grad = None  # a gradient from before compile_for is full-size too, and stale
    return True


def released(tensor: torch.Tensor) -> bool:
    """Whether `release_replaced` emptied `tensor`: its storage is smaller than its elements.

    (A meta tensor never holds storage: not released, just weightless.)
    """
    if tensor.is_meta or tensor.numel() <= 1:
        return False
    return tensor.untyped_storage().nbytes() < tensor.numel() * tensor.element_size()
