"""The sharding planners run alone on a captured Program planned for 4 processes: each writes
its plan record, and a second run writes the same (tests/pass_alone.py)."""

from retarget.passes.shard.shard_ddp import ShardDdp
from retarget.passes.shard.shard_fsdp import ShardFsdp
from retarget.passes.shard.shard_tp import ShardTp
from retarget.passes.shard.split_stages import SplitStages
from retarget.passes.shard.zero1 import ShardOptimizerState
from tests.pass_alone import captured, run_twice


def test_shard_fsdp_alone_plans_one_unit_per_decoder_layer_and_the_root():
    program = captured("fsdp", world_size=4)
    run_twice(ShardFsdp, "fsdp", program)
    units = [u.path for u in program.plan.fsdp.units]
    assert units == ["model.layers.0", "model.layers.1", ""]
    assert program.plan.fsdp.mesh_shape == (4,)


def test_shard_ddp_then_zero1_alone_plan_buckets_and_optimizer_shares():
    program = captured("zero1", world_size=4)
    run_twice(ShardDdp, "zero1", program)
    assert program.plan.ddp.buckets and program.plan.ddp.strategy == "zero1"
    run_twice(ShardOptimizerState, "zero1", program)
    assert len(program.plan.zero1.per_rank) == 4


def test_shard_tp_alone_splits_the_projections_over_two_ranks():
    program = captured("tp[size=2]", world_size=2)
    run_twice(ShardTp, "tp[size=2]", program)
    rules = program.plan.tp.rules
    assert rules["model.layers.0.self_attn.q_proj"].style == "colwise"
    assert rules["model.layers.0.self_attn.o_proj"].style == "rowwise"


def test_split_stages_alone_cuts_two_stages():
    target = "pp[size=2,microbatches=2]"  # the example's 2 rows, one per microbatch
    program = captured(target, world_size=2)
    run_twice(SplitStages, target, program)
    assert [s.blocks for s in program.plan.pp.stages] == [("model.layers.0",), ("model.layers.1",)]
