"""A region's calls through torch.compile: one compiled callable per graph, counted, fallback.

`RegionCompiler` is what compile_regions installs as a region's runner (`ir/region.py`,
`CallRunner`). A captured graph (one per call signature, already rewritten by every precision and
checkpointing pass) gets one `torch.compile` of the call of its code (`binding.call_graph_forward`;
the KV-cache bookkeeping and argument binding around it stay eager, so dynamo never guards on a
cache object). An export graph is compiled in its flat form (`flat_calls.FlatGraph`: inputs
flattened and the output rebuilt outside, export's input check left to the call signature), so
dynamo guards no pytree spec. The graph reads parameters from the live module it is called with,
so that one compiled callable serves every repeat of the block (dynamo takes the module's tensors
as inputs, it does not guard on which repeat it is). `isolate_recompiles=True` keeps each
callable's cache entries and recompile limit its own: a region's graphs share one code object, a
copy of `call_graph_forward`'s named after the region (`region_entry`), so what dynamo learns
about input sizes stays within the region.
A region no frontend captured compiles its eager form (the module's forward with every pass's
module-level rewrite), once per region; but once per repeat when the call carries a stateful
object (a KV cache). The block's own code then reads per-layer state (HF's `layer_idx` and the
cache's layer it indexes), which dynamo guards as constants: one shared callable would
recompile at every layer, and past dynamo's recompile limit (8) the remaining layers would run
uncompiled without a word. A repeat's own callable compiles once and matches its own guards.

Counting reads dynamo's own counters (`torch._dynamo.utils.counters`) around each compiled call:
the graphs the backend was handed (`stats.unique_graphs`) and graph breaks (`graph_break`). A call
that made dynamo compile adds its wall time (trace, backend, that call's run) to `seconds`;
`recompiles` counts compiling calls after the region's first (a new signature or a guard miss).

A compiled call that raises while dynamo compiles (its frame counter moved, or a dynamo error)
is run again uncompiled: if that succeeds the compile failed, and
the region runs uncompiled from then on (one `UncompiledRegionWarning`, the reason in the report),
or with `fullgraph=true` a `RegionCompileError` naming the region is raised. If the uncompiled
run fails too, the error is the model's and is raised as eager would raise it.
"""

from __future__ import annotations

import itertools
import time
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _StopRecomputationError

from retarget.core.capturing import capturing
from retarget.core.errors import RegionCompileError, UncompiledRegionWarning
from retarget.execution.flat_calls import FlatGraph
from retarget.frontends import CapturedGraph, one_line
from retarget.frontends.binding import CallForward, call_graph_forward
from retarget.frontends.state_layout import is_state

_RUNNERS = itertools.count()
#: The target's dynamic=auto|true|false as torch.compile's dynamic=None|True|False.
DYNAMIC = {"auto": None, "true": True, "false": False}


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    backend: str = "inductor"
    """torch.compile backend: inductor, aot_eager, eager, or any registered name."""
    mode: str = "default"
    """inductor mode: default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs."""
    dynamic: str = "auto"
    """auto: sizes become symbolic after a size changes | true: from the start | false: never."""
    fullgraph: bool = False
    """true: a graph break or a failed compile is an error naming the region, not a fallback."""
    scope: str = "regions"
    """regions: each block type's graph, reused by its repeats | whole: the model's forward."""

    def torch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of torch.compile."""
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "dynamic": DYNAMIC[self.dynamic],
            "fullgraph": self.fullgraph,
        }
        if self.mode != "default":
            kwargs["mode"] = self.mode
        return kwargs


@dataclass
class CompileStats:
    """What compiling one region did; `compile_regions` shows it in the report."""

    form: str
    """graph: the captured graph is compiled | eager form: the module's forward is."""
    compiles: int = 0
    """Graphs dynamo handed to the backend for this region (a graph break makes two)."""
    compiling_calls: int = 0
    repeat_compiles: int = 0
    """Compiling calls that were a repeat's first through its own callable (an eager form
    whose calls carry a KV cache): compiles, not recompiles."""
    seconds: float = 0.0
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)
    fallback: str = ""
    """Why the region runs uncompiled ('' while it runs compiled)."""

    @property
    def recompiles(self) -> int:
        """Calls that compiled again after the first (a new call signature or a guard miss)."""
        return max(self.compiling_calls - 1 - self.repeat_compiles, 0)


