"""FP8 backends: auto selection, import guards and their messages, torchao through our
eligibility table, and the GPU-only checks (te, native on CUDA), skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retarget
from retarget.kernels.fp8.backends import (
    BACKENDS,
    Environment,
    Fp8BackendError,
    select_backend,
)
from retarget.kernels.fp8.native import Float8Linear
from retarget.kernels.fp8.recipe import Fp8Recipe
from tests.zoo import ZOO, call, loss_of

LLAMA = ZOO["tiny_llama"]
CPU = {torch.device("cpu")}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


pytestmark = pytest.mark.usefixtures("one_thread")


def machine(*installed: str, capability=None) -> Environment:
    return Environment(
        importable=lambda name: name in installed, cuda_capability=lambda: capability
    )


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """(a dtype, b dtype, scale_a shape) of every torch._scaled_mm call.

    torchao computes on tensor subclasses, whose inner ops a dispatch mode does not see.
    """
    calls = []
    real = torch._scaled_mm

    def recording(a, b, scale_a, scale_b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, tuple(scale_a.shape)))
        return real(a, b, scale_a, scale_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return calls


@pytest.mark.parametrize(
    "env, scaling, expected",
    [
        (machine("transformer_engine", "torchao", capability=(9, 0)), "delayed", "te"),
        (machine("transformer_engine", "torchao", capability=(9, 0)), "rowwise", "torchao"),
        (machine("transformer_engine", "torchao", capability=(8, 9)), "current", "torchao"),
        (machine("transformer_engine", capability=(8, 9)), "delayed", "native"),
        (machine("torchao"), "delayed", "native"),
        (machine("torchao"), "current", "torchao"),
        (machine(), "current", "native"),
    ],
)
def test_auto_prefers_te_on_hopper_then_torchao_then_native(env, scaling, expected):
    backend, why = select_backend("auto", Fp8Recipe(scaling=scaling), env)
    assert backend.name == expected
    assert why.startswith("auto:")


def test_auto_says_why_torchao_was_passed_over():
    _, why = select_backend("auto", Fp8Recipe(scaling="delayed"), machine("torchao"))
    assert "delayed" in why


def test_te_is_refused_with_the_fix_when_missing_or_without_cuda():
    te = BACKENDS["te"]
    recipe = Fp8Recipe()
    with pytest.raises(
        Fp8BackendError, match="Transformer Engine is not installed.*backend=native"
    ):
        te.check(recipe, machine(), CPU)
    with pytest.raises(Fp8BackendError, match="needs a CUDA GPU.*found none"):
        te.check(recipe, machine("transformer_engine"), CPU)
    with pytest.raises(Fp8BackendError, match="move the model to the GPU"):
        te.check(recipe, machine("transformer_engine", capability=(9, 0)), CPU)
    with pytest.raises(Fp8BackendError, match="row-wise"):
        te.check(
            Fp8Recipe(scaling="rowwise"), machine("transformer_engine", capability=(9, 0)), set()
        )


def test_msamp_is_refused_with_install_instructions_and_the_native_alternative():
    msamp = BACKENDS["msamp"]
    with pytest.raises(Fp8BackendError) as missing:
        msamp.check(Fp8Recipe(), machine(), CPU)
    assert "github.com/Azure/MS-AMP" in str(missing.value)
    assert "backend=native" in str(missing.value)
    with pytest.raises(Fp8BackendError, match="needs a CUDA GPU"):
        msamp.check(Fp8Recipe(), machine("msamp"), CPU)


@pytest.mark.parametrize(
    "recipe, message",
    [
        (Fp8Recipe(scaling="delayed"), "no delayed scaling.*scaling=current.*backend=native"),
        (Fp8Recipe(scaling="current", margin=2), "takes no margin"),
        (
            Fp8Recipe(scaling="current", override_linear_precision=(True, False, False)),
            "no override_linear_precision",
        ),
    ],
)
def test_torchao_refuses_what_it_cannot_do(recipe, message):
    with pytest.raises(Fp8BackendError, match=message):
        BACKENDS["torchao"].check(recipe, machine("torchao"), CPU)
    with pytest.raises(Fp8BackendError, match="pip install torchao"):
        BACKENDS["torchao"].check(recipe, machine(), CPU)


def test_native_refuses_gpus_without_fp8_gemms():
    with pytest.raises(Fp8BackendError, match="capability 8.9"):
        BACKENDS["native"].check(Fp8Recipe(), machine(capability=(8, 0)), {torch.device("cuda")})
    BACKENDS["native"].check(Fp8Recipe(), machine(capability=(9, 0)), {torch.device("cuda")})


def test_unknown_backend_names_the_choices():
    with pytest.raises(Fp8BackendError, match="auto, native, torchao, te, msamp"):
        select_backend("cuda", Fp8Recipe())


@pytest.fixture(scope="module")
def torchao_llama():
    pytest.importorskip("torchao")
    model = LLAMA.factory()
    spec = "fp8[backend=torchao,scaling=rowwise,min_size=16]"
    return model, retarget.compile_for(model, spec, example_inputs=LLAMA.inputs(2))


def test_torchao_swaps_with_our_eligibility_and_keeps_parameters(torchao_llama):
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    model, compiled = torchao_llama
    analysis = compiled.program.analysis.fp8
    assert analysis["backend"] == "torchao"
    kept = {p for p, d in analysis["linears"].items() if not d["swapped"]}
    assert kept == {"model.layers.0.self_attn.q_proj", "lm_head"}
    for path, decision in analysis["linears"].items():
        module = compiled.get_submodule(path)
        assert isinstance(module, TorchaoFloat8Linear) == decision["swapped"], path
        assert module.weight is model.get_submodule(path).weight
    swapped = [d for d in analysis["linears"].values() if d["swapped"]]
    assert {d["class"] for d in swapped} == {"torchao.Float8Linear"}
    assert list(compiled.state_dict()) == list(model.state_dict())
    record = next(r for r in compiled.history if r.name == "swap_fp8")
    assert any("gradients to E4M3" in note for note in record.notes)
    code = compiled.program.regions[0].representative().gm.code
    assert "self.mlp.down_proj(" in code and "aten.linear" not in code


def test_torchao_modules_run_rowwise_scaled_mm_in_training_and_plain_linear_in_eval(
    torchao_llama, scaled_mm_calls
):
    model, compiled = torchao_llama
    loss = loss_of(call(compiled, LLAMA.inputs(2)))
    assert len(scaled_mm_calls) == 13  # the 13 swapped Linears, forward
    assert all(a == b == torch.float8_e4m3fn for a, b, _ in scaled_mm_calls)
    assert all(scale == (32, 1) for _, _, scale in scaled_mm_calls)  # one scale per token row
    assert abs(loss.item() - loss_of(call(model, LLAMA.inputs(2))).item()) < 0.05
    scaled_mm_calls.clear()
    compiled.eval()
    try:
        with torch.no_grad():
            call(compiled, LLAMA.inputs(2))
        assert scaled_mm_calls == []
    finally:
        compiled.train()


def test_torchao_format_decides_the_gradient_dtype(scaled_mm_calls):
    pytest.importorskip("torchao")
    spec = "fp8[backend=torchao,scaling=current,format={},min_size=16]"
    for fmt, grad_dtype in (("e4m3", torch.float8_e4m3fn), ("hybrid", torch.float8_e5m2)):
        layers = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
        example = torch.randn(16, 32)
        compiled = retarget.compile_for(layers, spec.format(fmt), example_inputs=example)
        out = compiled(torch.randn(16, 32))
        scaled_mm_calls.clear()
        out.sum().backward()
        assert len(scaled_mm_calls) == 2  # dgrad and wgrad of the middle Linear
        assert all(grad_dtype in (a, b) for a, b, _ in scaled_mm_calls)


# --------------------------------------------------------------------------- GPU only


def _gpu_llama(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=2048,
        use_cache=False,
    )
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()


def _gpu_losses(model, steps: int, batch: int = 4, seq: int = 512):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda", generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["te", "native"])
def test_gpu_fp8_tracks_bf16(backend):
    if backend == "te":
        pytest.importorskip("transformer_engine")
    example = {"input_ids": torch.randint(0, 32000, (4, 512), device="cuda")}
    reference = _gpu_losses(_gpu_llama(1024, 4), steps=10)
    spec = f"bf16+fp8[backend={backend},scaling=current,min_size=65536]"
    compiled = retarget.compile_for(_gpu_llama(1024, 4), spec, example_inputs=example)
    assert compiled.program.analysis.fp8["backend"] == backend
    losses = _gpu_losses(compiled, steps=10)
    assert ((losses - reference).abs() / reference).max() < 0.05


def test_float8_linear_is_what_native_swaps():
    layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    compiled = retarget.compile_for(
        layer, "fp8[backend=native,min_size=16]", example_inputs=torch.randn(4, 32)
    )
    assert [type(m) for m in compiled] == [nn.Linear, Float8Linear, nn.Linear]
