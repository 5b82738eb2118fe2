"""compile_for on the zoo: the contract of target "single"."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import retarget
from retarget.core.module_record import record_of
from retarget.core.modules import original_class
from tests.conftest import assert_same_step, step, to_device
from tests.zoo import ZOO, call, loss_of

CAPTURABLE = [name for name in ZOO if name != "uncapturable_block_model"]


@pytest.mark.parametrize("mode", ["regions", "whole"])
@pytest.mark.parametrize("name", list(ZOO))
def test_single_is_bitwise_equal_to_eager(name, mode, device):
    entry = ZOO[name]
    model = to_device(entry.factory(), device)
    example = to_device(entry.inputs(2), device)
    compiled = retarget.compile_for(model, "single", example_inputs=example, capture=mode)
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in model.named_parameters()]
    for training in (True, False):
        model.train(training)
        compiled.train(training)
        for batch in (2, 3):  # 3: a batch size the capture never saw
            inputs = to_device(entry.inputs(batch), device)
            assert_same_step(model, compiled, inputs, backward=training)
    for region in compiled.program.regions:
        if name == "uncapturable_block_model":
            assert region.frontend == "eager"
            assert all(f"{fe}:" in region.reason for fe in ("export", "fx", "dynamo"))
        else:
            assert region.frontend == "export", region.reason


@pytest.mark.parametrize("name", CAPTURABLE)
def test_regions_are_the_repeated_blocks(name):
    entry = ZOO[name]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    regions = compiled.report.to_dict()["regions"]
    expected = entry.repeated_block_type or type(entry.factory()).__name__
    assert [r["block_type"] for r in regions] == [expected]
    for path in regions[0]["paths"]:
        assert record_of(compiled.get_submodule(path)).region.name == regions[0]["name"]


def test_report_names_frontend_and_reason_per_region():
    entry = ZOO["uncapturable_block_model"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    (region,) = compiled.report.to_dict()["regions"]
    assert region["name"] == "blocks.*" and region["repeats"] == 3
    assert region["frontend"] == "eager"
    assert [f["frontend"] for f in region["failures"]] == ["export", "fx", "dynamo"]
    assert all("\n" not in f["reason"] for f in region["failures"])
    assert "eager" in str(compiled.report)


def test_whole_falls_back_to_regions_when_top_level_forward_is_data_dependent():
    entry = ZOO["control_flow_model"]
    compiled = retarget.compile_for(
        entry.factory(), example_inputs=entry.inputs(2), capture="whole"
    )
    capture = next(p for p in compiled.report.to_dict()["passes"] if p["name"] == "capture_regions")
    assert any("whole model not capturable" in note for note in capture["notes"])
    assert [r.name for r in compiled.program.regions] == ["blocks.*"]
    assert compiled.program.regions[0].frontend == "export"


def test_whole_capture_runs_the_root_graph():
    entry = ZOO["tiny_llama"]
    model = entry.factory()
    # capture='whole' of an HF decoder that returns its cache is not captured (known gap)
    model.config.use_cache = False
    compiled = retarget.compile_for(model, example_inputs=entry.inputs(2), capture="whole")
    (region,) = compiled.program.regions
    assert region.paths == [""] and region.frontend == "export"
    assert compiled.report.to_dict()["capture"] == "whole"
    out = call(compiled, entry.inputs(2))
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.loss is not None


def test_whole_capture_of_a_decoder_returning_its_cache_falls_back_to_regions():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(
        entry.factory(), example_inputs=entry.inputs(2), capture="whole"
    )
    (region,) = compiled.program.regions
    assert region.paths == ["model.layers.0", "model.layers.1"] and region.frontend == "export"
    notes = next(r.notes for r in compiled.history if r.name == "capture_regions")
    assert any("whole model not capturable" in n and "DynamicCache" in n for n in notes)
    # The report says what ran: regions, asked whole, and why not whole.
    report = compiled.report.to_dict()
    assert report["capture_asked"] == "whole"
    assert report["capture"].startswith("regions (asked whole; whole model not capturable")
    assert "capture: regions (asked whole;" in str(compiled.report)


def test_lazy_capture_without_example_inputs():
    entry = ZOO["tiny_gpt2"]
    model = entry.factory()
    compiled = retarget.compile_for(model)
    report = compiled.report.to_dict()
    assert report["lazy"] is True
    assert report["regions"][0]["frontend"] == "pending"
    assert "lazy" in str(compiled.report)
    assert_same_step(model, compiled, entry.inputs(2))
    assert compiled.report.to_dict()["regions"][0]["frontend"] == "export"


def test_capture_eager_captures_nothing_and_stays_exact():
    entry = ZOO["tiny_bert"]
    model = entry.factory()
    compiled = retarget.compile_for(model, example_inputs=entry.inputs(2), capture="eager")
    assert compiled.program.regions == []
    capture = next(r for r in compiled.history if r.name == "capture_regions")
    assert capture.changed is False
    assert_same_step(model, compiled, entry.inputs(2))


def test_original_model_is_not_edited_and_shares_weights():
    entry = ZOO["small_cnn"]
    model = entry.factory()
    modules_before = dict(model.named_modules())
    compiled = retarget.compile_for(model, example_inputs=entry.inputs(2))
    assert dict(model.named_modules()) == modules_before
    assert all(original_class(m) is type(m) for m in model.modules())
    assert all(not m._forward_pre_hooks for m in model.modules())
    for (_, a), (_, b) in zip(model.named_parameters(), compiled.named_parameters(), strict=True):
        assert a is b
    assert isinstance(compiled, type(model)) and isinstance(compiled, retarget.CompiledModule)


def test_tied_weights_stay_tied():
    entry = ZOO["tiny_gpt2"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    assert compiled.lm_head.weight is compiled.transformer.wte.weight


def test_training_matches_eager_including_batchnorm_statistics():
    entry = ZOO["small_cnn"]
    eager, twin = entry.factory(), entry.factory()
    compiled = retarget.compile_for(twin, example_inputs=entry.inputs(2))
    opt_a = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for batch in (2, 2, 3, 2):
        for model, opt in ((eager, opt_a), (compiled, opt_b)):
            torch.manual_seed(batch)
            loss_of(call(model, entry.inputs(batch))).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), compiled.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert compiled.layer1[0].bn1.num_batches_tracked.item() == 4


def test_unwrap_returns_the_original_with_current_weights():
    entry = ZOO["mnist_cnn"]
    model = entry.factory()
    compiled = retarget.compile_for(model, example_inputs=entry.inputs(2))
    opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
    before = model.fc1.weight.detach().clone()
    step_loss = loss_of(call(compiled, entry.inputs(2)))
    step_loss.backward()
    opt.step()
    plain = compiled.unwrap()
    assert plain is model and type(plain) is type(model)
    assert not torch.equal(plain.fc1.weight, before)
    assert torch.equal(plain.fc1.weight, compiled.fc1.weight)


def test_report_to_dict_is_json_ready_with_required_fields():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    data = json.loads(json.dumps(compiled.report.to_dict()))
    assert data["target"] == "single"
    assert {"name", "frontend", "reason", "repeats"} <= set(data["regions"][0])
    names = [p["name"] for p in data["passes"]]
    assert names == ["find_blocks", "capture_regions", "annotate_shapes"]
    assert {"name", "changed", "seconds", "stats", "notes"} <= set(data["passes"][0])
    text = str(compiled.report)
    assert "model.layers.*" in text and "LlamaDecoderLayer" in text and "capture_regions" in text


def test_history_keeps_graph_text_after_capture():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    after = compiled.graphs("capture_regions")
    assert "torch.ops.aten.linear.default" in after["model.layers.*"]
    assert compiled.graphs("capture_regions", when="before") == {}
    assert compiled.graphs() == after
    with pytest.raises(KeyError, match="did not run"):
        compiled.graphs("no_such_pass")
    with pytest.raises(ValueError, match="when must be"):
        compiled.graphs("capture_regions", when="during")


def test_print_after_writes_region_graphs():
    entry = ZOO["transformer_encoder"]
    stream = io.StringIO()
    retarget.compile_for(
        entry.factory(),
        example_inputs=entry.inputs(2),
        print_after=["capture_regions"],
        stream=stream,
    )
    assert "# ---- after capture_regions: region encoder.layers.*" in stream.getvalue()


def test_verify_true_checks_numerics_of_every_pass():
    entry = ZOO["tiny_bert"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2), verify=True)
    assert len(compiled.history) == 3


def test_verify_needs_example_inputs():
    with pytest.raises(ValueError, match="verify=True needs example_inputs"):
        retarget.compile_for(ZOO["mnist_cnn"].factory(), verify=True)


def test_parts_without_a_pass_are_refused_not_ignored():
    with pytest.raises(retarget.TargetNotSupportedError, match="sequence_parallel=true"):
        retarget.compile_for(nn.Linear(2, 2), "tp[size=2,sequence_parallel=true]", world_size=2)


def test_bad_arguments_fail_clearly():
    with pytest.raises(retarget.TargetError, match="did you mean 'fsdp'"):
        retarget.compile_for(nn.Linear(2, 2), "fsdpp")
    with pytest.raises(TypeError, match="takes an nn.Module"):
        retarget.compile_for(lambda x: x)
    with pytest.raises(ValueError, match="capture must be one of"):
        retarget.compile_for(nn.Linear(2, 2), capture="everything")
    with pytest.raises(ValueError, match="did you mean 'find_blocks'"):
        retarget.compile_for(nn.Linear(2, 2), disable=["find_block"])


def test_example_inputs_calling_conventions():
    class TwoArgs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    model = TwoArgs()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    for example in ((x, y), {"x": x, "y": y}):
        compiled = retarget.compile_for(model, example_inputs=example)
        assert compiled.program.regions[0].frontend == "export"
        assert torch.equal(compiled(x, y), model(x, y))
    single = retarget.compile_for(nn.Sequential(nn.Linear(4, 4)), example_inputs=x)
    assert single.program.regions[0].frontend == "export"
    _, grads = step(single, x)
    assert set(grads) == {"0.weight", "0.bias"}


@pytest.mark.parametrize(
    "name, frontend",
    [
        ("small_cnn", "fx"),
        ("control_flow_model", "fx"),
        ("small_cnn", "dynamo"),
        ("tiny_llama", "dynamo"),
    ],
)
def test_each_later_frontend_captures_regions_on_its_own(name, frontend):
    # Regions carry our mixin (a variadic forward); each frontend must trace the user's forward.
    # (fx cannot trace HF blocks, whose forwards take **kwargs, nor TransformerEncoderLayer.)
    entry = ZOO[name]
    model = entry.factory()
    compiled = retarget.compile_for(model, example_inputs=entry.inputs(2), frontends=(frontend,))
    assert {r.frontend for r in compiled.program.regions} == {frontend}, [
        r.reason for r in compiled.program.regions
    ]
    assert_same_step(model, compiled, entry.inputs(2))


def test_default_target_is_the_launched_one_else_single(monkeypatch):
    assert str(retarget.compile_for(nn.Linear(2, 2)).program.target) == "single"
    monkeypatch.setenv("RETARGET_TARGET", "bf16")
    assert str(retarget.compile_for(nn.Linear(2, 2)).program.target) == "bf16"


def test_one_process_target_in_a_multi_process_run_is_refused(monkeypatch):
    # Each rank would train alone: the silent failure this project exists to avoid.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(retarget.TargetError, match="this run has 2 processes.*'ddp\\+bf16'"):
        retarget.compile_for(nn.Linear(2, 2), "bf16")
    with pytest.raises(retarget.TargetError, match="'single' trains on one process"):
        retarget.compile_for(nn.Linear(2, 2))


class _TakesADict(nn.Module):
    """forward(batch): the whole dict is the one argument."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, batch):
        return self.linear(batch["x"])


def test_example_inputs_that_do_not_fit_forward_are_refused_naming_the_call():
    model, x = _TakesADict(), torch.randn(3, 4)
    expected = (
        r"example_inputs does not fit _TakesADict.forward\(batch\): a dict is passed as keyword "
        r"arguments: _TakesADict.forward\(x=...\) fails .*example_inputs=\(\{'x': ...\},\)"
    )
    with pytest.raises(ValueError, match=expected):
        retarget.compile_for(model, "single", example_inputs={"x": x})
    compiled = retarget.compile_for(model, "single", example_inputs=({"x": x},))
    assert torch.equal(compiled({"x": x}), model({"x": x}))
