"""tp keeps the compiler on: the blocks tp splits are captured again after the split (their graphs
hold the DTensor layouts of torch's parallel styles), the graph rewrites run on them and compile
compiles them once per block type.

On 2 gloo ranks `tp[size=2]+compile[backend=aot_eager]` and on 4 `fsdp+tp[size=2]+compile`:
loss and every gradient within 1e-5 relative of one process, for seven transformers models at
their default configs (sizes shrunk, dropout off; Qwen2 with its embeddings tied), each block
region a captured graph compiled once with no graph break; `tp[size=2]+bf16+ac+compile`
within the bf16 tolerances of the precision tests against one process's autocast. Refused
before the first step: async TP on CPU, and under compile a split block no frontend captures.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.passes.shard.test_tp_training import gradient_errors

MODELS = ("llama", "qwen2", "gpt_neox", "gpt2", "mistral", "phi3", "falcon")
ROWS = 4


def build(name: str) -> nn.Module:
    """The model type's default config, sizes shrunk (tests.tp_agreement_models), dropout off;
    Qwen2 ties its LM head to the embedding."""
    import transformers

    from tests import tp_agreement_models as am

    config = am.small_config(name)
    if name == "qwen2":
        config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


def batch(rows: int = ROWS) -> dict[str, torch.Tensor]:
    from tests import tp_agreement_models as am

    ids = torch.randint(3, am.VOCAB, (rows, am.SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _regions(compiled: nn.Module) -> list[dict[str, Any]]:
    return [
        {k: r[k] for k in ("name", "frontend", "graphs", "compile")}
        for r in compiled.report.to_dict()["regions"]
    ]


def _step(rank: int, world: int, target: str, names: tuple[str, ...]) -> dict[str, Any]:
    """One step of each model on this rank's rows (tp ranks of a dp group share them) against
    one process's step on all of them."""
    import torch.distributed as dist

    import retarget

    data = batch()
    dp_groups = world // 2
    rows = ROWS // dp_groups
    mine = {k: v[(rank // 2) * rows : (rank // 2 + 1) * rows] for k, v in data.items()}
    out = {}
    for name in names:
        model = build(name)
        reference = copy.deepcopy(model)
        expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(model, target, example_inputs=mine)
        loss = compiled(**mine).loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        loss_error = abs(total.item() / world - expected.item()) / abs(expected.item())
        split = sum(hasattr(p, "placements") for p in compiled.parameters())
        out[name] = (loss_error, gradient_errors(compiled, reference), split, _regions(compiled))
    return out


def _check_compiled_steps(results: list[dict[str, Any]]) -> None:
    for by_model in results:
        assert set(by_model) == set(MODELS)
        for name, (loss_error, grad_error, split, regions) in by_model.items():
            assert loss_error <= 1e-5, (name, loss_error)
            assert grad_error <= 1e-5, (name, grad_error)
            assert split > 0, name
            for region in regions:  # each block: a graph captured after the split, compiled once
                assert region["frontend"] == "dynamo", (name, region)
                assert region["graphs"] == 1, (name, region)
                compiled = region["compile"]
                assert compiled["form"] == "graph", (name, region)
                assert (compiled["compiles"], compiled["recompiles"]) == (1, 0), (name, region)
                assert compiled["graph_breaks"] == 0 and not compiled["fallback"], (name, region)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_tp_compile_equals_one_process_for_seven_models():
    _check_compiled_steps(run_ranks(_step, 2, "tp[size=2]+compile[backend=aot_eager]", MODELS))


@pytest.mark.slow
@pytest.mark.distributed
def test_four_ranks_fsdp_tp_compile_equals_one_process_for_seven_models():
    target = "fsdp+tp[size=2]+compile[backend=aot_eager]"
    _check_compiled_steps(run_ranks(_step, 4, target, MODELS, timeout=900))


def _low_precision(rank: int, world: int) -> dict[str, Any]:
    """tp+bf16+ac+compile against one process under torch.autocast in bfloat16."""
    import torch.distributed as dist

    import retarget

    data = batch(2)
    out = {}
    for name in ("llama", "gpt2"):
        reference = build(name)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = reference(**data).loss
        expected.backward()
        target = "tp[size=2]+bf16+ac+compile[backend=aot_eager]"
        compiled = retarget.compile_for(build(name), target, example_inputs=data)
        loss = compiled(**data).loss
        compiled.runtime.backward(loss)
        total = loss.detach().clone()
        dist.all_reduce(total)
        loss_error = abs(total.item() / world - expected.item())
        regions = _regions(compiled)
        graph = compiled.program.regions[0].representative()
        code = graph.gm.code if graph is not None else ""
        out[name] = (loss_error, gradient_errors(compiled, reference), regions, code)
    return out


@pytest.mark.distributed
def test_two_ranks_tp_bf16_ac_compile_within_bf16_tolerances():
    from tests.passes.precision.test_insert_autocast import GRAD_RTOL_DEFAULT, LOSS_ATOL

    for by_model in run_ranks(_low_precision, 2):
        for name, (loss_error, grad_error, regions, code) in by_model.items():
            assert loss_error <= LOSS_ATOL, (name, loss_error)
            assert 1e-5 < grad_error <= GRAD_RTOL_DEFAULT, (name, grad_error)
            for region in regions:
                assert region["frontend"] == "dynamo", (name, region)
                assert region["compile"]["compiles"] == 1, (name, region)
            # The autocast islands were replayed on the graph captured after the split: it
            # casts to bfloat16 around the DTensor matmuls the styles put there.
            assert "torch.bfloat16" in code and "redistribute" in code, name


@torch.compiler.disable
def _doubled(h: torch.Tensor) -> torch.Tensor:
    return h * 2


class Branchy(nn.Module):
    """A block calling a helper the user keeps out of torch.compile: export (non-strict runs the
    Python) captures it before the split; after it only dynamo is tried, and it breaks there."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_doubled(torch.relu(self.up(x))))


class BranchyStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Branchy() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


BRANCHY_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def _uncapturable(rank: int, world: int) -> dict[str, str]:
    import warnings

    import retarget
    from retarget.core.errors import TargetNotSupportedError

    plan = "tp[size=2,plan=tests.passes.shard.test_tp_compile:BRANCHY_PLAN]"
    out = {}
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16)
    with pytest.raises(TargetNotSupportedError) as refused:
        retarget.compile_for(BranchyStack(), f"{plan}+compile[backend=aot_eager]", example_inputs=x)
    out["compile"] = str(refused.value)
    model = BranchyStack()
    expected = model(x)
    with warnings.catch_warnings(record=True) as caught:  # without compile: eager form, warned
        warnings.simplefilter("always")
        compiled = retarget.compile_for(model, plan, example_inputs=x)
    out["warnings"] = " ".join(str(w.message) for w in caught)
    out["equal"] = str(torch.allclose(compiled(x), expected, rtol=1e-5, atol=1e-6))
    return out


@pytest.mark.distributed
def test_a_split_block_no_frontend_captures_is_refused_under_compile():
    for out in run_ranks(_uncapturable, 2):
        assert "tp+compile: region blocks.* (blocks.0)" in out["compile"]
        assert "could not be captured after the split" in out["compile"]
        assert "Drop compile" in out["compile"]
        assert "region(s) run eagerly" in out["warnings"] and "blocks.*" in out["warnings"]
        assert out["equal"] == "True"


def test_async_tp_is_refused_on_cpu_naming_what_it_needs():
    import retarget
    from retarget.core.errors import TargetNotSupportedError

    x = torch.randn(2, 4, 16)
    plan = "plan=tests.passes.shard.test_tp_compile:BRANCHY_PLAN"
    for target in (
        f"tp[size=2,{plan},async_tp=true]",
        f"tp[size=2,{plan},async_tp=true,sequence_parallel=true]+compile[backend=inductor]",
    ):
        with pytest.raises(TargetNotSupportedError, match=r"async_tp=true\]: it needs CUDA"):
            retarget.compile_for(BranchyStack(), target, example_inputs=x, world_size=2)
