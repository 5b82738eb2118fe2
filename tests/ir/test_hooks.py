"""User hooks fire as in eager on a compiled model; compile_for itself never calls them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from retarget.core.errors import EagerRegionWarning
from retarget.core.modules import original_class
from retarget.driver.compile import compile_for
from retarget.ir.hooks import hook_inside, is_users, users_hooks_set_aside
from retarget.models.hf_zoo import hf_model
from tests.zoo import uncapturable_block_model, vector_inputs


def _llama_pair():
    entry = hf_model("llama")
    return entry.factory(), entry.factory(), entry.inputs()


def _count_graph_runs(compiled) -> list[int]:
    """Count the calls that ran the compiled model's one region's graphs."""
    (region,) = compiled.program.regions
    return count_region_runs(region)


def count_region_runs(region) -> list[int]:
    """Count the calls that ran `region`'s graphs (instance attribute shadows the method)."""
    runs = [0]
    for graph in region.distinct_graphs():
        run = graph.run

        def counted(*args, run=run, **kwargs):
            runs[0] += 1
            return run(*args, **kwargs)

        graph.run = counted
    return runs


def _run(model, inputs):
    torch.manual_seed(1)
    out = model(**inputs)
    out.loss.backward()
    return out


def test_forward_hook_inside_a_region_fires_as_in_eager_then_the_graph_returns() -> None:
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}

    def recorder(tag):
        def hook(module, args, output):
            seen[tag].append(output.detach().clone())

        return hook

    reference.model.layers[1].mlp.register_forward_hook(recorder("eager"))
    handle = compiled.model.layers[1].mlp.register_forward_hook(recorder("compiled"))
    runs = _count_graph_runs(compiled)
    with pytest.warns(EagerRegionWarning, match="forward hook on mlp"):
        got = _run(compiled, inputs)
    want = _run(reference, inputs)
    assert torch.equal(want.loss, got.loss)
    assert len(seen["compiled"]) == len(seen["eager"]) == 1
    assert torch.equal(seen["compiled"][0], seen["eager"][0])
    assert runs[0] == 1  # layer 0 ran its graph; layer 1, hooked, its eager form
    assert compiled.report.to_dict()["regions"][0]["eager_while_hooked"] == {"mlp": "forward hook"}

    handle.remove()
    _run(compiled, inputs)
    assert runs[0] == 3 and len(seen["compiled"]) == 1


def test_hooks_registered_before_compile_for_are_not_called_by_it() -> None:
    reference, model, inputs = _llama_pair()
    counts = {"eager": 0, "compiled": 0}
    kwargs_seen: dict[str, list[str]] = {"eager": [], "compiled": []}

    def pre_hook(tag):
        def hook(module, args, kwargs):
            counts[tag] += 1
            kwargs_seen[tag].append(",".join(sorted(kwargs)))

        return hook

    reference.model.layers[0].self_attn.register_forward_pre_hook(
        pre_hook("eager"), with_kwargs=True
    )
    model.model.layers[0].self_attn.register_forward_pre_hook(
        pre_hook("compiled"), with_kwargs=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EagerRegionWarning)
        compiled = compile_for(model, "single", example_inputs=inputs)
        assert counts["compiled"] == 0  # probes, traces and checks are not the user's calls
        got = _run(compiled, inputs)
    want = _run(reference, inputs)
    assert counts == {"eager": 1, "compiled": 1}
    assert kwargs_seen["eager"] == kwargs_seen["compiled"]
    assert torch.equal(want.loss, got.loss)


def test_full_backward_hook_sees_the_same_gradients() -> None:
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    grads: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}

    def recorder(tag):
        def hook(module, grad_input, grad_output):
            grads[tag].append(grad_output[0].detach().clone())

        return hook

    reference.model.layers[0].mlp.down_proj.register_full_backward_hook(recorder("eager"))
    compiled.model.layers[0].mlp.down_proj.register_full_backward_hook(recorder("compiled"))
    with pytest.warns(EagerRegionWarning, match="backward hook on mlp.down_proj"):
        _run(compiled, inputs)
    _run(reference, inputs)
    assert len(grads["eager"]) == len(grads["compiled"]) == 1
    assert torch.equal(grads["eager"][0], grads["compiled"][0])


