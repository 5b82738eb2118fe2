"""Flat compiled calls (`execution/flat_calls.py`): an export graph compiled on its flat
inputs, with its pytree specs and export's `_guards_fn` outside the compiled code, gives what the
graph's own code gives, and a graph rewritten after its compile gets a new flat callable."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

import retarget
from retarget.core.module_record import record_of
from retarget.core.slots import BINDINGS
from retarget.execution.flat_calls import EXPORT_GUARDS, FlatGraph
from retarget.frontends.binding import call_graph_forward
from retarget.ir.call_key import last_call
from retarget.models.hf_zoo import hf_model

AOT = "compile[backend=aot_eager]"


def _first_call(compiled):
    """A region module, its region and the (args, kwargs) of its call in one forward."""
    modules = [m for m in compiled.modules() if record_of(m).region is not None]
    seen: dict = {}
    handle = modules[0].register_forward_pre_hook(
        lambda m, a, k: seen.setdefault("call", (a, k)), with_kwargs=True
    )
    return modules[0], record_of(modules[0]).region, seen, handle


def test_flat_form_of_a_llama_layer_matches_its_own_code_and_reads_no_spec():
    entry = hf_model("llama")
    inputs = entry.inputs()
    compiled = retarget.compile_for(entry.factory(), "single", example_inputs=inputs)
    module, region, seen, handle = _first_call(compiled)
    compiled(**inputs, use_cache=False)  # no KV cache: the call takes the quick signature
    handle.remove()
    args, kwargs = seen["call"]
    graph = last_call(module)[1]  # the graph that call ran
    flat = FlatGraph.of(graph.gm)
    assert flat is not None and flat.source_forward is type(graph.gm).forward
    code = flat.gm.code
    assert "_in_spec" not in code and "_out_spec" not in code and EXPORT_GUARDS not in code
    assert EXPORT_GUARDS in graph.gm.code  # the uncompiled path keeps export's check
    by_spec = FlatGraph.of(graph.gm)
    by_spec.plan = None  # `tree_flatten_spec` of the whole call, as the graph's own code does
    pairs = zip(flat.inputs(args, kwargs), by_spec.inputs(args, kwargs), strict=True)
    assert all(a is b for a, b in pairs)
    private = BINDINGS.get(module)[id(graph)][1]
    assert "_in_spec" in private and flat.private(private) == {}
    torch.manual_seed(0)
    want = graph.run(module, args, kwargs, private)
    torch.manual_seed(0)
    got = graph.run(module, args, kwargs, private, flat.call_forward(call_graph_forward))
    assert type(got) is type(want)
    pairs = zip(tree_leaves(got), tree_leaves(want), strict=True)
    for a, b in pairs:
        assert torch.equal(a, b)


def test_a_graph_without_pytree_code_has_no_flat_form():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert FlatGraph.of(gm) is None


def test_a_rewrite_after_the_compile_gets_a_new_flat_callable_and_is_run():
    entry = hf_model("llama")
    inputs = entry.inputs()
    compiled = retarget.compile_for(entry.factory(), f"single+{AOT}", example_inputs=inputs)
    reference = retarget.compile_for(entry.factory(), "single", example_inputs=inputs)
    (region, *_) = compiled.program.regions
    runner = region.runner
    graph = region.representative()
    first = runner._compiled_graph(graph)
    assert runner._compiled_graph(graph) is first

    def double_output(gm: torch.fx.GraphModule) -> None:
        (output,) = gm.graph.find_nodes(op="output")
        (result, *rest) = output.args[0]
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (result, 2.0))
        output.args = ((doubled, *rest),)

    region.add_transform("double", double_output)
    (ref_region, *_) = reference.program.regions
    ref_region.add_transform("double", double_output)
    assert runner._compiled_graph(graph) is not first
    with torch.no_grad():
        got, want = compiled(**inputs), reference(**inputs)
    assert torch.allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
