"""capture_regions run alone: capture_program stops right after the capture stages."""

from retarget.passes.capture.capture_regions import CaptureRegions
from tests.pass_alone import captured, run_twice, snapshot


def test_capture_program_runs_only_the_stages_before_the_first_rewrite():
    program = captured("fsdp+bf16", world_size=2)
    ran = [r.name for r in program.history]
    assert ran == ["find_blocks", "capture_regions", "annotate_shapes"]
    assert program.plan.to_dict() == {}  # nothing planned, nothing applied
    (region,) = [r for r in program.regions if r.graphs]
    assert region.frontend == "export"


def test_capture_regions_a_second_time_keeps_the_graphs_it_captured():
    program = captured()
    graphs = snapshot(program)["graphs"]
    result = run_twice(CaptureRegions, "single", program)
    assert not result.changed
    assert snapshot(program)["graphs"] == graphs
