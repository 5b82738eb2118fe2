"""FP8 recipes with Transformer Engine's semantics, so `fp8[...]` means what TE's recipe means.

Formats (TE `recipe.Format`): `hybrid` casts inputs and weights to E4M3 (max 448) and gradients
to E5M2 (max 57344); `e4m3` uses E4M3 everywhere.

Scaling (how the fp32 scale `s` of `cast(x * s)` is chosen; GEMMs take `1 / s`):

- `delayed` (TE `DelayedScaling`): every cast tensor role (input, weight, grad_output) keeps an
  amax history of `amax_history_len` slots, slot 0 being the current one. A cast uses the scale
  from the last update, so it costs one read of the tensor. TE starts from scale 1 and a zero
  history, so the *first* step casts with scale 1 (values above the FP8 maximum saturate); we do
  the same. A cast writes its amax into slot 0; before the next step's cast the update runs
  (TE's `_default_get_amax_and_update_history` + `_default_sf_compute`): `amax` is the
  history's maximum (`max`) or slot 0 (`most_recent`); the history rotates by -1 and slot 0 is
  zeroed; the scale becomes ``(fp8_max / amax) / 2**margin``, kept where amax is 0 or not
  finite. TE's (deprecated) `interval` "recomputes the scale once every interval steps": the
  history is recorded every step and the scale recomputed at every `interval`-th update.
- `current` (TE `Float8CurrentScaling`, torchao tensorwise): the scale comes from the tensor's
  own amax, with the same formula (scale 1 for an all-zero tensor).
- `rowwise` (torchao rowwise): one current scale per row of a GEMM's first operand and per
  column of its second, i.e. along the contraction dimension.

Casting always clamps to the format's range first (saturating: float8_e5m2 would overflow to inf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
#: format -> (forward dtype, gradient dtype)
FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
SCALINGS = ("delayed", "current", "rowwise")
AMAX_ALGOS = ("max", "most_recent")
#: The tensors one FP8 Linear casts, in the order of its delayed-scaling state columns.
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """What an FP8 Linear does; the fields mirror TE's recipe and Accelerate's FP8RecipeKwargs.

    >>> Fp8Recipe(format="hybrid", scaling="delayed", amax_history_len=16).dtype("grad_output")
    torch.float8_e5m2
    """

    format: str = "hybrid"
    """hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 everywhere."""
    scaling: str = "delayed"
    """delayed | current | rowwise (module docstring)."""
    amax_history_len: int = 16
    """Slots of the amax history (delayed scaling)."""
    amax_compute_algo: str = "most_recent"
    """max: largest amax in the history; most_recent: the last one (delayed scaling)."""
    margin: int = 0
    """The scale is divided by 2**margin: headroom against growth between updates."""
    interval: int = 1
    """Updates between scale recomputations (delayed scaling)."""
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    """(fprop, dgrad, wgrad): run that GEMM in the input's precision instead of FP8."""
    autocast_eval: bool = False
    """Use FP8 in eval mode too; otherwise eval runs the plain high-precision Linear."""

    def __post_init__(self) -> None:
        _check_choice("format", self.format, tuple(FORMATS))
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
        if self.amax_history_len < 1 or self.interval < 1:
            raise ValueError("Fp8Recipe: amax_history_len and interval must be at least 1")
        flags = tuple(bool(f) for f in self.override_linear_precision)
        if len(flags) != 3:
            raise ValueError("Fp8Recipe.override_linear_precision: 3 bools (fprop, dgrad, wgrad)")
        object.__setattr__(self, "override_linear_precision", flags)

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype a tensor role is cast to (row-wise scaling is E4M3 only, see layout.py)."""
        forward, backward = FORMATS[self.format]
        if self.scaling == "rowwise":
            return E4M3
        return backward if role == "grad_output" else forward


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Fp8Recipe.{field} must be one of {choices}, got {value!r}")


def amax_to_scale(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float | torch.Tensor, margin: int
) -> torch.Tensor:
    """TE's ``(fp8_max / amax) / 2**margin``, keeping `scale` where amax is 0 or not finite."""
    new = (fp8_max / amax) / (2.0**margin)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, new, scale)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale`` (scale broadcasts: 0-dim, (M, 1) or (1, N)).

    The result is row-major whatever x's strides (the GEMM layout rules start from that).
    """
    fp8_max = FP8_MAX[dtype]
    return (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype).contiguous()


def tensor_amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Largest magnitude in fp32: of the whole tensor, or along `dim` (kept as size 1)."""
    magnitude = x.detach().abs().float()
    return magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)


def current_scale(x: torch.Tensor, dtype: torch.dtype, margin: int, dim: int | None = None):
    """Scale from the tensor itself: per tensor, or per slice along the reduced `dim`."""
    amax = tensor_amax(x, dim)
    return amax_to_scale(amax, torch.ones_like(amax), FP8_MAX[dtype], margin)


def quantize_current(x: torch.Tensor, dtype: torch.dtype, margin: int, dim: int | None = None):
    """(x_fp8, inverse scale) with a current scale; `dim` reduces along it (row-wise scaling)."""
    scale = current_scale(x, dtype, margin, dim)
    return cast_to_fp8(x, scale, dtype), scale.reciprocal()


class DelayedScaling:
    """TE's delayed scaling over one module's state tensors (updated in place, no host syncs).

    `history` is (amax_history_len, len(ROLES)), `scale` and `updates` are (len(ROLES),): the
    layout of TE's `fp8_meta` amax_history / scale, one column per role. A cast records its amax
    in slot 0; the update that consumes it runs at the start of the role's next recording cast
    (TE updates between steps). So a cast that does not record, like the forward re-run of
    activation checkpointing, sees exactly the scale the original forward used.
    """

    def __init__(self, recipe: Fp8Recipe, history, scale, updates):
        self.recipe, self.history, self.scale, self.updates = recipe, history, scale, updates

    @staticmethod
    def initial_state(recipe: Fp8Recipe, device=None) -> dict[str, torch.Tensor]:
        """TE's initial state: zero history, scale 1. `updates` starts at -1: the update before
        the first cast has nothing to consume and does not count towards `interval`."""
        roles = len(ROLES)
        return {
            "fp8_amax_history": torch.zeros(recipe.amax_history_len, roles, device=device),
            "fp8_scale": torch.ones(roles, device=device),
            "fp8_updates": torch.full((roles,), -1, dtype=torch.long, device=device),
        }

    def quantize(self, role: str, x: torch.Tensor, *, observe: bool = True):
        """(x_fp8, inverse scale); with `observe`, update first and record x's amax after."""
        index = ROLES.index(role)
        if observe:
            self.update(role)
        scale = self.scale[index].clone()
        x_fp8 = cast_to_fp8(x, scale, self.recipe.dtype(role))
        if observe:
            with torch.no_grad():
                self.history[0, index] = tensor_amax(x)
        return x_fp8, scale.reciprocal()

    @torch.no_grad()
    def update(self, role: str) -> None:
        """Reduce the history, rotate it by -1, zero slot 0; rescale every interval-th update."""
        index = ROLES.index(role)
        column = self.history[:, index]
        reduced = column.amax() if self.recipe.amax_compute_algo == "max" else column[0].clone()
        column.copy_(torch.roll(column, -1, 0))
        column[0] = 0.0
        self.updates[index] += 1
        fp8_max = FP8_MAX[self.recipe.dtype(role)]
        rescaled = amax_to_scale(reduced, self.scale[index], fp8_max, self.recipe.margin)
        due = self.updates[index] % self.recipe.interval == 0
        self.scale[index] = torch.where(due, rescaled, self.scale[index])
