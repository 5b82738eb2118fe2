"""apply_plan run alone in one process: it applies nothing and says so (tests/pass_alone.py)."""

from retarget.passes.apply.apply_plan import ApplyPlan
from retarget.passes.shard.shard_fsdp import ShardFsdp
from tests.pass_alone import build, captured, run_twice


def test_apply_plan_alone_in_one_process_records_why_nothing_was_applied():
    program = captured("fsdp")
    build(ShardFsdp, "fsdp").run(program)
    run_twice(ApplyPlan, "fsdp", program)
    assert program.plan.applied.applied is False
    assert program.plan.applied.reason == "world size is 1"
