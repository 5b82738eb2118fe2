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
from tests.passes.shard.test_tp_training import gradient_errors, whole_state

MODELS = ("llama", "qwen2", "gpt_neox", "gpt2", "mistral", "phi3", "falcon")
ROWS = 4
#: Models whose every block Linear is split (Phi3's qkv as fused parts of unequal widths;
#: Falcon's under tp alone, with its one-head k and v kept whole): one rank holds at most 55% of
#: a block's parameters.
SPLIT_ALL = ("llama", "qwen2", "gpt_neox", "gpt2", "mistral", "phi3")


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
        blocks = compiled.program.plan.tp.blocks.values()
        held = max(mine / total for mine, total in blocks)  # a block's parameters on one rank
        errors = (loss_error, gradient_errors(compiled, reference))
        out[name] = (*errors, split, _regions(compiled), held)
    return out


def _check_compiled_steps(results: list[dict[str, Any]], split_all: tuple[str, ...]) -> None:
    for by_model in results:
        assert set(by_model) == set(MODELS)
        for name, (loss_error, grad_error, split, regions, held) in by_model.items():
            assert loss_error <= 1e-5, (name, loss_error)
            if name in split_all:
                assert held <= 0.55, (name, held)
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
    target = "tp[size=2]+compile[backend=aot_eager]"
    _check_compiled_steps(run_ranks(_step, 2, target, MODELS), (*SPLIT_ALL, "falcon"))


@pytest.mark.slow
@pytest.mark.distributed
def test_four_ranks_fsdp_tp_compile_equals_one_process_for_seven_models():
    target = "fsdp+tp[size=2]+compile[backend=aot_eager]"
    _check_compiled_steps(run_ranks(_step, 4, target, MODELS, timeout=900), SPLIT_ALL)


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


def _unequal_parts_state(rank: int, world: int, folder: str, name: str) -> dict[str, Any]:
    """Phi3's qkv (q|k|v of unequal widths) and Falcon's (one-head k and v kept whole on every
    rank) are stored in rank order under tp: what a user reads by name is still the model's
    tensor. state_dict and save_model give it whole in the model's order, a checkpoint resumes
    bit for bit, a one-process state dict loads into the split model (torch's
    set_model_state_dict, as for any tp model), and clipping counts rows held twice once."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import retarget
    from retarget.runtime.state.checkpoint import load_state, save_state
    from retarget.runtime.state.save_model import save_model

    data = batch()
    key = {
        "phi3": "model.layers.0.self_attn.qkv_proj.weight",
        "falcon": "transformer.h.0.self_attention.query_key_value.weight",
    }[name]
    reference = build(name)
    reference(**data).loss.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()

    def fresh() -> tuple[Any, Any]:
        compiled = retarget.compile_for(build(name), "tp[size=2]", example_inputs=data)
        return compiled, torch.optim.Adam(compiled.parameters(), lr=1e-3)

    def steps(compiled: Any, optimizer: Any, count: int) -> None:
        for _ in range(count):
            compiled(**data).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    compiled, optimizer = fresh()
    compiled(**data).loss.backward()
    norm = float(compiled.runtime.clip_grad_norm_(compiled.parameters(), 1e9))
    optimizer.zero_grad()
    initial = whole_state(compiled)[key]
    local = compiled.get_submodule(key.rpartition(".")[0]).weight.to_local()
    steps(compiled, optimizer, 3)
    save_state(f"{folder}/state", model=compiled, optimizers=optimizer)
    save_model(compiled, f"{folder}/model")
    written = load_file(f"{folder}/model/model.safetensors")
    live = whole_state(compiled)
    # (a tied LM head is written once, under the embedding's name)
    saved_equal = key in written and all(torch.equal(written[k], live[k]) for k in written)
    steps(compiled, optimizer, 2)
    expected = whole_state(compiled)
    resumed, resumed_optimizer = fresh()
    load_state(f"{folder}/state", model=resumed, optimizers=resumed_optimizer)
    steps(resumed, resumed_optimizer, 2)
    got = whole_state(resumed)
    bitwise = list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    one = build(name)
    with torch.no_grad():
        for param in one.parameters():
            param.mul_(-2.0)  # not what a fresh build holds
    target, _ = fresh()
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(target, one.state_dict(), options=options)
    loaded = whole_state(target)
    return {
        "norm": abs(norm - expected_norm) <= 1e-5 * expected_norm,
        "initial": torch.equal(initial, build(name).state_dict()[key]),
        "local_rows": local.shape[0],
        "whole_rows": live[key].shape[0],
        "saved_equal": saved_equal,
        "bitwise": bitwise,
        "loaded": all(torch.equal(loaded[k], v) for k, v in one.state_dict().items()),
    }


def _both_unequal_parts_states(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {name: _unequal_parts_state(rank, world, f"{folder}/{name}", name) for name in ROWS_HELD}


#: Rows of the qkv weight one rank holds, and the model's: Phi3 [q_r|k_r|v_r] of q|k|v =
#: 64|32|32; Falcon [q_r|k|v] of q|k|v = 64|16|16.
ROWS_HELD = {"phi3": (64, 128), "falcon": (64, 96)}


@pytest.mark.distributed
def test_unequal_parts_read_in_the_model_order_save_resume_load_and_clip(tmp_path):
    for result in run_ranks(_both_unequal_parts_states, 2, str(tmp_path)):
        for name, (local, rows) in ROWS_HELD.items():
            assert result[name] == {
                "norm": True,
                "initial": True,
                "local_rows": local,
                "whole_rows": rows,
                "saved_equal": True,
                "bitwise": True,
                "loaded": True,
            }, name


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
