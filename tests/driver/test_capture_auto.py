"""capture="auto" (retarget.Accelerator's): a target whose passes read no graph captures nothing.

Its repeats run their own forward (what a graph would compute bit for bit), so the first step
does not wait for a torch.export per block type; a pass that reads or rewrites graphs (a
precision, compile, a pass of the user's), verify/print options or capture="regions" bring the
capture back.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import retarget
from retarget.passes.base import Pass, PassResult
from tests.conftest import assert_same_step


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(  # the default config, sizes shrunk
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _batch(size: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (size, 8), generator=torch.Generator().manual_seed(size))
    return {"input_ids": ids, "labels": ids}


def _captures(compiled) -> int:
    return sum(r.captures for r in compiled.program.regions)


class _ReadsGraphs(Pass):
    name = "count_graph_nodes"
    summary = "count the nodes of every region graph (a pass of the user's)"

    def run(self, program):
        nodes = sum(len(g.gm.graph.nodes) for r in program.regions for g in r.graphs.values())
        return PassResult(changed=False, stats={"nodes": nodes})


class _ModulesOnly(_ReadsGraphs):
    name = "count_modules"
    reads_graphs = False

    def run(self, program):
        return PassResult(changed=False, stats={"modules": len(list(program.module.modules()))})


@pytest.mark.parametrize("with_example", [False, True])
def test_single_captures_nothing_and_steps_bitwise(with_example):
    model = _llama()
    example = _batch() if with_example else None
    compiled = retarget.compile_for(model, "single", example_inputs=example, capture="auto")
    for size in (2, 3):
        assert_same_step(model, compiled, _batch(size), backward=True)
    (region,) = compiled.program.regions
    assert region.deferred and region.frontend == "own forward"
    assert _captures(compiled) == 0 and region.capture_seconds == 0.0
    report = compiled.report.to_dict()
    assert report["capture"].startswith("none (auto")
    assert report["capture_asked"] == "auto"
    assert "own forward" in str(compiled.report)
    if with_example:  # shapes and FLOPs come from an eager forward, not from graphs
        assert sum(m["flops"] for m in report["modules"].values()) > 0


def test_ddp_plan_and_module_only_passes_capture_nothing():
    compiled = retarget.compile_for(
        _llama(),
        "ddp",
        example_inputs=_batch(),
        world_size=2,
        extra_passes=[_ModulesOnly()],
        capture="auto",
    )
    assert _captures(compiled) == 0
    assert all(r.deferred for r in compiled.program.regions)


@pytest.mark.parametrize(
    "how",
    ["bf16", "capture=regions", "verify", "print_after", "extra_pass"],
)
def test_graphs_are_captured_when_something_reads_them(how, capsys):
    kwargs: dict = {"example_inputs": _batch(), "capture": "auto"}
    target = "bf16" if how == "bf16" else "single"
    if how == "capture=regions":
        kwargs["capture"] = "regions"
    elif how == "verify":
        kwargs["verify"] = True
    elif how == "print_after":
        kwargs["print_after"] = iter(["annotate_shapes"])  # an iterator is read once
    elif how == "extra_pass":
        kwargs["extra_passes"] = [_ReadsGraphs()]
    compiled = retarget.compile_for(_llama(), target, **kwargs)
    (region,) = compiled.program.regions
    assert not region.deferred and region.frontend == "export"
    assert _captures(compiled) >= 1
    if how == "print_after":
        assert "after annotate_shapes: region model.layers.*" in capsys.readouterr().err
    if how == "extra_pass":
        record = next(r for r in compiled.program.history if r.name == "count_graph_nodes")
        assert record.stats["nodes"] > 0


def test_a_rewrite_added_later_ends_the_deferral():
    model = _llama()
    compiled = retarget.compile_for(model, "single", capture="auto")
    (region,) = compiled.program.regions
    seen: list[int] = []
    region.add_transform("count", lambda gm: seen.append(len(gm.graph.nodes)))
    assert not region.deferred and region.frontend == "pending"
    assert_same_step(model, compiled, _batch(), backward=True)
    assert region.captures == 1 and seen and region.frontend == "export"


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerator_captures_only_what_its_target_rewrites(mixed_precision):
    reference = _llama()
    accelerator = retarget.Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = accelerator.prepare(_llama())
    loss = model(**_batch()).loss
    accelerator.backward(loss)
    if mixed_precision == "no":  # as Accelerate: nothing captured, the same numbers
        assert _captures(model) == 0
        expected = reference(**_batch()).loss
        expected.backward()
        assert torch.equal(loss, expected)
        for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
    else:  # autocast is a graph rewrite: the block is captured
        assert _captures(model) == 1
