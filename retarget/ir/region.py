"""Regions: module paths that share one captured graph per call signature.

A `Region` is a distinct block type (say every `LlamaDecoderLayer` under `model.layers`) or the
whole model. Each repeat's record names its region (core/module_record.py), and the repeat's forward
(execution/module_call.py) calls `Region.call`, which asks for the graph that matches the call's
signature, capturing on a miss (so a last batch of another size costs one more capture, not a wrong
answer), and runs it against the repeat's own live parameters. Passes rewrite a region's graphs
through `add_transform`, which also replays the rewrite on every later capture. The signature and
its cache (a repeat's module walk, its last call's quick signature and graph) live in
`ir/call_key.py`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed
import torch.utils.checkpoint
from torch import fx, nn

from retarget.core.capturing import capturing_originals
from retarget.core.errors import EagerRegionWarning, PassError, RegionCompileError
from retarget.core.module_record import record_of, records_replaced
from retarget.core.slots import BINDINGS
from retarget.frontends import EAGER, FRONTENDS, CapturedGraph, capture_call
from retarget.frontends.check import check_against_eager
from retarget.ir.call_key import (
    autocast_state,
    block_walk,
    call_key,
    last_call,
    masked_key,
    quick_signature,
    remember_call,
)
from retarget.ir.hooks import hook_inside, own_forward_hooks_set_aside, users_hooks_set_aside

PENDING = "pending"
#: The frontend of a deferred region: nothing captured, its repeats run their own forward.
OWN_FORWARD = "own forward"
_RECAPTURE_FAILED = ("recapture",)  # the warning key of a failed capture after `recapture`
GraphTransform = Callable[[fx.GraphModule], None]
#: Wraps a module's eager forward: the module-level form of a rewrite, for calls without a graph.
EagerForm = Callable[[Callable[..., Any]], Callable[..., Any]]


class CallRunner(Protocol):
    """Runs a region's calls in place of `CapturedGraph.run` and the eager form (compile_regions'
    compiled callables); a call forced eager by a user's hook never goes through it."""

    def graph_call(
        self, module: nn.Module, graph: CapturedGraph, args: tuple, kwargs: dict, private: dict
    ) -> Any: ...

    def eager_call(self, module: nn.Module, eager: Callable, args: tuple, kwargs: dict) -> Any: ...

    def summary(self) -> dict[str, Any]:
        """What the runner did, for the report."""
        ...


