"""The kwargs handlers of how each process runs: DDP, the process group, the profiler.

DistributedDataParallelKwargs  broadcast_buffers, bucket_cap_mb, find_unused_parameters,
                               gradient_as_bucket_view, static_graph -> ddp[...] options;
                               comm_hook fp16|bf16|power_sgd -> fp16-comm | bf16-comm |
                               powersgd; comm_wrapper fp16|bf16 -> powersgd[wrapper=...];
                               comm_state_option -> powersgd[rank, start_iter, ...].
                               Refused: dim != 0, check_reduction, batched_power_sgd.
InitProcessGroupKwargs         backend, timeout -> the process group (ProcessState).
ProfileKwargs                  -> Accelerator.profile().
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from retarget.compat.accelerate.kwargs_base import KwargsHandler, KwargsHandlerError, TargetDraft
from retarget.targets.strategies import DDP_STRATEGIES, FSDP_STRATEGIES

__all__ = [
    "DDPCommunicationHookType",
    "DistributedDataParallelKwargs",
    "InitProcessGroupKwargs",
    "ProfileKwargs",
]


class DDPCommunicationHookType(str, enum.Enum):
    """Accelerate's names for `comm_hook=` and `comm_wrapper=` (plain strings work too)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"
    """Refused by DistributedDataParallelKwargs: torch's hook fails on CPU."""


def _word(value: Any) -> str:
    """An Accelerate enum member or string as a lowercase word."""
    return str(getattr(value, "value", value)).strip().lower()


_DDP_OPTIONS = (
    "broadcast_buffers",
    "bucket_cap_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
)
_HOOK_PARTS = {"fp16": "fp16-comm", "bf16": "bf16-comm", "power_sgd": "powersgd"}
#: PowerSGDState's argument names -> the powersgd part's options.
_POWERSGD_STATE = {
    "matrix_approximation_rank": "rank",
    "start_powerSGD_iter": "start_iter",
    "min_compression_rate": "min_compression_rate",
    "use_error_feedback": "error_feedback",
    "warm_start": "warm_start",
}


@dataclass(frozen=True, kw_only=True)
class DistributedDataParallelKwargs(KwargsHandler):
    """DDP settings and gradient communication hooks (Accelerate's names and defaults)."""

    dim: int = 0
    """Refused unless 0: DDP scatters inputs along it across device_ids; we use one device per
    process."""
    broadcast_buffers: bool = True
    """-> ddp[broadcast_buffers]."""
    bucket_cap_mb: int = 25
    """-> ddp[bucket_cap_mb]."""
    find_unused_parameters: bool = False
    """-> ddp[find_unused_parameters]."""
    check_reduction: bool = False
    """Refused when True: deprecated in torch's DDP, where it has no effect."""
    gradient_as_bucket_view: bool = False
    """-> ddp[gradient_as_bucket_view]."""
    static_graph: bool = False
    """-> ddp[static_graph]."""
    comm_hook: Any = "no"
    """no | fp16 | bf16 | power_sgd -> the fp16-comm, bf16-comm or powersgd part."""
    comm_wrapper: Any = "no"
    """no | fp16 | bf16: cast PowerSGD's communication too -> powersgd[wrapper=...]."""
    comm_state_option: Mapping[str, Any] = field(default_factory=dict)
    """PowerSGDState arguments -> powersgd options (matrix_approximation_rank -> rank,
    start_powerSGD_iter -> start_iter, min_compression_rate, use_error_feedback ->
    error_feedback, warm_start)."""

    def shape_target(self, draft: TargetDraft) -> None:
        changed = self.changed()
        if not changed:
            return
        who = type(self).__name__
        if self.dim != 0:
            self.refuse(
                "dim",
                "DDP scatters inputs along `dim` across device_ids; retarget runs "
                "one device per process, so there is nothing to scatter. Remove it",
            )
        if self.check_reduction:
            self.refuse("check_reduction", "it is deprecated in torch's DDP and has no effect")
        strategy = draft.strategy
        if strategy == "single" and draft.strategy_is_default:
            draft.parts = {"ddp": {}, **{k: v for k, v in draft.parts.items() if k != "single"}}
            strategy = "ddp"
        if strategy not in DDP_STRATEGIES:
            hint = (
                " With FSDP the gradient communication dtype is the reduce dtype of the "
                "mixed-precision policy: set mixed_precision= instead of a comm hook"
                if strategy in FSDP_STRATEGIES
                else ""
            )
            raise KwargsHandlerError(
                f"{who}({', '.join(sorted(changed))}) configures DDP, but the target's "
                f"distribution is '{strategy}': use target='ddp' (or zero1), or remove the "
                f"handler.{hint}"
            )
        for option in _DDP_OPTIONS:
            if option in changed:
                draft.set_option(strategy, option, changed[option], f"{who}.{option}")
        self._shape_hook(draft, who)

    def _shape_hook(self, draft: TargetDraft, who: str) -> None:
        hook, wrapper = _word(self.comm_hook), _word(self.comm_wrapper)
        if hook == "batched_power_sgd":
            self.refuse(
                "comm_hook",
                "no pass implements batched PowerSGD (torch's hook fails "
                "on CPU with a bare assertion); use comm_hook='power_sgd'",
            )
        if hook not in ("no", *_HOOK_PARTS):
            self.refuse("comm_hook", "use one of no, fp16, bf16, power_sgd")
        if wrapper not in ("no", "fp16", "bf16"):
            self.refuse("comm_wrapper", "use one of no, fp16, bf16")
        if wrapper != "no" and hook != "power_sgd":
            self.refuse(
                "comm_wrapper",
                "a wrapper casts what a compressing hook sends; only "
                "comm_hook='power_sgd' takes one (fp16/bf16 hooks already cast)",
            )
        if self.comm_state_option and hook != "power_sgd":
            self.refuse("comm_state_option", "it configures PowerSGD: set comm_hook='power_sgd'")
        if hook == "no":
            return
        part = _HOOK_PARTS[hook]
        draft.parts.setdefault(part, {})
        if wrapper != "no":
            draft.set_option(part, "wrapper", wrapper, f"{who}.comm_wrapper")
        for key, value in self.comm_state_option.items():
            if key not in _POWERSGD_STATE:
                raise KwargsHandlerError(
                    f"{who}(comm_state_option={{{key!r}: ...}}) cannot be honoured: the "
                    f"powersgd part takes {', '.join(_POWERSGD_STATE)}"
                )
            draft.set_option(part, _POWERSGD_STATE[key], value, f"{who}.comm_state_option")


