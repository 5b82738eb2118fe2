"""tp[size=2] on 2 gloo ranks and fsdp+tp[size=2] on a 2x2 mesh of 4: loss and every gradient
(gathered whole) equal one process's within 1e-5 relative, for each model of tests.tp_models
under tp (under fsdp+tp those test_tp_compile does not step), with its hand plan and with the
plan derived from its graphs (plan=auto), and after an accumulation window under fsdp+tp;
20 training steps track one process's loss within 1e-4; clip_grad_norm_ equals one process's;
a checkpoint resumes bit for bit.

Both ways a split block runs are checked: the plans derived from the graphs (plan=auto) compile
with capture="regions", so every split block is captured again with dynamo after the split and
runs that graph (so do the bf16+ac steps under capture="auto": their rewrites read the graphs);
the hand plans, accumulation, training and checkpoints compile with capture="auto"
(retarget.Accelerator's), where a split block nothing rewrites runs its own forward with the
styles' hooks (execution/tp_regions.py), which is what the dynamo graph computes, without its
capture (~7x the rest of a step on these CPUs). Each result records which way its blocks ran,
and the checks below hold that it is the way asked.

Several models share one launch (4 ranks on 2 shared cores are slow).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import run_ranks

ROWS = 4
STEPS = 20
LR = 0.05
#: The frontend each capture mode leaves a plain split block with (no rewrite on it, no compile).
SPLIT_FRONTEND = {"regions": "dynamo", "auto": "own forward"}


def _example(kind: str, world: int = 4) -> Any:
    """Example inputs with the rows each rank steps on (ROWS over the dp groups of a world of
    tp pairs), so the split blocks' graphs captured at compile_for (capture="regions") serve
    the steps."""
    from tests import tp_models as tm

    batch = tm.batch_for(kind, ROWS // max(world // 2, 1), seed=9)
    return batch["x"] if kind == "vector" else batch


def gradient_errors(compiled: Any, reference: torch.nn.Module) -> float:
    """Largest |grad - reference grad| over the parameter's largest reference gradient (or, for
    one whose reference gradient is ~0, 1e-3 of the model's largest: a key bias). Gradients
    are gathered whole in the model's order (fused parts of unequal widths are stored in rank
    order)."""
    from retarget.execution.tp_row_order import in_model_order

    refs = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in reference.parameters())
    worst = 0.0
    for name, param in compiled.named_parameters():
        owner, _, leaf = name.rpartition(".")
        grad = in_model_order(compiled.get_submodule(owner), leaf, param.grad)
        expected = refs[name].grad
        denominator = max(expected.abs().max().item(), 1e-3 * scale)
        worst = max(worst, (grad - expected).abs().max().item() / denominator)
    return worst


def whole_state(compiled: Any) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor whole (all ranks call it: a collective)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in compiled.state_dict().items()
    }


def _rows(batch: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    n = ROWS // parts
    return {k: v[index * n : (index + 1) * n] for k, v in batch.items()}


def _one_step(rank: int, world: int, target: str, names: list[str], capture: str) -> dict[str, Any]:
    """Each model's step errors (step_errors) and the frontends its split regions ran."""
    import retarget
    from tests import tp_models as tm

    out = {}
    for name in names:
        build, _, kind = tm.MODELS[name]
        batch = tm.batch_for(kind, ROWS)
        reference = build()
        expected = tm.loss_of(reference, batch)
        expected.backward()
        spec = target.format(plan=f"tests.tp_models:{name.upper()}_2")
        compiled = retarget.compile_for(
            build(), spec, example_inputs=_example(kind, world), capture=capture
        )
        errors = step_errors(rank, world, compiled, batch, reference, expected)
        out[name] = (*errors, split_frontends(compiled))
    return out


def split_frontends(compiled: Any) -> set[str]:
    """The frontends of the regions that hold a module the tp plan splits, after the steps."""
    from retarget.execution.tp_regions import regions_holding_split_modules

    program = compiled.program
    return {r.frontend for r in regions_holding_split_modules(program, program.plan.tp)}


