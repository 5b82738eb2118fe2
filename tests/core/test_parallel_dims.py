"""ParallelDims: the degrees resolved from targets and checked against the world, and the meshes
and groups `Meshes` makes for each layout on four real gloo ranks."""

from __future__ import annotations

import pytest

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.core.parallel_dims import Meshes, ParallelDims
from retarget.core.plans import Plan
from retarget.core.world import World
from retarget.targets.grammar import Target
from tests.distributed import run_ranks


def test_the_degrees_must_multiply_to_the_world():
    with pytest.raises(ValueError, match=r"pp=2 x tp=2 lays out 4 processes.*world has 8"):
        ParallelDims(world_size=8, pp=2, tp=2, used=("pp", "tp"))
    with pytest.raises(ValueError, match=r"tp=0 must be a whole number >= 1"):
        ParallelDims(world_size=8, tp=0)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard x cp = 4"):
        ParallelDims(world_size=8, dp_shard=2, cp=2, tp=2, ep=3, used=("dp", "cp", "tp"))
    with pytest.raises(ValueError, match=r"used=\('dp', 'shard'\)"):
        ParallelDims(world_size=2, dp_shard=2, used=("dp", "shard"))
    dims = ParallelDims(world_size=8, dp_shard=4, cp=1, tp=2, ep=4, used=("dp", "tp"))
    assert dims.dp == 4 and dims.ep == 4


def test_the_mesh_lists_the_used_dimensions_outermost_first_at_any_degree():
    dims = ParallelDims(world_size=8, pp=2, dp_shard=2, tp=2, used=("tp", "dp", "pp"))
    assert dims.mesh_shape() == (("pp", 2), ("dp", 2), ("tp", 2))
    assert dims.describe() == "mesh pp x dp x tp (2, 2, 2)"
    one = ParallelDims(world_size=2, tp=2, used=("dp", "tp"))  # fsdp+tp on 2: dp of one
    assert one.mesh_shape() == (("dp", 1), ("tp", 2))
    assert ParallelDims(world_size=1).describe() == "1 process, no mesh"
    assert ParallelDims(world_size=3, dp_replicate=3).describe() == "3 processes, no mesh"


def _resolve(target: str, world: int, local: int | None = None) -> ParallelDims:
    size = World(size=world, local_size=local or world, source="stated")
    return ParallelDims.resolve(Target.parse(target), size)


@pytest.mark.parametrize(
    ("target", "world", "shape"),
    [
        ("fsdp", 4, (("dp", 4),)),
        ("zero2+bf16", 2, (("dp", 2),)),
        ("hsdp[replicate=2,shard=1]", 2, (("replicate", 2), ("shard", 1))),
        ("ddp", 4, (("dp", 4),)),
        ("fsdp+tp[size=2]", 8, (("dp", 4), ("tp", 2))),
        ("fsdp+tp[size=2]", 2, (("dp", 1), ("tp", 2))),
        ("tp", 4, (("tp", 4),)),
        ("pp", 4, (("pp", 4),)),
        ("fsdp+pp[size=2]", 8, (("pp", 2), ("dp", 4))),
        ("tp[size=2]+pp", 8, (("pp", 4), ("tp", 2))),
        ("fsdp+tp[size=2]+pp[size=2]", 8, (("pp", 2), ("dp", 2), ("tp", 2))),
        ("fsdp+cp[size=2]", 8, (("dp", 4), ("cp", 2))),
        ("ddp+cp", 4, (("dp", 1), ("cp", 4))),
        ("single", 4, ()),
    ],
)
def test_the_degrees_are_resolved_from_the_target_and_the_world(target, world, shape):
    dims = _resolve(target, world)
    assert dims.mesh_shape() == shape
    assert dims.world_size == (world if shape else 1)


def test_a_plan_made_in_one_process_lays_out_the_world_it_names():
    dims = _resolve("tp[size=2]", 1)  # planned here, applied nowhere: a world of one
    assert dims.world_size == 2 and dims.mesh_shape() == (("tp", 2),)
    hsdp = _resolve("hsdp", 8, local=4)  # shard within a machine, replicate across
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 4)


@pytest.mark.parametrize(
    ("target", "world", "error", "message"),
    [
        ("tp[size=3]", 4, TargetNotSupportedError, r"tp\[size=3\] does not divide the 4"),
        ("tp[size=2]", 4, TargetNotSupportedError, r"alone on 4 processes would leave 2 copies"),
        ("fsdp+tp", 4, TargetNotSupportedError, r"fsdp\+tp: say the tensor-parallel degree"),
        ("tp+pp", 4, TargetNotSupportedError, r"tp\+pp: say the tensor-parallel degree"),
        ("pp[size=2]", 4, TargetNotSupportedError, r"at least 2 and the 4 processes \(stated\)"),
        ("fsdp+pp[size=3]", 4, TargetNotSupportedError, r"at least 2 and a divisor of the 4"),
        ("ddp+cp[size=3]", 4, TargetNotSupportedError, r"must be at least 2 and divide the 4"),
        ("hsdp[replicate=3,shard=3]", 8, ValueError, r"replicate x shard = 9 processes"),
    ],
)
def test_a_degree_that_does_not_fit_is_refused_naming_it(target, world, error, message):
    with pytest.raises(error, match=message):
        _resolve(target, world)


