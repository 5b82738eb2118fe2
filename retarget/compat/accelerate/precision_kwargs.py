"""The precision kwargs handlers: the fp16 loss scaler, the FP8 recipes, autocast blocks.

GradScalerKwargs  -> fp16[init_scale, growth_factor, backoff_factor, growth_interval];
                     needs mixed_precision="fp16".
TERecipeKwargs / MSAMPRecipeKwargs / FP8RecipeKwargs / AORecipeKwargs
                  -> fp8[backend=te|msamp|torchao, format, amax_history, ...], written as
                     Accelerate's fp8_config keys and read by the same table as its YAML
                     (config_sections.py); need mixed_precision="fp8".
AutocastKwargs    -> Accelerator.autocast() blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from retarget.compat.accelerate.kwargs_base import KwargsHandler, KwargsHandlerError, TargetDraft

__all__ = [
    "FP8_RECIPES",
    "AORecipeKwargs",
    "AutocastKwargs",
    "FP8RecipeKwargs",
    "GradScalerKwargs",
    "MSAMPRecipeKwargs",
    "TERecipeKwargs",
]


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


#: TERecipeKwargs fields -> Accelerate fp8_config keys (accelerate_sections maps those).
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


#: The handlers that choose an FP8 recipe (at most one per Accelerator).
FP8_RECIPES = (TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs, FP8RecipeKwargs)


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
