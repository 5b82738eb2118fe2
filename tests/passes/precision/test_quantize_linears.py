"""quantize_linears on Hugging Face models at their default configs (sizes shrunk), with PEFT LoRA
on top (QLoRA): the decisions, the bytes, the numerics against the dequantized model, training,
the compositions with bf16/ac/compile, unwrap, and the refusals."""

from __future__ import annotations

import importlib.util
import warnings

import peft
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.core.modules import released
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.targets.errors import TargetError
from tests import zoo

BNB = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes (a test extra)"
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def base_model(name: str = "llama", hidden: int = 64) -> nn.Module:
    """The model at its default config, sizes shrunk; GQA (2 key/value heads of 4)."""
    config_class, model_class = CONFIGS[name]
    torch.manual_seed(0)
    config = config_class(
        vocab_size=zoo.VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return model_class(config).train()


def lora(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=TARGETS))


def batch() -> dict[str, torch.Tensor]:
    inputs = zoo.lm_inputs()
    return {**inputs, "labels": inputs["input_ids"]}


def dequantized_reference(compiled: nn.Module, name: str, hidden: int = 64) -> nn.Module:
    """The same LoRA model in plain eager form, each quantized base weight replaced by what the
    quantized module computes with."""
    reference = lora(base_model(name, hidden))
    modules = dict(compiled.named_modules())
    with torch.no_grad():
        for path, module in reference.named_modules():
            twin = modules.get(path)
            if isinstance(twin, QuantizedLinear):
                module.weight.copy_(twin.dequantized_weight())
    return reference


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_qlora_trains_the_adapters_on_quantized_base_weights(name, bits):
    inputs = batch()
    with torch.no_grad():
        unquantized = base_model(name).eval()(**inputs)
    compiled = retarget.compile_for(
        lora(base_model(name)), f"quant[bits={bits}]", example_inputs=inputs
    )
    quant = compiled.program.analysis.quant
    decided = quant["linears"]
    quantized = [p for p, d in decided.items() if d["quantized"]]
    assert len(quantized) == 2 * len(TARGETS)
    assert all(p.endswith(".base_layer") for p in quantized)
    assert decided["base_model.model.lm_head"]["rule"] == "output_head"
    adapters = [p for p, d in decided.items() if d["rule"] == "adapter"]
    assert len(adapters) == 2 * 2 * len(TARGETS) and all(".lora_" in p for p in adapters)
    # Base weight bytes against their float32 size.
    ratio = quant["weight_bytes"]["after"] / quant["weight_bytes"]["before"]
    assert ratio <= 0.30
    assert {type(compiled.get_submodule(p)) for p in quantized} == {QuantizedLinear}
    # Every region runs its captured graph, which calls the quantized modules.
    report = compiled.report.to_dict()
    assert all(r["frontend"] == "export" and not r["eager_signatures"] for r in report["regions"])
    assert report["passes"][-1]["stats"]["graph_module_calls"] == len(TARGETS)
    text = str(compiled.report)
    assert "quant" in text and "kept: output_head" in text

    assert_dequantized_numerics(compiled, name, inputs, unquantized.logits, bits)
    assert_adapters_train(compiled, inputs)
    named = dict(compiled.named_parameters())
    assert all(named[f"{p}.weight"].grad is None for p in quantized)


