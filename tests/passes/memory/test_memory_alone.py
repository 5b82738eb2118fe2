"""checkpoint_blocks run alone on a captured Program (tests/pass_alone.py)."""

from retarget.core.module_record import record_of
from retarget.passes.memory.checkpoint_blocks import CheckpointBlocks
from tests.pass_alone import captured, run_twice


def test_checkpoint_blocks_alone_recomputes_every_decoder_layer_once():
    program = captured("ac")
    result = run_twice(CheckpointBlocks, "ac", program)
    assert result.changed
    for path in ("model.layers.0", "model.layers.1"):
        assert record_of(program.submodule(path)).checkpoint is not None, path
    assert program.analysis.checkpoint["plan"]
