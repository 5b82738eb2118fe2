"""Float8Linear (native backend): numerics vs fp32, the GEMMs really are FP8 `_scaled_mm`,
saturation, CUDA layout rules, recipe switches and checkpoint compatibility."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from retarget.core.capturing import capturing_originals
from retarget.kernels.fp8 import layout
from retarget.kernels.fp8.layout import (
    CPU_GEMM_ENV,
    ScaledMMLayoutError,
    broken_rules,
    check_scaled_mm,
    column_major,
    cpu_fp8_gemm,
    emulated_scaled_mm,
    scaled_mm,
)
from retarget.kernels.fp8.native import Float8Linear
from retarget.kernels.fp8.recipe import E4M3, E5M2, Fp8Recipe

# Measured (tokens 35, 64 -> 128, seed 0): relative error of the output / grad norms is
# 0.034-0.037 for E4M3 operands and 0.058 for E5M2 gradients (hybrid dgrad/wgrad). E4M3 rounds
# each element by up to 2^-4 and E5M2 by up to 2^-3; the bounds below leave ~35% headroom.
E4M3_TOL, E5M2_TOL = 0.05, 0.08


class OpRecorder(TorchDispatchMode):
    """Records (op name, input dtypes, input shapes) of the matmul-like ops that run."""

    WATCHED = ("_scaled_mm", "aten.mm", "aten.addmm", "aten.linear", "aten.bmm")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(w in name for w in self.WATCHED):
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            self.calls.append((name, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors]))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [name for name, _, _ in self.calls]


def _pair(recipe: Fp8Recipe, in_features=64, out_features=128):
    torch.manual_seed(0)
    reference = nn.Linear(in_features, out_features)
    copy = nn.Linear(in_features, out_features)
    copy.load_state_dict(reference.state_dict())
    return reference, Float8Linear.from_linear(copy, recipe)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("scaling", ["delayed", "current", "rowwise"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_forward_and_backward_track_fp32_within_fp8_rounding(scaling, fmt):
    reference, fp8 = _pair(Fp8Recipe(scaling=scaling, format=fmt))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 64, generator=gen)
    grad = torch.randn(5, 7, 128, generator=gen)
    _step(fp8, x, grad)  # delayed scaling: step 1 casts with scale 1, as TE does
    got, want = _step(fp8, x, grad), _step(reference, x, grad)
    grad_tol = E5M2_TOL if fmt == "hybrid" and scaling != "rowwise" else E4M3_TOL
    errors = [_relative(g, w) for g, w in zip(got[:3], want[:3], strict=True)]
    assert errors[0] < E4M3_TOL
    assert errors[1] < grad_tol and errors[2] < grad_tol
    assert min(errors) > 1e-3  # FP8 rounding is visible: the GEMMs did not run in fp32
    assert torch.allclose(got[3], want[3], rtol=1e-5, atol=1e-5)  # bias grad in high precision


@pytest.mark.usefixtures("reference_fp8_gemm")
def test_every_gemm_is_scaled_mm_on_float8_operands():
    _, fp8 = _pair(Fp8Recipe(scaling="current", format="hybrid"))
    x = torch.randn(4, 64, requires_grad=True)
    with OpRecorder() as forward:
        out = fp8(x)
    with OpRecorder() as backward:
        out.sum().backward()
    assert forward.calls == [("aten._scaled_mm.default", [E4M3, E4M3], [(4, 64), (64, 128)])]
    # dgrad: dy (E5M2) @ W (E4M3); wgrad: dy^T (E5M2) @ x (E4M3), tokens padded 4 -> 16.
    assert backward.calls == [
        ("aten._scaled_mm.default", [E5M2, E4M3], [(4, 128), (128, 64)]),
        ("aten._scaled_mm.default", [E5M2, E4M3], [(128, 16), (16, 64)]),
    ]


def _fp8_operands(m, k, n, a_dtype, b_dtype, rowwise, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=gen) * 40).clamp(-440, 440).to(a_dtype)
    b = (torch.randn(n, k, generator=gen) * 40).clamp(-440, 440).to(b_dtype).t()  # column-major
    if rowwise:
        scale_a = torch.rand(m, 1, generator=gen) / 100 + 1e-3
        scale_b = torch.rand(1, n, generator=gen) / 100 + 1e-3
    else:
        scale_a, scale_b = torch.tensor(0.0123), torch.tensor(0.0021)
    return a, b, scale_a, scale_b


@pytest.mark.parametrize(
    "a_dtype, b_dtype, rowwise, out_dtype",
    [
        (E4M3, E4M3, False, torch.float32),
        (E5M2, E4M3, False, torch.float32),
        (E4M3, E5M2, False, torch.bfloat16),
        (E4M3, E4M3, True, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("m, k, n", [(32, 64, 48), (16, 256, 32)])
def test_cpu_emulation_computes_what_scaled_mm_computes(
    a_dtype, b_dtype, rowwise, out_dtype, m, k, n
):
    operands = _fp8_operands(m, k, n, a_dtype, b_dtype, rowwise)
    want = torch._scaled_mm(*operands, out_dtype=out_dtype)
    got = emulated_scaled_mm(*operands, out_dtype)
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape == (m, n)
    got, want = got.float(), want.float()
    # The same exact products summed in another order: fp32 rounding of the sum, then the one
    # rounding to out_dtype (a bf16 result may land one bf16 step, 2^-8 relative, away).
    step = 2.0**-8 if out_dtype == torch.bfloat16 else 1e-6
    bound = step * want.abs() + 1e-6 * want.abs().max()
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, torch.zeros_like(got))


def test_the_cpu_runs_the_emulation_by_default_and_scaled_mm_on_request():
    _, fp8 = _pair(Fp8Recipe(scaling="current", format="hybrid"))
    x = torch.randn(4, 64, requires_grad=True)
    with OpRecorder() as emulated:
        out = fp8(x)
        out.sum().backward()
    grads = x.grad.clone(), fp8.weight.grad.clone()
    # The three GEMMs as fp32 matmuls of the same shapes as _scaled_mm's operands.
    f32 = [torch.float32, torch.float32]
    assert emulated.calls == [
        ("aten.mm.default", f32, [(4, 64), (64, 128)]),
        ("aten.mm.default", f32, [(4, 128), (128, 64)]),
        ("aten.mm.default", f32, [(128, 16), (16, 64)]),
    ]
    x.grad = fp8.weight.grad = None
    with cpu_fp8_gemm("scaled_mm"), OpRecorder() as reference:
        again = fp8(x)
        again.sum().backward()
    assert [name for name, _, _ in reference.calls] == ["aten._scaled_mm.default"] * 3
    assert torch.allclose(out, again, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grads[0], x.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grads[1], fp8.weight.grad, rtol=1e-5, atol=1e-5)


def test_an_unknown_cpu_gemm_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(CPU_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="RETARGET_FP8_CPU_GEMM='fast': choose one of emulated"):
        layout._initial_cpu_gemm()
    monkeypatch.setenv(CPU_GEMM_ENV, "scaled_mm")
    assert layout._initial_cpu_gemm() == "scaled_mm"
    with pytest.raises(ValueError, match="choose one of emulated, scaled_mm"):
        with cpu_fp8_gemm("fast"):
            pass


def test_wgrad_pads_tokens_and_matches_unpadded_result():
    _, fp8 = _pair(Fp8Recipe(scaling="current", format="e4m3"))
    x = torch.randn(5, 64)
    grad = torch.randn(5, 128)
    _, _, dw, _ = _step(fp8, x, grad)
    reference = grad.t() @ x
    assert _relative(dw, reference) < E4M3_TOL


def test_saturation_clamps_instead_of_producing_inf():
    _, fp8 = _pair(Fp8Recipe(scaling="delayed", format="hybrid"))
    x = torch.full((16, 64), 1e6)  # first delayed step: scale 1, far above E4M3's 448
    out = fp8(x)
    out.backward(torch.full_like(out, 1e7))  # far above E5M2's 57344
    assert torch.isfinite(out).all()
    assert torch.isfinite(fp8.weight.grad).all()
    expected = 448.0 * fp8.weight.to(E4M3).float().sum(1) + fp8.bias
    assert torch.allclose(out[0], expected, rtol=1e-5)


def test_layout_rules_refuse_what_cpu_would_run():
    a = torch.randn(32, 64).to(E4M3)
    w = torch.randn(48, 64).to(E4M3)
    one = torch.tensor(1.0)
    check_scaled_mm(a, w.t(), one, one, torch.float32)  # row-major a, column-major w.t(): fine
    row_major_b = w.t().contiguous()
    torch._scaled_mm(a, row_major_b, one, one, out_dtype=torch.float32)  # the CPU kernel accepts
    with pytest.raises(ScaledMMLayoutError, match="b_column_major"):
        scaled_mm(a, row_major_b, one, one, torch.float32)
    a24, w24 = torch.randn(32, 24).to(E4M3), torch.randn(48, 24).to(E4M3)
    torch._scaled_mm(a24, w24.t(), one, one, out_dtype=torch.float32)  # CPU accepts K=24
    with pytest.raises(ScaledMMLayoutError, match="k_multiple_of_16"):
        scaled_mm(a24, w24.t(), one, one, torch.float32)
    w40 = torch.randn(40, 64).to(E4M3)
    assert broken_rules(a, w40.t(), one, one, torch.float32) == ["b_multiple_of_16"]
    assert broken_rules(a.to(E5M2), w.t().to(E5M2), one, one, torch.float32) == ["not_both_e5m2"]
    assert broken_rules(a, w.t(), one.half(), one, torch.float32) == ["scales"]
    rows, cols = torch.ones(32, 1), torch.ones(1, 48)
    assert broken_rules(a, w.t(), rows, cols, torch.bfloat16) == []
    assert broken_rules(a, w.t(), rows, cols, torch.float32) == ["rowwise_bf16_out"]
    assert broken_rules(a.to(E5M2), w.t(), rows, cols, torch.bfloat16) == ["rowwise_e4m3"]
    assert broken_rules(a.t(), w.t(), one, one, torch.float32)[0] == "a_row_major"
    assert column_major(row_major_b).stride() == (1, 64)


def test_layers_with_dims_not_multiple_of_16_are_refused_by_our_check():
    fp8 = Float8Linear(24, 32, recipe=Fp8Recipe(scaling="current"))
    with pytest.raises(ScaledMMLayoutError, match="divisible by 16"):
        fp8(torch.randn(4, 24))


@pytest.mark.usefixtures("reference_fp8_gemm")
@pytest.mark.parametrize(
    "override, forward_fp8, backward_fp8",
    [((True, False, False), 0, 2), ((False, True, False), 1, 1), ((False, True, True), 1, 0)],
)
def test_override_linear_precision_runs_those_gemms_in_high_precision(
    override, forward_fp8, backward_fp8
):
    reference, fp8 = _pair(Fp8Recipe(scaling="delayed", override_linear_precision=override))
    x = torch.randn(16, 64, requires_grad=True)
    with OpRecorder() as forward:
        out = fp8(x)
    with OpRecorder() as backward:
        out.sum().backward()
    assert sum("_scaled_mm" in n for n in forward.names()) == forward_fp8
    assert sum("_scaled_mm" in n for n in backward.names()) == backward_fp8
    if override[0]:
        assert torch.allclose(out, reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("reference_fp8_gemm")
def test_eval_runs_the_plain_linear_unless_autocast_eval():
    reference, fp8 = _pair(Fp8Recipe(scaling="delayed"))
    fp8.eval()
    x = torch.randn(8, 64)
    with OpRecorder() as calls:
        out = fp8(x)
    assert not any("_scaled_mm" in n for n in calls.names())
    assert torch.equal(out, reference(x))
    assert fp8.fp8_updates.tolist() == [-1, -1, -1]
    _, in_eval = _pair(Fp8Recipe(scaling="delayed", autocast_eval=True))
    in_eval.eval()
    with OpRecorder() as calls:
        in_eval(x)
    assert "aten._scaled_mm.default" in calls.names()
    assert in_eval.fp8_updates.tolist() == [-1, -1, -1]  # eval forwards do not move the history


def test_delayed_state_advances_once_per_training_step():
    _, fp8 = _pair(Fp8Recipe(scaling="delayed", amax_history_len=4))
    x = torch.randn(16, 64, requires_grad=True)
    for _ in range(3):
        fp8(x).sum().backward()
    # Three steps: two updates consumed the amaxes of steps 1 and 2; step 3's waits in slot 0.
    assert fp8.fp8_updates.tolist() == [2, 2, 2]
    assert (fp8.fp8_scale != 1).all() and (fp8.fp8_amax_history[0] > 0).all()


def test_while_capturing_it_computes_the_plain_linear():
    reference, fp8 = _pair(Fp8Recipe(scaling="current"))
    x = torch.randn(4, 64)
    with capturing_originals(), OpRecorder() as calls:
        out = fp8(x)
    assert torch.equal(out, reference(x)) and not any("_scaled_mm" in n for n in calls.names())


def test_same_parameters_and_checkpoints_load_both_ways():
    plain = nn.Linear(64, 32)
    weight, bias = plain.weight, plain.bias
    fp8 = Float8Linear.from_linear(plain, Fp8Recipe(scaling="delayed"))
    assert fp8 is plain and fp8.weight is weight and fp8.bias is bias
    assert list(fp8.state_dict()) == ["weight", "bias"]
    assert {name for name, _ in fp8.named_buffers()} == {
        "fp8_amax_history",
        "fp8_scale",
        "fp8_updates",
    }
    other = nn.Linear(64, 32)
    other.load_state_dict(fp8.state_dict())  # strict: no missing or unexpected keys
    assert torch.equal(other.weight, weight)
    fresh = nn.Linear(64, 32)
    fp8.load_state_dict(fresh.state_dict())
    assert torch.equal(fp8.weight, fresh.weight) and fp8.weight is weight


def test_autocast_output_dtype_follows_autocast():
    _, fp8 = _pair(Fp8Recipe(scaling="current"))
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8(x)
    assert out.dtype == torch.bfloat16
    assert fp8(x).dtype == torch.float32


def test_subclasses_keep_their_class():
    class MyLinear(nn.Linear):
        pass

    layer = Float8Linear.from_linear(MyLinear(16, 16), Fp8Recipe(scaling="current"))
    assert isinstance(layer, MyLinear) and isinstance(layer, Float8Linear)
    assert type(layer).__name__ == "Float8MyLinear"


def test_activation_checkpointing_recomputes_without_recording_amaxes_twice():
    reference, fp8 = _pair(Fp8Recipe(scaling="delayed", amax_history_len=4))
    _, plain_run = _pair(Fp8Recipe(scaling="delayed", amax_history_len=4))
    x = torch.randn(16, 64)
    for layer in (fp8, plain_run):
        _step(layer, x, torch.ones(16, 128))  # step 1 (scale 1): same for both
    layer_input = x.clone().requires_grad_()
    fp8.zero_grad()
    out = torch.utils.checkpoint.checkpoint(fp8, layer_input, use_reentrant=False)
    out.backward(torch.ones_like(out))
    _, _, plain_grad, _ = _step(plain_run, x, torch.ones(16, 128))
    assert fp8.fp8_updates.tolist() == [1, 1, 1]  # the recompute did not update or record
    assert torch.equal(fp8.fp8_amax_history, plain_run.fp8_amax_history)
    assert torch.equal(fp8.weight.grad, plain_grad)  # recomputed with the same scales


def test_non_contiguous_inputs_and_weights_meet_the_layout_rules():
    reference, fp8 = _pair(Fp8Recipe(scaling="current"))
    with torch.no_grad():
        fp8.weight.data = fp8.weight.data.t().contiguous().t()  # column-major storage
    x = torch.randn(64, 16).t()  # (16, 64), column-major
    out = fp8(x)
    out.sum().backward()
    assert _relative(out, reference(x)) < E4M3_TOL
