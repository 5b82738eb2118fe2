"""FP8 recipes: Transformer Engine's delayed-scaling semantics checked against hand computation."""

from __future__ import annotations

import pytest
import torch

from retarget.kernels.fp8.recipe import (
    E4M3,
    E5M2,
    DelayedScaling,
    Fp8Recipe,
    amax_to_scale,
    cast_to_fp8,
    quantize_current,
)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _state(recipe: Fp8Recipe) -> DelayedScaling:
    s = DelayedScaling.initial_state(recipe)
    return DelayedScaling(recipe, s["fp8_amax_history"], s["fp8_scale"], s["fp8_updates"])


def _with_amax(amax: float) -> torch.Tensor:
    return torch.tensor([[amax, -amax / 2], [0.25, amax / 4]])


def _run(recipe: Fp8Recipe, amaxes: list[float], role: str = "input") -> list[float]:
    """Cast one tensor per step; return the scale each step's cast used."""
    state = _state(recipe)
    used = []
    for amax in amaxes:
        _, inverse = state.quantize(role, _with_amax(amax))
        used.append(1.0 / inverse.item())
    return used


def test_delayed_scaling_follows_te_formula_over_steps():
    # margin 1, window of 3, max: scale_k = (448 / max(last 3 amaxes)) / 2, used at step k+1.
    recipe = Fp8Recipe(amax_history_len=3, amax_compute_algo="max", margin=1)
    amaxes = [2.0, 8.0, 4.0, 1.0, 0.5]
    expected = [1.0]  # TE starts from scale 1 with an empty history
    for step in range(1, len(amaxes)):
        window = amaxes[max(0, step - 3) : step]
        expected.append(E4M3_MAX / max(window) / 2)
    assert _run(recipe, amaxes) == pytest.approx(expected, rel=1e-6)
    # expected = [1, 112, 28, 28, 28]: 8 leaves the window only at the step after the 5th.
    assert expected[1:] == pytest.approx([112.0, 28.0, 28.0, 28.0])


def test_history_rotates_like_te_with_the_newest_amax_in_slot_zero():
    recipe = Fp8Recipe(amax_history_len=3, amax_compute_algo="max")
    state = _state(recipe)
    for amax in (2.0, 8.0, 4.0):
        state.quantize("weight", _with_amax(amax))
    # Each update rolled by -1 and zeroed slot 0; the last cast's amax waits in slot 0 for the
    # update before the next cast.
    assert state.history[:, 1].tolist() == [4.0, 2.0, 8.0]
    assert state.history[:, 0].tolist() == [0.0, 0.0, 0.0]  # other roles untouched
    assert state.updates.tolist() == [-1, 2, -1]
    state.quantize("weight", _with_amax(1.0), observe=False)  # a recompute: no update, no record
    assert state.history[:, 1].tolist() == [4.0, 2.0, 8.0] and state.updates[1] == 2


def test_most_recent_uses_only_the_last_amax():
    recipe = Fp8Recipe(amax_history_len=4, amax_compute_algo="most_recent")
    used = _run(recipe, [8.0, 2.0, 4.0])
    assert used == pytest.approx([1.0, E4M3_MAX / 8.0, E4M3_MAX / 2.0])
    with_max = _run(Fp8Recipe(amax_history_len=4, amax_compute_algo="max"), [8.0, 2.0, 4.0])
    assert with_max == pytest.approx([1.0, E4M3_MAX / 8.0, E4M3_MAX / 8.0])


def test_interval_recomputes_the_scale_every_interval_updates_only():
    recipe = Fp8Recipe(amax_history_len=8, amax_compute_algo="most_recent", interval=3)
    used = _run(recipe, [4.0, 8.0, 2.0, 1.0, 16.0, 0.5, 1.0])
    # Updates 3 and 6 recompute (from the amax of steps 3 and 6); the others keep the scale.
    assert used == pytest.approx([1.0, 1.0, 1.0, 224.0, 224.0, 224.0, 896.0])


def test_first_step_uses_scale_one_and_saturates_instead_of_overflowing():
    recipe = Fp8Recipe(amax_history_len=2)
    state = _state(recipe)
    x = torch.tensor([1000.0, -3000.0, 2.0])
    x_fp8, inverse = state.quantize("input", x)
    assert inverse.item() == 1.0
    assert x_fp8.float().tolist() == [448.0, -448.0, 2.0]
    _, inverse = state.quantize("input", x)
    assert 1.0 / inverse.item() == pytest.approx(E4M3_MAX / 3000.0)
    grads = cast_to_fp8(torch.tensor([1e6, -1e6]), torch.tensor(1.0), E5M2)
    assert grads.float().tolist() == [E5M2_MAX, -E5M2_MAX]  # an unclamped cast gives inf


def test_gradient_role_uses_e5m2_range_for_hybrid_and_e4m3_range_otherwise():
    hybrid = _run(Fp8Recipe(amax_history_len=1), [2.0, 2.0], role="grad_output")
    e4m3 = _run(Fp8Recipe(amax_history_len=1, format="e4m3"), [2.0, 2.0], role="grad_output")
    assert hybrid[1] == pytest.approx(E5M2_MAX / 2.0)
    assert e4m3[1] == pytest.approx(E4M3_MAX / 2.0)
    assert Fp8Recipe().dtype("grad_output") == E5M2 and Fp8Recipe().dtype("input") == E4M3


def test_scale_is_kept_when_amax_is_zero_or_not_finite():
    scale = torch.tensor(7.0)
    for amax in (0.0, float("inf"), float("nan")):
        assert amax_to_scale(torch.tensor(amax), scale, E4M3_MAX, 0).item() == 7.0
    assert amax_to_scale(torch.tensor(4.0), scale, E4M3_MAX, 2).item() == E4M3_MAX / 4.0 / 4


def test_current_scaling_per_tensor_and_per_row():
    x = torch.tensor([[1.0, -4.0], [0.5, 0.25]])
    x_fp8, inverse = quantize_current(x, E4M3, margin=0)
    assert inverse.item() == pytest.approx(4.0 / E4M3_MAX)
    assert x_fp8.float().abs().max().item() == E4M3_MAX
    rows_fp8, row_inverse = quantize_current(x, E4M3, margin=0, dim=1)
    assert row_inverse.shape == (2, 1)
    assert row_inverse.flatten().tolist() == pytest.approx([4.0 / E4M3_MAX, 0.5 / E4M3_MAX])
    assert (rows_fp8.float().abs().amax(dim=1) == E4M3_MAX).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"format": "e5m2"}, "format"),
        ({"scaling": "block"}, "scaling"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"override_linear_precision": (True,)}, "override_linear_precision"),
    ],
)
def test_bad_recipe_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Fp8Recipe(**kwargs)
