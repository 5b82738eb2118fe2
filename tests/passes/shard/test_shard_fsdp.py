"""shard_fsdp: units and per-rank counts in one process; FSDP2 variants on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.execution.step_guard import OptimizerNotPrepared
from retarget.passes.shard.fsdp_units import local_numel
from tests import zoo
from tests.distributed import run_ranks
from tests.sharded_training import (
    example_of,
    full_state,
    lm_batches,
    max_difference,
    mnist_batches,
    mnist_without_dropout,
    share,
    train,
)

LR = 0.1


# -- one process: the plan ------------------------------------------------------------------


def test_units_are_the_repeated_blocks_then_the_root_with_per_rank_counts():
    model = zoo.tiny_llama()
    compiled = retarget.compile_for(model, "fsdp", example_inputs=zoo.lm_inputs(), world_size=3)
    entry = compiled.program.plan.fsdp
    assert (entry.mesh_shape, entry.mesh_dims) == ((3,), ("shard",))
    assert entry.reshard_after_forward
    assert [u.path for u in entry.units] == ["model.layers.0", "model.layers.1", ""]
    assert sum(u.parameters for u in entry.units) == sum(p.numel() for p in model.parameters())
    for unit in entry.units:
        assert sum(unit.per_rank) == unit.parameters and len(unit.per_rank) == 3
    # 64-row weights split 22/22/20 rows: rank 2 holds less.
    layer = entry.units[0].per_rank
    assert layer[0] == layer[1] > layer[2]
    text = str(compiled.report)
    assert "FSDP2 units on mesh (3 shard)" in text and "model.layers.0  LlamaDecoderLayer" in text
    assert "plan not applied: world size is 1" in text
    assert list(compiled.state_dict()) == list(model.state_dict())


def test_inspect_shows_the_plan_for_a_stated_world_size(capsys):
    from retarget.cli.main import main

    argv = ["inspect", "tests.zoo:tiny_llama", "--inputs", "tests.zoo:lm_inputs"]
    assert main([*argv, "--target", "fsdp+bf16", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "distribution plan: fsdp over 4 processes (stated); not applied" in out
    assert "model.layers.1  LlamaDecoderLayer  41,088      10,272 | 10,272 | 10,272 | 10,272" in out
    assert "gather in bfloat16, reduce-scatter gradients in float32" in out


def test_local_numel_follows_torch_chunk():
    for rows, shards in [(10, 3), (2, 4), (64, 2), (7, 7)]:
        pieces = torch.empty(rows, 5).chunk(shards)
        expected = [p.numel() for p in pieces] + [0] * (shards - len(pieces))
        assert [local_numel((rows, 5), shards, i) for i in range(shards)] == expected


def test_variants_set_mesh_reshard_and_mixed_precision():
    def plan(target, world=4):
        example = zoo.mnist_cnn_inputs()
        compiled = retarget.compile_for(
            zoo.mnist_cnn(), target, example_inputs=example, world_size=world
        )
        return compiled.program.plan.fsdp

    assert plan("zero2").reshard_after_forward is False
    assert plan("zero3").reshard_after_forward is True
    hsdp = plan("hsdp[replicate=2,shard=2]")
    assert (hsdp.mesh_shape, hsdp.mesh_dims) == ((2, 2), ("replicate", "shard"))
    mixed = plan("fsdp+bf16")
    assert (mixed.param_dtype, mixed.reduce_dtype) == ("bfloat16", "float32")
    assert plan("fsdp").param_dtype is None and plan("fsdp").reduce_dtype is None
    offload = plan("fsdp+offload")
    assert offload.offload and offload.pin_memory == torch.cuda.is_available()
    assert not plan("fsdp").offload
    # MNIST has no repeated block: the root is the one unit.
    assert [u.path for u in plan("fsdp").units] == [""]


def test_bad_fsdp_settings_are_refused_with_the_fix():
    example = zoo.mnist_cnn_inputs()
    with pytest.raises(retarget.PassError, match=r"replicate x shard = 6 processes, but the world"):
        retarget.compile_for(
            zoo.mnist_cnn(), "hsdp[replicate=2,shard=3]", example_inputs=example, world_size=4
        )
    with pytest.raises(TargetNotSupportedError, match=r"params and optimizer both true"):
        retarget.compile_for(zoo.mnist_cnn(), "fsdp+offload[params=false]")
    with pytest.raises(TargetNotSupportedError, match=r"sync_module_states=false says not to"):
        retarget.compile_for(
            zoo.mnist_cnn(), "fsdp[cpu_ram_efficient_loading=true,sync_module_states=false]"
        )
    with pytest.raises(TargetNotSupportedError, match=r"not implemented under tensor paral"):
        retarget.compile_for(zoo.mnist_cnn(), "fsdp[cpu_ram_efficient_loading=true]+tp")
    with pytest.raises(retarget.TargetError, match=r"'fp16-comm' needs one of 'ddp', 'zero1'"):
        retarget.compile_for(zoo.mnist_cnn(), "fsdp+fp16-comm")


def test_whole_model_capture_leaves_the_root_as_the_only_unit():
    model = zoo.tiny_llama()
    # capture='whole' of an HF decoder that returns its cache is not captured (known gap)
    model.config.use_cache = False
    compiled = retarget.compile_for(
        model, "fsdp", example_inputs=zoo.lm_inputs(), capture="whole", world_size=2
    )
    assert [u.path for u in compiled.program.plan.fsdp.units] == [""]
    notes = next(r.notes for r in compiled.history if r.name == "shard_fsdp")
    assert any("blocks are not called as modules" in n for n in notes)


def test_min_params_keeps_small_blocks_in_the_root_unit():
    compiled = retarget.compile_for(
        zoo.tiny_llama(), "fsdp[min_params=100000]", example_inputs=zoo.lm_inputs(), world_size=2
    )
    assert [u.path for u in compiled.program.plan.fsdp.units] == [""]
    notes = next(r.notes for r in compiled.history if r.name == "shard_fsdp")
    assert any("model.layers.0: stays in the root unit" in n for n in notes)


# -- two ranks ------------------------------------------------------------------------------


def _train_sharded(target, factory, batches, rank, world, **compile_kwargs):
    example = example_of(share(batches[0], 0, 2))
    model = retarget.compile_for(factory(), target, example_inputs=example)
    reference = factory()
    train(model, [share(b, rank, world) for b in batches], torch.optim.SGD(model.parameters(), LR))
    train(reference, batches, torch.optim.SGD(reference.parameters(), LR))
    return model, max_difference(model, reference)


def local_per_unit(model) -> list[int]:
    """Elements this rank holds in each FSDP unit of the plan, read from the live shards."""
    units = model.program.plan.fsdp.units
    counts = []
    for unit in units:
        module = model.get_submodule(unit.path) if unit.path else model
        params = module.parameters() if unit.path else _root_only(model, units)
        counts.append(sum(p._local_tensor.numel() for p in params))
    return counts


def _root_only(model, units):
    inner = {id(p) for u in units if u.path for p in model.get_submodule(u.path).parameters()}
    return [p for p in model.parameters() if id(p) not in inner]


def _fsdp_ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    # Tiny Llama, fsdp, an SGD built before compile_for and prepared; the last global batch
    # has another size, so the region graph is captured again while FSDP runs.
    batches = lm_batches(2, 4) + lm_batches(1, 6, seed=5)
    original = zoo.tiny_llama()
    stale = torch.optim.SGD(original.parameters(), LR)
    optimizer = torch.optim.SGD(original.parameters(), LR)
    model = retarget.compile_for(original, "fsdp", example_inputs=share(batches[0], 0, 2))
    prepared = model.runtime.prepare(optimizer)
    reference = zoo.tiny_llama()
    train(model, [share(b, rank, world) for b in batches], prepared, model.runtime.backward)
    train(reference, batches, torch.optim.SGD(reference.parameters(), LR))
    out["fsdp"] = max_difference(model, reference)
    out["same_optimizer"] = prepared is optimizer
    out["signatures"] = len(model.program.regions[0].graphs)
    out["eager_signatures"] = model.program.regions[0].eager_signatures
    out["dtensor"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
    out["keys"] = list(model.state_dict()) == list(reference.state_dict())
    out["isinstance"] = isinstance(model, (type(reference), retarget.CompiledModule))
    out["per_rank"] = (
        local_per_unit(model),
        [u.per_rank[rank] for u in model.program.plan.fsdp.units],
    )
    unwrapped = model.unwrap()  # gathers the shards into the original model (a collective)
    out["unwrapped"] = unwrapped is original and max_difference(model, unwrapped) == 0.0
    try:
        stale.step()
        out["stale"] = "stepped"
    except OptimizerNotPrepared as err:
        out["stale"] = str(err)

    # zero2 and both 2-rank hsdp meshes on the tiny Llama; fsdp and zero2 on the MNIST CNN.
    batches = lm_batches(3, 4, seed=7)
    for target in ("zero2", "hsdp", "hsdp[replicate=2,shard=1]", "zero3+ac"):
        model, out[target] = _train_sharded(target, zoo.tiny_llama, batches, rank, world)
        out[target + " mesh"] = model.program.plan.applied.wrapped
    batches = mnist_batches(3, 4)
    for target in ("fsdp", "zero2+offload", "hsdp"):
        _, out["mnist " + target] = _train_sharded(
            target, mnist_without_dropout, batches, rank, world
        )

    # fsdp+bf16 against fully_shard + MixedPrecisionPolicy + autocast written by hand, and
    # against float32 training.
    batches = lm_batches(3, 4, seed=9)
    model = retarget.compile_for(
        zoo.tiny_llama(), "fsdp+bf16", example_inputs=share(batches[0], 0, 2)
    )
    by_hand = zoo.tiny_llama()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in by_hand.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(by_hand, mesh=mesh, mp_policy=policy)
    fp32 = zoo.tiny_llama()
    mine = [share(b, rank, world) for b in batches]
    train(model, mine, torch.optim.SGD(model.parameters(), LR))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(by_hand, mine, torch.optim.SGD(by_hand.parameters(), LR))
    train(fp32, batches, torch.optim.SGD(fp32.parameters(), LR))
    out["bf16 vs by hand"] = max_difference(model, by_hand)
    out["bf16 vs fp32"] = max_difference(model, fp32)

    # state_dict=full: whole tensors out, whole tensors back in.
    model = retarget.compile_for(
        mnist_without_dropout(), "fsdp[state_dict=full]", example_inputs=zoo.mnist_cnn_inputs()
    )
    state = model.state_dict()
    out["full_shapes"] = all(
        type(v) is torch.Tensor and v.shape == p.shape
        for v, p in zip(state.values(), mnist_without_dropout().state_dict().values(), strict=True)
    )
    model.load_state_dict({k: torch.zeros_like(v) for k, v in state.items()})
    out["loaded_zeros"] = all(v.abs().sum().item() == 0 for v in full_state(model).values())
    return out


@pytest.mark.distributed
def test_fsdp_variants_on_two_ranks_match_one_process():
    for out in run_ranks(_fsdp_ranks, 2):
        print({k: v for k, v in out.items() if isinstance(v, float)})
        # fp32, measured: ~7e-9 (Llama: fsdp, zero2, both hsdp meshes), ~1e-7 (MNIST).
        keys = ("fsdp", "zero2", "hsdp", "hsdp[replicate=2,shard=1]", "zero3+ac", "mnist fsdp")
        for key in keys:
            assert out[key] < 1e-6, key
        assert out["mnist zero2+offload"] < 1e-6 and out["mnist hsdp"] < 1e-6
        assert out["hsdp mesh"].endswith("(mesh (1, 2))")
        assert out["hsdp[replicate=2,shard=1] mesh"].endswith("(mesh (2, 1))")
        assert out["same_optimizer"] and out["dtensor"] and out["keys"] and out["isinstance"]
        assert out["unwrapped"]
        assert out["signatures"] == 2, out["eager_signatures"]  # batch 2 per rank, then 3
        mine, planned = out["per_rank"]
        assert mine == planned
        assert "FSDP replaced by shards" in out["stale"] and "prepare(optimizer)" in out["stale"]
        # Same casts as fully_shard(bf16 policy) + autocast by hand: measured bitwise equal.
        assert out["bf16 vs by hand"] == 0.0
        assert 0 < out["bf16 vs fp32"] < 5e-2
        assert out["full_shapes"] and out["loaded_zeros"]
