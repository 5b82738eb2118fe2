"""plan_stream run alone on a captured Program (tests/pass_alone.py)."""

from retarget.passes.place.plan_stream import PlanStream
from tests.pass_alone import captured, run_twice

TARGET = "stream[from=disk,max_memory=0.5]"


def test_plan_stream_alone_keeps_what_fits_and_streams_the_rest_from_disk():
    program = captured(TARGET)
    run_twice(PlanStream, TARGET, program)
    plan = program.plan.stream
    assert set(plan.device_map.values()) == {plan.main_device, "disk"}
    assert plan.blocks == ("model.layers.0", "model.layers.1")
