"""`retarget.utils.BnbQuantizationConfig` and `load_and_quantize_model`: Accelerate's API for
quantized loading, on retarget's kernels, from a sharded safetensors checkpoint that a default
config Llama wrote with `save_pretrained` (the config class is Accelerate's own oracle)."""

from __future__ import annotations

import peft
import pytest
import torch
from accelerate.utils import BnbQuantizationConfig as AccelerateConfig
from transformers import LlamaForCausalLM

import retarget
from retarget.bigmodel.empty_init import init_empty_weights
from retarget.core.errors import CheckpointError, TargetNotSupportedError
from retarget.kernels.quant.formats import QuantLayout, dequantize, quantize
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.utils import BnbQuantizationConfig, load_and_quantize_model
from tests.passes.precision.test_quantize_linears import TARGETS, base_model, batch

CONFIG_CASES = [
    {"load_in_4bit": True},
    {"load_in_8bit": True, "torch_dtype": "bf16"},
    {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bf16"},
    {"load_in_4bit": True, "load_in_8bit": True},
    {},
    {"load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
    {"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp64"},
    {"load_in_8bit": True, "skip_modules": "lm_head"},
]


@pytest.mark.parametrize("kwargs", CONFIG_CASES, ids=str)
def test_config_accepts_and_refuses_what_accelerate_does(kwargs):
    try:
        theirs = AccelerateConfig(**kwargs)
    except ValueError as err:
        with pytest.raises(ValueError) as ours:
            BnbQuantizationConfig(**kwargs)
        assert str(ours.value).split(" but")[0].split(",")[0] in str(err)
        return
    ours = BnbQuantizationConfig(**kwargs)
    for name in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "torch_dtype"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.bnb_4bit_compute_dtype == theirs.bnb_4bit_compute_dtype


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A sharded safetensors checkpoint of the model, as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("llama")
    base_model().save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def empty_model() -> LlamaForCausalLM:
    config = base_model().config
    with init_empty_weights():
        return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("kwargs", "fmt"),
    [
        (
            {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
            "nf4",
        ),
        ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp32"}, "fp4"),
        ({"load_in_8bit": True}, "int8"),
    ],
)
def test_loads_a_sharded_checkpoint_tensor_by_tensor_into_quantized_linears(
    checkpoint, kwargs, fmt
):
    reference = base_model().eval()
    config = BnbQuantizationConfig(**kwargs)
    model = load_and_quantize_model(empty_model(), config, weights_location=checkpoint).eval()
    assert model.is_loaded_in_4bit == ("load_in_4bit" in kwargs)
    assert model.is_loaded_in_8bit == ("load_in_8bit" in kwargs)
    assert not any(p.is_meta for p in model.parameters())
    quantized = {p: m for p, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 2 * len(TARGETS) and "lm_head" not in quantized
    expected = dict(reference.named_modules())
    for path, module in quantized.items():
        assert module.layout.format == fmt and module.weight.dtype == torch.float32
        weight = expected[path].weight
        layout = QuantLayout(fmt, tuple(weight.shape), 64, fmt == "nf4")
        same = dequantize(quantize(weight, layout, torch.float32), layout, torch.float32)
        assert torch.equal(module.dequantized_weight(), same)
    # The tensors that stay float are the checkpoint's, in torch_dtype (Accelerate's default:
    # the 4-bit compute dtype, float16 for 8 bits).
    state = reference.state_dict()
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] not in quantized:
            assert value.dtype == config.torch_dtype, key
            assert torch.equal(value, state[key].to(config.torch_dtype)), key
    with torch.no_grad():
        assert torch.isfinite(model(**batch()).logits).all()


def test_a_loaded_quantized_model_trains_lora_through_compile_for(checkpoint):
    config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = load_and_quantize_model(empty_model(), config, weights_location=checkpoint)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    # prepare_model_for_kbit_training casts float16/bfloat16 parameters to float32: the packed
    # buffers are float32 already, so their bytes are untouched.
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=TARGETS))
    compiled = retarget.compile_for(model, "single", example_inputs=batch())
    optimizer = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        loss = compiled(**batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    regions = compiled.report.to_dict()["regions"]
    assert all(not r["eager_signatures"] for r in regions)


def test_refusals_and_warnings(checkpoint, tmp_path):
    config = BnbQuantizationConfig(load_in_4bit=True)
    with pytest.raises(CheckpointError, match="no weights_location was given"):
        load_and_quantize_model(empty_model(), config)
    with pytest.raises(TargetNotSupportedError, match="device_map=.*several devices or to disk"):
        load_and_quantize_model(
            empty_model(), config, checkpoint, device_map={"model": "cpu", "lm_head": "disk"}
        )
    other = base_model()
    other.config.num_hidden_layers = 1
    LlamaForCausalLM(other.config).save_pretrained(tmp_path / "small")
    with pytest.raises(
        CheckpointError, match=r"does not match the model: missing \['model.layers.1"
    ):
        load_and_quantize_model(empty_model(), config, tmp_path / "small")
    with pytest.warns(UserWarning, match="not recommended to quantize a loaded model"):
        model = load_and_quantize_model(base_model(), config)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantizedLinear)
    with pytest.raises(
        TargetNotSupportedError, match=r"tp: model.layers.0.self_attn.q_proj \(and 13"
    ):
        retarget.compile_for(model, "tp", example_inputs=batch(), world_size=2)
    eight = BnbQuantizationConfig(load_in_8bit=True, llm_int8_threshold=5.0)
    with pytest.warns(UserWarning, match="llm_int8_threshold=5.0 .* ignored"):
        load_and_quantize_model(empty_model(), eight, checkpoint, device_map="auto")
