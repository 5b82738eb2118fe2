"""Accelerate's kwargs handlers, each mapped onto the target or a runtime setting, with every
field we cannot honour refused by name.

    >>> handler = DistributedDataParallelKwargs(comm_hook="bf16")
    >>> Accelerator(kwargs_handlers=[handler])          # 2 processes: target ddp+bf16-comm

The classes keep Accelerate's names, fields and defaults, so a script passes the same objects
(Accelerate's own instances are converted by `as_handler`). Only fields that differ from their
default act, as in Accelerate. Where each field goes:

    DistributedDataParallelKwargs  broadcast_buffers, bucket_cap_mb, find_unused_parameters,
                                   gradient_as_bucket_view, static_graph -> ddp[...] options;
                                   comm_hook fp16|bf16|power_sgd -> fp16-comm | bf16-comm |
                                   powersgd; comm_wrapper fp16|bf16 -> powersgd[wrapper=...];
                                   comm_state_option -> powersgd[rank, start_iter, ...].
                                   Refused: dim != 0, check_reduction, batched_power_sgd.
    TERecipeKwargs / MSAMPRecipeKwargs / FP8RecipeKwargs / AORecipeKwargs
                                   -> fp8[backend=te|msamp|torchao, format, amax_history, ...]
                                   (through accelerate_config's fp8_config table); need
                                   mixed_precision="fp8".
    GradScalerKwargs               -> fp16[init_scale, growth_factor, backoff_factor,
                                   growth_interval]; needs mixed_precision="fp16".
    InitProcessGroupKwargs         backend, timeout -> the process group (ProcessState).
    AutocastKwargs                 -> Accelerator.autocast() blocks.
    ProfileKwargs                  -> Accelerator.profile().
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import torch

from retarget.target.strategies import DDP_STRATEGIES, FSDP_STRATEGIES, STRATEGIES

__all__ = [
    "AORecipeKwargs",
    "AutocastKwargs",
    "DistributedDataParallelKwargs",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "KwargsHandlerError",
    "MSAMPRecipeKwargs",
    "ProfileKwargs",
    "TERecipeKwargs",
    "TargetDraft",
]


class KwargsHandlerError(ValueError):
    """A kwargs handler field cannot be honoured; the message names the field and the way out."""


@dataclass
class TargetDraft:
    """The target being assembled from an Accelerator's arguments: `{part: {option: value}}`."""

    parts: dict[str, dict[str, Any]]
    strategy_is_default: bool
    """The distribution part came from the world size, not from the user (so DDP settings may
    turn `single` into `ddp`: in a world of one the plan is recorded, and reported as unapplied)."""

    @property
    def strategy(self) -> str:
        return next((name for name in self.parts if name in STRATEGIES), "single")

    def set_option(self, part: str, option: str, value: Any, who: str) -> None:
        """Set `part[option]`, refusing a different value the target already gives it."""
        options = self.parts.setdefault(part, {})
        if option in options and options[option] != value:
            raise KwargsHandlerError(
                f"{who} sets {part}[{option}={value}] but the target says "
                f"{part}[{option}={options[option]}]: keep one of them"
            )
        options[option] = value


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _word(value: Any) -> str:
    """An Accelerate enum member or string as a lowercase word."""
    return str(getattr(value, "value", value)).strip().lower()


@dataclass(frozen=True, kw_only=True)
class KwargsHandler:
    """Base of the handlers: only fields that differ from their default act (as in Accelerate)."""

    def changed(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != _default(f)
        }

    def refuse(self, name: str, why: str) -> NoReturn:
        raise KwargsHandlerError(
            f"{type(self).__name__}({name}={getattr(self, name)!r}) cannot be honoured: {why}"
        )

    def shape_target(self, draft: TargetDraft) -> None:
        """Contribute to the target (handlers that map onto it override this)."""

    def fp8_config(self) -> dict[str, Any]:
        """Accelerate `fp8_config` keys this handler stands for (FP8 recipe handlers)."""
        return {}


# ------------------------------------------------------------------------------ DDP

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


# ------------------------------------------------------------------------------ precision


def _need_part(handler: KwargsHandler, draft: TargetDraft, part: str, mixed: str) -> None:
    if part not in draft.parts:
        raise KwargsHandlerError(
            f"{type(handler).__name__}({', '.join(sorted(handler.changed())) or ''}) configures "
            f"{part}, but the target has no '{part}' part: pass mixed_precision='{mixed}'"
        )


