"""quant[backend=bnb]: bitsandbytes' 4-bit (nf4/fp4, Linear4bit's format and matmul_4bit) and
LLM.int8 weights under LoRA, on Hugging Face models at their default configs (sizes shrunk):
the decisions, the bytes, the numerics, training, compile, checkpoints, and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import retarget
from retarget.core.errors import TargetNotSupportedError
from tests.passes.precision.test_quantize_linears import (
    TARGETS,
    _saved_dense_copies,
    assert_adapters_train,
    base_model,
    batch,
    compiled_against_eager,
    dequantized_reference,
    lora,
)

pytest.importorskip("bitsandbytes")  # a test extra: CI always has it


#: Wide enough that no weight has the shape of a batch's flattened activations (32 x hidden),
#: which the check for dense weight copies saved for backward would mistake for one.
HIDDEN = 128


def _numerics(compiled: nn.Module, name: str, inputs: dict, unquantized: torch.Tensor, bits: int):
    """In training mode (bitsandbytes' CPU training matmuls dequantize the weight) the logits
    are the model's with dequantized weights, and near the unquantized model's: nf4's noise is
    ~10% of a weight's RMS, int8's ~0.7%; at hidden 128 the logits move 15.0% (Llama) and 15.3%
    (Qwen2) under nf4, exactly as much as under the native backend, whose nf4 is the same."""
    reference = dequantized_reference(compiled, name, HIDDEN)
    with torch.no_grad():
        got = compiled(**inputs).logits
        want = reference(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    error = (got - unquantized).norm() / (unquantized - unquantized.mean()).norm()
    assert error < (0.2 if bits == 4 else 0.015), error


@pytest.mark.parametrize(("name", "bits"), [("llama", 4), ("qwen2", 4), ("llama", 8), ("qwen2", 8)])
def test_bnb_backend_trains_the_adapters_on_bitsandbytes_weights(name, bits):
    from retarget.kernels.quant.bnb_linear import BnbLinear

    inputs = batch()
    with torch.no_grad():
        unquantized = base_model(name, HIDDEN).train()(**inputs).logits
    compiled = retarget.compile_for(
        lora(base_model(name, HIDDEN)), f"quant[bits={bits},backend=bnb]", example_inputs=inputs
    )
    quant = compiled.program.analysis.quant
    quantized = [p for p, d in quant["linears"].items() if d["quantized"]]
    assert len(quantized) == 2 * len(TARGETS)  # every projection of both layers
    assert {type(compiled.get_submodule(p)) for p in quantized} == {BnbLinear}
    assert quant["weight_bytes"]["after"] / quant["weight_bytes"]["before"] <= 0.30
    assert "by the bnb backend" in str(compiled.report)

    compiled.train()
    _numerics(compiled, name, inputs, unquantized, bits)
    shapes = {tuple(compiled.get_submodule(p).dequantized_weight().shape) for p in quantized}
    shapes |= {s[::-1] for s in shapes}
    assert _saved_dense_copies(compiled, inputs, shapes) == []  # only the packed weight is kept
    compiled.zero_grad()
    assert_adapters_train(compiled, inputs)


def test_bnb_formats_are_bitsandbytes_own_and_its_nf4_is_the_native_one():
    """The module computes with exactly what bitsandbytes' own quantize/dequantize give for the
    same weight and settings; and its nf4 weights equal the native backend's bit for bit."""
    import bitsandbytes as bnb

    inputs = batch()
    path = "base_model.model.model.layers.1.mlp.down_proj.base_layer"
    for settings, (quant_type, nested) in {
        "type=nf4": ("nf4", False),
        "type=fp4": ("fp4", False),
        "double_quant=true": ("nf4", True),
    }.items():
        compiled = retarget.compile_for(
            lora(base_model()), f"quant[bits=4,backend=bnb,{settings}]", example_inputs=inputs
        )
        ours = compiled.get_submodule(path)
        weight = lora(base_model()).get_submodule(path).weight.detach()
        codes, state = bnb.functional.quantize_4bit(
            weight, blocksize=64, compress_statistics=nested, quant_type=quant_type
        )
        theirs = bnb.functional.dequantize_4bit(codes, state)
        assert torch.equal(ours.dequantized_weight(), theirs), settings
        assert compiled.program.analysis.quant["double_quant"] is nested
        if settings == "type=nf4":
            native = retarget.compile_for(lora(base_model()), "quant", example_inputs=inputs)
            assert torch.equal(native.get_submodule(path).dequantized_weight(), theirs)


@pytest.mark.parametrize("bits", [4, 8])
def test_bnb_backend_under_compile_matches_its_eager_form(bits):
    """bitsandbytes' ops are torch custom ops: dynamo traces each block whole (no graph
    break), and loss and adapter gradients equal the eager form's."""
    summary = compiled_against_eager(f"quant[bits={bits},backend=bnb]", 64)
    assert summary["compiled_callables"] == 1 and not summary["fallback"], summary
    assert summary["graph_breaks"] == 0, summary


def test_bnb_backend_resumes_saves_and_unwraps(tmp_path):
    """The whole quantized state is the Linear's `weight` (one uint8 buffer): a checkpoint
    loaded into a model quantized from other weights computes as the saved one."""
    from safetensors.torch import load_file

    from retarget.runtime.state.checkpoint import load_state, save_state
    from retarget.runtime.state.save_model import save_model

    inputs = batch()

    def prepared(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = lora(base_model())
        if seed:  # other base weights: what the checkpoint holds must replace them all
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
        compiled = retarget.compile_for(model, "quant[backend=bnb]", example_inputs=inputs)
        trainable = [p for p in compiled.parameters() if p.requires_grad]
        return compiled, compiled.runtime.prepare(torch.optim.AdamW(trainable, lr=1e-2))

    compiled, optimizer = prepared(0)
    for _ in range(2):
        compiled.runtime.backward(compiled(**inputs).loss)
        optimizer.step()
        optimizer.zero_grad()
    save_state(tmp_path / "state", model=compiled, optimizers=[optimizer])
    resumed, resumed_optimizer = prepared(7)
    load_state(tmp_path / "state", model=resumed, optimizers=[resumed_optimizer])
    for model, opt in ((compiled, optimizer), (resumed, resumed_optimizer)):
        model.runtime.backward(model(**inputs).loss)
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(compiled.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name

    path = "base_model.model.model.layers.0.mlp.up_proj.base_layer"
    dequantized = compiled.get_submodule(path).dequantized_weight()
    save_model(compiled, tmp_path / "full")
    saved = load_file(tmp_path / "full" / "model.safetensors")
    assert saved[f"{path}.weight"].shape == (128, 64)
    assert torch.equal(saved[f"{path}.weight"], dequantized)
    plain = compiled.unwrap().get_submodule(path)
    assert type(plain.weight) is nn.Parameter and torch.equal(plain.weight, dequantized)


def test_bnb_backend_refusals_name_the_setting(monkeypatch):
    model = lora(base_model())
    with pytest.raises(TargetNotSupportedError, match=r"backend=bnb,type=nf4\] with fsdp: .*"):
        retarget.compile_for(model, "fsdp+quant[backend=bnb]", example_inputs=batch(), world_size=2)
    with pytest.raises(TargetNotSupportedError, match=r"block_size=48 is not one of"):
        retarget.compile_for(model, "quant[backend=bnb,block_size=48]", example_inputs=batch())
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    with pytest.raises(TargetNotSupportedError, match=r"needs bitsandbytes: pip install"):
        retarget.compile_for(model, "quant[backend=bnb]", example_inputs=batch())