class RegionCompiler:
    """A region's runner: its graphs (or its eager form) through torch.compile."""

    def __init__(self, region_name: str, settings: CompileOptions, form: str):
        self.region_name = region_name
        self.settings = settings
        self.stats = CompileStats(form=form)
        self._graphs: dict[int, tuple[CapturedGraph, Callable[..., Any], CallForward]] = {}
        self._eager: Callable[..., Any] | None = None
        self._eager_per_repeat: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._entry = region_entry(region_name)

    # -- CallRunner ------------------------------------------------------------------------
    def graph_call(
        self, module: nn.Module, graph: CapturedGraph, args: tuple, kwargs: dict, private: dict
    ) -> Any:
        def plain() -> Any:
            return graph.run(module, args, kwargs, private)

        if self._runs_plain():
            return plain()
        compiled = self._compiled_graph(graph)
        return self._counted(lambda: graph.run(module, args, kwargs, private, compiled), plain)

    def eager_call(self, module: nn.Module, eager: Callable, args: tuple, kwargs: dict) -> Any:
        def plain() -> Any:
            return eager(*args, **kwargs)

        if self._runs_plain():
            return plain()
        first = False
        if _carries_state(args, kwargs):  # per-layer state: one callable per repeat (docstring)
            compiled = self._eager_per_repeat.get(module)
            if compiled is None:
                compiled = self._eager_per_repeat[module] = self._compile(_call_eager)
                first = bool(self.stats.compiling_calls)
        else:
            if self._eager is None:
                self._eager = self._compile(_call_eager)
            compiled = self._eager
        return self._counted(lambda: compiled(eager, args, kwargs), plain, first)

    def summary(self) -> dict[str, Any]:
        """The report's entry for this region."""
        s = self.stats
        return {
            "backend": self.settings.backend,
            "mode": self.settings.mode,
            "dynamic": self.settings.dynamic,
            "fullgraph": self.settings.fullgraph,
            # a region left eager after compile_regions ran (tp's split blocks) says so
            "form": "eager form" if self._eager is not None and not self._graphs else s.form,
            "compiled_callables": (
                len(self._graphs) + (self._eager is not None) + len(self._eager_per_repeat)
            ),
            "compiles": s.compiles,
            "recompiles": s.recompiles,
            "graph_breaks": s.graph_breaks,
            "break_reasons": list(s.break_reasons),
            "compile_seconds": round(s.seconds, 4),
            "fallback": s.fallback,
        }

    # -- internals -------------------------------------------------------------------------
    def _runs_plain(self) -> bool:
        # Captures trace the block's own code; a compile around ours (the user compiling the
        # compiled model) traces through this call, so it must not start a second compile.
        return bool(self.stats.fallback) or capturing() or torch.compiler.is_compiling()

    def _compiled_graph(self, graph: CapturedGraph) -> CallForward:
        """The compiled call of `graph`'s current code: flat (`flat_calls`) where it has a flat
        form; made anew if a rewrite recompiled the graph since."""
        forward = type(graph.gm).forward
        entry = self._graphs.get(id(graph))
        if entry is None or entry[1] is not forward:
            compiled = self._compile(self._entry)
            flat = FlatGraph.of(graph.gm)
            entry = (graph, forward, compiled if flat is None else flat.call_forward(compiled))
            self._graphs[id(graph)] = entry
        return entry[2]

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, **self.settings.torch_kwargs(), isolate_recompiles=True)

    def _counted(
        self, compiled_call: Callable[[], Any], plain_call: Callable[[], Any], first: bool = False
    ) -> Any:
        """Run `compiled_call`, counting what dynamo compiled; `first`: a later repeat's own
        callable is called for the first time (its compile is not a recompile)."""
        # dynamo (1-2 s to import) is imported by the first compiled call, not by compile_for
        from torch._dynamo.exc import TorchDynamoException as DynamoError
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        frames = counters["frames"]["total"]
        breaks = dict(counters["graph_break"])
        start = time.perf_counter()
        try:
            out = compiled_call()
        except _StopRecomputationError:  # checkpoint's early stop of a recompute: not ours
            raise
        except Exception as exc:
            compiling = counters["frames"]["total"] != frames or isinstance(exc, DynamoError)
            if not compiling:  # a cached compiled graph raised: the model's error
                raise
            return self._fall_back(exc, plain_call)
        new_graphs = counters["stats"]["unique_graphs"] - graphs
        if new_graphs:
            s = self.stats
            s.compiles += new_graphs
            s.compiling_calls += 1
            s.repeat_compiles += first
            s.seconds += time.perf_counter() - start
            for reason, count in counters["graph_break"].items():
                if count > breaks.get(reason, 0):
                    s.graph_breaks += count - breaks.get(reason, 0)
                    first_line = reason.strip().splitlines()[0] if reason.strip() else reason
                    if first_line not in s.break_reasons:
                        s.break_reasons.append(first_line)
        return out

    def _fall_back(self, exc: Exception, plain_call: Callable[[], Any]) -> Any:
        out = plain_call()  # raises as eager would when the model itself is at fault
        reason = _reason(exc)
        if self.settings.fullgraph:
            raise RegionCompileError(
                f"compile[fullgraph=true]: region {self.region_name} did not compile "
                f"({self.stats.form}, backend {self.settings.backend}): {reason}"
            ) from exc
        self.stats.fallback = reason
        warnings.warn(
            f"retarget: region {self.region_name} could not be compiled with backend "
            f"'{self.settings.backend}' and runs uncompiled ({reason}); compiled.report shows it",
            UncompiledRegionWarning,
            stacklevel=6,
        )
        return out


def region_entry(region_name: str) -> CallForward:
    """`call_graph_forward` under a code object of this region's own (one per runner).

    dynamo keys what it learns about a frame's inputs (which sizes changed, so `dynamic=auto`
    makes them symbolic) by the code's (file, line, name). Flat calls put every region's inputs
    at the same names (`args[0]`, ...), so with one shared code object a shape seen by one
    region (of any model in the process) would make another region's first compile dynamic; a
    name per runner keeps that learning within the region, where a new batch size is a new
    signature of the same block.
    """
    code = call_graph_forward.__code__
    code = code.replace(co_name=f"call_graph_forward[{region_name}#{next(_RUNNERS)}]")
    return types.FunctionType(code, call_graph_forward.__globals__, code.co_name)


def _reason(exc: Exception) -> str:
    """One line; a backend's failure names what the backend raised."""
    inner = getattr(exc, "inner_exception", None)
    return one_line(exc) if inner is None else f"{one_line(exc)} {one_line(inner)}"


def _carries_state(args: tuple, kwargs: dict) -> bool:
    """Whether a call passes a stateful object (a KV cache) as one of its arguments."""
    return any(is_state(value) for value in (*args, *kwargs.values()) if value is not None)


def _call_eager(eager: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What an eager-form region compiles: its forward, every module-level rewrite applied."""
    return eager(*args, **kwargs)
