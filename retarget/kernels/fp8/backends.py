"""FP8 backends: who implements the FP8 Linears, chosen by `fp8[backend=...]`.

| backend | what the swapped module is                  | scaling                   | runs on   |
|---------|---------------------------------------------|---------------------------|-----------|
| native  | our Float8Linear (torch._scaled_mm)          | delayed, current, rowwise | CPU, CUDA |
| torchao | torchao.float8 Float8Linear                  | current, rowwise          | CPU, CUDA |
| te      | transformer_engine.pytorch.Linear            | delayed, current          | CUDA 8.9+ |
| msamp   | MS-AMP's FP8Linear via msamp.initialize      | MS-AMP's own              | CUDA      |

`auto` picks te on a Hopper-class GPU (capability >= 9.0) with Transformer Engine importable,
then torchao when it is importable and has the requested recipe, then native. Each backend checks
everything before it touches the model, so a refusal leaves nothing half-applied; refusals are
Fp8BackendError (a ValueError) naming the setting and the alternative.

Third-party modules get the `CaptureAsLinear` mixin: while a region is captured, and in eval
mode unless `autocast_eval`, they compute the plain Linear, as our Float8Linear does.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from retarget.core.capturing import capturing
from retarget.core.modules import original_class, with_mixin
from retarget.core.slots import AUTOCAST_EVAL, TE_RECIPE
from retarget.kernels.fp8.native import Float8Linear
from retarget.kernels.fp8.recipe import Fp8Recipe

TE_INSTALL = "Transformer Engine is not installed (pip install transformer_engine[pytorch])"
MSAMP_INSTALL = (
    "MS-AMP is not installed and is on no package registry: build it from source "
    "(git clone https://github.com/Azure/MS-AMP, then follow its README: install its CUDA "
    "extensions and `pip install .`) on a CUDA machine"
)


class Fp8BackendError(ValueError):
    """The requested FP8 backend cannot run here or cannot do the requested recipe."""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_capability() -> tuple[int, int] | None:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@dataclass(frozen=True)
class Environment:
    """What this machine offers; tests pass their own to see every branch."""

    importable: Callable[[str], bool] = _importable
    cuda_capability: Callable[[], tuple[int, int] | None] = _cuda_capability


@dataclass
class Swapped:
    """What a backend did: the new class per path, notes, and an optimizer it made (MS-AMP)."""

    classes: dict[str, str]
    notes: list[str] = field(default_factory=list)
    optimizer: Any = None


class CaptureAsLinear(nn.Module):
    """Mixin for third-party FP8 Linears (see the module docstring)."""

    _retarget_mixin = True
    _retarget_fp8 = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fp8_in_eval = AUTOCAST_EVAL.get(self, False)
        if capturing() or (not self.training and not fp8_in_eval):
            return F.linear(x, self.weight, self.bias)
        return super().forward(x, *args, **kwargs)


class Backend:
    name: ClassVar[str]
    scalings: ClassVar[tuple[str, ...]]

    def check(self, recipe: Fp8Recipe, env: Environment, devices: set[torch.device]) -> None:
        """Raise Fp8BackendError when this backend cannot run `recipe` here."""

    def swap(self, root: nn.Module, paths: list[str], recipe: Fp8Recipe, **settings) -> Swapped:
        raise NotImplementedError

    def _refuse_scaling(self, recipe: Fp8Recipe, hint: str) -> None:
        if recipe.scaling not in self.scalings:
            raise Fp8BackendError(
                f"fp8[backend={self.name}] does not do scaling={recipe.scaling} "
                f"(it does {', '.join(self.scalings)}); {hint}"
            )


class NativeBackend(Backend):
    name = "native"
    scalings = ("delayed", "current", "rowwise")

    def check(self, recipe, env, devices) -> None:
        capability = env.cuda_capability()
        if any(d.type == "cuda" for d in devices) and capability and capability < (8, 9):
            raise Fp8BackendError(
                f"fp8[backend=native]: torch._scaled_mm needs CUDA compute capability 8.9+ "
                f"(this GPU is {capability[0]}.{capability[1]}); run FP8 on an Ada/Hopper GPU"
            )
        if any(d.type not in ("cpu", "cuda") for d in devices):
            raise Fp8BackendError("fp8[backend=native] runs on CPU and CUDA tensors only")

    def swap(self, root, paths, recipe, **settings) -> Swapped:
        classes = {}
        for path in paths:
            module = Float8Linear.from_linear(root.get_submodule(path), recipe)
            classes[path] = type(module).__name__
        return Swapped(classes)


class TorchaoBackend(Backend):
    name = "torchao"
    scalings = ("current", "rowwise")

    def check(self, recipe, env, devices) -> None:
        if not env.importable("torchao"):
            raise Fp8BackendError(
                "fp8[backend=torchao]: torchao is not installed (pip install torchao); "
                "or use fp8[backend=native]"
            )
        self._refuse_scaling(
            recipe,
            "torchao 0.18 has no delayed scaling: use fp8[backend=torchao,scaling=current] "
            "or fp8[backend=native] for Transformer Engine's delayed recipe",
        )
        if recipe.margin:
            raise Fp8BackendError(
                "fp8[backend=torchao] takes no margin (torchao scales by fp8_max / amax); "
                "use fp8[backend=native] for a margin"
            )
        if any(recipe.override_linear_precision):
            raise Fp8BackendError(
                "fp8[backend=torchao] has no override_linear_precision; use fp8[backend=native]"
            )

    def swap(self, root, paths, recipe, **settings) -> Swapped:
        from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(
            "tensorwise" if recipe.scaling == "current" else "rowwise"
        )
        if recipe.scaling == "current" and recipe.format == "e4m3":
            grads = CastConfig(target_dtype=torch.float8_e4m3fn)
            config = dataclasses.replace(
                config, cast_config_grad_output=grads, cast_config_grad_output_for_grad_weight=grads
            )
        wanted = set(paths)
        convert_to_float8_training(
            root, module_filter_fn=lambda _m, fqn: fqn in wanted, config=config
        )
        classes = {}
        for path in paths:
            module = with_mixin(root.get_submodule(path), CaptureAsLinear)
            AUTOCAST_EVAL.set(module, recipe.autocast_eval)
            classes[path] = f"torchao.{original_class(module).__name__}"
        notes = []
        if recipe.scaling == "rowwise" and recipe.format == "hybrid":
            notes.append("rowwise: torchao casts gradients to E4M3 too (row-wise GEMMs take E4M3)")
        return Swapped(classes, notes)


class TeBackend(Backend):
    """transformer_engine.pytorch.Linear under te.fp8_autocast; GPU only (not run on CPU)."""

    name = "te"
    scalings = ("delayed", "current")

    def check(self, recipe, env, devices) -> None:
        alternative = "use fp8[backend=native] (runs anywhere) or fp8[backend=torchao]"
        if not env.importable("transformer_engine"):
            raise Fp8BackendError(f"fp8[backend=te]: {TE_INSTALL} and needs CUDA; {alternative}")
        capability = env.cuda_capability()
        if capability is None or capability < (8, 9):
            raise Fp8BackendError(
                f"fp8[backend=te]: Transformer Engine needs a CUDA GPU of compute capability 8.9+ "
                f"(found {'none' if capability is None else capability}); {alternative}"
            )
        if any(d.type != "cuda" for d in devices):
            raise Fp8BackendError(
                "fp8[backend=te]: move the model to the GPU before compile_for (TE modules are "
                "created on the weights' device)"
            )
        self._refuse_scaling(recipe, "use fp8[backend=native] for row-wise scaling")

    def swap(self, root, paths, recipe, **settings) -> Swapped:
        te = importlib.import_module("transformer_engine.pytorch")
        te_recipe = make_te_recipe(recipe)
        classes = {}
        for path in paths:
            linear = root.get_submodule(path)
            module = te.Linear(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                params_dtype=linear.weight.dtype,
                device=linear.weight.device,
            )
            module.weight = linear.weight  # the same Parameter objects: FSDP and optimizers
            if linear.bias is not None:
                module.bias = linear.bias
            module = with_mixin(module, TeAutocast)
            TE_RECIPE.set(module, te_recipe)
            AUTOCAST_EVAL.set(module, recipe.autocast_eval)
            module.train(linear.training)
            root.set_submodule(path, module)
            classes[path] = "te.Linear"
        note = (
            "te: Linear only; LayerNorm+Linear is not fused into te.LayerNormLinear, which "
            "would move the LayerNorm's state_dict keys under the Linear's path"
        )
        return Swapped(classes, [note])


class TeAutocast(nn.Module):
    """Mixin for te.Linear: forward under te.fp8_autocast with our recipe; no `_extra_state` key."""

    _retarget_mixin = True
    _retarget_fp8 = True
    # TE rebuilds its FP8 metadata at the first step; keeping it out of state_dict keeps the
    # checkpoint keys those of the plain model, loadable both ways.
    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if capturing():
            return F.linear(x, self.weight, self.bias)
        te = importlib.import_module("transformer_engine.pytorch")
        enabled = self.training or AUTOCAST_EVAL.get(self, False)
        with te.fp8_autocast(enabled=enabled, fp8_recipe=TE_RECIPE.get(self)):
            return super().forward(x, *args, **kwargs)


def make_te_recipe(recipe: Fp8Recipe) -> Any:
    """Our recipe as a transformer_engine.common.recipe object (only on a machine with TE)."""
    te_recipe = importlib.import_module("transformer_engine.common.recipe")
    fmt = te_recipe.Format.HYBRID if recipe.format == "hybrid" else te_recipe.Format.E4M3
    if recipe.scaling == "current":
        if not hasattr(te_recipe, "Float8CurrentScaling"):
            raise Fp8BackendError("fp8[backend=te,scaling=current] needs Transformer Engine 2.2+")
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    kwargs = {
        "fp8_format": fmt,
        "margin": recipe.margin,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
    }
    optional = {"interval": (recipe.interval, 1)}
    optional["override_linear_precision"] = (recipe.override_linear_precision, (False,) * 3)
    accepted = {f.name for f in dataclasses.fields(te_recipe.DelayedScaling)}
    for name, (value, default) in optional.items():
        if name in accepted:
            kwargs[name] = value
        elif value != default:
            raise Fp8BackendError(f"fp8[backend=te]: this Transformer Engine has no '{name}'")
    return te_recipe.DelayedScaling(**kwargs)


class MsampBackend(Backend):
    """msamp.initialize(model, None, opt_level); GPU only (not run on CPU)."""

    name = "msamp"
    scalings = ("delayed", "current", "rowwise")

    def check(self, recipe, env, devices) -> None:
        if not env.importable("msamp"):
            raise Fp8BackendError(
                f"fp8[backend=msamp]: {MSAMP_INSTALL}; or use fp8[backend=native], which runs "
                "Transformer Engine's recipes on torch._scaled_mm without extra installs"
            )
        if env.cuda_capability() is None:
            raise Fp8BackendError("fp8[backend=msamp]: MS-AMP needs a CUDA GPU")

    def swap(self, root, paths, recipe, *, opt_level: str = "o2", kept: tuple[str, ...] = ()):
        msamp = importlib.import_module("msamp")
        for path in kept:  # MS-AMP's LinearReplacer leaves these alone
            root.get_submodule(path).use_fp32_linear = True
        model, optimizer = msamp.initialize(root, None, opt_level.upper())
        assert model is root, "msamp.initialize replaced the root module"
        note = (
            "msamp: weights are now MS-AMP ScalingParameters (new objects, no longer shared with "
            "the original model); build the training step on program.plan.fp8.optimizer "
            f"(MS-AMP's optimizer for opt_level {opt_level.upper()}; set its learning rate)"
        )
        return Swapped({p: "msamp.FP8Linear" for p in paths}, [note], optimizer)


BACKENDS: dict[str, Backend] = {
    b.name: b for b in (NativeBackend(), TorchaoBackend(), TeBackend(), MsampBackend())
}


def select_backend(name: str, recipe: Fp8Recipe, env: Environment | None = None):
    """(backend, why) for `fp8[backend=name]`; `auto` as in the module docstring."""
    env = env or Environment()
    if name != "auto":
        if name not in BACKENDS:
            choices = ", ".join(("auto", *BACKENDS))
            raise Fp8BackendError(f"unknown fp8 backend {name!r}; choose from {choices}")
        return BACKENDS[name], f"backend={name}"
    capability = env.cuda_capability()
    if capability and capability >= (9, 0) and env.importable("transformer_engine"):
        if recipe.scaling in TeBackend.scalings:
            return BACKENDS["te"], f"auto: Hopper-class GPU ({capability}) with Transformer Engine"
    if env.importable("torchao"):
        try:
            BACKENDS["torchao"].check(recipe, env, set())
        except Fp8BackendError as why:
            reason = str(why).split(";")[0].removeprefix("fp8[backend=torchao] ")
            return BACKENDS["native"], f"auto: torchao {reason}"
        return BACKENDS["torchao"], "auto: torchao is importable and has this recipe"
    return BACKENDS["native"], "auto: no Transformer Engine on a Hopper GPU, no torchao"