@dataclass
class Region:
    """One capture unit: `paths` are its repeats, all computed by the same graph."""

    name: str
    block_type: str
    paths: list[str]
    frontends: tuple[str, ...] = tuple(FRONTENDS)
    frontend: str = PENDING
    failures: list[tuple[str, str]] = field(default_factory=list)
    reason: str = ""
    graphs: dict[Any, CapturedGraph] = field(default_factory=dict)
    transforms: list[tuple[str, GraphTransform]] = field(default_factory=list)
    eager_forms: list[tuple[str, EagerForm]] = field(default_factory=list)
    shared: bool = True
    eager_only: bool = False
    captures: int = 0
    capture_seconds: float = 0.0
    version: int = 0
    eager_keys: set = field(default_factory=set, repr=False)
    dynamic_graphs: list[CapturedGraph] = field(default_factory=list, repr=False)
    reuses: int = 0
    """Signatures served by a graph with symbolic sizes instead of a new capture."""
    hooked: dict[str, str] = field(default_factory=dict)
    """Submodule path -> user hook kind that made calls run eagerly (see `ir/hooks.py`)."""
    eager_signatures: list[str] = field(default_factory=list)
    """Why each signature that failed to capture after the first one did (it runs eagerly)."""
    warned: set = field(default_factory=set, repr=False)
    failed_graphs: dict[int, str] = field(default_factory=dict, repr=False)
    """id(graph) -> why it failed at run time where the eager form ran: such calls run eagerly."""
    ran_graphs: set[int] = field(default_factory=set, repr=False)
    """id(graph) of the graphs that have run once: only a graph's first run is checked."""
    runner: CallRunner | None = field(default=None, repr=False)
    """Runs the calls in place of the plain graph or eager form (compile_regions installs it)."""
    recaptured: bool = False
    """`recapture` dropped the graphs captured at compile time (tp split the region)."""
    deferred: bool = False
    """Nothing is captured: no pass reads or rewrites this region's graphs (capture="auto"), so
    its calls run the module's own forward, which a graph would compute bit for bit. A rewrite
    added later (`add_transform`) ends it: the next call of each signature captures."""

    @property
    def repeats(self) -> int:
        return len(self.paths)

    # -- capture --------------------------------------------------------------------------
    def capture(
        self, module: nn.Module, args: tuple, kwargs: dict, *, check: tuple[nn.Module, ...] = ()
    ) -> CapturedGraph | None:
        """Capture the call for `module`'s signature (checked on `check` repeats too)."""
        with running_eagerly((module, *check)), capturing_originals(), _own_saved_tensors():
            with users_hooks_set_aside(module, *check), own_forward_hooks_set_aside(module):
                result = capture_call(
                    module, args, kwargs, frontends=self.frontends, check_modules=check
                )
            if result.graph is None and check and _mismatch_only(result.failures):
                # The graph is wrong for another repeat: repeats differ (layer-index code, say).
                with users_hooks_set_aside(module):
                    result = capture_call(module, args, kwargs, frontends=self.frontends)
                if result.graph is not None:
                    self.shared = False
                    self.reason = "repeats compute differently; one graph per repeat"
        self.captures += 1
        self.capture_seconds += result.seconds
        if result.graph is None:
            if not self.graphs:
                if self.recaptured:  # compile_for warns of the regions it leaves eager
                    self._warn_once(
                        _RECAPTURE_FAILED,
                        f"retarget: region {self.name} could not be captured again "
                        f"({result.reason}) and runs its eager form; compiled.report shows it",
                    )
                self.frontend, self.eager_only = EAGER, True
                self.failures = result.failures
                self.reason = (
                    f"{self.reason}; then {result.reason}" if self.recaptured else result.reason
                )
            else:  # a later signature: the region keeps its graphs, this call runs eagerly
                self.eager_signatures.append(result.reason)
                self._warn_once(
                    ("signature",),
                    f"retarget: a new call signature of region {self.name} could not be "
                    f"captured and runs eagerly ({result.reason}); other signatures keep their "
                    "graphs; compiled.report shows each",
                )
            return None
        if not self.graphs:
            self.frontend, self.failures = result.frontend, result.failures
            self.reason = self.reason or result.reason
        # The train/eval mode is part of the signature; rewrites that differ by mode read it.
        result.graph.gm.meta["training"] = module.training
        for pass_name, transform in self.transforms:
            _apply(pass_name, transform, result.graph)
        key = self._key(module, args, kwargs)
        self.graphs[key] = result.graph
        if result.graph.dynamic and self.shared:
            result.graph.pattern = masked_key(key, result.graph.dynamic)
            self.dynamic_graphs.append(result.graph)
        return result.graph

    def recapture(self, frontends: tuple[str, ...], reason: str) -> None:
        """Forget every graph: the next call of each signature captures anew with `frontends`
        (tp splits a region's modules after capture; the graphs must hold the split). The
        rewrites stay and are replayed on the new captures."""
        self.frontends, self.frontend, self.reason = frontends, PENDING, reason
        self.eager_only, self.failures, self.shared, self.recaptured = False, [], True, True
        self.graphs.clear()
        self.dynamic_graphs.clear()
        self.eager_keys.clear()
        self.failed_graphs.clear()
        self.ran_graphs.clear()
        self.version += 1

    def captured_by_compile_for(self) -> None:
        """compile_for makes the first call after `recapture` itself and warns of a region it
        leaves eager (driver.compile.warn_eager_regions): no second warning here."""
        self.warned.add(_RECAPTURE_FAILED)

    def run_eager_form(self, reason: str) -> None:
        """No graph from now on: every call runs the eager form (every rewrite's module-level
        form), for `reason`."""
        self.recapture((), reason)
        self.frontend, self.eager_only = EAGER, True

    def defer(self, reason: str) -> None:
        """Capture nothing until a rewrite asks for a graph (see `deferred`)."""
        self.deferred, self.frontend, self.reason = True, OWN_FORWARD, reason

    def _key(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        key = call_key(module, args, kwargs)
        return key if self.shared else (record_of(module).path, key)

    def graph_for(self, module: nn.Module, args: tuple, kwargs: dict) -> CapturedGraph | None:
        """The graph for this call, capturing it on first sight; None means run eager."""
        if self.eager_only or self.deferred:
            return None
        key = self._key(module, args, kwargs)
        if key in self.graphs:
            return self.graphs[key]
        if key in self.eager_keys:
            return None
        graph = self._reuse_dynamic(module, args, kwargs, key)
        if graph is not None:
            return graph
        graph = self.capture(module, args, kwargs)
        if graph is None:
            self.eager_keys.add(key)
        return graph

    def _reuse_dynamic(self, module: nn.Module, args: tuple, kwargs: dict, key: Any):
        """A graph with symbolic sizes whose pattern fits this call, checked once against eager.

        The check (two forwards of one block) replaces a capture (a trace): a decode step with a
        one-token-longer cache reuses the previous step's graph, exactly.
        """
        for graph in self.dynamic_graphs:
            if key[0] != graph.pattern[0] or masked_key(key, graph.dynamic) != graph.pattern:
                continue
            try:
                with running_eagerly((module,)), capturing_originals():
                    with own_forward_hooks_set_aside(module):
                        check_against_eager(module, graph, args, kwargs)
            except Exception:  # outside the graph's guards, or not exact here: capture anew
                continue
            self.graphs[key] = graph
            self.reuses += 1
            return graph
        return None

    def distinct_graphs(self) -> list[CapturedGraph]:
        """Each graph once (a graph with symbolic sizes serves several signatures)."""
        return list({id(g): g for g in self.graphs.values()}.values())

    # -- rewriting ------------------------------------------------------------------------
    def rewritten_by(self, pass_name: str) -> bool:
        """Whether `pass_name` added a rewrite to this region (add_transform)."""
        return any(name == pass_name for name, _ in self.transforms)

    def add_transform(
        self, pass_name: str, transform: GraphTransform, eager_form: EagerForm | None = None
    ) -> int:
        """Apply a graph rewrite to every captured graph now and every later capture.

        `eager_form` is the same rewrite at module level; it wraps the forward of every call that
        runs without a graph (an uncapturable region, or a signature that failed to capture), so
        a rewrite is never silently lost. Returns how many graphs were rewritten now.
        """
        if self.deferred:  # a rewrite needs the graphs: capture at the next calls
            self.deferred, self.frontend, self.reason = False, PENDING, ""
        self.transforms.append((pass_name, transform))
        if eager_form is not None:
            self.eager_forms.append((pass_name, eager_form))
        graphs = self.distinct_graphs()
        for graph in graphs:
            _apply(pass_name, transform, graph)
        self.version += 1
        return len(graphs)

    def _note_hook(self, path: str, kind: str) -> None:
        if path not in self.hooked:
            self.hooked[path] = kind
            self._warn_once(
                (path, kind),
                f"retarget: region {self.name} runs its eager form while a {kind} on {path} "
                "exists (a captured graph has no module boundaries to call it at); it runs its "
                "graph again once the hook is removed",
            )

    def _warn_once(self, key: tuple, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, EagerRegionWarning, stacklevel=5)

    def representative(self) -> CapturedGraph | None:
        """The first graph captured (what reports and dumps show)."""
        return next(iter(self.graphs.values()), None)

    # -- running --------------------------------------------------------------------------
    def call(self, module: nn.Module, args: tuple, kwargs: dict, eager: Callable) -> Any:
        if self.deferred:
            return self._eager_call(module, eager, args, kwargs, True)
        walk = block_walk(module)
        hooked = hook_inside(module) if walk.may_hold_hooks() else None
        if hooked is not None:  # a graph would skip the hook: run the eager form meanwhile
            self._note_hook(*hooked)
            graph = None
        else:
            graph = self._graph_for_call(module, args, kwargs, walk.training())
        if graph is None or id(graph) in self.failed_graphs:
            return self._eager_call(module, eager, args, kwargs, hooked is None)
        bindings = BINDINGS.setdefault(module, {})
        cached = bindings.get(id(graph))
        if cached is None or cached[0] != self.version:
            cached = (self.version, graph.private_attributes(module))
            bindings[id(graph)] = cached
        if id(graph) in self.ran_graphs:
            return self._run_graph(module, graph, args, kwargs, cached[1])
        try:  # its first run: a graph that raises where the eager form runs is at fault
            result = self._run_graph(module, graph, args, kwargs, cached[1])
        except _NOT_RETRIED:
            raise
        except Exception as error:
            return self._after_graph_failure(module, graph, error, eager, args, kwargs)
        self.ran_graphs.add(id(graph))
        return result

    def _run_graph(
        self, module: nn.Module, graph: CapturedGraph, args: tuple, kwargs: dict, private: dict
    ) -> Any:
        if self.runner is not None:
            return self.runner.graph_call(module, graph, args, kwargs, private)
        return graph.run(module, args, kwargs, private)

    def _eager_call(
        self, module: nn.Module, eager: Callable, args: tuple, kwargs: dict, via_runner: bool
    ) -> Any:
        """The call without a graph: the eager forward wrapped in every rewrite's eager form."""
        for _, wrap in self.eager_forms:
            eager = wrap(eager)
        if self.runner is not None and via_runner:
            return self.runner.eager_call(module, eager, args, kwargs)
        return eager(*args, **kwargs)

    def _after_graph_failure(
        self,
        module: nn.Module,
        graph: CapturedGraph,
        error: Exception,
        eager: Callable,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """A graph raised at run time: run the eager form instead. If it runs, the graph is at
        fault (a rewrite that does not hold for these values, say), and this signature runs
        eagerly from now on, warned once and reported; if it raises too, that error is the
        model's own and propagates."""
        result = self._eager_call(module, eager, args, kwargs, True)
        rewrites = list(dict.fromkeys(name for name, _ in self.transforms))
        lost = [n for n in rewrites if n not in {name for name, _ in self.eager_forms}]
        detail = (str(error).strip().splitlines() or [""])[0][:200]
        why = f"its graph failed at run time ({type(error).__name__}: {detail})"
        if rewrites:
            why += f" after the rewrites of {', '.join(rewrites)}"
        self.failed_graphs[id(graph)] = why
        self.eager_signatures.append(why)
        kept = (
            f"without the rewrites of {', '.join(lost)}, which have no module-level form"
            if lost
            else "with the same rewrites in their module-level form"
        )
        self._warn_once(
            ("failed", id(graph)),
            f"retarget: region {self.name}: {why}; calls of that signature run the eager "
            f"forward instead, {kept}; compiled.report shows it",
        )
        return result

    def graph_epoch(self) -> tuple:
        """Changes whenever the graph table may have: a capture, a reuse, a removal."""
        return (self.captures, self.reuses, len(self.graphs), self.eager_only, self.shared)

    def graph_for_call(self, module: nn.Module, args: tuple, kwargs: dict) -> CapturedGraph | None:
        """`graph_for` through the repeat's last-call cache (what `call` uses)."""
        return self._graph_for_call(module, args, kwargs, block_walk(module).training())

    def _graph_for_call(
        self, module: nn.Module, args: tuple, kwargs: dict, training: tuple
    ) -> CapturedGraph | None:
        """`graph_for`, with the repeat's last graph reused when the call looks the same."""
        quick = quick_signature(args, kwargs)
        if quick is None:
            return self.graph_for(module, args, kwargs)
        token = (quick, training, autocast_state())
        last = last_call(module)
        epoch = self.graph_epoch()
        if last is not None and last[2] is self and last[3] == epoch and last[0] == token:
            return last[1]
        graph = self.graph_for(module, args, kwargs)
        if graph is not None:
            remember_call(module, token, graph, self, self.graph_epoch())
        return graph


#: Errors a graph's first run is not retried for: retarget's own (a compile that `fullgraph`
#: makes an error), memory the eager form would run out of too, checkpoint's control flow, and a
#: collective's (running a step twice would leave the other ranks waiting).
_NOT_RETRIED: tuple[type[BaseException], ...] = (
    RegionCompileError,
    PassError,
    torch.OutOfMemoryError,
    # torch.utils.checkpoint stops a recomputation early with an exception of its own
    *(
        (torch.utils.checkpoint._StopRecomputationError,)
        if hasattr(torch.utils.checkpoint, "_StopRecomputationError")
        else ()
    ),
    *((torch.distributed.DistError,) if torch.distributed.is_available() else ()),
)


def _mismatch_only(failures: list[tuple[str, str]]) -> bool:
    return any("CaptureMismatch" in why for _, why in failures)


@contextlib.contextmanager
def running_eagerly(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    """Let region modules run their original forward (while they are being traced): their
    records name no region meanwhile.

    A module that checkpoints itself inside its own forward (transformers' decoder layers from
    5.24 on wrap `forward`, where earlier versions wrapped `__call__`) has that switched off
    for the trace: the graph records the plain computation, and the checkpoint around the region
    module's call still checkpoints the graph's run, as it checkpointed the eager forward.
    """
    regional = tuple(m for m in modules if record_of(m).region is not None)
    self_checkpointing = [m for m in modules if getattr(m, "gradient_checkpointing", False) is True]
    for module in self_checkpointing:
        module.gradient_checkpointing = False
    try:
        with records_replaced(regional, region=None):
            yield
    finally:
        for module in self_checkpointing:
            module.gradient_checkpointing = True


def _own_saved_tensors() -> contextlib.AbstractContextManager:
    """Keep what a capture saves for backward (its trace, its check against eager) out of an
    enclosing checkpoint's count: a first call captured inside a checkpointed forward (a layer
    that checkpoints itself) would otherwise save far more than its recomputation does."""
    return torch.autograd.graph.saved_tensors_hooks(_detached, _same)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # Not the tensor itself: a node saving its own output (rsqrt) would hold the output, whose
    # grad_fn is that node, in a cycle through C++ that gc never frees.
    return tensor.detach()


def _same(tensor: Any) -> Any:
    return tensor


def _apply(pass_name: str, transform: GraphTransform, graph: CapturedGraph) -> None:
    try:
        transform(graph.gm)
        graph.gm.graph.lint()
        graph.gm.recompile()
    except Exception as exc:
        raise PassError(pass_name, [], f"graph rewrite failed: {exc}") from exc