def test_a_hook_that_changes_the_output_changes_it_in_the_compiled_model_too() -> None:
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    for root in (reference, compiled):
        root.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 2)
    with pytest.warns(EagerRegionWarning):
        got = _run(compiled, inputs)
    assert torch.equal(_run(reference, inputs).loss, got.loss)


def test_global_module_hooks_count_every_call_as_in_eager() -> None:
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.append(original_class(module).__name__)
    )
    try:
        with pytest.warns(EagerRegionWarning, match="global forward hook"):
            _run(compiled, inputs)
        on_compiled = list(calls)
        calls.clear()
        _run(reference, inputs)
    finally:
        handle.remove()
    assert on_compiled == calls and "LlamaMLP" in calls
    assert hook_inside(compiled.model.layers[0]) is None


def test_hooks_on_the_region_module_itself_keep_the_graph() -> None:
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    outputs = []
    compiled.model.layers[0].register_forward_hook(lambda m, a, out: outputs.append(out))
    runs = _count_graph_runs(compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerRegionWarning)
        _run(compiled, inputs)
    assert runs[0] == 2 and len(outputs) == 1


def test_set_aside_restores_order_and_ignores_our_own_hooks() -> None:
    module = nn.Sequential(nn.Linear(2, 2))
    order: list[str] = []
    module[0].register_forward_hook(lambda *_: order.append("first"))
    module[0].register_forward_hook(lambda *_: order.append("second"))
    with users_hooks_set_aside(module):
        module(torch.ones(1, 2))
        assert order == []
    module(torch.ones(1, 2))
    assert order == ["first", "second"]
    assert not is_users(hook_inside)  # a function of retarget's own
    assert is_users(lambda: None)


def test_a_region_left_eager_is_named_in_one_warning() -> None:
    with pytest.warns(EagerRegionWarning, match=r"1 region\(s\) run eagerly") as caught:
        compile_for(uncapturable_block_model(), "bf16", example_inputs=vector_inputs())
    messages = [str(w.message) for w in caught if issubclass(w.category, EagerRegionWarning)]
    assert len(messages) == 1
    assert "blocks.* (export: " in messages[0]
    assert "passes in their eager form: insert_autocast" in messages[0]


@pytest.mark.parametrize("kind", ["forward pre-hook", "backward hook", "global forward hook"])
def test_a_hook_added_after_warm_calls_is_seen_and_its_removal_too(kind: str) -> None:
    # The block's walk and its last call are cached after the first calls; hooks are not.
    reference, model, inputs = _llama_pair()
    compiled = compile_for(model, "single", example_inputs=inputs)
    inputs = {**inputs, "use_cache": False}  # plain calls: the quick signature's path
    for _ in range(3):
        _run(compiled, inputs)
    runs = _count_graph_runs(compiled)  # the graphs of these calls, captured at the first
    _run(compiled, inputs)
    assert runs[0] == 2
    fired: list[int] = []
    mlp = compiled.model.layers[0].mlp
    if kind == "forward pre-hook":
        handle = mlp.register_forward_pre_hook(lambda m, a: fired.append(1))
    elif kind == "backward hook":
        handle = mlp.register_full_backward_hook(lambda m, gi, go: fired.append(1))
    else:
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, a, out: fired.append(1) if m is mlp else None
        )
    try:
        with pytest.warns(EagerRegionWarning, match=kind):
            got = _run(compiled, inputs)
    finally:
        handle.remove()
    assert fired == [1] and torch.equal(got.loss, _run(reference, inputs).loss)
    assert runs[0] == 2 + (1 if "global" not in kind else 0)  # layer 1 keeps its graph
    _run(compiled, inputs)
    assert runs[0] == 4 + (1 if "global" not in kind else 0) and fired == [1]