@dataclass(frozen=True, kw_only=True)
class GradScalerKwargs(KwargsHandler):
    """fp16 loss scaling -> the fp16 part's options (needs mixed_precision="fp16")."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    """Refused when False: fp16 gradients underflow without loss scaling; use bf16."""

    def shape_target(self, draft: TargetDraft) -> None:
        changed = self.changed()
        if not changed:
            return
        if not self.enabled:
            self.refuse(
                "enabled",
                "fp16 training without loss scaling loses small gradients to "
                "underflow; use mixed_precision='bf16', which needs no scaler",
            )
        _need_part(self, draft, "fp16", "fp16")
        for option, value in changed.items():
            draft.set_option("fp16", option, value, f"GradScalerKwargs.{option}")


def _fp8_keys(handler: KwargsHandler, table: Mapping[str, str]) -> dict[str, Any]:
    """The handler's set fields under their Accelerate fp8_config keys."""
    return {
        key: getattr(handler, name)
        for name, key in table.items()
        if getattr(handler, name) is not None
    }


#: TERecipeKwargs fields -> Accelerate fp8_config keys (accelerate_config maps those).
_TE_KEYS = {
    "fp8_format": "fp8_format",
    "amax_history_len": "amax_history_len",
    "amax_compute_algo": "amax_compute_algo",
    "margin": "margin",
    "interval": "interval",
    "override_linear_precision": "override_linear_precision",
    "use_autocast_during_eval": "use_autocast_during_eval",
}


@dataclass(frozen=True, kw_only=True)
class TERecipeKwargs(KwargsHandler):
    """Transformer Engine's FP8 recipe -> fp8[backend=te, ...]; None leaves our default."""

    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_mxfp8_block_scaling: bool | None = None
    """Refused when True: the fp8 part has no MXFP8 block scaling."""

    def fp8_config(self) -> dict[str, Any]:
        if self.use_mxfp8_block_scaling:
            self.refuse(
                "use_mxfp8_block_scaling",
                "no fp8 backend here implements MXFP8 block "
                "scaling; use the delayed, current or rowwise scaling of fp8[scaling=...]",
            )
        return {"backend": "TE", **_fp8_keys(self, _TE_KEYS)}


@dataclass(frozen=True, kw_only=True)
class MSAMPRecipeKwargs(KwargsHandler):
    """MS-AMP's FP8 -> fp8[backend=msamp, opt_level]."""

    opt_level: str | None = None

    def fp8_config(self) -> dict[str, Any]:
        return {"backend": "MSAMP", **_fp8_keys(self, {"opt_level": "opt_level"})}


@dataclass(frozen=True, kw_only=True)
class AORecipeKwargs(KwargsHandler):
    """torchao's float8 training -> fp8[backend=torchao] with current (tensorwise) scaling."""

    config: Any = None
    """Refused when set: choose the scaling with target='bf16+fp8[backend=torchao,
    scaling=rowwise]' instead of a torchao Float8LinearConfig."""
    module_filter_func: Callable[..., bool] | None = None
    """Refused when set: use fp8[include=...,exclude=...] name patterns."""
    pad_inner_dim: bool | None = None
    """Refused when set: Linears with dims that are not multiples of 16 are kept in high
    precision (and reported), not padded."""
    enable_fsdp_float8_all_gather: bool | None = None
    """Refused when True: FSDP all-gathers the high-precision weights."""

    def fp8_config(self) -> dict[str, Any]:
        why = {
            "config": "choose the recipe with target='bf16+fp8[backend=torchao,scaling=rowwise]' "
            "(or scaling=current)",
            "module_filter_func": "choose Linears with fp8[include=...,exclude=...] name patterns",
            "pad_inner_dim": "Linears whose dims are not multiples of 16 stay in high precision "
            "(the report lists them); they are not padded",
            "enable_fsdp_float8_all_gather": "FSDP all-gathers the high-precision weights here",
        }
        for name, reason in why.items():
            if getattr(self, name) not in (None, False):
                self.refuse(name, reason)
        return {"backend": "AO"}


