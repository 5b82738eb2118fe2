"""install_comm_hook run alone after shard_ddp (tests/pass_alone.py)."""

from retarget.passes.comm.install_comm_hook import InstallCommHook
from retarget.passes.shard.shard_ddp import ShardDdp
from tests.pass_alone import build, captured, run_twice


def test_install_comm_hook_alone_records_the_bf16_hook_once():
    program = captured("ddp+bf16-comm", world_size=2)
    build(ShardDdp, "ddp+bf16-comm").run(program)
    run_twice(InstallCommHook, "ddp+bf16-comm", program)
    assert program.plan.comm_hook.part == "bf16-comm"