def step_errors(
    rank: int, world: int, compiled: Any, batch: dict, reference: Any, expected: Any, direct=True
) -> tuple[float, float, int]:
    """One step of `compiled` on this rank's rows of `batch` (tp ranks of a dp group share
    them) against `reference`'s step on all of it (`expected` its loss, backward done): (loss
    error, worst gradient error, DTensor parameters). `direct`: `loss.backward()`, else the
    runtime's backward."""
    import torch.distributed as dist

    from tests import tp_models as tm

    loss = tm.loss_of(compiled, _rows(batch, rank // 2, world // 2))
    loss.backward() if direct else compiled.runtime.backward(loss)
    total = loss.detach().clone()
    dist.all_reduce(total)
    loss_error = abs(total.item() / world - expected.item()) / abs(expected.item())
    split = sum(hasattr(p, "placements") for p in compiled.parameters())
    return loss_error, gradient_errors(compiled, reference), split


def _accumulated(rank: int, world: int, target: str, names: list[str]) -> dict[str, float]:
    """A window of 2 micro-steps of one row each (run.accumulate, run.backward): the gradients
    FSDP2 holds back on the first and reduces on the second equal one process's on all rows."""
    import retarget
    from tests import tp_models as tm

    out = {}
    for name in names:
        build, _, kind = tm.MODELS[name]
        batch = tm.batch_for(kind, ROWS)
        reference = build()
        tm.loss_of(reference, batch).backward()
        spec = target.format(plan=f"tests.tp_models:{name.upper()}_2")
        compiled = retarget.compile_for(
            build(), spec, example_inputs=_example(kind, world), capture="auto"
        )
        run = compiled.runtime
        mine = _rows(batch, rank // 2, world // 2)
        for row in range(2):
            with run.accumulate(2):
                run.backward(tm.loss_of(compiled, {k: v[row : row + 1] for k, v in mine.items()}))
        out[name] = (gradient_errors(compiled, reference), split_frontends(compiled))
    return out


def _training(rank: int, world: int, target: str, name: str) -> dict[str, Any]:
    """20 SGD steps with clipping, compiled (Runtime, capture="auto") against one process."""
    import retarget
    from tests import tp_models as tm

    build, _, kind = tm.MODELS[name]
    reference = build()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    spec = target.format(plan=f"tests.tp_models:{name.upper()}_2")
    compiled = retarget.compile_for(
        build(), spec, example_inputs=_example(kind, world), capture="auto"
    )
    run = compiled.runtime
    optimizer = run.prepare(torch.optim.SGD(compiled.parameters(), lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        batch = tm.batch_for(kind, ROWS, seed=100 + step)
        expected = tm.loss_of(reference, batch)
        expected.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = tm.loss_of(compiled, _rows(batch, rank // 2, world // 2))
        loss.backward()
        norm = run.clip_grad_norm_(compiled.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.item(), expected.item()))
        norms.append((float(norm), float(ref_norm)))
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=2, shuffle=True)
    seen = [b.tolist() for b in run.shard(loader)]
    gathered = [run.gather_for_metrics(b).tolist() for b in run.shard(loader)]
    return {
        "losses": losses,
        "norms": norms,
        "applied": compiled.program.plan.applied.wrapped,
        "seen": seen,
        "gathered": sorted(sum(gathered, [])),
        "per_rank": _held_and_planned(compiled, rank // 2),
        "frontends": split_frontends(compiled),
        "capture": compiled.report.to_dict()["capture"],
    }


def _held_and_planned(compiled: Any, dp_rank: int) -> tuple[list[int], list[int]] | None:
    """Under fsdp: the elements this rank holds per FSDP unit, and what the plan says it holds."""
    from tests.passes.shard.test_shard_fsdp import local_per_unit

    fsdp = compiled.program.plan.fsdp
    if fsdp is None:
        return None
    return local_per_unit(compiled), [u.per_rank[dp_rank] for u in fsdp.units]


def _checkpoint(rank: int, world: int, target: str, name: str, folder: str) -> dict[str, Any]:
    """Train 3 steps, save_state, train 2 more; a fresh model resumed from the checkpoint must
    take the same 2 steps bit for bit. save_model writes whole tensors equal to the live ones.
    capture="auto": the split blocks run their own forward."""
    from safetensors.torch import load_file

    import retarget
    from retarget.runtime.state.checkpoint import load_state, save_state
    from retarget.runtime.state.save_model import save_model
    from tests import tp_models as tm

    build, _, kind = tm.MODELS[name]
    spec = target.format(plan=f"tests.tp_models:{name.upper()}_2")

    def fresh() -> tuple[Any, Any]:
        compiled = retarget.compile_for(
            build(), spec, example_inputs=_example(kind, world), capture="auto"
        )
        return compiled, torch.optim.Adam(compiled.parameters(), lr=1e-3)

    def steps(compiled: Any, optimizer: Any, seeds: range) -> None:
        for seed in seeds:
            batch = _rows(tm.batch_for(kind, ROWS, seed=seed), rank // 2, world // 2)
            tm.loss_of(compiled, batch).backward()
            optimizer.step()
            optimizer.zero_grad()

    compiled, optimizer = fresh()
    steps(compiled, optimizer, range(3))
    save_state(f"{folder}/state", model=compiled, optimizers=optimizer)
    save_model(compiled, f"{folder}/model")
    written = load_file(f"{folder}/model/model.safetensors")
    live = whole_state(compiled)
    saved_equal = all(torch.equal(written[k], live[k]) for k in written)
    steps(compiled, optimizer, range(3, 5))
    expected = whole_state(compiled)
    resumed, resumed_optimizer = fresh()
    load_state(f"{folder}/state", model=resumed, optimizers=resumed_optimizer)
    steps(resumed, resumed_optimizer, range(3, 5))
    got = whole_state(resumed)
    bitwise = list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    ran = split_frontends(compiled) | split_frontends(resumed)
    return {"saved_equal": saved_equal and len(written) > 0, "bitwise": bitwise, "ran": ran}


def _bf16_ac(rank: int, world: int, name: str, plan: str = "") -> dict[str, Any]:
    """fsdp+tp+bf16+ac: one step's loss against one float32 process (bf16 tolerance);
    the blocks are checkpointed and FSDP gathers in bfloat16. `plan="auto"` derives the plan
    from the bf16 graphs (their casts must not hide the Linears)."""
    import torch.distributed as dist

    import retarget
    from tests import tp_models as tm

    build = tm.MODELS[name][0]
    batch = tm.batch_for("lm", ROWS)
    expected = tm.loss_of(build(), batch).item()
    plan = plan or f"tests.tp_models:{name.upper()}_2"
    target = f"fsdp+tp[size=2,plan={plan}]+bf16+ac"
    # capture="auto": the autocast and checkpoint rewrites on the split blocks read their
    # graphs, so the blocks are captured again after the split all the same.
    compiled = retarget.compile_for(
        build(), target, example_inputs=_example("lm", world), capture="auto"
    )
    loss = tm.loss_of(compiled, _rows(batch, rank // 2, world // 2))
    loss.backward()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    norm = compiled.runtime.clip_grad_norm_(compiled.parameters(), 1.0)
    ran = [r["name"] for r in compiled.report.to_dict()["passes"]]
    return {
        "frontends": split_frontends(compiled),
        "error": abs(total.item() / world - expected) / expected,
        "norm": float(norm),
        "passes": ran,
        "param_dtype": compiled.program.plan.fsdp.param_dtype,
        "split": sum(
            r.style in ("colwise", "rowwise") for r in compiled.program.plan.tp.rules.values()
        ),
    }


def _accelerator_ranks() -> tuple[int, int, int]:
    """retarget.Accelerator's (data_parallel_rank, data_parallel_shard_rank,
    tensor_parallel_rank) under fsdp+tp: Accelerate's mesh order, tp innermost."""
    import retarget

    accelerator = retarget.Accelerator(target="fsdp+tp[size=2]")
    return (
        accelerator.data_parallel_rank,
        accelerator.data_parallel_shard_rank,
        accelerator.tensor_parallel_rank,
    )


def _check_one_step(result: dict[str, Any]) -> None:
    """Hand plans ("step", capture="auto": own forward) and the plans derived from the graphs
    ("auto", capture="regions": dynamo graphs) alike."""
    for plan, capture in (("step", "auto"), ("auto", "regions")):
        for name, (loss_error, grad_error, split, frontends) in result[plan].items():
            assert loss_error <= 1e-5 and grad_error <= 1e-5, (plan, name, loss_error, grad_error)
            assert split > 0, (plan, name)
            assert frontends == {SPLIT_FRONTEND[capture]}, (plan, name, frontends)


def _check_checkpoint(results: list[dict[str, Any]], key: str) -> None:
    """Saved whole, resumed bit for bit, the split blocks on their own forward (capture=auto)."""
    expected = {"saved_equal": True, "bitwise": True, "ran": {SPLIT_FRONTEND["auto"]}}
    assert all(r[key] == expected for r in results), (key, [r[key] for r in results])


def _check_steps(results: list[dict[str, Any]], world: int) -> None:
    for step in range(STEPS):
        mine = sum(r["losses"][step][0] for r in results) / world
        expected = results[0]["losses"][step][1]
        assert abs(mine - expected) <= 1e-4 * abs(expected), (step, mine, expected)
        norm, ref_norm = results[0]["norms"][step]
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm, (step, norm, ref_norm)


def _tp_body(rank: int, world: int, folder: str) -> dict[str, Any]:
    names = ["mlp", "llama", "qwen2", "qwen3", "neox", "codegen", "gpt2", "bert"]
    target = "tp[size=2,plan={plan}]"
    return {
        "step": _one_step(rank, world, target, names, "auto"),
        "auto": _one_step(rank, world, "tp[size=2,plan=auto]", names, "regions"),
        "train": _training(rank, world, target, "llama"),
        "checkpoint": _checkpoint(rank, world, target, "gpt2", folder),
    }


@pytest.mark.distributed
def test_tp_on_2_ranks_matches_one_process(tmp_path):
    results = run_ranks(_tp_body, 2, str(tmp_path), timeout=900)
    _check_checkpoint(results, "checkpoint")
    _check_one_step(results[0])
    assert all(r["train"]["frontends"] == {SPLIT_FRONTEND["auto"]} for r in results)
    # The report says capture ran (shard_tp read the graphs) and the split blocks do not.
    capture = results[0]["train"]["capture"]
    assert capture == "regions (auto: the blocks tp split run their own forward)", capture
    # Every rank sees the same loss: tp ranks share the batch.
    assert results[0]["train"]["losses"] == results[1]["train"]["losses"]
    assert results[0]["train"]["applied"].startswith("tensor parallel x 14 modules")
    # _check_steps averages over the world; under tp alone each rank's loss is the whole one.
    _check_steps([r["train"] for r in results], 2)
    # The loader does not divide between tp ranks: both read every sample, alike.
    seen = [r["train"]["seen"] for r in results]
    assert seen[0] == seen[1] and sorted(sum(seen[0], [])) == list(range(16))
    assert all(r["train"]["gathered"] == list(range(16)) for r in results)


def _fsdp_tp_body(rank: int, world: int, folder: str) -> dict[str, Any]:
    # Llama, Qwen2, GPT-NeoX and GPT-2 take one fsdp+tp step each in test_tp_compile (plan=auto,
    # compiled); here the others, with their hand plans and derived ones, and GPT-2's hand plan
    # through accumulation, training and a checkpoint below.
    names = ["mlp", "qwen3", "bert"]
    target = "fsdp+tp[size=2,plan={plan}]"
    return {
        "step": _one_step(rank, world, target, [*names, "mlp_fused_head"], "auto"),
        "auto": _one_step(rank, world, "fsdp+tp[size=2,plan=auto]", names, "regions"),
        "accumulated": _accumulated(rank, world, target, ["gpt2", "qwen3"]),
        "train": _training(rank, world, target, "llama"),
        # GPT-2's fused c_attn bias is replicated over dp, Qwen3's norms sum Partial gradients
        # over tp (execution/tp_fsdp.py): both through clipping, steps and a checkpoint.
        "train_gpt2": _training(rank, world, target, "gpt2"),
        "train_qwen3": _training(rank, world, target, "qwen3"),
        "checkpoint": _checkpoint(rank, world, target, "gpt2", f"{folder}/gpt2"),
        "checkpoint_qwen3": _checkpoint(rank, world, target, "qwen3", f"{folder}/qwen3"),
        "bf16_ac": {name: _bf16_ac(rank, world, name) for name in ("llama", "qwen3", "gpt2")}
        | {"gpt2 auto": _bf16_ac(rank, world, "gpt2", plan="auto")},
        "ranks": _accelerator_ranks(),
    }


@pytest.mark.distributed
def test_fsdp_tp_on_a_2x2_mesh_matches_one_process(tmp_path):
    results = run_ranks(_fsdp_tp_body, 4, str(tmp_path), timeout=1800)
    for key in ("checkpoint", "checkpoint_qwen3"):
        _check_checkpoint(results, key)
    _check_one_step(results[0])
    for name, (error, frontends) in results[0]["accumulated"].items():
        assert error <= 1e-5, (name, error)
        assert frontends == {SPLIT_FRONTEND["auto"]}, (name, frontends)
    for name in ("gpt2", "qwen3"):
        _check_steps([r[f"train_{name}"] for r in results], 4)
    # shard_fsdp's per-rank counts are what FSDP2 left on each rank (GPT-2's fused bias whole).
    for key in ("train", "train_gpt2", "train_qwen3"):
        for r in results:
            held, planned = r[key]["per_rank"]
            assert held == planned, (key, held, planned)
            assert r[key]["frontends"] == {SPLIT_FRONTEND["auto"]}, (key, r[key]["frontends"])
    train = [r["train"] for r in results]
    assert train[0]["applied"] == "fully_shard x 3 (mesh (2, 2))"
    # The two tp ranks of a dp group saw the same rows, the two dp groups different ones.
    assert train[0]["losses"] == train[1]["losses"] != train[2]["losses"]
    _check_steps(train, 4)
    # The loader divides between the 2 dp groups only; tp ranks of a group read alike.
    seen = [t["seen"] for t in train]
    assert seen[0] == seen[1] and seen[2] == seen[3]
    assert sorted(sum(seen[0] + seen[2], [])) == list(range(16))
    # gather_for_metrics gathers over dp: every sample once, not once per tp rank.
    assert all(t["gathered"] == list(range(16)) for t in train)
    assert [r["ranks"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for name, mixed in results[0]["bf16_ac"].items():
        assert mixed["error"] <= 1e-2 and 0 < mixed["norm"] < float("inf"), (name, mixed)
        assert {"checkpoint_blocks", "shard_tp", "shard_fsdp"} <= set(mixed["passes"])
        assert mixed["param_dtype"] == "bfloat16" and mixed["split"] >= 4, (name, mixed)
        # Under capture="auto" too: bf16's and ac's rewrites are on the split blocks.
        assert mixed["frontends"] == {SPLIT_FRONTEND["regions"]}, (name, mixed)