@dataclass(frozen=True, kw_only=True)
class FP8RecipeKwargs(KwargsHandler):
    """Accelerate's older FP8 handler: `backend` TE, MSAMP or AO with that backend's fields.

    Without a backend, fp8's `auto` picks one (te on Hopper with Transformer Engine, else
    torchao, else native) where Accelerate picks MS-AMP or TE.
    """

    backend: str | None = None
    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    opt_level: str | None = None

    def fp8_config(self) -> dict[str, Any]:
        backend = None if self.backend is None else str(self.backend).strip().upper()
        te_fields = _fp8_keys(self, _TE_KEYS)
        if backend not in (None, "TE", "MSAMP", "MS-AMP", "AO"):
            self.refuse("backend", "use TE, MSAMP or AO")
        if te_fields and backend not in (None, "TE"):
            raise KwargsHandlerError(
                f"FP8RecipeKwargs({', '.join(te_fields)}) are Transformer Engine recipe fields "
                f"but backend={self.backend!r}: use backend='TE' or remove them"
            )
        if self.opt_level is not None and backend not in ("MSAMP", "MS-AMP"):
            self.refuse("opt_level", "it is MS-AMP's; set backend='MSAMP'")
        config = {**te_fields, **_fp8_keys(self, {"opt_level": "opt_level"})}
        return config if backend is None else {"backend": backend, **config}


# ------------------------------------------------------------------------------ runtime settings


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


@dataclass(frozen=True, kw_only=True)
class AutocastKwargs(KwargsHandler):
    """`torch.autocast` settings of `Accelerator.autocast()` blocks (code outside the model).

    The model's own precision comes from the target's passes (explicit casts in captured
    graphs), so in `kwargs_handlers` `enabled=False` with mixed precision on is refused: it
    would contradict mixed_precision=. Pass it to `accelerator.autocast(...)` to run a block in
    float32 instead.
    """

    enabled: bool = True
    cache_enabled: bool | None = None

    def autocast_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"enabled": self.enabled}
        if self.cache_enabled is not None:
            kwargs["cache_enabled"] = self.cache_enabled
        return kwargs


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


#: The handlers that choose an FP8 recipe (at most one per Accelerator).
FP8_RECIPES = (TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs, FP8RecipeKwargs)

#: Our handler classes by name: Accelerate's instances of the same names are converted.
HANDLERS: dict[str, type[KwargsHandler]] = {
    cls.__name__: cls
    for cls in (
        DistributedDataParallelKwargs,
        GradScalerKwargs,
        TERecipeKwargs,
        MSAMPRecipeKwargs,
        AORecipeKwargs,
        FP8RecipeKwargs,
        InitProcessGroupKwargs,
        AutocastKwargs,
        ProfileKwargs,
    )
}


def as_handler(obj: Any) -> KwargsHandler:
    """Our handler for `obj` (ours, or Accelerate's instance of the same name, converted)."""
    if isinstance(obj, KwargsHandler):
        return obj
    name = type(obj).__name__
    if name not in HANDLERS:
        raise KwargsHandlerError(
            f"kwargs_handlers holds a {name}, which retarget does not know: it takes "
            f"{', '.join(HANDLERS)}"
        )
    cls = HANDLERS[name]
    known = {f.name for f in fields(cls)}
    given = _changed_fields(obj)
    unknown = sorted(set(given) - known)
    if unknown:
        raise KwargsHandlerError(
            f"{name}({', '.join(unknown)}) cannot be honoured: retarget's {name} has no such "
            f"field (it takes {', '.join(sorted(known))})"
        )
    return cls(**given)


def _changed_fields(obj: Any) -> dict[str, Any]:
    """A foreign handler's fields that differ from its own class's defaults (what it asks for).

    Accelerate passes on only those (its default InitProcessGroupKwargs backend "nccl" never
    reaches torch), so a default is left to ours.
    """
    if not dataclasses.is_dataclass(obj):
        return dict(vars(obj))
    try:
        default = type(obj)()
    except Exception:  # noqa: BLE001 - a class without defaults: every field is asked for
        default = None
    return {
        f.name: getattr(obj, f.name)
        for f in fields(obj)
        if default is None or getattr(obj, f.name) != getattr(default, f.name)
    }


def collect_handlers(kwargs_handlers: Any) -> dict[type[KwargsHandler], KwargsHandler]:
    """`kwargs_handlers` by class; a class given twice is an error, as in Accelerate."""
    found: dict[type[KwargsHandler], KwargsHandler] = {}
    for obj in kwargs_handlers or ():
        handler = as_handler(obj)
        if type(handler) in found:
            raise KwargsHandlerError(
                f"kwargs_handlers holds two {type(handler).__name__}: merge them into one"
            )
        found[type(handler)] = handler
    recipes = [h for h in found.values() if isinstance(h, FP8_RECIPES)]
    if len(recipes) > 1:
        names = ", ".join(type(h).__name__ for h in recipes)
        raise KwargsHandlerError(f"kwargs_handlers holds several FP8 recipes ({names}): keep one")
    return found
