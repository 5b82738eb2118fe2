"""compile_regions run alone on a captured Program (tests/pass_alone.py)."""

from retarget.passes.compile.compile_regions import CompileRegions
from tests.pass_alone import captured, run_twice


def test_compile_regions_alone_gives_the_block_region_one_compiler_once():
    program = captured("compile[backend=eager]")
    result = run_twice(CompileRegions, "compile[backend=eager]", program)
    assert result.changed
    (region,) = [r for r in program.regions if r.graphs]
    runner = region.runner
    assert runner is not None and type(runner).__name__ == "RegionCompiler"
