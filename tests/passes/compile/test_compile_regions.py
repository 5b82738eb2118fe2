"""compile_regions (the `compile` part): torch.compile of each region's final graph.

Numerics against the same target without `compile` over a few SGD steps, reuse across repeats,
recompiles, graph breaks, the fallback of a compile that fails, refusals and the report. Backends
are aot_eager / eager (same aten ops as the uncompiled graph) except one small inductor test.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import retarget
from retarget.cli.main import main
from retarget.core.errors import (
    EagerRegionWarning,
    PassError,
    RegionCompileError,
    UncompiledRegionWarning,
)
from retarget.passes.compile import compile_regions
from retarget.passes.pipeline import build_pipeline
from retarget.targets.grammar import TargetError, parse_target
from tests.conftest import step, to_device
from tests.zoo import ZOO, ResidualMLP, call, vector_inputs

AOT = "compile[backend=aot_eager]"
#: A backend torch registers for its own tests: it fails on a graph whose inputs are not leaf
#: tensors, as a block's input is in training (the output of the layer before).
FAILING = "compile[backend=non_leaf_compile_error_testing_only]"
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


class Stack(nn.Module):
    """`depth` identical residual blocks between two Linears."""

    def __init__(self, depth: int = 4, block: type[nn.Module] = ResidualMLP):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack(depth: int = 4, block: type[nn.Module] = ResidualMLP) -> Stack:
    torch.manual_seed(0)
    return Stack(depth, block).train()


def without_compile(target: str) -> str:
    parts = [p for p in target.split("+") if not p.startswith("compile")]
    return "+".join(parts) or "single"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def train_side_by_side(factory, inputs, target: str, steps: int = 3):
    """`target` and the same target without compile, SGD steps in lockstep; the worst relative
    loss and gradient differences, and the compiled model."""
    reference = retarget.compile_for(factory(), without_compile(target), example_inputs=inputs)
    compiled = retarget.compile_for(factory(), target, example_inputs=inputs)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, compiled)]
    worst_loss = worst_grad = 0.0
    for _ in range(steps):
        (loss_r, grads_r), (loss_c, grads_c) = (step(m, inputs) for m in (reference, compiled))
        assert grads_r.keys() == grads_c.keys()
        worst_loss = max(worst_loss, relative(loss_c, loss_r))
        worst_grad = max(worst_grad, *(relative(grads_c[k], grads_r[k]) for k in grads_r))
        pairs = zip((reference, compiled), (grads_r, grads_c), optimizers, strict=True)
        for model, grads, optimizer in pairs:
            for name, p in model.named_parameters():
                p.grad = grads.get(name)
            optimizer.step()
    return worst_loss, worst_grad, compiled


def summaries(compiled) -> dict[str, dict]:
    return {r.name: r.runner.summary() for r in compiled.program.regions}


# -------------------------------------------------------------------------------- numerics
# The uncapturable model's region runs its eager form; under bf16 that form is torch.autocast,
# which dynamo traces into casts of its own: not bitwise with eager autocast (checked below).
ZOO_CASES = [
    (name, target)
    for name in ZOO
    for target in (AOT, f"bf16+ac+{AOT}")
    if not (name == "uncapturable_block_model" and "bf16" in target)
]


def without_dropout(factory):
    """`factory` with every dropout probability 0 (modules, and MultiheadAttention's float)."""

    def build() -> nn.Module:
        model = factory()
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0
            if isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0
        return model

    return build


@pytest.mark.parametrize(("name", "target"), ZOO_CASES, ids=[f"{n}-{t}" for n, t in ZOO_CASES])
def test_zoo_trains_like_the_uncompiled_target(name, target, device):
    entry = ZOO[name]
    # Under bf16, AOT autograd rounds dropout's backward differently from eager (one bf16 ulp on
    # the gradients, test_bf16_dropout_differs_by_bf16_rounding_only); float32 keeps dropout.
    factory = without_dropout(entry.factory) if "bf16" in target else entry.factory
    inputs = to_device(entry.inputs(2), device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerRegionWarning)
        loss_err, grad_err, compiled = train_side_by_side(
            lambda: to_device(factory(), device), inputs, target
        )
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (loss_err, grad_err)
    for region, summary in summaries(compiled).items():
        assert summary["compiles"] >= 1 and not summary["fallback"], (region, summary)


def test_bf16_dropout_differs_by_bf16_rounding_only():
    entry, inputs = ZOO["tiny_bert"], ZOO["tiny_bert"].inputs(2)
    reference = retarget.compile_for(entry.factory(), "bf16", example_inputs=inputs)
    compiled = retarget.compile_for(entry.factory(), f"bf16+{AOT}", example_inputs=inputs)
    (loss_r, grads_r), (loss_c, grads_c) = step(reference, inputs), step(compiled, inputs)
    assert relative(loss_c, loss_r) <= LOSS_RTOL
    flat_r, flat_c = (torch.cat([g[k].flatten() for k in grads_r]) for g in (grads_r, grads_c))
    # All gradients together differ by less than one bf16 ulp (7.8e-3), yet they do differ.
    assert 0 < ((flat_c - flat_r).norm() / flat_r.norm()).item() < 7.8e-3


@pytest.mark.parametrize(
    ("target", "compiles"),
    [
        (f"ac[policy=selective]+{AOT}", 1),
        # Layer 0 runs outside a checkpoint, layer 1 inside one: the checkpoint wraps the call,
        # so one compiled callable serves both (each repeat is a RetargetedModule of one class;
        # when the checkpointed repeat had a class of its own, dynamo compiled it again).
        (f"ac[every=2]+{AOT}", 1),
        (f"fp16+{AOT}", 1),
        (f"bf16+ac+{AOT}", 1),
    ],
)
def test_llama_composes_with_precision_and_checkpointing(target, compiles):
    loss_err, grad_err, compiled = train_side_by_side(ZOO["tiny_llama"].factory, _llama(), target)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (loss_err, grad_err)
    assert summaries(compiled)["model.layers.*"]["compiles"] == compiles


def test_an_uncapturable_region_compiles_its_eager_form_with_graph_breaks():
    with pytest.warns(EagerRegionWarning):
        loss_err, grad_err, compiled = train_side_by_side(
            ZOO["uncapturable_block_model"].factory, vector_inputs(2), f"bf16+{AOT}"
        )
    # bf16 rounding of dynamo's traced autocast vs eager autocast (one bf16 ulp is 7.8e-3 relative),
    # carried through three SGD steps: within insert_autocast's own tolerance of float32 (2e-2).
    assert loss_err <= 2e-3 and grad_err <= 2e-2, (loss_err, grad_err)
    summary = summaries(compiled)["blocks.*"]
    assert summary["form"] == "eager form"
    assert summary["graph_breaks"] >= 1 and summary["break_reasons"]
    assert "graph break" in str(compiled.report)


def test_inductor_on_a_tiny_model():
    loss_err, grad_err, compiled = train_side_by_side(
        lambda: stack(2), vector_inputs(4), "compile[backend=inductor]", steps=2
    )
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
    assert summaries(compiled)["blocks.*"]["compiles"] == 1


# ----------------------------------------------------------------------- reuse and recompiles
def test_four_identical_blocks_compile_once():
    compiled = retarget.compile_for(stack(4), AOT, example_inputs=vector_inputs(2))
    summary = summaries(compiled)["blocks.*"]
    assert (summary["compiles"], summary["recompiles"], summary["compiled_callables"]) == (1, 0, 1)
    step(compiled, vector_inputs(2))
    assert summaries(compiled)["blocks.*"]["compiles"] == 1


def test_a_new_input_shape_recompiles_once():
    compiled = retarget.compile_for(stack(4), AOT, example_inputs=vector_inputs(2))
    for batch in (3, 3, 2, 3):
        step(compiled, vector_inputs(batch))
    summary = summaries(compiled)["blocks.*"]
    assert (summary["compiles"], summary["recompiles"]) == (2, 1)


def test_without_example_inputs_regions_compile_at_their_first_call():
    compiled = retarget.compile_for(stack(2), AOT)
    assert "pending: compiled at its first call" in str(compiled.report)
    call(compiled, vector_inputs(2))
    assert summaries(compiled)["blocks.*"]["compiles"] == 1


# ------------------------------------------------------------------------ failures and fallback
def test_a_failing_compile_runs_the_uncompiled_graph_with_one_warning():
    inputs = vector_inputs(2)
    reference = retarget.compile_for(stack(2), "single", example_inputs=inputs)
    with pytest.warns(UncompiledRegionWarning, match=r"region blocks\.\*"):
        compiled = retarget.compile_for(stack(2), FAILING, example_inputs=inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncompiledRegionWarning)  # warned once, not per call
        assert torch.equal(step(compiled, inputs)[0], step(reference, inputs)[0])
    summary = summaries(compiled)["blocks.*"]
    assert "TestingOnlyCompileError" in summary["fallback"] and summary["compiles"] == 0
    assert "uncompiled:" in str(compiled.report)


def test_fullgraph_makes_a_failing_compile_an_error_naming_the_region():
    compiled = retarget.compile_for(stack(2), FAILING.replace("]", ",fullgraph=true]"))
    with pytest.raises(RegionCompileError, match=r"region blocks\.\* did not compile"):
        call(compiled, vector_inputs(2))


def test_fullgraph_refuses_a_graph_break():
    with pytest.raises(PassError) as info:
        retarget.compile_for(
            ZOO["uncapturable_block_model"].factory(),
            "compile[backend=eager,fullgraph=true]",
            example_inputs=vector_inputs(2),
        )
    assert isinstance(info.value.__cause__, RegionCompileError)
    assert "region blocks.* did not compile (eager form" in str(info.value)


def test_an_error_of_the_model_itself_is_raised_not_taken_for_a_compile_failure():
    compiled = retarget.compile_for(stack(2), AOT, example_inputs=vector_inputs(2))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        call(compiled, torch.randn(2, 7))
    assert not summaries(compiled)["blocks.*"]["fallback"]


# ------------------------------------------------------------------------------ scope=whole
def test_scope_whole_compiles_the_whole_model_as_one_graph():
    loss_err, grad_err, compiled = train_side_by_side(
        ZOO["small_cnn"].factory,
        ZOO["small_cnn"].inputs(2),
        "compile[backend=aot_eager,scope=whole]",
    )
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL
    assert [r.paths for r in compiled.program.regions] == [[""]]
    assert summaries(compiled)["<model>"]["compiles"] >= 1


def test_scope_whole_refuses_a_model_that_is_not_one_graph():
    with pytest.raises(PassError, match=r"scope=whole.*use compile\[scope=regions\]"):
        retarget.compile_for(
            ZOO["control_flow_model"].factory(),
            "compile[backend=eager,scope=whole]",
            example_inputs=vector_inputs(2),
        )


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("compile[backend=nonesuch]", "backend='nonesuch' is not a registered"),
        ("compile[backend=aot_eager,mode=max-autotune]", "mode=max-autotune is an inductor mode"),
    ],
)
def test_options_torch_cannot_honour_are_refused(target, message):
    with pytest.raises(ValueError, match=message):
        build_pipeline(parse_target(target))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_run_on_cuda():
    inputs = vector_inputs(4).cuda()
    loss_err, grad_err, compiled = train_side_by_side(
        lambda: stack(2).cuda(), inputs, "compile[mode=reduce-overhead]", steps=2
    )
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
    assert summaries(compiled)["blocks.*"]["compiles"] >= 1


