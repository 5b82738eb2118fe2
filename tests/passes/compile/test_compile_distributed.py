"""compile beside distribution on 2 gloo ranks: each target against itself without `compile`.

DDP, FSDP2 (with bf16, bf16 and checkpointing, zero2, hsdp), a DDP comm hook, gradient
accumulation (accumulate and no_sync), checkpoints (save_state / load_state) of a compiled
model, and Accelerate's loop with Accelerator(dynamo_backend="aot_eager"). The backend is
aot_eager, which runs the same aten ops as the uncompiled graphs: per-step losses and final
weights are compared with the uncompiled target (measured bitwise equal for all of them, fp32
and bf16; asserted within 1e-6 for weights and the compile tests' loss tolerance). One test runs
inductor, on a tiny MLP under DDP and FSDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import retarget
from retarget.runtime.state.checkpoint import load_state, save_state
from tests import zoo
from tests.distributed import run_ranks
from tests.sharded_training import full_state, lm_batches, loss_of, max_difference, share, train

AOT = "compile[backend=aot_eager]"
LR = 0.1
LOSS_RTOL = (
    1e-5  # tests/passes/compile/test_compile_regions.py's, for bf16; fp32 is asserted to 1e-6
)
STRATEGIES = ("ddp", "fsdp+bf16", "fsdp+bf16+ac", "zero2", "hsdp", "ddp+bf16-comm")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _compile_summary(model) -> dict:
    (region,) = model.program.regions
    return region.runner.summary()


def test_under_fsdp_regions_compile_at_their_first_call_after_sharding():
    inputs = zoo.lm_inputs()
    sharded = retarget.compile_for(
        zoo.tiny_llama(), f"fsdp+{AOT}", example_inputs=inputs, world_size=2
    )
    notes = next(r.notes for r in sharded.history if r.name == "compile_regions")
    assert any("compiles at its first call after sharding" in n for n in notes)
    assert _compile_summary(sharded)["compiles"] == 0
    sharded(**inputs)  # one process: the plan is not applied, the region compiles now
    assert _compile_summary(sharded)["compiles"] == 1
    # DDP does not re-class the blocks: the pass compiles with the example inputs.
    replicated = retarget.compile_for(
        zoo.tiny_llama(), f"ddp+{AOT}", example_inputs=inputs, world_size=2
    )
    assert _compile_summary(replicated)["compiles"] == 1


def _strategies(rank: int, world: int) -> dict:
    batches = lm_batches(3, 4)
    mine = [share(b, rank, world) for b in batches]
    out = {}
    for target in STRATEGIES:
        runs = {}
        for spec in (target, f"{target}+{AOT}"):
            original = zoo.tiny_llama()
            model = retarget.compile_for(original, spec, example_inputs=mine[0])
            runs[spec] = (model, train(model, mine, torch.optim.SGD(model.parameters(), LR)))
            keys = list(original.state_dict())
        (plain, plain_losses), (compiled, losses) = runs.values()
        out[target] = {
            "loss": _relative(losses, plain_losses),
            "weights": max_difference(compiled, plain),
            "passes": [r.name for r in compiled.history],
            "compile": _compile_summary(compiled),
            "keys": list(compiled.state_dict()) == keys,
            "applied": compiled.program.plan.applied.applied,
        }
    return out


@pytest.mark.distributed
def test_each_strategy_with_compile_trains_like_itself_without():
    for out in run_ranks(_strategies, 2, timeout=300):
        for target in STRATEGIES:
            got = out[target]
            assert got["applied"] and got["keys"], target
            assert got["loss"] <= (LOSS_RTOL if "bf16" in target else 1e-6), (target, got)
            assert got["weights"] <= 1e-6, (target, got)
            summary = got["compile"]
            assert summary["compiles"] >= 1 and not summary["fallback"], (target, summary)
            # Compile each block, then shard it (torchtitan's order).
            passes = got["passes"]
            shard = "shard_ddp" if "ddp" in target else "shard_fsdp"
            assert passes.index("compile_regions") < passes.index(shard), passes
        # FSDP re-classes each block: compiling before sharding would be redone at the first
        # step, so regions compile once, after sharding (one graph: batch 2 per rank throughout).
        for target in ("fsdp+bf16", "fsdp+bf16+ac", "zero2", "hsdp"):
            summary = out[target]["compile"]
            assert (summary["compiles"], summary["recompiles"]) == (1, 0), (target, summary)
        assert out["ddp"]["compile"]["recompiles"] == 0


def _inductor(rank: int, world: int) -> dict:
    from tests.passes.compile.test_compile_regions import stack

    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    out = {}
    for target in ("ddp", "fsdp"):
        models = []
        for spec in (target, f"{target}+compile[backend=inductor]"):
            model = retarget.compile_for(stack(), spec, example_inputs=inputs[0])
            optimizer = torch.optim.SGD(model.parameters(), LR)
            for x in inputs:
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            models.append(model)
        out[target] = (max_difference(*models[::-1]), _compile_summary(models[1]))
    return out


@pytest.mark.distributed
def test_inductor_on_a_tiny_model_under_ddp_and_fsdp():
    for out in run_ranks(_inductor, 2, timeout=300):
        for target, (difference, summary) in out.items():
            # Inductor fuses and reorders sums: not bitwise (measured 1.5e-8).
            assert difference <= 1e-6, (target, difference)
            assert (summary["compiles"], summary["fallback"]) == (1, ""), (target, summary)


def _accumulate(rank: int, world: int) -> dict:
    """4 micro-batches, a step every 2: runtime.accumulate, and DDP no_sync by hand."""
    batches = lm_batches(4, 4, seed=3)
    mine = [share(b, rank, world) for b in batches]
    out = {}
    for target in ("ddp", "fsdp"):
        weights = []
        for spec in (target, f"{target}+{AOT}"):
            model = retarget.compile_for(zoo.tiny_llama(), spec, example_inputs=mine[0])
            runtime = model.runtime
            optimizer = runtime.prepare(torch.optim.SGD(model.parameters(), LR))
            for batch in mine:
                with runtime.accumulate(2):
                    runtime.backward(loss_of(model, batch))
                    if runtime.sync_gradients:
                        optimizer.step()
                        optimizer.zero_grad()
            weights.append(full_state(model))
        out[target] = _max_diff(*weights)
    weights = []
    for spec in ("ddp", f"ddp+{AOT}"):
        model = retarget.compile_for(zoo.tiny_llama(), spec, example_inputs=mine[0])
        optimizer = torch.optim.SGD(model.parameters(), LR)
        for i, batch in enumerate(mine):
            if i % 2 == 0:
                with model.runtime.no_sync():
                    (loss_of(model, batch) / 2).backward()
            else:
                (loss_of(model, batch) / 2).backward()
                optimizer.step()
                optimizer.zero_grad()
        weights.append(full_state(model))
    out["no_sync"] = _max_diff(*weights)
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.distributed
def test_accumulation_and_no_sync_with_compile_match_the_uncompiled_target():
    for out in run_ranks(_accumulate, 2, timeout=300):
        assert out["ddp"] <= 1e-6 and out["fsdp"] <= 1e-6 and out["no_sync"] <= 1e-6, out


def _checkpoint(rank: int, world: int, root: str) -> dict:
    """Save at step 2 of 4, resume in a fresh model: compiled, and into the uncompiled target."""
    batches = [share(b, rank, world) for b in lm_batches(4, 4, seed=4)]
    out = {}
    for target in ("ddp", "fsdp"):
        folder = Path(root) / target

        def build(spec: str):
            original = zoo.tiny_llama()
            model = retarget.compile_for(original, spec, example_inputs=batches[0])
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            return original, model, optimizer

        original, model, optimizer = build(f"{target}+{AOT}")
        full = train(model, batches[:2], optimizer)
        save_state(folder, model=model, optimizers=[optimizer], step=2)
        full += train(model, batches[2:], optimizer)
        out[target] = {"keys": list(model.state_dict()) == list(original.state_dict())}
        for spec in (f"{target}+{AOT}", target):
            _, resumed, optimizer = build(spec)
            assert load_state(folder, model=resumed, optimizers=[optimizer]).step == 2
            losses = train(resumed, batches[2:], optimizer)
            out[target][spec] = (losses == full[2:], max_difference(resumed, model))
    return out


@pytest.mark.distributed
def test_checkpoints_of_a_compiled_model_keep_keys_and_resume_exactly(tmp_path):
    for out in run_ranks(_checkpoint, 2, str(tmp_path), timeout=300):
        for target in ("ddp", "fsdp"):
            got = out[target]
            assert got["keys"], target
            # The same target resumes bit for bit; the uncompiled one too (aot_eager's ops).
            assert got[f"{target}+{AOT}"] == (True, 0.0), (target, got)
            assert got[target] == (True, 0.0), (target, got)


def _accelerator(rank: int, world: int, root: str) -> dict:
    """Accelerate's loop on 2 ranks, dynamo_backend no vs aot_eager: accumulate 2 micro-steps,
    save_state after the first window, and a fresh Accelerator resumes the second."""
    from torch.utils.data import DataLoader

    gen = torch.Generator().manual_seed(6)
    rows = torch.randint(0, zoo.VOCAB, (16, zoo.SEQ), generator=gen)
    samples = [{"input_ids": r, "labels": r} for r in rows]

    def prepared(backend: str):
        accelerator = retarget.Accelerator(dynamo_backend=backend, gradient_accumulation_steps=2)
        model = zoo.tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(samples, batch_size=2)
        return accelerator, *accelerator.prepare(model, optimizer, loader)

    def micro_steps(accelerator, model, optimizer, batches) -> list[float]:
        losses = []
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    out = {}
    for backend in ("no", "aot_eager"):
        accelerator, model, optimizer, loader = prepared(backend)
        batches = list(loader)  # 4 per rank
        losses = micro_steps(accelerator, model, optimizer, batches[:2])
        folder = Path(root) / backend
        accelerator.save_state(folder)
        losses += micro_steps(accelerator, model, optimizer, batches[2:])
        resumed_accelerator, resumed, resumed_optimizer, _ = prepared(backend)
        resumed_accelerator.load_state(folder)
        resumed_losses = micro_steps(resumed_accelerator, resumed, resumed_optimizer, batches[2:])
        out[backend] = {
            "target": str(accelerator.target),
            "losses": losses,
            "weights": full_state(model),
            "resumed": (resumed_losses == losses[2:], max_difference(resumed, model)),
            "compiled": "compile (torch.compile" in str(model.report),
        }
    return out


@pytest.mark.distributed
def test_an_accelerator_with_a_dynamo_backend_on_two_ranks_trains_and_resumes(tmp_path):
    for out in run_ranks(_accelerator, 2, str(tmp_path), timeout=300):
        plain, compiled = out["no"], out["aot_eager"]
        assert (plain["target"], compiled["target"]) == ("ddp", "ddp+compile[backend=aot_eager]")
        assert compiled["compiled"] and not plain["compiled"]
        assert _relative(compiled["losses"], plain["losses"]) <= 1e-6
        assert _max_diff(compiled["weights"], plain["weights"]) <= 1e-6
        assert plain["resumed"] == compiled["resumed"] == (True, 0.0)