@dataclass(frozen=True, kw_only=True)
class InitProcessGroupKwargs(KwargsHandler):
    """How the process group is created. Create the Accelerator before anything else starts it.

    `backend` None picks gloo on CPU and nccl on CUDA (Accelerate's default "nccl" is never
    passed on by Accelerate itself either).
    """

    backend: str | None = None
    init_method: str | None = None
    """Refused unless None or "env://": the group is initialised from torchrun's environment."""
    timeout: datetime.timedelta | None = None
    """How long a collective waits for a peer (RETARGET_TIMEOUT_S)."""

    def check(self) -> None:
        if self.init_method not in (None, "env://"):
            self.refuse(
                "init_method",
                "the process group is initialised from the environment "
                "torchrun / retarget launch sets (env://); launch with them",
            )
        if self.timeout is not None and not isinstance(self.timeout, datetime.timedelta):
            self.refuse("timeout", "give a datetime.timedelta")

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """The process-group timeout in effect while the group is created."""
        if self.timeout is None:
            yield
            return
        saved = os.environ.get("RETARGET_TIMEOUT_S")
        os.environ["RETARGET_TIMEOUT_S"] = str(self.timeout.total_seconds())
        try:
            yield
        finally:
            if saved is None:
                del os.environ["RETARGET_TIMEOUT_S"]
            else:
                os.environ["RETARGET_TIMEOUT_S"] = saved


_ACTIVITIES = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA", "hpu": "HPU"}


def _device_present(name: str) -> bool:
    module = getattr(torch, name, None)
    return name == "cpu" or bool(module is not None and module.is_available())


@dataclass(frozen=True, kw_only=True)
class ProfileKwargs(KwargsHandler):
    """torch.profiler settings of `Accelerator.profile()` (Accelerate's fields).

    With `output_trace_dir` each process writes `profile_<rank>.json` (a Chrome trace) there
    when the block ends.
    """

    activities: list[str] | None = None
    schedule_option: Mapping[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The torch profiler these settings describe."""
        activities = None
        if self.activities is not None:
            activities = []
            for name in self.activities:
                word = str(name).strip().lower()
                if word not in _ACTIVITIES:
                    self.refuse("activities", f"{name!r} is not one of {', '.join(_ACTIVITIES)}")
                if not _device_present(word):
                    self.refuse("activities", f"this machine has no {word} device to profile")
                activities.append(getattr(torch.profiler.ProfilerActivity, _ACTIVITIES[word]))
        schedule = None
        if self.schedule_option is not None:
            try:
                schedule = torch.profiler.schedule(**self.schedule_option)
            except TypeError as err:
                self.refuse("schedule_option", f"torch.profiler.schedule says: {err}")
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )
