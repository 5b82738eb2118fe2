"""User hooks and captured regions: hooks fire as in eager, and compile_for never calls them.

A captured graph has no module boundaries inside, so a hook on a submodule of a region (a
forward pre/post hook, a full backward hook, or a global module hook) cannot run inside it. While
such a hook exists the region runs its eager form (every pass's module-level rewrite applied) and
the hook fires exactly as in eager; once it is removed the region returns to its graph. Hooks on
the region module itself need nothing: `nn.Module.__call__` runs them around the graph.
`Region.call` asks `hook_inside` only when the block's cached walk (`ir/call_key.py`) finds a
hook dict that is not empty, so a block without hooks pays a few dict lookups per call.

Hooks retarget installs (its probes) and torch.distributed's (FSDP2 puts its hooks on the
sharded blocks themselves, around the graph) are not the user's: `is_users` tells them apart by
the module that defines the hook function. While compile_for traces, probes and checks, the
user's hooks are set aside (`users_hooks_set_aside`), so they see only the calls the user makes.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.nn.modules import module as module_globals

#: Per-module hook dicts and what the report calls them.
HOOK_KINDS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)
#: torch.nn's global (every module) hook dicts.
GLOBAL_KINDS = (
    ("_global_forward_pre_hooks", "global forward pre-hook"),
    ("_global_forward_hooks", "global forward hook"),
    ("_global_backward_pre_hooks", "global backward pre-hook"),
    ("_global_backward_hooks", "global backward hook"),
)
#: Modules whose hooks are not the user's: ours, torch.distributed's, and torch's module tracker
#: (FlopCounterMode and memory tools install it as global hooks only to attribute ops to modules;
#: inside a graph the ops count toward the region's module). Other torch hooks (weight_norm's
#: pre-hook, say) count as the user's: a graph would skip them, so they keep a region eager.
_NOT_USERS = ("retarget.", "torch.distributed.", "torch.utils.module_tracker")


def is_users(hook: Callable[..., Any]) -> bool:
    """Whether a hook is the user's (not retarget's probes, not torch.distributed's)."""
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "__func__", function)  # bound methods
    defined_in = getattr(function, "__module__", None) or ""
    return not defined_in.startswith(_NOT_USERS)


def hook_inside(module: nn.Module) -> tuple[str, str] | None:
    """(submodule path, hook kind) of a user hook a graph of `module` would skip, or None.

    Global module hooks count for every region; a module's own hooks only below its root.
    """
    for attribute, kind in GLOBAL_KINDS:
        if any(is_users(h) for h in getattr(module_globals, attribute).values()):
            return ("every module", kind)
    for path, sub in module.named_modules():
        if not path:
            continue
        for attribute, kind in HOOK_KINDS:
            hooks = sub.__dict__.get(attribute)
            if hooks and any(is_users(h) for h in hooks.values()):
                return (path, kind)
    return None


#: The user's hooks one `users_hooks_set_aside` holds: id(hook dict) -> its (key, hook) pairs.
ParkedHooks = dict[int, list[tuple[int, Any]]]


def users_hook_kinds(module: nn.Module, parked: ParkedHooks | None = None) -> list[str]:
    """The kinds of user hook `module` has, counting those `parked` holds (compile_for's,
    `Program.parked_hooks`, while it runs)."""
    kinds = []
    for attribute, kind in HOOK_KINDS:
        hooks = module.__dict__.get(attribute)
        if hooks is None:
            continue
        if any(is_users(h) for h in hooks.values()) or (parked or {}).get(id(hooks)):
            kinds.append(kind)
    return kinds


@contextlib.contextmanager
def users_hooks_set_aside(*roots: nn.Module) -> Iterator[ParkedHooks]:
    """Remove the user's hooks from every module under `roots` (and the global ones) meanwhile;
    yields what it holds, by hook dict (for `users_hook_kinds`).

    They are put back in their registration order on exit, even on error, next to any hook
    registered in between.
    """
    parked: list[tuple[dict, list[tuple[int, Any]]]] = []
    held: ParkedHooks = {}
    dicts = [getattr(module_globals, attribute) for attribute, _ in GLOBAL_KINDS]
    seen: set[int] = set()
    for root in roots:
        for sub in root.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                dicts += [sub.__dict__[a] for a, _ in HOOK_KINDS if sub.__dict__.get(a)]
    for hooks in dicts:
        users = [(key, hook) for key, hook in hooks.items() if is_users(hook)]
        for key, _ in users:
            del hooks[key]
        if users:
            parked.append((hooks, users))
            held[id(hooks)] = users
    try:
        yield held
    finally:
        held.clear()
        for hooks, users in parked:
            _put_back(hooks, users)


def _put_back(hooks: dict, parked: list[tuple[int, Any]]) -> None:
    """Return parked hooks to their dict in registration order (handle ids), beside any
    registered meanwhile."""
    merged = sorted([*hooks.items(), *parked], key=lambda item: item[0])
    hooks.clear()
    hooks.update(OrderedDict(merged))


@contextlib.contextmanager
def own_forward_hooks_set_aside(*roots: nn.Module) -> Iterator[None]:
    """Remove each root's own forward pre/post hooks meanwhile (not its submodules').

    A region captured at step time is captured from inside its module's call: the hooks on the
    module itself (FSDP2's all-gather and reshard, registered on the sharded block) have run
    around that call already, and a tracer that re-entered them would trace a collective and the
    shard bookkeeping into the block's graph (dynamo breaks its graph there). The graph replaces
    what runs between them, so the capture leaves them out.
    """
    parked = []
    for root in roots:
        for attribute in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = root.__dict__.get(attribute)
            if hooks:
                parked.append((hooks, list(hooks.items())))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, items in parked:
            _put_back(hooks, items)


__all__ = [
    "GLOBAL_KINDS",
    "HOOK_KINDS",
    "hook_inside",
    "own_forward_hooks_set_aside",
    "is_users",
    "users_hook_kinds",
    "users_hooks_set_aside",
]
