"""Capture: turn one module call into an fx graph, trying frontends in order.

    export (torch.export non-strict, training IR) -> fx (symbolic_trace) -> dynamo (dynamo.export)

The first frontend whose graph reproduces the module's eager outputs bit for bit on the call's
real inputs wins; each earlier failure is kept as a one-line reason. When none succeeds the
module stays eager (`Capture.graph is None`), which is not an error: every pass has a
module-level form.

A captured graph is specialised to one *call signature* (tensor shapes and dtypes, non-tensor
argument values, train/eval flags, grad and autocast mode); `retarget.ir.region` keeps one graph per
signature and re-captures on a new one. Graph code reads parameters through `self.<path>` at
every call (see `binding.py`), so one graph serves every repeat of a block and always sees the
live weights.

Layer: above core and targets (and models); below ir and kernels, which it does not import.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from retarget.core.modules import original_class
from retarget.frontends import dynamo, export, fx
from retarget.frontends.binding import CapturedGraph, relink_attributes
from retarget.frontends.check import check_against_eager
from retarget.frontends.hf_paths import eager_paths
from retarget.frontends.state import StateCall, find_state, functional_view
from retarget.frontends.state_layers import layer_index

#: Frontends in the order they are tried; "eager" is what is left when all fail.
FRONTENDS: dict[str, Callable[[nn.Module, tuple, dict], CapturedGraph]] = {
    "export": export.capture,
    "fx": fx.capture,
    "dynamo": dynamo.capture,
}
EAGER = "eager"


@dataclass
class Capture:
    """The outcome of capturing one call: a graph from `frontend`, or eager with reasons."""

    frontend: str
    graph: CapturedGraph | None
    failures: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def reason(self) -> str:
        """Why the earlier frontends were not used, one clause per frontend."""
        return "; ".join(f"{name}: {why}" for name, why in self.failures)


@contextlib.contextmanager
def quiet_tracer_logs() -> Iterator[None]:
    """Silence the tracers' own output while trying them: a failure lands in the report."""
    loggers = [logging.getLogger(name) for name in _TRACER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        # export prints the partial graph of a failed trace to stderr
        sink = io.StringIO()
        with (
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_TRACER_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes",
    "torch._dynamo",
    "torch.export",
    "torch._export",
)


def one_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception, prefixed by its type, cut to `limit` characters."""
    text = str(exc).strip().splitlines()
    first = next((line.strip() for line in text if line.strip()), "")
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


def capture_call(
    module: nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    frontends: tuple[str, ...] = tuple(FRONTENDS),
    check_modules: tuple[nn.Module, ...] = (),
) -> Capture:
    """Capture `module(*args, **kwargs)` with the first frontend that reproduces eager exactly.

    `check_modules` are further modules of the same structure (repeats of a block) that the graph
    must also reproduce, each called with the same inputs; a graph that is only right for
    `module` is rejected.
    """
    start = time.perf_counter()
    failures: list[tuple[str, str]] = []
    # What the graph computes does not depend on autograd history; tracing inputs that carry it
    # makes export lift intermediate tensors as constants.
    traced_args, traced_kwargs = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
    index = layer_index(module)
    found = find_state(args, kwargs, index)
    attempts = [(name, FRONTENDS[name]) for name in frontends]
    if found is not None and found.tensors and "export" in frontends:
        # A filled cache grows by one token per decode step: try a graph that serves every length.
        attempts.insert(frontends.index("export"), ("export", export.capture_dynamic))
    for name, trace in attempts:
        try:
            state = None if found is None else replace(found, after=None)
            traced = _traced_call(module, traced_args, traced_kwargs, state)
            with quiet_tracer_logs(), eager_paths():
                graph = trace(*traced)
            graph.state = state
            graph.dynamic = _signature_positions(graph.dynamic_inputs, state)
            relink_attributes(graph.gm, module)
            checks = [check_against_eager(t, graph, args, kwargs) for t in (module, *check_modules)]
            graph.checkpointed = checks[0]
        except Exception as exc:  # a frontend failing is data for the report, not an error
            dynamic = trace is export.capture_dynamic
            failures.append((f"{name} (dynamic shapes)" if dynamic else name, one_line(exc)))
            continue
        return Capture(name, graph, failures, time.perf_counter() - start)
    return Capture(EAGER, None, failures, time.perf_counter() - start)


def _signature_positions(
    dynamic_inputs: tuple[tuple[int, int], ...], state: StateCall | None
) -> frozenset:
    """Map a functional view's symbolic inputs to positions in the call signature.

    The view's flat inputs are the cache's tensors, then the call's own leaves (the cache's place
    holding a marker); the signature describes the cache leaf by its tensors' shapes.
    """
    if state is None or len(state.positions) != 1:
        return frozenset()
    count = state.tensors
    return frozenset(
        ("state", state.positions[0], index, dim) if index < count else ("leaf", index - count, dim)
        for index, dim in dynamic_inputs
    )


def _traced_call(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], state: StateCall | None
) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """What a frontend traces: the call itself, or its functional view when it carries state."""
    if state is None:
        return module, args, kwargs
    view = functional_view(module, original_class(module).forward, state)
    _, _, tensors, plain_args, plain_kwargs = state.split(args, kwargs, state.index)
    return view, ([t.detach() for t in tensors], plain_args, plain_kwargs), {}


__all__ = ["EAGER", "FRONTENDS", "Capture", "CapturedGraph", "capture_call", "one_line"]