def assert_dequantized_numerics(
    compiled: nn.Module, name: str, inputs: dict, unquantized: torch.Tensor, bits: int,
    hidden: int = 64,
) -> None:  # fmt: skip
    """The logits are exactly the model's with dequantized weights, and near the unquantized
    model's: a normal weight's quantization noise is ~10% of its RMS under nf4 and ~0.7% under
    int8 (half a level step, docs/quantization.md); the logits inherit it (measured 9-11%,
    0.7%)."""
    reference = dequantized_reference(compiled, name, hidden)
    compiled.eval(), reference.eval()
    with torch.no_grad():
        got = compiled(**inputs).logits
        want = reference(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    centred = unquantized - unquantized.mean()
    error = (got - unquantized).norm() / centred.norm()
    assert error < (0.15 if bits == 4 else 0.015), error


def assert_adapters_train(compiled: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """20 AdamW steps on the trainable parameters lower the loss; only the adapters train."""
    compiled.train()
    trainable = [p for p in compiled.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(20):
        loss = compiled(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.9 * losses[0], losses
    named = dict(compiled.named_parameters())
    assert all(".lora_" in n for n, p in named.items() if p.requires_grad)


@pytest.mark.parametrize(
    "target",
    [
        "bf16+quant",
        "quant+ac",
        "bf16+quant[double_quant=true]+ac",
        "quant[type=fp4]+compile[backend=aot_eager]",
        # bitsandbytes' nf4 is the native one bit for bit: the same loss as plain `quant`.
        pytest.param("bf16+quant[backend=bnb]+ac", marks=BNB),
    ],
)
def test_quant_composes_with_precision_checkpointing_and_compile(target):
    inputs = batch()
    plain = retarget.compile_for(lora(base_model()), "quant", example_inputs=inputs)
    compiled = retarget.compile_for(lora(base_model()), target, example_inputs=inputs)
    report = compiled.report.to_dict()
    assert all(r["frontend"] == "export" and not r["eager_signatures"] for r in report["regions"])
    passes = [r["name"] for r in report["passes"]]
    assert passes[3] == "quantize_linears"  # before every rewrite of the blocks
    loss = compiled(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in compiled.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    if "fp4" not in target:
        expected = plain(**inputs).loss
        tolerance = 0.02 if "bf16" in target else 1e-5
        torch.testing.assert_close(loss, expected, rtol=tolerance, atol=tolerance)
    if "compile" in target:
        (summary,) = [r["compile"] for r in report["regions"]]
        # One compiled callable per block type, no graph break at the quantized modules.
        assert summary["compiled_callables"] == 1 and summary["graph_breaks"] == 0, summary
    if "bf16" in target:
        module = compiled.get_submodule(
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
        )
        assert module.compute_dtype == torch.bfloat16


def test_unwrap_gives_the_original_model_with_dequantized_weights():
    inputs = batch()
    original = lora(base_model())
    path = "base_model.model.model.layers.1.mlp.down_proj.base_layer"
    weight = original.get_submodule(path).weight
    compiled = retarget.compile_for(original, "quant[bits=8]", example_inputs=inputs)
    assert released(weight)  # the full-size weight no longer sits beside the quantized one
    assert compiled.runtime is not None
    unwrapped = compiled.unwrap()
    assert unwrapped is original and not released(weight)
    assert torch.equal(weight, compiled.get_submodule(path).dequantized_weight())
    compiled.eval(), unwrapped.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            unwrapped(**inputs).logits, compiled(**inputs).logits, rtol=1e-5, atol=1e-5
        )


def test_skip_patterns_and_their_typos_are_reported():
    compiled = retarget.compile_for(
        lora(base_model()), "quant[skip=*.o_proj.base_layer|*.typo_proj]", example_inputs=batch()
    )
    decided = compiled.program.analysis.quant["linears"]
    skipped = [p for p, d in decided.items() if d["rule"] == "skip"]
    assert len(skipped) == 2 and all("o_proj" in p for p in skipped)
    notes = compiled.report.to_dict()["passes"][3]["notes"]
    assert any("skip pattern '*.typo_proj' names no Linear" in n for n in notes)


def test_peft_kbit_preparation_then_adapters_and_a_warning_without_them():
    """PEFT's QLoRA recipe: prepare_model_for_kbit_training freezes every weight (and turns on
    HF's gradient checkpointing); without adapters nothing would train, which quant says."""
    frozen = peft.prepare_model_for_kbit_training(base_model())
    with pytest.warns(UserWarning, match="no parameter is trainable any more: add adapters"):
        compiled = retarget.compile_for(frozen, "quant", example_inputs=batch())
    with torch.no_grad():
        assert torch.isfinite(compiled(**batch()).loss)
    adapted = lora(peft.prepare_model_for_kbit_training(base_model()))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no parameter is trainable")
        compiled = retarget.compile_for(adapted, "quant", example_inputs=batch())
    loss = compiled(**batch()).loss
    loss.backward()
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n and g is not None for n, g in grads.items())


def test_an_optimizer_holding_the_frozen_weights_is_warned_with_the_count():
    compiled = retarget.compile_for(lora(base_model()), "quant", example_inputs=batch())
    with pytest.warns(UserWarning, match="holds 14 frozen quantized weights"):
        compiled.runtime.prepare(torch.optim.AdamW(compiled.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainable = [p for p in compiled.parameters() if p.requires_grad]
        compiled.runtime.prepare(torch.optim.AdamW(trainable, lr=1e-3))


def test_refusals_name_the_setting():
    with pytest.raises(TargetError, match="'fp8' and 'quant' do not combine"):
        retarget.compile_for(base_model(), "bf16+fp8+quant", example_inputs=batch())
    with pytest.raises(TargetError, match="'quant' and 'tp' do not combine"):
        retarget.compile_for(base_model(), "tp+quant", example_inputs=batch())
    with pytest.raises(TargetError, match="type=int8 .* needs bits=8"):
        retarget.compile_for(base_model(), "quant[type=int8]", example_inputs=batch())
    with pytest.raises(TargetError, match="did you mean 'quant'"):
        retarget.compile_for(base_model(), "qlora", example_inputs=batch())


def test_adapters_save_with_peft_and_the_model_saves_in_its_own_layout(tmp_path):
    """PEFT's save_pretrained on the unwrapped model writes the trained adapters, which load
    back onto a fresh base; save_model writes the dequantized weights under the model's keys
    (a file transformers reads like any other)."""
    from safetensors.torch import load_file

    from retarget.runtime.state.save_model import save_model

    inputs = batch()
    compiled = retarget.compile_for(lora(base_model()), "quant", example_inputs=inputs)
    optimizer = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        compiled(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = {n: p.detach().clone() for n, p in compiled.named_parameters() if p.requires_grad}
    path = "base_model.model.model.layers.0.mlp.up_proj.base_layer"
    dequantized = compiled.get_submodule(path).dequantized_weight()

    save_model(compiled, tmp_path / "full")
    saved = load_file(tmp_path / "full" / "model.safetensors")
    assert saved[f"{path}.weight"].shape == (128, 64)
    assert torch.equal(saved[f"{path}.weight"], dequantized)

    compiled.unwrap().save_pretrained(tmp_path / "adapters")
    loaded = peft.PeftModel.from_pretrained(base_model(), tmp_path / "adapters")
    named = dict(loaded.named_parameters())
    for name, value in trained.items():
        assert torch.equal(named[name], value), name


# -- backend=torchao ---------------------------------------------------------------------------
#: torchao's nf4 quantizes its block scales in blocks of 256: a weight needs 64 x 256 elements
#: (a multiple), which hidden 128 gives q/o (128 x 128) and the MLP, not k/v (128 x 64).
AO_HIDDEN = 128


def _saved_dense_copies(compiled: nn.Module, inputs: dict, shapes: set) -> list[tuple]:
    """Float matrices of a quantized weight's shape that a training forward saves for backward
    and that are not one of the model's own tensors (a dequantized copy)."""
    own = {t.data_ptr() for t in [*compiled.parameters(), *compiled.buffers()]}
    found = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor and tuple(tensor.shape) in shapes:
            if tensor.data_ptr() not in own:
                found.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compiled(**inputs).loss.backward()
    return found


@pytest.mark.parametrize(("name", "bits"), [("llama", 4), ("qwen2", 4), ("llama", 8)])
def test_torchao_backend_trains_the_adapters_on_torchaos_tensors(name, bits):
    from retarget.kernels.quant.torchao_linear import TorchaoLinear

    inputs = batch()
    with torch.no_grad():
        unquantized = base_model(name, AO_HIDDEN).eval()(**inputs)
    compiled = retarget.compile_for(
        lora(base_model(name, AO_HIDDEN)), f"quant[bits={bits},backend=torchao]",
        example_inputs=inputs,
    )  # fmt: skip
    quant = compiled.program.analysis.quant
    decided = quant["linears"]
    quantized = [p for p, d in decided.items() if d["quantized"]]
    kept = {p.rsplit(".", 2)[-2] for p, d in decided.items() if d["rule"] == "kernel_size"}
    assert kept == ({"k_proj", "v_proj"} if bits == 4 else set()), kept
    assert len(quantized) == 2 * (len(TARGETS) - len(kept))
    assert {type(compiled.get_submodule(p)) for p in quantized} == {TorchaoLinear}
    weights = {type(compiled.get_submodule(p).weight).__name__ for p in quantized}
    assert weights == ({"NF4Tensor"} if bits == 4 else {"Int8Tensor"})
    assert quant["weight_bytes"]["after"] / quant["weight_bytes"]["before"] <= 0.30
    assert quant["double_quant"] is (bits == 4)  # torchao's nf4 always quantizes its scales
    text = str(compiled.report)
    assert "by the torchao backend" in text
    assert ("kept: kernel_size" in text) is (bits == 4)

    # The model computes with torchao's dequantized weights; near the unquantized model.
    assert_dequantized_numerics(compiled, name, inputs, unquantized.logits, bits, AO_HIDDEN)

    compiled.train()
    shapes = {tuple(compiled.get_submodule(p).dequantized_weight().shape) for p in quantized}
    shapes |= {s[::-1] for s in shapes}
    assert _saved_dense_copies(compiled, inputs, shapes) == []
    compiled.zero_grad()
    assert_adapters_train(compiled, inputs)


def compiled_against_eager(target: str, hidden: int) -> dict:
    """`target` with and without compile[backend=aot_eager] on the LoRA Llama: the same loss and
    adapter gradients; returns the compiled model's one region's compile summary."""
    inputs = batch()
    models = [
        retarget.compile_for(lora(base_model("llama", hidden)), t, example_inputs=inputs)
        for t in (target, f"{target}+compile[backend=aot_eager]")
    ]
    losses = [model(**inputs).loss for model in models]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in models]
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    (summary,) = [r["compile"] for r in models[1].report.to_dict()["regions"]]
    return summary


@pytest.mark.parametrize("bits", [4, 8])
def test_torchao_backend_under_compile_matches_its_eager_form(bits):
    """torch.compile runs the blocks holding torchao's tensor subclasses: one compiled callable
    per block type, loss and adapter gradients as without compile. Int8Tensor traces whole;
    NF4Tensor's dequantize (inside torchao's own autograd.Function) does not, so dynamo breaks
    the graph at each quantized Linear, and the report says so with the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = compiled_against_eager(f"quant[bits={bits},backend=torchao]", AO_HIDDEN)
    warned = [w for w in caught if "dynamo cannot trace torchao's NF4" in str(w.message)]
    assert len(warned) == (1 if bits == 4 else 0), [str(w.message) for w in caught]
    assert summary["compiled_callables"] == 1 and not summary["fallback"], summary
    if bits == 8:
        assert summary["graph_breaks"] == 0, summary
    else:
        assert summary["graph_breaks"] >= len(TARGETS), summary
        assert summary["break_reasons"], summary  # dynamo's first line: failed to bind arguments


def test_torchao_backend_resumes_saves_and_unwraps(tmp_path):
    from safetensors.torch import load_file

    from retarget.runtime.state.checkpoint import load_state, save_state
    from retarget.runtime.state.save_model import save_model

    inputs = batch()

    def prepared() -> tuple[nn.Module, torch.optim.Optimizer]:
        compiled = retarget.compile_for(
            lora(base_model("llama", AO_HIDDEN)), "quant[backend=torchao]", example_inputs=inputs
        )
        trainable = [p for p in compiled.parameters() if p.requires_grad]
        return compiled, compiled.runtime.prepare(torch.optim.AdamW(trainable, lr=1e-2))

    compiled, optimizer = prepared()
    for _ in range(2):
        compiled.runtime.backward(compiled(**inputs).loss)
        optimizer.step()
        optimizer.zero_grad()
    save_state(tmp_path / "state", model=compiled, optimizers=[optimizer])
    resumed, resumed_optimizer = prepared()
    load_state(tmp_path / "state", model=resumed, optimizers=[resumed_optimizer])
    for model, opt in ((compiled, optimizer), (resumed, resumed_optimizer)):
        model.runtime.backward(model(**inputs).loss)
        opt.step()
        opt.zero_grad()
    for (name, a), b in zip(compiled.named_parameters(), resumed.parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a, b), name

    path = "base_model.model.model.layers.0.mlp.up_proj.base_layer"
    dequantized = compiled.get_submodule(path).dequantized_weight()
    save_model(compiled, tmp_path / "full")
    saved = load_file(tmp_path / "full" / "model.safetensors")
    assert saved[f"{path}.weight"].shape == (2 * AO_HIDDEN, AO_HIDDEN)
    assert torch.equal(saved[f"{path}.weight"], dequantized)
    plain = compiled.unwrap().get_submodule(path)
    assert type(plain.weight) is nn.Parameter and torch.equal(plain.weight, dequantized)


def test_torchao_backend_refusals_name_the_setting():
    model = lora(base_model("llama", AO_HIDDEN))
    with pytest.raises(TargetNotSupportedError, match=r"torchao has no fp4 .*backend=native"):
        retarget.compile_for(model, "quant[backend=torchao,type=fp4]", example_inputs=batch())
    with pytest.raises(TargetNotSupportedError, match=r"type=int8\] with fsdp: .* no split"):
        retarget.compile_for(
            model, "fsdp+quant[backend=torchao,bits=8]", example_inputs=batch(), world_size=2
        )
    with pytest.raises(TargetNotSupportedError, match=r"type=nf4\] with ddp: .*use fsdp"):
        retarget.compile_for(
            model, "ddp+quant[backend=torchao]", example_inputs=batch(), world_size=2
        )
