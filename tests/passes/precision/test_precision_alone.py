"""insert_autocast and swap_fp8 run alone on a captured Program (tests/pass_alone.py)."""

from retarget.passes.precision.insert_autocast import InsertAutocast
from retarget.passes.precision.swap_fp8 import SwapFp8
from tests.pass_alone import captured, run_twice, snapshot


def test_insert_autocast_alone_lowers_the_matmuls_of_the_block_graph_once():
    program = captured("bf16")
    before = snapshot(program)["graphs"]
    result = run_twice(InsertAutocast, "bf16", program)
    assert result.changed and result.stats["dtype"] == "bfloat16"
    after = snapshot(program)["graphs"]
    (region,) = [name for name, codes in after.items() if codes]
    assert after[region] != before[region]
    assert "bfloat16" in after[region][0]


def test_swap_fp8_alone_swaps_the_eligible_linears_once():
    program = captured("fp8[min_size=16]")  # the tiny model's Linears are 64 wide
    result = run_twice(SwapFp8, "fp8[min_size=16]", program)
    assert result.changed and result.stats["swapped"] == 13  # all but the first and last
    up = program.submodule("model.layers.0.mlp.up_proj")
    assert type(up).__name__ == "Float8Linear"
    assert program.analysis.fp8["linears"]["model.layers.0.mlp.up_proj"]["swapped"]
