"""core/world.py: the one reader of the launcher's environment, the World a plan is made for,
and HSDP's mesh, which the plan and the memory estimate share."""

from __future__ import annotations

import pytest

import retarget
from retarget.core.world import World, launch_environment, launched_target
from retarget.report.memory_estimate import estimate_memory
from tests import zoo


def test_launch_environment_reads_torchruns_variables(monkeypatch):
    env = launch_environment()
    assert env.rank is None and env.world_size == 1 and not env.distributed
    for name, value in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    env = launch_environment()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 4)
    assert env.distributed


def test_world_is_stated_else_the_environments_else_one(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert World.resolve() == World(size=1, local_size=1, source="one process")
    assert World.resolve(8) == World(size=8, local_size=8, source="stated")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert World.resolve() == World(size=4, local_size=2, source="environment")
    # A stated size equal to the environment's keeps its machines; another one cannot.
    assert World.resolve(4).local_size == 2 and World.resolve(6).local_size == 6
    assert World.resolve(4).describe() == "4 processes (stated)"


def test_hsdp_mesh_defaults_to_one_shard_group_per_machine():
    world = World(size=8, local_size=4, source="environment")
    assert world.hsdp_mesh() == (2, 4)
    assert world.hsdp_mesh(shard=2) == (4, 2)
    assert world.hsdp_mesh(replicate=2, shard=4) == (2, 4)
    with pytest.raises(ValueError, match=r"replicate x shard = 9 processes, but the world has 8"):
        world.hsdp_mesh(replicate=3, shard=3)


def test_memory_estimate_shards_hsdp_like_the_plan(monkeypatch):
    # Two machines of two processes: the plan shards within a machine (shard groups of 2),
    # and so must the estimate (it used to assume one group spanning all four ranks).
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    compiled = retarget.compile_for(
        zoo.mnist_cnn(), "hsdp", example_inputs=zoo.mnist_cnn_inputs(), world_size=4
    )
    plan = compiled.program.plan.fsdp
    assert plan.mesh_shape == (2, 2)
    estimate = estimate_memory(compiled, run=False)
    assert estimate.shards == plan.shard_size == 2


def test_launched_target_reads_the_launchers_export(monkeypatch):
    assert launched_target() is None
    monkeypatch.setenv("RETARGET_TARGET", "ddp+bf16")
    assert str(launched_target()) == "ddp+bf16"
    monkeypatch.setenv("RETARGET_TARGET", "ddp+nope")
    with pytest.raises(retarget.TargetError, match=r"\$RETARGET_TARGET='ddp\+nope'"):
        launched_target()