def test_a_used_dimension_without_its_planner_s_record_is_named():
    dims = _resolve("fsdp+tp[size=2]", 4)
    assert dims.unplanned(Plan()) == ["dp", "tp"]


def _groups(rank: int, world_size: int) -> dict[str, object]:
    """The ranks of every mesh and group `Meshes` makes, per layout, on one rank."""
    import torch.distributed as dist

    from retarget.execution.process import ProcessState

    ProcessState.current()

    def ranks(group: object) -> list[int]:
        return dist.get_process_group_ranks(group)

    out: dict[str, object] = {}
    fsdp_cp = Meshes(ParallelDims(world_size=4, dp_shard=2, cp=2, used=("dp", "cp")), "cpu")
    out["fsdp+cp fsdp"] = ranks(fsdp_cp.fsdp().get_group())
    out["fsdp+cp cp"] = ranks(fsdp_cp["cp"].get_group())
    out["fsdp+cp data"] = fsdp_cp.data()[:2]
    hsdp = Meshes(
        ParallelDims(world_size=4, dp_replicate=2, dp_shard=2, used=("replicate", "shard")), "cpu"
    )
    out["hsdp fsdp shape"] = tuple(hsdp.fsdp().shape)
    out["hsdp data"] = hsdp.data()
    tp = Meshes(ParallelDims(world_size=4, dp_shard=2, tp=2, used=("dp", "tp")), "cpu")
    out["fsdp+tp tp"] = ranks(tp["tp"].get_group())
    out["fsdp+tp dp"] = ranks(tp["dp"].get_group())
    out["fsdp+tp copies"] = tuple(tp.split("dp", (2, 1), ("copies", "whole")).shape)
    assert tp.split("dp", (2, 1), ("copies", "whole")) is tp.split(
        "dp", (2, 1), ("copies", "whole")
    )
    pp_tp = Meshes(ParallelDims(world_size=4, pp=2, tp=2, used=("pp", "tp")), "cpu")
    out["pp+tp pp"] = ranks(pp_tp["pp"].get_group())
    out["pp+tp data"] = pp_tp.data()
    out["pp+tp tied"] = ranks(pp_tp.holders_group((0, 1)))
    ddp = Meshes(ParallelDims(world_size=4, dp_replicate=4, used=("dp",)), "cpu")
    out["ddp data"] = ddp.data()
    out["ddp made a mesh"] = ddp._mesh is not None
    return out


@pytest.mark.distributed
def test_every_layout_gets_the_groups_torchtitan_lays_out_on_four_ranks():
    results = run_ranks(_groups, 4)
    for rank, out in enumerate(results):
        # fsdp+cp: FSDP2 over all four (dp x cp flattened); cp groups of consecutive ranks
        assert out["fsdp+cp fsdp"] == [0, 1, 2, 3]
        assert out["fsdp+cp cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["fsdp+cp data"] == (rank // 2, 2)
        assert out["hsdp fsdp shape"] == (2, 2)
        assert out["hsdp data"] is None  # every rank reads its own batch
        assert out["fsdp+tp tp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert out["fsdp+tp dp"] == [rank % 2, rank % 2 + 2]
        assert out["fsdp+tp copies"] == (2, 1)
        # pp outermost: stage 0 on ranks 0-1, stage 1 on 2-3; a tied weight's group pairs the
        # ranks at the same tp position
        assert out["pp+tp pp"] == [rank % 2, rank % 2 + 2]
        assert out["pp+tp data"] == (0, 1, None)
        assert out["pp+tp tied"] == [rank % 2, rank % 2 + 2]
        assert out["ddp data"] is None and out["ddp made a mesh"] is False


#: What makes a mesh or a process group, and the one module allowed to (execution/process.py
#: starts the default, world group).
_MAKERS = ("init_device_mesh(", "new_group(", "._flatten(", "._unflatten(", "DeviceMesh(")


def test_meshes_and_process_groups_are_made_in_one_module():
    from pathlib import Path

    root = Path(retarget.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        makers = [m for m in _MAKERS if m in text and name != "core/parallel_dims.py"]
        if "init_process_group(" in text and name != "execution/process.py":
            makers.append("init_process_group(")
        found += [f"{name}: {m}" for m in makers]
    assert found == []
