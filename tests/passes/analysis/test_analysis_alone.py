"""find_blocks and annotate_shapes run alone on a captured Program (tests/pass_alone.py)."""

from retarget.passes.analysis.annotate_shapes import AnnotateShapes
from retarget.passes.analysis.find_blocks import FindBlocks
from tests.pass_alone import captured, snapshot


def test_find_blocks_alone_finds_the_decoder_layers_and_finds_them_again():
    program = captured()
    before = [(g.block_type, list(g.paths)) for g in program.blocks]
    assert before == [("LlamaDecoderLayer", ["model.layers.0", "model.layers.1"])]
    state = snapshot(program)
    FindBlocks().run(program)
    assert [(g.block_type, list(g.paths)) for g in program.blocks] == before
    assert snapshot(program) == state


def test_annotate_shapes_alone_records_each_linear_and_the_same_again():
    program = captured()
    modules = program.analysis.modules
    assert modules["model.layers.0.self_attn.q_proj"]["flops"] > 0
    flops = program.analysis.flops
    AnnotateShapes().run(program)
    assert program.analysis.flops == flops and program.analysis.modules == modules