def test_cuda_graphs_are_refused_off_cuda():
    with pytest.raises(PassError, match="mode=reduce-overhead runs CUDA graphs"):
        retarget.compile_for(stack(2), "compile[mode=reduce-overhead]")


def test_capture_eager_leaves_nothing_to_compile_and_is_refused():
    with pytest.raises(PassError, match="capture='eager' leaves no region"):
        retarget.compile_for(stack(2), AOT, capture="eager")


def test_scope_whole_and_ac_are_refused_by_the_target():
    with pytest.raises(TargetError, match=r"compile\[scope=whole\] and 'ac' do not combine"):
        parse_target("ac+compile[scope=whole]")


# ------------------------------------------------------------------------ report and pipeline
def test_pipeline_compiles_after_checkpointing_and_before_sharding():
    names = [p.name for p in build_pipeline(parse_target("ddp+bf16+ac+compile"))]
    assert names[-4:] == ["checkpoint_blocks", "compile_regions", "shard_ddp", "apply_plan"]


def test_inspect_prints_the_compile_table(capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    argv = ["inspect", "tests.zoo:control_flow_model", "--inputs", "tests.zoo:vector_inputs"]
    assert main([*argv, "--target", AOT]) == 0
    out = capsys.readouterr().out
    table = out[out.index("compile (torch.compile") :].splitlines()
    assert table[1].split() == [
        "region", "backend", "mode", "form", "compiles", "recompiles", "breaks", "seconds",
        "status",
    ]  # fmt: skip
    assert table[2].split()[:7] == ["blocks.*", "aot_eager", "default", "graph", "1", "0", "0"]
    assert table[2].split()[-1] == "compiled"


def _llama() -> dict[str, torch.Tensor]:
    return ZOO["tiny_llama"].inputs(2)


def test_report_dict_carries_each_region_compile_entry():
    compiled = retarget.compile_for(stack(2), AOT, example_inputs=vector_inputs(2))
    entry = compiled.report.to_dict()["regions"][0]["compile"]
    assert entry["backend"] == "aot_eager" and entry["form"] == "graph"
    assert entry["compiles"] == 1 and entry["compile_seconds"] > 0
    record = next(r for r in compiled.history if r.name == "compile_regions")
    assert record.stats["compiles"] == 1 and record.stats["uncompiled"] == 0


def test_options_reach_torch_compile_as_its_own_arguments():
    options = compile_regions.CompileRegions.stage(
        parse_target("compile[dynamic=false,fullgraph=true,mode=max-autotune]")
    )[0].options
    assert options.torch_kwargs() == {
        "backend": "inductor",
        "dynamic": False,
        "fullgraph": True,
        "mode": "max-autotune",
    }
    relu = parse_target("compile[backend=relu_compile_error_testing_only]")
    assert compile_regions.CompileRegions.stage(relu)[0].options.backend == (
        "relu_compile_error_TESTING_ONLY"  # the registered spelling, whatever the case given
    )


def test_verify_checks_the_compiled_model_against_eager():
    compiled = retarget.compile_for(stack(2), AOT, example_inputs=vector_inputs(2), verify=True)
    assert compiled.history[-1].name == "compile_regions"


def test_a_users_hook_inside_a_block_runs_that_call_uncompiled():
    inputs = vector_inputs(2)
    reference = retarget.compile_for(stack(2), "single", example_inputs=inputs)
    compiled = retarget.compile_for(stack(2), AOT, example_inputs=inputs)
    seen = []
    compiled.blocks[0].fc1.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with pytest.warns(EagerRegionWarning, match="runs its eager form while a forward hook"):
        loss, _ = step(compiled, inputs)
    assert len(seen) == 1 and torch.equal(loss, step(reference, inputs)[0])
    assert summaries(compiled)["blocks.*"]["compiles"] == 1  # no compile of the hooked call


def test_generate_gives_the_eager_tokens():
    entry, inputs = ZOO["tiny_llama"], _llama()
    compiled = retarget.compile_for(entry.factory().eval(), AOT, example_inputs=inputs)
    prompt = {"input_ids": inputs["input_ids"][:, :4], "attention_mask": torch.ones(2, 4).long()}
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    expected = entry.factory().eval().generate(**prompt, **kwargs)
    assert torch.equal(compiled.generate(**prompt, **kwargs), expected)
    summary = summaries(compiled)["model.layers.*"]
    # The example's graph, the prompt's, and one for every decode step (symbolic cache length).
    assert summary["compiled_callables"] == 3 and not summary["fallback"]
