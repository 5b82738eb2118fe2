"""compile beside distribution on 2 gloo ranks: each target against itself without `compile`.

DDP, FSDP2 (with bf16, zero2, hsdp), a DDP comm hook, gradient accumulation (accumulate and
no_sync) and checkpoints (save_state / load_state) of a compiled model. The backend is
aot_eager, which runs the same aten ops as the uncompiled graphs: per-step losses and final
weights are compared with the uncompiled target (measured bitwise equal for all of them, fp32
and bf16; asserted within 1e-6 for weights and the compile tests' loss tolerance).
"""

from __future__ import annotations

from pathlib import Path

import torch

import retarget
from retarget.runtime.state.checkpoint import load_state, save_state
from tests import zoo
from tests.distributed import run_ranks
from tests.sharded_training import full_state, lm_batches, loss_of, max_difference, share, train

AOT = "compile[backend=aot_eager]"
LR = 0.1
LOSS_RTOL = 1e-5  # tests/test_compile_regions.py's, for bf16; fp32 is asserted to 1e-6
STRATEGIES = ("ddp", "fsdp+bf16", "zero2", "hsdp", "ddp+bf16-comm")


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _compile_summary(model) -> dict:
    (region,) = model.program.regions
    return region.runner.summary()


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
        for target in ("fsdp+bf16", "zero2", "hsdp"):
            summary = out[target]["compile"]
            assert (summary["compiles"], summary["recompiles"]) == (1, 0), (target, summary)
        assert out["ddp"]["compile"]["recompiles"] == 0


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


def test_checkpoints_of_a_compiled_model_keep_keys_and_resume_exactly(tmp_path):
    for out in run_ranks(_checkpoint, 2, str(tmp_path), timeout=300):
        for target in ("ddp", "fsdp"):
            got = out[target]
            assert got["keys"], target
            # The same target resumes bit for bit; the uncompiled one too (aot_eager's ops).
            assert got[f"{target}+{AOT}"] == (True, 0.0), (target, got)
            assert got[target] == (True, 0.0), (target, got)
